/* emu-rng.h: the emulator checks' deterministic random numbers (xorshift64*, from EMU_SEED, which
 * the including file defines) and bf16 rounding; shared by emu-dflash.cc and emu-train.cc. */
#ifndef DFL_EMU_RNG_H
#define DFL_EMU_RNG_H

#include <stdint.h>

static uint64_t rs = EMU_SEED;
static uint64_t rnext()
{
    rs ^= rs >> 12;
    rs ^= rs << 25;
    rs ^= rs >> 27;
    return rs * 0x2545F4914F6CDD1Dull;
}
static float runi() { return (float)((rnext() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }
static float rnorm()
{
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += runi();
    return s * 0.8660254f;
}
static int rint_(int lo, int hi) { return lo + (int)(rnext() % (uint64_t)(hi - lo + 1)); }
static float rb(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

#endif
