/* draft_rng.c: xoshiro256** and splitmix64 (see draft_rng.h). */
#include "draft_rng.h"

#include <math.h>
#include <stddef.h>

uint64_t dfl_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void dfl_rng_seed(dfl_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = dfl_splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t dfl_rng_next(dfl_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint64_t dfl_rng_below(dfl_rng *r, uint64_t n)
{
    if (n <= 1)
        return 0;
    /* accept x < limit, the largest multiple of n that fits: every residue equally likely */
    uint64_t limit = UINT64_MAX - (UINT64_MAX % n + 1) % n;
    uint64_t x;
    do
        x = dfl_rng_next(r);
    while (x > limit);
    return x % n;
}

double dfl_rng_double(dfl_rng *r) { return (double)(dfl_rng_next(r) >> 11) * 0x1.0p-53; }

void dfl_rng_normal2(dfl_rng *r, double *a, double *b)
{
    double u1 = dfl_rng_double(r), u2 = dfl_rng_double(r);
    double rad = sqrt(-2.0 * log(1.0 - u1)), th = 6.283185307179586 * u2;
    *a = rad * cos(th);
    if (b)
        *b = rad * sin(th);
}

double dfl_rng_normal(dfl_rng *r)
{
    double a;
    dfl_rng_normal2(r, &a, NULL);
    return a;
}

uint64_t dfl_hash2(uint64_t a, uint64_t b)
{
    uint64_t x = a ^ (b * 0xD1B54A32D192ED03ull);
    dfl_splitmix64(&x);
    return dfl_splitmix64(&x);
}
