/* dtype.h: element types, their names in safetensors and in .dfl streams, and conversions.
 * bf16 and f16 <-> f32 conversions round to nearest even and keep NaN a NaN. */
#ifndef DFL_DTYPE_H
#define DFL_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The numeric values are part of the .dfl format (dfl-frame(5)): never renumber. */
typedef enum dfl_dtype {
    DFL_DT_INVALID = 0,
    DFL_BF16 = 1,
    DFL_F16 = 2,
    DFL_F32 = 3,
    DFL_F64 = 4,
    DFL_I8 = 5,
    DFL_I16 = 6,
    DFL_I32 = 7,
    DFL_I64 = 8,
    DFL_U8 = 9,
    DFL_U16 = 10,
    DFL_U32 = 11,
    DFL_U64 = 12,
    DFL_BOOL = 13,
    DFL_F8_E4M3 = 14,
    DFL_F8_E5M2 = 15,
    DFL_DT_COUNT
} dfl_dtype;

size_t dfl_dtype_size(dfl_dtype t);          /* 0 for DFL_DT_INVALID */
const char *dfl_dtype_name(dfl_dtype t);     /* safetensors spelling: "BF16", "F32", "BOOL" */
const char *dfl_dtype_lower(dfl_dtype t);    /* "bf16", "f32", for messages and options */
dfl_dtype dfl_dtype_from_name(const char *s);/* either spelling; DFL_DT_INVALID if unknown */
bool dfl_dtype_is_float(dfl_dtype t);        /* BF16, F16, F32, F64, F8_* */

static inline float dfl_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t dfl_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float dfl_bf16_to_f32(uint16_t h) { return dfl_bits_f32((uint32_t)h << 16); }

static inline uint16_t dfl_f32_to_bf16(float f)
{
    uint32_t u = dfl_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)          /* NaN: keep it NaN (quiet), keep the sign */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);              /* round to nearest even; overflow -> inf */
    return (uint16_t)(u >> 16);
}

float dfl_f16_to_f32(uint16_t h);
uint16_t dfl_f32_to_f16(float f);

/* Convert n elements between float types (BF16, F16, F32, F64) and from integer types to F32/F64.
 * Returns false for an unsupported pair. Buffers must not overlap. */
bool dfl_convert(void *dst, dfl_dtype dt, const void *src, dfl_dtype st, size_t n);
/* Read element i of a float tensor as double (any float dtype). */
double dfl_load_f64(const void *p, dfl_dtype t, size_t i);

#endif
