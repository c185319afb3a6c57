/* dtype.c: element types and conversions (see dtype.h). */
#include "dtype.h"

#include <math.h>
#include <strings.h>

static const struct {
    const char *name, *lower;
    size_t size;
    bool is_float;
} dt_info[DFL_DT_COUNT] = {
    [DFL_DT_INVALID] = {"INVALID", "invalid", 0, false},
    [DFL_BF16] = {"BF16", "bf16", 2, true},
    [DFL_F16] = {"F16", "f16", 2, true},
    [DFL_F32] = {"F32", "f32", 4, true},
    [DFL_F64] = {"F64", "f64", 8, true},
    [DFL_I8] = {"I8", "i8", 1, false},
    [DFL_I16] = {"I16", "i16", 2, false},
    [DFL_I32] = {"I32", "i32", 4, false},
    [DFL_I64] = {"I64", "i64", 8, false},
    [DFL_U8] = {"U8", "u8", 1, false},
    [DFL_U16] = {"U16", "u16", 2, false},
    [DFL_U32] = {"U32", "u32", 4, false},
    [DFL_U64] = {"U64", "u64", 8, false},
    [DFL_BOOL] = {"BOOL", "bool", 1, false},
    [DFL_F8_E4M3] = {"F8_E4M3", "f8_e4m3", 1, true},
    [DFL_F8_E5M2] = {"F8_E5M2", "f8_e5m2", 1, true},
};

static bool valid(dfl_dtype t) { return t > DFL_DT_INVALID && t < DFL_DT_COUNT; }

size_t dfl_dtype_size(dfl_dtype t) { return valid(t) ? dt_info[t].size : 0; }
const char *dfl_dtype_name(dfl_dtype t) { return valid(t) ? dt_info[t].name : "INVALID"; }
const char *dfl_dtype_lower(dfl_dtype t) { return valid(t) ? dt_info[t].lower : "invalid"; }
bool dfl_dtype_is_float(dfl_dtype t) { return valid(t) && dt_info[t].is_float; }

dfl_dtype dfl_dtype_from_name(const char *s)
{
    for (int t = 1; t < DFL_DT_COUNT; t++)
        if (strcmp(s, dt_info[t].name) == 0 || strcmp(s, dt_info[t].lower) == 0)
            return (dfl_dtype)t;
    return DFL_DT_INVALID;
}

float dfl_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: value = man * 2^-24 */
            float f = (float)man * 0x1p-24f;
            u = dfl_f32_bits(f) | sign;
        }
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return dfl_bits_f32(u);
}

uint16_t dfl_f32_to_f16(float f)
{
    uint32_t u = dfl_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* rounds to >= 65520: inf (also inf itself) */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below the smallest normal half (2^-14): subnormal or zero */
        /* value = a as float; half subnormal unit is 2^-24. rint rounds to nearest even. */
        float v = dfl_bits_f32(a) * 0x1p24f;
        return (uint16_t)(sign | (uint16_t)rintf(v));
    }
    /* normal: rebias exponent, round mantissa 23 -> 10 bits to nearest even */
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    r -= (uint32_t)(127 - 15) << 23;
    return (uint16_t)(sign | (r >> 13));
}

static double f8_e4m3_to_f64(uint8_t b)
{
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    double v;
    if (e == 15 && m == 7)
        return NAN;
    if (e == 0)
        v = ldexp(m / 8.0, -6);
    else
        v = ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

static double f8_e5m2_to_f64(uint8_t b)
{
    uint16_t h = (uint16_t)b << 8;
    return dfl_f16_to_f32(h);
}

/* Loads go through memcpy: tensors of files written by other tools may be unaligned. */
#define LOAD(type, p, i) ({ type v_; memcpy(&v_, (const char *)(p) + (i) * sizeof(type), sizeof v_); v_; })

double dfl_load_f64(const void *p, dfl_dtype t, size_t i)
{
    switch (t) {
    case DFL_BF16: return dfl_bf16_to_f32(LOAD(uint16_t, p, i));
    case DFL_F16: return dfl_f16_to_f32(LOAD(uint16_t, p, i));
    case DFL_F32: return LOAD(float, p, i);
    case DFL_F64: return LOAD(double, p, i);
    case DFL_F8_E4M3: return f8_e4m3_to_f64(((const uint8_t *)p)[i]);
    case DFL_F8_E5M2: return f8_e5m2_to_f64(((const uint8_t *)p)[i]);
    case DFL_I8: return ((const int8_t *)p)[i];
    case DFL_I16: return LOAD(int16_t, p, i);
    case DFL_I32: return LOAD(int32_t, p, i);
    case DFL_I64: return (double)LOAD(int64_t, p, i);
    case DFL_U8: case DFL_BOOL: return ((const uint8_t *)p)[i];
    case DFL_U16: return LOAD(uint16_t, p, i);
    case DFL_U32: return LOAD(uint32_t, p, i);
    case DFL_U64: return (double)LOAD(uint64_t, p, i);
    default: return NAN;
    }
}

bool dfl_convert(void *dst, dfl_dtype dt, const void *src, dfl_dtype st, size_t n)
{
    if (!valid(dt) || !valid(st))
        return false;
    if (dt == st) {
        memcpy(dst, src, n * dfl_dtype_size(dt));
        return true;
    }
    switch (dt) {
    case DFL_F32: {
        float *d = dst;
        if (st == DFL_BF16 && ((uintptr_t)src & 1) == 0) {
            const uint16_t *s = src;
            for (size_t i = 0; i < n; i++)
                d[i] = dfl_bf16_to_f32(s[i]);
        } else {
            for (size_t i = 0; i < n; i++)
                d[i] = (float)dfl_load_f64(src, st, i);
        }
        return true;
    }
    case DFL_F64: {
        double *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = dfl_load_f64(src, st, i);
        return true;
    }
    case DFL_BF16: {
        uint16_t *d = dst;
        if (st == DFL_F32 && ((uintptr_t)src & 3) == 0) {
            const float *s = src;
            for (size_t i = 0; i < n; i++)
                d[i] = dfl_f32_to_bf16(s[i]);
            return true;
        }
        if (!dfl_dtype_is_float(st))
            return false;
        /* Via f64 -> f32 would double-round for f64 sources; round f64 to bf16 directly. */
        for (size_t i = 0; i < n; i++) {
            double v = dfl_load_f64(src, st, i);
            if (st == DFL_F64 && isfinite(v) && fabs(v) < 3.4e38) {
                /* round to 8 significant bits, nearest even */
                int ex;
                double m = frexp(v, &ex);            /* v = m * 2^ex, 0.5 <= |m| < 1 */
                double r = nearbyint(ldexp(m, 8));   /* current rounding mode: nearest even */
                d[i] = dfl_f32_to_bf16((float)ldexp(r, ex - 8));
            } else {
                d[i] = dfl_f32_to_bf16((float)v);
            }
        }
        return true;
    }
    case DFL_F16: {
        uint16_t *d = dst;
        if (!dfl_dtype_is_float(st))
            return false;
        for (size_t i = 0; i < n; i++)
            d[i] = dfl_f32_to_f16((float)dfl_load_f64(src, st, i));
        return true;
    }
    default:
        return false;
    }
}
