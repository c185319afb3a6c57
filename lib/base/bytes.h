/* bytes.h: little-endian loads and stores of unaligned bytes, and the doubling growth of a
 * malloc'ed array. Header-only: each is a few instructions. */
#ifndef DFL_BYTES_H
#define DFL_BYTES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The n bytes at p (n from 0 to 8) as a little-endian unsigned integer. */
static inline uint64_t dfl_get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static inline uint16_t dfl_get_le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t dfl_get_le32(const uint8_t *p) { return (uint32_t)dfl_get_le(p, 4); }
static inline uint64_t dfl_get_le64(const uint8_t *p) { return dfl_get_le(p, 8); }

/* v into the n bytes at p (n from 0 to 8), little-endian. */
static inline void dfl_put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline void dfl_put_le16(uint8_t *p, uint16_t v) { dfl_put_le(p, v, 2); }
static inline void dfl_put_le32(uint8_t *p, uint32_t v) { dfl_put_le(p, v, 4); }
static inline void dfl_put_le64(uint8_t *p, uint64_t v) { dfl_put_le(p, v, 8); }

/* Room for need elements in the array *(T **)arrp of *cap elements of elem bytes: when *cap is
 * smaller, reallocates it to first elements (when *cap is 0) doubled until need fit. Returns
 * false, changing nothing, when out of memory or when the size would overflow. */
static inline bool dfl_reserve(void *arrp, size_t *cap, size_t need, size_t elem, size_t first)
{
    if (need <= *cap)
        return true;
    size_t ncap = *cap ? *cap : first ? first : 1, bytes;
    while (ncap < need) {
        if (ncap > SIZE_MAX / 2)
            return false;
        ncap *= 2;
    }
    if (__builtin_mul_overflow(ncap, elem, &bytes))
        return false;
    void *old;
    memcpy(&old, arrp, sizeof old);
    void *p = realloc(old, bytes);
    if (!p)
        return false;
    memcpy(arrp, &p, sizeof p);
    *cap = ncap;
    return true;
}

/* Room for element n (an append): dfl_reserve for n + 1, growing by doubling. Use:
 *     if (!dfl_grow(&f->recs, &f->cap_recs, f->nrecs, sizeof *f->recs, 64))
 *         return dfl_fail(e, DFL_ENOMEM, "out of memory"); */
static inline bool dfl_grow(void *arrp, size_t *cap, size_t n, size_t elem, size_t first)
{
    return n < SIZE_MAX && dfl_reserve(arrp, cap, n + 1, elem, first);
}

#endif
