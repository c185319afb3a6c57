/* jsonl.c: samples from JSON Lines (see jsonl.h): the fast scanner, the jansson path that
 * decides what the scanner declines, and inputs read through libarchive. */
#include "jsonl.h"

#include <archive.h>
#include <archive_entry.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <jansson.h>
#include <math.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "util.h"

void dfl_sample_free(dfl_sample *s)
{
    free(s->ids);
    free(s->mask);
    free(s->lab);
    memset(s, 0, sizeof *s);
}

/* Grows *arr (elements of size sz) to hold at least need elements. */
static bool grow(void **arr, size_t *cap, size_t need, size_t sz)
{
    if (need <= *cap)
        return true;
    size_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    void *p = realloc(*arr, c * sz);
    if (!p)
        return false;
    *arr = p;
    *cap = c;
    return true;
}
#define GROW(arr, cap, need) grow((void **)&(arr), &(cap), (need), sizeof *(arr))

/* The checks common to both paths, once a line has been read: non-empty, equal lengths; then
 * the chosen mask source is put in s->mask. e may be NULL (fast path: a failure declines). */
static int finish(dfl_sample *s, dfl_err *e)
{
    if (s->n == 0)
        return dfl_fail(e, DFL_EDATA, "input_ids is empty");
    if (s->has_mask) {
        if (s->n_mask != s->n)
            return dfl_fail(e, DFL_EDATA, "loss_mask has %zu values for %zu input_ids", s->n_mask, s->n);
    } else if (s->has_lab) {
        if (s->n_lab != s->n)
            return dfl_fail(e, DFL_EDATA, "labels has %zu values for %zu input_ids", s->n_lab, s->n);
        uint8_t *t = s->mask;
        size_t tc = s->mask_cap;
        s->mask = s->lab;
        s->mask_cap = s->lab_cap;
        s->lab = t;
        s->lab_cap = tc;
    } else {
        if (!GROW(s->mask, s->mask_cap, s->n))
            return dfl_fail(e, DFL_ENOMEM, "out of memory for a sample of %zu tokens", s->n);
        memset(s->mask, 1, s->n);
    }
    return DFL_OK;
}

/* ---- the fast scanner ----
 * Every function takes the position p and the end of the line, and returns the position after
 * what it read, or NULL to decline. It accepts only valid JSON, with the rules of the jansson
 * path (duplicate keys rejected, nesting of at most DFL_JSON_MAX_DEPTH, \u0000 allowed in string
 * values): strings are checked for control characters, escapes (lone surrogates are refused, as
 * jansson does; \u0000 is declined: jansson takes it in a value, not in a key) and UTF-8 (no
 * overlong forms, surrogates or code points above U+10FFFF);
 * integers must fit in 64 bits and reals must not overflow. Whatever it is unsure of, it
 * declines: the jansson path then decides. */

#define MAX_KEYS 32 /* keys per object tracked for duplicates; more: decline */

typedef struct key_span {
    const char *p;
    size_t n;
} key_span;

/* JSON whitespace except '\n': a line never holds one, so the scanner can run on a buffer of many
 * lines and stop at the end of the first. */
static inline bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\r'; }
static inline bool is_digit(char c) { return (unsigned char)(c - '0') < 10; }

static inline const char *ws(const char *p, const char *end)
{
    while (p < end && is_ws(*p))
        p++;
    return p;
}

static bool hex4(const char *p, const char *end, uint32_t *v)
{
    if (end - p < 4)
        return false;
    uint32_t x = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        x <<= 4;
        if (c >= '0' && c <= '9')
            x |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            x |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            x |= (uint32_t)(c - 'A' + 10);
        else
            return false;
    }
    *v = x;
    return true;
}

/* Length of the valid UTF-8 sequence of 2 to 4 bytes at p, 0 if invalid. */
static size_t utf8_seq(const unsigned char *p, const unsigned char *end)
{
    unsigned c = p[0];
    size_t n;
    uint32_t v;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
        v = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        v = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        v = c & 0x07;
    } else {
        return 0;
    }
    if ((size_t)(end - p) < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        unsigned u = p[i];
        if (u < 0x80 || u > 0xBF)
            return 0;
        v = (v << 6) | (u & 0x3F);
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    if ((n == 3 && v < 0x800) || (n == 4 && v < 0x10000))
        return 0;
    return n;
}

/* p is after the opening quote. *escaped tells whether the string held a backslash. */
static const char *scan_string(const char *p, const char *end, bool *escaped)
{
    *escaped = false;
    for (;;) {
        /* the common case: printable ASCII */
        while (p < end) {
            unsigned char c = (unsigned char)*p;
            if (c < 0x20 || c == '"' || c == '\\' || c >= 0x80)
                break;
            p++;
        }
        if (p >= end)
            return NULL;
        unsigned char c = (unsigned char)*p;
        if (c == '"')
            return p + 1;
        if (c < 0x20)
            return NULL;
        if (c >= 0x80) {
            size_t k = utf8_seq((const unsigned char *)p, (const unsigned char *)end);
            if (!k)
                return NULL;
            p += k;
            continue;
        }
        /* backslash */
        *escaped = true;
        if (++p >= end)
            return NULL;
        c = (unsigned char)*p;
        if (c == 'u') {
            uint32_t v, w;
            if (!hex4(p + 1, end, &v))
                return NULL;
            p += 5;
            if (v == 0 || (v >= 0xDC00 && v <= 0xDFFF))
                return NULL;
            if (v >= 0xD800 && v <= 0xDBFF) {
                if (end - p < 6 || p[0] != '\\' || p[1] != 'u' || !hex4(p + 2, end, &w) ||
                    w < 0xDC00 || w > 0xDFFF)
                    return NULL;
                p += 6;
            }
        } else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' ||
                   c == 'r' || c == 't') {
            p++;
        } else {
            return NULL;
        }
    }
}

/* A JSON number; integers must fit in int64 and reals must not overflow (jansson's rules). */
static const char *skip_number(const char *p, const char *end)
{
    const char *s = p;
    bool neg = false;
    if (*p == '-') {
        neg = true;
        p++;
    }
    if (p >= end)
        return NULL;
    const char *digits = p;
    if (*p == '0') {
        p++;
        if (p < end && is_digit(*p))
            return NULL;
    } else if (is_digit(*p)) {
        while (p < end && is_digit(*p))
            p++;
    } else {
        return NULL;
    }
    size_t nd = (size_t)(p - digits);
    bool real = false;
    if (p < end && *p == '.') {
        p++;
        if (p >= end || !is_digit(*p))
            return NULL;
        while (p < end && is_digit(*p))
            p++;
        real = true;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || !is_digit(*p))
            return NULL;
        while (p < end && is_digit(*p))
            p++;
        real = true;
    }
    if (!real) {
        if (nd > 19)
            return NULL;
        if (nd == 19 && memcmp(digits, neg ? "9223372036854775808" : "9223372036854775807", 19) > 0)
            return NULL;
        return p;
    }
    char buf[64];
    size_t n = (size_t)(p - s);
    if (n >= sizeof buf)
        return NULL;
    memcpy(buf, s, n);
    buf[n] = 0;
    errno = 0;
    double d = strtod(buf, NULL);
    if ((d == HUGE_VAL || d == -HUGE_VAL) && errno == ERANGE)
        return NULL;
    return p;
}

static const char *skip_value(const char *p, const char *end, int depth);

static const char *literal(const char *p, const char *end, const char *word, size_t n)
{
    if ((size_t)(end - p) < n || memcmp(p, word, n) != 0)
        return NULL;
    return p + n;
}

/* A key at p (which must be a quote): checked against the keys seen so far in the object. */
static const char *scan_key(const char *p, const char *end, key_span *keys, int *nk, key_span *k)
{
    if (p >= end || *p != '"')
        return NULL;
    bool esc;
    const char *q = scan_string(p + 1, end, &esc);
    if (!q || esc) /* an escaped key could equal another spelled differently: decline */
        return NULL;
    k->p = p + 1;
    k->n = (size_t)(q - 1 - (p + 1));
    for (int i = 0; i < *nk; i++)
        if (keys[i].n == k->n && memcmp(keys[i].p, k->p, k->n) == 0)
            return NULL;
    if (*nk == MAX_KEYS)
        return NULL;
    keys[(*nk)++] = *k;
    q = ws(q, end);
    if (q >= end || *q != ':')
        return NULL;
    return ws(q + 1, end);
}

/* p is after '{'; depth is the nesting level of this object. */
static const char *skip_object(const char *p, const char *end, int depth)
{
    if (depth > DFL_JSON_MAX_DEPTH)
        return NULL;
    key_span keys[MAX_KEYS], k;
    int nk = 0;
    p = ws(p, end);
    if (p < end && *p == '}')
        return p + 1;
    for (;;) {
        p = scan_key(p, end, keys, &nk, &k);
        if (!p)
            return NULL;
        p = skip_value(p, end, depth);
        if (!p)
            return NULL;
        p = ws(p, end);
        if (p >= end)
            return NULL;
        if (*p == ',') {
            p = ws(p + 1, end);
            continue;
        }
        if (*p == '}')
            return p + 1;
        return NULL;
    }
}

static const char *skip_array(const char *p, const char *end, int depth)
{
    if (depth > DFL_JSON_MAX_DEPTH)
        return NULL;
    p = ws(p, end);
    if (p < end && *p == ']')
        return p + 1;
    for (;;) {
        p = skip_value(p, end, depth);
        if (!p)
            return NULL;
        p = ws(p, end);
        if (p >= end)
            return NULL;
        if (*p == ',') {
            p = ws(p + 1, end);
            continue;
        }
        if (*p == ']')
            return p + 1;
        return NULL;
    }
}

/* A value at p; depth is the nesting level of the container holding it. */
static const char *skip_value(const char *p, const char *end, int depth)
{
    if (p >= end)
        return NULL;
    bool esc;
    switch (*p) {
    case '"': return scan_string(p + 1, end, &esc);
    case '{': return skip_object(p + 1, end, depth + 1);
    case '[': return skip_array(p + 1, end, depth + 1);
    case 't': return literal(p, end, "true", 4);
    case 'f': return literal(p, end, "false", 5);
    case 'n': return literal(p, end, "null", 4);
    default:
        if (*p == '-' || is_digit(*p))
            return skip_number(p, end);
        return NULL;
    }
}

/* After an array element: ',' (then the next element) or ']'. Returns 1 for another element,
 * 0 at the end of the array (*pp after ']'), -1 to decline. */
static inline int next_elem(const char **pp, const char *end)
{
    const char *p = *pp;
    if (p < end && *p == ',') {
        p++;
        if (p < end && is_ws(*p))
            p = ws(p, end);
        *pp = p;
        return 1;
    }
    p = ws(p, end);
    if (p >= end)
        return -1;
    if (*p == ',') {
        *pp = ws(p + 1, end);
        return 1;
    }
    if (*p == ']') {
        *pp = p + 1;
        return 0;
    }
    return -1;
}

/* The value of the nd (1 to 8) ASCII digits that start the 8 bytes of x (first byte lowest); the
 * bytes after them do not matter. */
static inline __attribute__((always_inline)) uint64_t swar_value(uint64_t x, int nd)
{
    uint64_t d = (x - 0x3030303030303030ull) << (8 * (8 - nd)); /* digits in the top nd bytes */
    d = (d * 10 + (d >> 8)) & 0x00FF00FF00FF00FFull;
    d = (d * 100 + (d >> 16)) & 0x0000FFFF0000FFFFull;
    return (d * 10000 + (d >> 32)) & 0xFFFFFFFFull;
}

/* Number of leading ASCII digits in the 8 bytes of x (first byte lowest), and in *v their value
 * (when 1 to 8 digits). Bytes after the first non-digit do not matter. */
static inline __attribute__((always_inline)) int swar_digits(uint64_t x, uint64_t *v)
{
    uint64_t hi = x & 0xF0F0F0F0F0F0F0F0ull;
    uint64_t p6 = (x + 0x0606060606060606ull) & 0xF0F0F0F0F0F0F0F0ull; /* '0'-'9' keep 0x3_ */
    uint64_t bad = (hi ^ 0x3030303030303030ull) | (p6 ^ 0x3030303030303030ull);
    int nd = bad ? __builtin_ctzll(bad) >> 3 : 8;
    if (nd == 0)
        return 0;
    *v = swar_value(x, nd);
    return nd;
}

/* An unsigned JSON integer (no sign, no fraction, no exponent) at *pp, at most max: true with
 * *v, *pp after it; false to decline. */
static inline __attribute__((always_inline)) bool fast_uint(const char **pp, const char *end, uint64_t max, uint64_t *v)
{
    const char *p = *pp;
    if (p >= end)
        return false;
    int nd = 0;
    if (end - p >= 8) { /* up to 8 digits at once */
        uint64_t x;
        memcpy(&x, p, 8);
        nd = swar_digits(x, v);
        if (nd == 0 || (nd > 1 && *p == '0'))
            return false;
        p += nd;
    }
    if (nd == 0 || nd == 8) { /* near the end of the buffer, or a long number */
        unsigned d;
        if (nd == 0) {
            d = (unsigned char)*p - '0';
            if (d > 9)
                return false;
            *v = d;
            p++;
            if (d == 0 && p < end && is_digit(*p))
                return false;
        }
        if (*v != 0)
            while (p < end && (d = (unsigned char)*p - '0') <= 9) {
                *v = *v * 10 + d;
                if (*v > max)
                    return false;
                p++;
            }
    }
    if (*v > max || (p < end && (*p == '.' || *p == 'e' || *p == 'E')))
        return false;
    *pp = p;
    return true;
}

/* ---- lists, 64 bytes at a time ----
 * Most of a line is its lists of numbers, and these nearly always come in one form: elements of
 * a few digits separated by "," or ", ". Where a list is in that form, its elements are found a
 * block of 64 bytes at a time from bit masks (bit i for byte i of the block: digits, commas,
 * spaces, minus signs), so that the work per element does not wait on the one before. A block
 * takes the elements up to the first byte out of that form, each followed by its separator and
 * the start of the next element; the element-by-element code goes on from there (the last
 * element of a list, other whitespace, true and false, long numbers), and decides or declines
 * exactly as it would have without blocks. */

#if defined(__SSE2__)
#define LIST_BLOCKS 1

enum { LIST_IDS, LIST_COUNT, LIST_MASK, LIST_LABELS }; /* LIST_COUNT: ids checked, not kept */

#define BLOCK 64
#define BLOCK_READ (BLOCK + 8) /* bytes a block may read: an element's 8 bytes can start at 63 */
#define BLOCK_WAIT 8           /* after a block that took nothing: elements read one by one, */
#define BLOCK_WAIT_MAX 128     /* twice as many after each such block in a row, up to this */

typedef struct list_try {
    int wait;                  /* elements to read one by one before the next block */
    int after;                 /* the wait after a block that takes nothing */
} list_try;

static inline __attribute__((always_inline)) uint64_t block_mask(__m128i eq, int k)
{
    return (uint64_t)(uint32_t)_mm_movemask_epi8(eq) << (16 * k);
}

static inline __attribute__((always_inline)) unsigned popcount64(uint64_t x)
{
    x -= (x >> 1) & 0x5555555555555555ull;                                /* 2-bit sums */
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull); /* 4-bit sums */
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;                           /* byte sums */
    return (unsigned)((x * 0x0101010101010101ull) >> 56);
}

/* The elements of the kind's form in the block at p, the start of an element; at least
 * BLOCK_READ bytes from p are readable. Values go to out (int32 ids, or mask bytes; nothing for
 * LIST_COUNT), *pp after the separator of the last one taken; returns how many were taken. A
 * mask block may write up to BLOCK / 2 bytes to out. */
static inline __attribute__((always_inline)) size_t list_block(const char **pp, int kind, void *out)
{
    const char *p = *pp;
    bool sign = kind == LIST_LABELS, ones = kind == LIST_MASK || kind == LIST_LABELS;
    uint64_t dig = 0, com = 0, sp = 0, neg = 0, zero = 0, one = 0;
    for (int k = 0; k < BLOCK / 16; k++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(p + 16 * k));
        __m128i t = _mm_sub_epi8(x, _mm_set1_epi8('0'));
        dig |= block_mask(_mm_cmpeq_epi8(_mm_min_epu8(t, _mm_set1_epi8(9)), t), k);
        com |= block_mask(_mm_cmpeq_epi8(x, _mm_set1_epi8(',')), k);
        sp |= block_mask(_mm_cmpeq_epi8(x, _mm_set1_epi8(' ')), k);
        zero |= block_mask(_mm_cmpeq_epi8(t, _mm_setzero_si128()), k);
        if (ones)
            one |= block_mask(_mm_cmpeq_epi8(t, _mm_set1_epi8(1)), k);
        if (sign)
            neg |= block_mask(_mm_cmpeq_epi8(x, _mm_set1_epi8('-')), k);
    }
    uint64_t first = dig & ~(dig << 1);                          /* first digit of a run */
    uint64_t start = sign ? (first & ~(neg << 1)) | neg : first;
    uint64_t last = dig & ~(dig >> 1);                           /* last digit of a run */
    uint64_t comma = last & (com >> 1);                          /* followed by ',' */
    uint64_t two = comma & (sp >> 2) & (start >> 3);             /* by ", " and an element */
    uint64_t sep = (comma & (start >> 2)) | two;                 /* by a separator and an element */
    uint64_t bad = ~(dig | com | sp | neg) | (com & ~(sep << 1)) | (sp & ~(two << 2)) | (last & ~sep) |
                   (first & zero & (dig >> 1));                  /* a leading zero */
    uint64_t d2 = dig & (dig >> 1), d4 = d2 & (d2 >> 2), d8 = d4 & (d4 >> 4); /* k digits from here */
    if (kind == LIST_MASK)
        bad |= d2 | (dig & ~(zero | one));                       /* not one digit, 0 or 1 */
    else if (sign)                                               /* '-' not before a digit; 19 digits */
        bad |= (neg & ~(dig >> 1)) | (d8 & (d8 >> 8) & (d2 >> 16) & (dig >> 18));
    else
        bad |= d8 & (dig >> 8);                                  /* 9 digits: one by one */
    uint64_t ends = sep & ((bad & -bad) - 1);                    /* the elements before the first bad byte */
    if (!ends)
        return 0;
    unsigned hi = 63 - (unsigned)__builtin_clzll(ends);          /* the last one taken */
    *pp = p + hi + 2 + ((two >> hi) & 1);
    if (kind == LIST_IDS) {
        size_t n = 0;
        do {
            unsigned s = (unsigned)__builtin_ctzll(start), e = (unsigned)__builtin_ctzll(ends);
            uint64_t x;
            memcpy(&x, p + s, 8);
            ((int32_t *)out)[n++] = (int32_t)swar_value(x, (int)(e - s + 1));
            start &= start - 1;
            ends &= ends - 1;
        } while (ends);
        return n;
    }
    size_t n = popcount64(ends);
    if (kind == LIST_COUNT)
        return n;
    /* the first bytes of the elements taken, and those whose mask is 0 ('0', "-100") */
    uint64_t at = kind == LIST_MASK ? ends : start & (hi == 63 ? ~0ull : (2ull << hi) - 1);
    uint64_t off = kind == LIST_MASK ? at & zero : at & neg & (one >> 1) & (zero >> 2) & (zero >> 3) & (last >> 3);
    uint8_t *o = out;
    if (off == 0 || off == at) { /* the usual runs of 0 or of 1 */
        memset(o, off == 0, BLOCK / 2);
    } else {
        for (size_t i = 0; i < n; i++) {
            o[i] = !((off >> __builtin_ctzll(at)) & 1);
            at &= at - 1;
        }
    }
    return n;
}

/* Reads blocks of a list while they take elements, growing the array to n + BLOCK / 2 first
 * (a block holds at most 32 elements). After a block that took none, t says how many elements
 * to read one by one (a list not in the usual form, such as true and false, is then tried less
 * and less often). Returns 1 when elements were taken, 0 when none, -1 when out of memory. */
static inline __attribute__((always_inline)) int list_blocks(const char **pp, const char *end, int kind,
                                                             void **arr, size_t *cap, size_t sz, size_t *n,
                                                             list_try *t)
{
    if (t->wait) {
        t->wait--;
        return 0;
    }
    size_t n0 = *n;
    while (end - *pp >= BLOCK_READ) {
        if (kind != LIST_COUNT && !grow(arr, cap, *n + BLOCK / 2, sz))
            return -1;
        size_t k = list_block(pp, kind, kind == LIST_COUNT ? NULL : (char *)*arr + *n * sz);
        if (!k) {
            if (*n == n0) {
                t->wait = t->after;
                t->after = t->after < BLOCK_WAIT_MAX ? 2 * t->after : BLOCK_WAIT_MAX;
            }
            break;
        }
        t->after = BLOCK_WAIT;
        *n += k;
    }
    return *n > n0;
}
#endif

/* input_ids: a list of integers in [0, INT32_MAX]. Returns 1 parsed, 0 declined, -1 no memory. */
static int fast_ids(dfl_sample *s, const char **pp, const char *end)
{
    const char *p = *pp;
    if (p >= end || *p != '[')
        return 0;
    p = ws(p + 1, end);
    size_t n = 0;
    if (p < end && *p == ']') {
        p++;
    } else {
#ifdef LIST_BLOCKS
        list_try t = {0, BLOCK_WAIT};
#endif
        for (;;) {
#ifdef LIST_BLOCKS
            if (s->count_ids)
                list_blocks(&p, end, LIST_COUNT, NULL, NULL, 0, &n, &t);
            else if (list_blocks(&p, end, LIST_IDS, (void **)&s->ids, &s->ids_cap, sizeof *s->ids, &n,
                                 &t) < 0)
                return -1;
#endif
            uint64_t v;
            if (!fast_uint(&p, end, INT32_MAX, &v))
                return 0;
            if (!s->count_ids) {
                if (n == s->ids_cap && !GROW(s->ids, s->ids_cap, n + 1))
                    return -1;
                s->ids[n] = (int32_t)v;
            }
            n++;
            if (end - p >= 3 && p[0] == ',' && p[1] == ' ' && is_digit(p[2])) {
                p += 2; /* the usual ", " */
                continue;
            }
            int r = next_elem(&p, end);
            if (r < 0)
                return 0;
            if (r == 0)
                break;
        }
    }
    s->n = n;
    *pp = p;
    return 1;
}

/* loss_mask: a list of 0, 1, true, false. */
static int fast_mask(dfl_sample *s, const char **pp, const char *end)
{
    const char *p = *pp;
    if (p >= end || *p != '[')
        return 0;
    p = ws(p + 1, end);
    size_t n = 0;
    if (p < end && *p == ']') {
        p++;
    } else {
#ifdef LIST_BLOCKS
        list_try t = {0, BLOCK_WAIT};
#endif
        for (;;) {
#ifdef LIST_BLOCKS
            if (list_blocks(&p, end, LIST_MASK, (void **)&s->mask, &s->mask_cap, 1, &n, &t) < 0)
                return -1;
#endif
            if (p >= end)
                return 0;
            uint8_t v;
            if (*p == '0' || *p == '1') {
                v = (uint8_t)(*p - '0');
                p++;
                if (p < end && (is_digit(*p) || *p == '.' || *p == 'e' || *p == 'E'))
                    return 0;
            } else if (*p == 't') {
                v = 1;
                if (!(p = literal(p, end, "true", 4)))
                    return 0;
            } else if (*p == 'f') {
                v = 0;
                if (!(p = literal(p, end, "false", 5)))
                    return 0;
            } else {
                return 0;
            }
            if (n == s->mask_cap && !GROW(s->mask, s->mask_cap, n + 1))
                return -1;
            s->mask[n++] = v;
            if (end - p >= 3 && p[0] == ',' && p[1] == ' ' &&
                (p[2] == '0' || p[2] == '1' || p[2] == 't' || p[2] == 'f')) {
                p += 2; /* the usual ", " */
                continue;
            }
            int r = next_elem(&p, end);
            if (r < 0)
                return 0;
            if (r == 0)
                break;
        }
    }
    s->n_mask = n;
    *pp = p;
    return 1;
}

/* labels: a list of integers; -100 gives mask 0, anything else 1. */
static int fast_labels(dfl_sample *s, const char **pp, const char *end)
{
    const char *p = *pp;
    if (p >= end || *p != '[')
        return 0;
    p = ws(p + 1, end);
    size_t n = 0;
    if (p < end && *p == ']') {
        p++;
    } else {
#ifdef LIST_BLOCKS
        list_try t = {0, BLOCK_WAIT};
#endif
        for (;;) {
#ifdef LIST_BLOCKS
            if (list_blocks(&p, end, LIST_LABELS, (void **)&s->lab, &s->lab_cap, 1, &n, &t) < 0)
                return -1;
#endif
            if (p >= end)
                return 0;
            bool neg = *p == '-';
            p += neg;
            uint64_t v;
            /* beyond 18 digits (not exactly checked here): let jansson decide */
            if (!fast_uint(&p, end, 999999999999999999ull, &v))
                return 0;
            if (n == s->lab_cap && !GROW(s->lab, s->lab_cap, n + 1))
                return -1;
            s->lab[n++] = !(neg && v == 100);
            if (end - p >= 3 && p[0] == ',' && p[1] == ' ' && (is_digit(p[2]) || p[2] == '-')) {
                p += 2; /* the usual ", " */
                continue;
            }
            int r = next_elem(&p, end);
            if (r < 0)
                return 0;
            if (r == 0)
                break;
        }
    }
    s->n_lab = n;
    *pp = p;
    return 1;
}

static inline bool key_is(const key_span *k, const char *name, size_t n)
{
    return k->n == n && memcmp(k->p, name, n) == 0;
}

int dfl_sample_parse_fast_eol(dfl_sample *s, const char *line, const char *end, const char **eol)
{
    const char *p = line;
    s->has_ids = s->has_mask = s->has_lab = false;
    s->n = s->n_mask = s->n_lab = 0;
    p = ws(p, end);
    if (p >= end || *p != '{')
        return 0;
    p = ws(p + 1, end);
    if (p < end && *p == '}')
        return 0;
    key_span keys[MAX_KEYS], k;
    int nk = 0;
    for (;;) {
        p = scan_key(p, end, keys, &nk, &k);
        if (!p)
            return 0;
        int r = 2;
        if (key_is(&k, "input_ids", 9)) {
            r = fast_ids(s, &p, end);
            s->has_ids = true;
        } else if (key_is(&k, "loss_mask", 9)) {
            if (p < end && *p == 'n') {
                p = literal(p, end, "null", 4);
            } else {
                r = fast_mask(s, &p, end);
                s->has_mask = true;
            }
        } else if (key_is(&k, "labels", 6)) {
            if (p < end && *p == 'n') {
                p = literal(p, end, "null", 4);
            } else {
                r = fast_labels(s, &p, end);
                s->has_lab = true;
            }
        } else {
            p = skip_value(p, end, 1);
        }
        if (r <= 0)
            return r;
        if (!p)
            return 0;
        p = ws(p, end);
        if (p >= end)
            return 0;
        if (*p == ',') {
            p = ws(p + 1, end);
            continue;
        }
        if (*p == '}') {
            p++;
            break;
        }
        return 0;
    }
    p = ws(p, end);
    if ((p != end && *p != '\n') || !s->has_ids)
        return 0;
    int rc = finish(s, NULL);
    if (rc == DFL_ENOMEM)
        return -1;
    *eol = p;
    return rc == DFL_OK ? 1 : 0;
}

int dfl_sample_parse_fast(dfl_sample *s, const char *line, size_t n)
{
    const char *eol;
    int r = dfl_sample_parse_fast_eol(s, line, line + n, &eol);
    return r == 1 && eol != line + n ? 0 : r; /* a '\n' inside: not one line */
}

/* ---- the jansson path ---- */

/* Nesting depth of the text, as lib/base/json.c counts it (strings skipped). */
static bool depth_ok(const char *s, size_t n, int max)
{
    int d = 0;
    bool in_str = false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
            continue;
        }
        if (c == '"')
            in_str = true;
        else if (c == '[' || c == '{') {
            if (++d > max)
                return false;
        } else if (c == ']' || c == '}')
            d--;
    }
    return true;
}

int dfl_sample_parse_json(dfl_sample *s, const char *line, size_t n, dfl_err *e)
{
    s->has_ids = s->has_mask = s->has_lab = false;
    s->n = s->n_mask = s->n_lab = 0;
    if (n > DFL_JSONL_MAX_LINE)
        return dfl_fail(e, DFL_EDATA, "line of %zu bytes is longer than the limit of %u bytes", n,
                        DFL_JSONL_MAX_LINE);
    if (memchr(line, 0, n))
        return dfl_fail(e, DFL_EDATA, "not valid JSON: the line contains a NUL byte");
    if (!depth_ok(line, n, DFL_JSON_MAX_DEPTH))
        return dfl_fail(e, DFL_EDATA, "JSON nested deeper than %d levels", DFL_JSON_MAX_DEPTH);
    json_error_t je;
    /* JSON_ALLOW_NUL: a string value may hold \u0000 (the keys read here hold no strings, and
     * the values of other keys are never used) */
    json_t *root = json_loadb(line, n, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!root)
        return dfl_fail(e, DFL_EDATA, "not valid JSON (column %d): %s", je.column, je.text);
    int rc = DFL_OK;
    json_t *v;
    if (!json_is_object(root)) {
        rc = dfl_fail(e, DFL_EDATA, "not a JSON object (a sample is an object with \"input_ids\")");
        goto out;
    }
    v = json_object_get(root, "input_ids");
    if (!v || json_is_null(v)) {
        rc = dfl_fail(e, DFL_EDATA, "missing input_ids");
        goto out;
    }
    if (!json_is_array(v)) {
        rc = dfl_fail(e, DFL_EDATA, "input_ids is not a list");
        goto out;
    }
    size_t m = json_array_size(v);
    if (!GROW(s->ids, s->ids_cap, m)) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory for a sample of %zu tokens", m);
        goto out;
    }
    for (size_t i = 0; i < m; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x)) {
            rc = dfl_fail(e, DFL_EDATA, "input_ids[%zu] is not an integer", i);
            goto out;
        }
        json_int_t t = json_integer_value(x);
        if (t < 0) {
            rc = dfl_fail(e, DFL_EDATA, "input_ids[%zu] = %lld is negative", i, (long long)t);
            goto out;
        }
        if (t > INT32_MAX) {
            rc = dfl_fail(e, DFL_EDATA, "input_ids[%zu] = %lld does not fit a 32-bit token id", i,
                          (long long)t);
            goto out;
        }
        s->ids[i] = (int32_t)t;
    }
    s->n = m;
    s->has_ids = true;
    v = json_object_get(root, "loss_mask");
    if (v && !json_is_null(v)) {
        if (!json_is_array(v)) {
            rc = dfl_fail(e, DFL_EDATA, "loss_mask is not a list");
            goto out;
        }
        m = json_array_size(v);
        if (!GROW(s->mask, s->mask_cap, m)) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory for a sample of %zu tokens", m);
            goto out;
        }
        for (size_t i = 0; i < m; i++) {
            json_t *x = json_array_get(v, i);
            if (json_is_boolean(x)) {
                s->mask[i] = json_is_true(x);
            } else if (json_is_integer(x) && (json_integer_value(x) == 0 || json_integer_value(x) == 1)) {
                s->mask[i] = (uint8_t)json_integer_value(x);
            } else if (json_is_integer(x)) {
                rc = dfl_fail(e, DFL_EDATA, "loss_mask[%zu] = %lld is not 0, 1, true or false", i,
                              (long long)json_integer_value(x));
                goto out;
            } else {
                rc = dfl_fail(e, DFL_EDATA, "loss_mask[%zu] is not 0, 1, true or false", i);
                goto out;
            }
        }
        s->n_mask = m;
        s->has_mask = true;
    } else if ((v = json_object_get(root, "labels")) && !json_is_null(v)) {
        if (!json_is_array(v)) {
            rc = dfl_fail(e, DFL_EDATA, "labels is not a list");
            goto out;
        }
        m = json_array_size(v);
        if (!GROW(s->lab, s->lab_cap, m)) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory for a sample of %zu tokens", m);
            goto out;
        }
        for (size_t i = 0; i < m; i++) {
            json_t *x = json_array_get(v, i);
            if (!json_is_integer(x)) {
                rc = dfl_fail(e, DFL_EDATA, "labels[%zu] is not an integer", i);
                goto out;
            }
            s->lab[i] = json_integer_value(x) != -100;
        }
        s->n_lab = m;
        s->has_lab = true;
    }
    rc = finish(s, e);
out:
    json_decref(root);
    return rc;
}

int dfl_sample_parse(dfl_sample *s, const char *line, size_t n, bool *blank, dfl_err *e)
{
    *blank = false;
    if (n > DFL_JSONL_MAX_LINE)
        return dfl_fail(e, DFL_EDATA, "line of %zu bytes is longer than the limit of %u bytes", n,
                        DFL_JSONL_MAX_LINE);
    int r = dfl_sample_parse_fast(s, line, n);
    if (r > 0)
        return DFL_OK;
    if (r < 0)
        return dfl_fail(e, DFL_ENOMEM, "out of memory for a sample");
    const char *q = line;
    while (q < line + n && (is_ws(*q) || *q == '\n'))
        q++;
    if (q == line + n) {
        *blank = true;
        return DFL_OK;
    }
    return dfl_sample_parse_json(s, line, n, e);
}

/* ---- inputs through libarchive ---- */

enum { IN_START, IN_RAW, IN_ARCHIVE, IN_DONE };

struct dfl_input {
    char *path;          /* as given ("-" for stdin) */
    char *disp;          /* for messages */
    char *part_name;     /* current part */
    bool is_stdin;
    int state;
    uint64_t size;
    struct archive *a;   /* outer reader */
    struct archive *inner; /* decompressing reader over a compressed archive member, or NULL */
    bool inner_eof;
    dfl_map map;
    bool regular;        /* a regular file (libarchive opens it, and may seek in it) */
    int fd;              /* stdin, or a pipe or device named by path: read by fd_read */
    uint8_t *rbuf;
    volatile sig_atomic_t *stop;
};

#define RBUF_SIZE (1u << 20)

/* libarchive's read callback for stdin, pipes and devices: waits with poll() so that a stop
 * requested by a signal is seen even while no data comes (a plain read() would be restarted). */
static la_ssize_t fd_read(struct archive *a, void *ctx, const void **buf)
{
    dfl_input *in = ctx;
    for (;;) {
        if (in->stop && *in->stop) {
            archive_set_error(a, EINTR, "interrupted");
            return -1;
        }
        struct pollfd pfd = {.fd = in->fd, .events = POLLIN};
        int pr = poll(&pfd, 1, 200);
        if (pr < 0 && errno != EINTR) {
            archive_set_error(a, errno, "poll failed");
            return -1;
        }
        if (pr <= 0)
            continue;
        ssize_t n = read(in->fd, in->rbuf, RBUF_SIZE);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            archive_set_error(a, errno, "read failed");
            return -1;
        }
        *buf = in->rbuf;
        return (la_ssize_t)n;
    }
}

/* Names in messages: bytes below 0x20 and DEL become '?'. */
static char *sanitize(const char *s)
{
    char *d = dfl_strdup(s);
    if (!d)
        return NULL;
    for (char *p = d; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            *p = '?';
    return d;
}

static bool ends_with(const char *s, size_t n, const char *suf)
{
    size_t k = strlen(suf);
    return n >= k && memcmp(s + n - k, suf, k) == 0;
}

bool dfl_jsonl_member_name(const char *name)
{
    static const char *const comp[] = {".gz", ".zst", ".zstd", ".xz", ".bz2", ".lz4"};
    static const char *const base[] = {".jsonl", ".json", ".ndjson"};
    size_t n = strlen(name);
    for (size_t i = 0; i < DFL_ARRAY_LEN(comp); i++)
        if (ends_with(name, n, comp[i])) {
            n -= strlen(comp[i]);
            break;
        }
    for (size_t i = 0; i < DFL_ARRAY_LEN(base); i++)
        if (ends_with(name, n, base[i]) && n > strlen(base[i]))
            return true;
    return false;
}

static bool compressed_name(const char *name)
{
    static const char *const comp[] = {".gz", ".zst", ".zstd", ".xz", ".bz2", ".lz4"};
    size_t n = strlen(name);
    for (size_t i = 0; i < DFL_ARRAY_LEN(comp); i++)
        if (ends_with(name, n, comp[i]))
            return true;
    return false;
}

int dfl_input_open(dfl_input **out, const char *path, volatile sig_atomic_t *stop, dfl_err *e)
{
    *out = NULL;
    dfl_input *in = calloc(1, sizeof *in);
    if (!in)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    in->map.fd = -1;
    in->fd = -1;
    in->stop = stop;
    in->is_stdin = strcmp(path, "-") == 0;
    in->path = dfl_strdup(path);
    in->disp = sanitize(in->is_stdin ? "(stdin)" : path);
    if (!in->path || !in->disp) {
        dfl_input_close(in);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    if (!in->is_stdin) {
        struct stat st;
        if (stat(path, &st) != 0) {
            int err = errno;
            dfl_input_close(in);
            return dfl_fail_errno(e, DFL_EIO, err, "%s: cannot open", path);
        }
        if (S_ISDIR(st.st_mode)) {
            dfl_input_close(in);
            return dfl_fail(e, DFL_EIO, "%s: is a directory", path);
        }
        if (S_ISREG(st.st_mode)) {
            in->size = (uint64_t)st.st_size;
            in->regular = true;
        }
    } else {
        struct stat st;
        if (fstat(0, &st) == 0 && S_ISREG(st.st_mode))
            in->size = (uint64_t)st.st_size;
    }
    *out = in;
    return DFL_OK;
}

static int arch_fail(dfl_input *in, struct archive *a, const char *name, dfl_err *e)
{
    const char *m = archive_error_string(a);
    if (in->stop && *in->stop)
        return dfl_fail(e, DFL_EINTR, "interrupted");
    return dfl_fail(e, DFL_EDATA, "%s: cannot read: %s", name, m ? m : "unknown libarchive error");
}

static la_ssize_t inner_read(struct archive *a, void *ctx, const void **buf)
{
    (void)a;
    dfl_input *in = ctx;
    const void *b;
    size_t n;
    la_int64_t off;
    int r = archive_read_data_block(in->a, &b, &n, &off);
    if (r == ARCHIVE_EOF)
        return 0;
    if (r < ARCHIVE_WARN) {
        archive_set_error(a, EIO, "%s", archive_error_string(in->a) ? archive_error_string(in->a) : "read error");
        return -1;
    }
    *buf = b;
    return (la_ssize_t)n;
}

static void close_inner(dfl_input *in)
{
    if (in->inner) {
        archive_read_free(in->inner);
        in->inner = NULL;
    }
}

static int set_part_name(dfl_input *in, const char *member)
{
    free(in->part_name);
    in->part_name = NULL;
    if (!member) {
        in->part_name = dfl_strdup(in->disp);
    } else {
        char *m = sanitize(member);
        if (m) {
            size_t n = strlen(in->disp) + strlen(m) + 2;
            in->part_name = malloc(n);
            if (in->part_name)
                snprintf(in->part_name, n, "%s:%s", in->disp, m);
            free(m);
        }
    }
    return in->part_name ? DFL_OK : DFL_ENOMEM;
}

/* At an archive entry: is it a part? Sets up the inner reader for a compressed member. */
static int archive_entry_part(dfl_input *in, struct archive_entry *ent, dfl_part *p, bool *is_part,
                              dfl_err *e)
{
    *is_part = false;
    const char *name = archive_entry_pathname(ent);
    if (!name)
        name = "";
    if (archive_entry_filetype(ent) != AE_IFREG || !dfl_jsonl_member_name(name)) {
        char *s = sanitize(name);
        dfl_verbose("%s: skipping member '%s' (not a .jsonl/.json file)", in->disp, s ? s : "?");
        free(s);
        return DFL_OK;
    }
    if (set_part_name(in, name))
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    close_inner(in);
    in->inner_eof = false;
    if (compressed_name(name) && !(archive_entry_size_is_set(ent) && archive_entry_size(ent) == 0)) {
        in->inner = archive_read_new();
        if (!in->inner)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        archive_read_support_filter_all(in->inner);
        archive_read_support_format_raw(in->inner);
        if (archive_read_open(in->inner, in, NULL, inner_read, NULL) != ARCHIVE_OK)
            return arch_fail(in, in->inner, in->part_name, e);
        struct archive_entry *ie;
        int r = archive_read_next_header(in->inner, &ie);
        if (r == ARCHIVE_EOF)
            in->inner_eof = true;
        else if (r < ARCHIVE_WARN)
            return arch_fail(in, in->inner, in->part_name, e);
    } else if (compressed_name(name)) {
        in->inner_eof = true; /* an empty compressed member: no data */
    }
    p->name = in->part_name;
    p->mapped = false;
    p->data = NULL;
    p->size = 0;
    *is_part = true;
    return DFL_OK;
}

int dfl_input_next_part(dfl_input *in, dfl_part *p, bool *eof, dfl_err *e)
{
    *eof = false;
    memset(p, 0, sizeof *p);
    if (in->state == IN_DONE || in->state == IN_RAW) {
        in->state = IN_DONE;
        close_inner(in);
        *eof = true;
        return DFL_OK;
    }
    struct archive_entry *ent;
    if (in->state == IN_START) {
        if (!in->is_stdin && in->size == 0) {
            struct stat st;
            if (stat(in->path, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == 0) {
                /* an empty plain file: one empty mapped part (libarchive has nothing to detect) */
                if (set_part_name(in, NULL))
                    return dfl_fail(e, DFL_ENOMEM, "out of memory");
                in->state = IN_DONE;
                p->name = in->part_name;
                p->mapped = true;
                return DFL_OK;
            }
        }
        in->a = archive_read_new();
        if (!in->a)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        archive_read_support_filter_all(in->a);
        archive_read_support_format_raw(in->a);
        archive_read_support_format_tar(in->a);
        archive_read_support_format_zip(in->a);
        int r;
        if (in->regular) {
            r = archive_read_open_filename(in->a, in->path, 1 << 20);
        } else {
            in->fd = in->is_stdin ? 0 : open(in->path, O_RDONLY | O_CLOEXEC);
            if (in->fd < 0)
                return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", in->disp);
            in->rbuf = malloc(RBUF_SIZE);
            if (!in->rbuf)
                return dfl_fail(e, DFL_ENOMEM, "out of memory");
            r = archive_read_open(in->a, in, NULL, fd_read, NULL);
        }
        if (in->stop && *in->stop)
            return dfl_fail(e, DFL_EINTR, "interrupted");
        if (r != ARCHIVE_OK)
            return arch_fail(in, in->a, in->disp, e);
        r = archive_read_next_header(in->a, &ent);
        if (r == ARCHIVE_EOF) {
            in->state = IN_DONE;
            *eof = true;
            return DFL_OK;
        }
        if (r < ARCHIVE_WARN)
            return arch_fail(in, in->a, in->disp, e);
        if ((archive_format(in->a) & ARCHIVE_FORMAT_BASE_MASK) == ARCHIVE_FORMAT_RAW) {
            if (set_part_name(in, NULL))
                return dfl_fail(e, DFL_ENOMEM, "out of memory");
            p->name = in->part_name;
            bool plain = archive_filter_count(in->a) <= 1 &&
                         archive_filter_code(in->a, 0) == ARCHIVE_FILTER_NONE;
            struct stat st;
            if (plain && !in->is_stdin && stat(in->path, &st) == 0 && S_ISREG(st.st_mode)) {
                /* a plain regular file: map it, so that samples can be re-read by offset */
                archive_read_free(in->a);
                in->a = NULL;
                int rc = dfl_map_open(&in->map, in->path, e);
                if (rc)
                    return rc;
                if (in->map.fd >= 0) { /* the mapping outlives it: do not hold a descriptor per input */
                    close(in->map.fd);
                    in->map.fd = -1;
                }
                in->state = IN_DONE;
                p->mapped = true;
                p->data = in->map.data;
                p->size = in->map.size;
                return DFL_OK;
            }
            in->state = IN_RAW;
            return DFL_OK;
        }
        in->state = IN_ARCHIVE;
        bool is_part;
        int rc = archive_entry_part(in, ent, p, &is_part, e);
        if (rc || is_part)
            return rc;
    }
    /* IN_ARCHIVE: the next member that is a part */
    close_inner(in);
    for (;;) {
        int r = archive_read_next_header(in->a, &ent);
        if (r == ARCHIVE_EOF) {
            in->state = IN_DONE;
            *eof = true;
            return DFL_OK;
        }
        if (r < ARCHIVE_WARN)
            return arch_fail(in, in->a, in->disp, e);
        bool is_part;
        int rc = archive_entry_part(in, ent, p, &is_part, e);
        if (rc || is_part)
            return rc;
    }
}

int dfl_input_read(dfl_input *in, void *buf, size_t cap, size_t *got, dfl_err *e)
{
    *got = 0;
    if (in->state != IN_RAW && in->state != IN_ARCHIVE)
        return DFL_OK;
    struct archive *a = in->inner ? in->inner : in->a;
    if (in->inner && in->inner_eof)
        return DFL_OK;
    if (!in->inner && in->inner_eof) /* empty compressed member */
        return DFL_OK;
    for (;;) {
        la_ssize_t r = archive_read_data(a, buf, cap);
        if (r >= 0) {
            *got = (size_t)r;
            return DFL_OK;
        }
        if (r == ARCHIVE_RETRY)
            continue;
        return arch_fail(in, a, in->part_name ? in->part_name : in->disp, e);
    }
}

uint64_t dfl_input_consumed(const dfl_input *in)
{
    if (in->a)
        return (uint64_t)archive_filter_bytes(in->a, -1);
    return in->state == IN_DONE ? in->size : 0;
}

uint64_t dfl_input_size(const dfl_input *in) { return in->size; }

void dfl_input_close(dfl_input *in)
{
    if (!in)
        return;
    close_inner(in);
    if (in->a)
        archive_read_free(in->a);
    if (in->map.fd >= 0 || in->map.data)
        dfl_map_close(&in->map);
    if (in->fd > 0)
        close(in->fd);
    free(in->rbuf);
    free(in->path);
    free(in->disp);
    free(in->part_name);
    free(in);
}
