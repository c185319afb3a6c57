/* framecraft.h: byte-level helpers to craft and damage .dfl streams (dfl-frame(5)), shared by
 * tests/unit/test-frame.c and tests/tools/mkframes.c. Written from the man page, independently of
 * lib/formats/frame.c, so that they also check that the page says enough to build a stream. */
#ifndef DFL_FRAMECRAFT_H
#define DFL_FRAMECRAFT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "dtype.h"

typedef struct fc_buf {
    uint8_t *p;
    size_t n, cap;
} fc_buf;

static inline void fc_put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void fc_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void fc_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t fc_get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t fc_get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t fc_get64(const uint8_t *p) { return fc_get32(p) | (uint64_t)fc_get32(p + 4) << 32; }

static inline void fc_reserve(fc_buf *b, size_t more)
{
    if (b->n + more <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + more)
        cap *= 2;
    b->p = realloc(b->p, cap);
    if (!b->p)
        abort();
    b->cap = cap;
}

static inline void fc_append(fc_buf *b, const void *d, size_t n)
{
    fc_reserve(b, n);
    if (n)
        memcpy(b->p + b->n, d, n);
    b->n += n;
}

static inline void fc_copy(fc_buf *dst, const uint8_t *p, size_t n)
{
    dst->n = 0;
    fc_append(dst, p, n);
}

/* Inserts n bytes at offset at. */
static inline void fc_insert(fc_buf *b, size_t at, const void *d, size_t n)
{
    fc_reserve(b, n);
    memmove(b->p + at + n, b->p + at, b->n - at);
    memcpy(b->p + at, d, n);
    b->n += n;
}

static inline uint64_t fc_pad(uint64_t stored) { return (64 - (stored + 8) % 64) % 64; }

/* Size of the frame whose header is at h, from its stored_len. */
static inline uint64_t fc_total(const uint8_t *h)
{
    uint64_t s = fc_get64(h + 8);
    return 64 + s + fc_pad(s) + 8;
}

/* Recomputes the header check and the trailer of the frame at off (after an edit). */
static inline void fc_refix(uint8_t *s, size_t off)
{
    uint8_t *h = s + off;
    fc_put64(h + 56, XXH3_64bits(h, 56));
    uint64_t t = fc_total(h);
    fc_put64(h + t - 8, XXH3_64bits(h, t - 8));
}

/* Recomputes only the header check (the frame's length may now be a lie). */
static inline void fc_refix_header(uint8_t *s, size_t off) { fc_put64(s + off + 56, XXH3_64bits(s + off, 56)); }

/* Appends a complete frame. */
static inline void fc_frame(fc_buf *b, uint16_t type, uint8_t flags, uint64_t seq, const void *payload,
                            uint64_t stored, uint64_t raw)
{
    uint8_t h[64] = {0};
    memcpy(h, "\x89" "DFL", 4);
    h[4] = 1;
    h[5] = flags;
    fc_put16(h + 6, type);
    fc_put64(h + 8, stored);
    fc_put64(h + 16, raw);
    fc_put64(h + 24, seq);
    size_t at = b->n;
    fc_append(b, h, 64);
    fc_append(b, payload, (size_t)stored);
    static const uint8_t z[64];
    fc_append(b, z, (size_t)fc_pad(stored));
    fc_append(b, z, 8);
    fc_refix(b->p, at);
}

/* Offsets of the frames of a stream, walking the lengths (at most max; stops at a cut). */
static inline int fc_list(const uint8_t *s, size_t n, size_t *offs, int max)
{
    int k = 0;
    size_t off = 0;
    while (off + 64 <= n && k < max) {
        offs[k++] = off;
        off += (size_t)fc_total(s + off);
    }
    return k;
}

/* Renumbers every frame (seq = position), sets END's frame count, and refixes everything. For
 * streams without an INDEX (whose offsets would move). */
static inline void fc_renumber(uint8_t *s, size_t n)
{
    size_t offs[4096];
    int k = fc_list(s, n, offs, 4096);
    for (int i = 0; i < k; i++) {
        uint8_t *h = s + offs[i];
        fc_put64(h + 24, (uint64_t)i);
        if (fc_get16(h + 6) == 5)
            fc_put64(h + 64 + 32, (uint64_t)i);
        fc_refix(s, offs[i]);
    }
}

/* Rewrites the INDEX and END frames of a stream after an edit that moved or added frames: the
 * INDEX entries (offset, S, T of every batch frame, in order; the INDEX must already have room
 * for exactly that many) and END's totals, INDEX offset and frame count (END's own seq); both
 * refixed. Frame numbers are left as they are (fc_renumber first where they should follow). */
static inline void fc_reindex(uint8_t *s, size_t n)
{
    size_t offs[4096];
    int k = fc_list(s, n, offs, 4096);
    uint64_t nb = 0, tokens = 0, seqs = 0;
    size_t idx = 0, end = 0;
    for (int i = 0; i < k; i++) {
        uint16_t t = fc_get16(s + offs[i] + 6);
        if (t == 4)
            idx = offs[i];
        if (t == 5)
            end = offs[i];
    }
    if (!idx || !end || (fc_get64(s + idx + 16) - 16) / 16 != fc_get64(s + idx + 64))
        abort();
    uint8_t *ent = s + idx + 64 + 16;
    for (int i = 0; i < k; i++) {
        const uint8_t *h = s + offs[i];
        uint16_t t = fc_get16(h + 6);
        if (t != 2 && t != 3)
            continue;
        if (nb == fc_get64(s + idx + 64))
            abort(); /* no room in the INDEX */
        uint32_t S = fc_get32(h + 64 + 16), T = (uint32_t)fc_get64(h + 64 + 8);
        fc_put64(ent + 16 * nb, offs[i]);
        fc_put32(ent + 16 * nb + 8, S);
        fc_put32(ent + 16 * nb + 12, T);
        nb++, tokens += T, seqs += S;
    }
    if (nb != fc_get64(s + idx + 64))
        abort();
    uint8_t *e = s + end + 64;
    fc_put64(e, nb);
    fc_put64(e + 8, tokens);
    fc_put64(e + 16, seqs);
    fc_put64(e + 24, idx);
    fc_put64(e + 32, fc_get64(s + end + 24));
    fc_refix(s, idx);
    fc_refix(s, end);
}

/* Index of the first frame of the given type, or -1. */
static inline int fc_find(const uint8_t *s, size_t n, uint16_t type, size_t *off)
{
    size_t offs[4096];
    int k = fc_list(s, n, offs, 4096);
    for (int i = 0; i < k; i++)
        if (fc_get16(s + offs[i] + 6) == type) {
            *off = offs[i];
            return i;
        }
    return -1;
}

/* d = the stream src[0..n) with the bytes add[0..len) inserted at offset at, renumbered. */
static inline void fc_with_bytes(fc_buf *d, const uint8_t *src, size_t n, size_t at, const void *add, size_t len)
{
    fc_copy(d, src, n);
    fc_insert(d, at, add, len);
    fc_renumber(d->p, d->n);
}

/* d = the stream src[0..n) with a frame (as fc_frame makes it, seq 0) inserted at offset at,
 * renumbered. */
static inline void fc_with_frame(fc_buf *d, const uint8_t *src, size_t n, size_t at, uint16_t type, uint8_t flags,
                                 const void *payload, uint64_t stored, uint64_t raw)
{
    fc_buf fr = {0};
    fc_frame(&fr, type, flags, 0, payload, stored, raw);
    fc_with_bytes(d, src, n, at, fr.p, fr.n);
    free(fr.p);
}

/* v as element i of a BF16, F16 or F32 array (a batch's hidden-state layer). */
static inline void fc_store_f32(void *p, dfl_dtype dt, size_t i, float v)
{
    if (dt == DFL_BF16)
        ((uint16_t *)p)[i] = dfl_f32_to_bf16(v);
    else if (dt == DFL_F16)
        ((uint16_t *)p)[i] = dfl_f32_to_f16(v);
    else
        ((float *)p)[i] = v;
}

#endif
