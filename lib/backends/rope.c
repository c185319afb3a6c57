/* rope.c: RoPE inverse frequencies with rope scaling (see rope.h). Every step in f32 where
 * transformers computes on a float32 tensor; the scalars that it computes in Python (wavelength
 * bounds, the yarn correction range) in double, then cast to f32 where they meet a tensor. */
#include "rope.h"

#include <math.h>
#include <string.h>

const char *dfl_rope_kind_name(dfl_rope_kind k)
{
    switch (k) {
    case DFL_ROPE_DEFAULT: return "default";
    case DFL_ROPE_LINEAR: return "linear";
    case DFL_ROPE_LLAMA3: return "llama3";
    case DFL_ROPE_YARN: return "yarn";
    }
    return "?";
}

/* transformers' find_correction_dim: the dimension whose wavelength makes `rot` turns over n
 * positions. */
static double yarn_dim(double rot, int d, double theta, double n)
{
    return (double)d * log(n / (rot * 2.0 * M_PI)) / (2.0 * log(theta));
}

void dfl_rope_inv_freq_scaled(float *inv, int d, float theta, const dfl_rope_scaling *rs,
                              dfl_dtype round_to)
{
    int half = d / 2;
    for (int i = 0; i < half; i++)
        inv[i] = 1.0f / powf(theta, (float)(2 * i) / (float)d);
    dfl_rope_kind kind = rs ? rs->kind : DFL_ROPE_DEFAULT;
    if (kind == DFL_ROPE_LINEAR) {
        for (int i = 0; i < half; i++)
            inv[i] /= (float)rs->factor;
    } else if (kind == DFL_ROPE_LLAMA3) {
        float factor = (float)rs->factor, lo = (float)rs->low_freq_factor;
        float span = (float)(rs->high_freq_factor - rs->low_freq_factor);
        float old = (float)rs->original_max_pos;
        float lo_wl = (float)(rs->original_max_pos / rs->low_freq_factor);
        float hi_wl = (float)(rs->original_max_pos / rs->high_freq_factor);
        for (int i = 0; i < half; i++) {
            float wl = (float)(2.0 * M_PI) / inv[i];
            float f = wl > lo_wl ? inv[i] / factor : inv[i];
            if (!(wl < hi_wl) && !(wl > lo_wl)) {
                float s = (old / wl - lo) / span;
                f = (1.0f - s) * f / factor + s * f;
            }
            inv[i] = f;
        }
    } else if (kind == DFL_ROPE_YARN) {
        double lo = yarn_dim(rs->beta_fast, d, theta, rs->original_max_pos);
        double hi = yarn_dim(rs->beta_slow, d, theta, rs->original_max_pos);
        if (rs->truncate) {
            lo = floor(lo);
            hi = ceil(hi);
        }
        if (lo < 0)
            lo = 0;
        if (hi > d - 1)
            hi = d - 1;
        if (lo == hi)
            hi += 0.001;
        float flo = (float)lo, span = (float)(hi - lo), factor = (float)rs->factor;
        for (int i = 0; i < half; i++) {
            float pos_freq = powf(theta, (float)(2 * i) / (float)d);
            float extra = 1.0f / pos_freq, inter = 1.0f / (factor * pos_freq);
            float ramp = ((float)i - flo) / span;
            ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
            float ef = 1.0f - ramp;
            inv[i] = inter * (1.0f - ef) + extra * ef;
        }
    }
    for (int i = 0; i < half; i++) {
        if (round_to == DFL_BF16)
            inv[i] = dfl_bf16_to_f32(dfl_f32_to_bf16(inv[i]));
        else if (round_to == DFL_F16)
            inv[i] = dfl_f16_to_f32(dfl_f32_to_f16(inv[i]));
    }
}

bool dfl_rope_scaling_eq(const dfl_rope_scaling *a, const dfl_rope_scaling *b)
{
    static const dfl_rope_scaling none = {.kind = DFL_ROPE_DEFAULT};
    if (!a || a->kind == DFL_ROPE_DEFAULT)
        a = &none;
    if (!b || b->kind == DFL_ROPE_DEFAULT)
        b = &none;
    if (a->kind == DFL_ROPE_DEFAULT && b->kind == DFL_ROPE_DEFAULT)
        return true;
    return a->kind == b->kind && a->factor == b->factor &&
           a->low_freq_factor == b->low_freq_factor && a->high_freq_factor == b->high_freq_factor &&
           a->original_max_pos == b->original_max_pos && a->beta_fast == b->beta_fast &&
           a->beta_slow == b->beta_slow && a->truncate == b->truncate &&
           a->attention_factor == b->attention_factor;
}
