/* jsonl.c: samples from JSON Lines (see jsonl.h): the fast scanner, the jansson path that
 * decides what the scanner declines, and inputs read through libarchive. */
#include "jsonl.h"

#include <archive.h>
#include <archive_entry.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
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

#include "json.h"
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

/* One or more digits at p: the end of them, or NULL when there is none. */
static inline const char *digits1(const char *p, const char *end)
{
    if (p >= end || !is_digit(*p))
        return NULL;
    while (p < end && is_digit(*p))
        p++;
    return p;
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
    } else if (!(p = digits1(p, end))) {
        return NULL;
    }
    size_t nd = (size_t)(p - digits);
    bool real = false;
    if (p < end && *p == '.') {
        if (!(p = digits1(p + 1, end)))
            return NULL;
        real = true;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if (!(p = digits1(p, end)))
            return NULL;
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

/* After an object's member or an array's element: ',' (*pp then at the next one) or the closing
 * bracket `close` (*pp after it). Returns 1 for another, 0 at the end, -1 to decline. */
static inline int next_item(const char **pp, const char *end, char close)
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
    if (*p == close) {
        *pp = p + 1;
        return 0;
    }
    return -1;
}

/* The members of an object (keys: room for MAX_KEYS keys, for the duplicate check) or the
 * elements of an array (keys NULL); p is after '{' or '[', depth the nesting level of this
 * container. Returns the end of the container, NULL to decline. */
static const char *skip_items(const char *p, const char *end, int depth, key_span *keys)
{
    const char close = keys ? '}' : ']';
    if (depth > DFL_JSON_MAX_DEPTH)
        return NULL;
    key_span k;
    int nk = 0;
    p = ws(p, end);
    if (p < end && *p == close)
        return p + 1;
    for (;;) {
        if (keys && !(p = scan_key(p, end, keys, &nk, &k)))
            return NULL;
        if (!(p = skip_value(p, end, depth)))
            return NULL;
        int r = next_item(&p, end, close);
        if (r <= 0)
            return r == 0 ? p : NULL;
    }
}

static const char *skip_object(const char *p, const char *end, int depth)
{
    key_span keys[MAX_KEYS];
    return skip_items(p, end, depth, keys);
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
    case '[': return skip_items(p + 1, end, depth + 1, NULL);
    case 't': return literal(p, end, "true", 4);
    case 'f': return literal(p, end, "false", 5);
    case 'n': return literal(p, end, "null", 4);
    default:
        if (*p == '-' || is_digit(*p))
            return skip_number(p, end);
        return NULL;
    }
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

enum { LIST_IDS, LIST_COUNT, LIST_MASK, LIST_LABELS }; /* LIST_COUNT: ids checked, not kept */

#if defined(__SSE2__)
#define LIST_BLOCKS 1

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

/* One element of a list of the kind at *pp: true with its value in *v (the token id, or the mask
 * byte: 0 or 1) and *pp after it; false to decline.
 *  LIST_IDS, LIST_COUNT (input_ids): an integer in [0, INT32_MAX].
 *  LIST_MASK (loss_mask): 0, 1, true or false.
 *  LIST_LABELS (labels): an integer; -100 gives mask 0, anything else 1. */
static inline __attribute__((always_inline)) bool fast_elem(const char **pp, const char *end, int kind,
                                                            uint64_t *v)
{
    const char *p = *pp;
    if (kind == LIST_IDS || kind == LIST_COUNT) {
        if (!fast_uint(&p, end, INT32_MAX, v))
            return false;
    } else if (kind == LIST_MASK) {
        if (p >= end)
            return false;
        if (*p == '0' || *p == '1') {
            *v = (uint64_t)(*p - '0');
            p++;
            if (p < end && (is_digit(*p) || *p == '.' || *p == 'e' || *p == 'E'))
                return false;
        } else if (*p == 't') {
            *v = 1;
            if (!(p = literal(p, end, "true", 4)))
                return false;
        } else if (*p == 'f') {
            *v = 0;
            if (!(p = literal(p, end, "false", 5)))
                return false;
        } else {
            return false;
        }
    } else {
        if (p >= end)
            return false;
        bool neg = *p == '-';
        p += neg;
        uint64_t u;
        /* beyond 18 digits (not exactly checked here): let jansson decide */
        if (!fast_uint(&p, end, 999999999999999999ull, &u))
            return false;
        *v = !(neg && u == 100);
    }
    *pp = p;
    return true;
}

/* Whether c can start an element of a list of the kind (after the usual ", "). */
static inline __attribute__((always_inline)) bool elem_start(int kind, char c)
{
    if (kind == LIST_MASK)
        return c == '0' || c == '1' || c == 't' || c == 'f';
    return is_digit(c) || (kind == LIST_LABELS && c == '-');
}

/* A list of the kind at *pp (see fast_elem), its elements kept in *arr (int32_t for LIST_IDS,
 * uint8_t for LIST_MASK and LIST_LABELS; none for LIST_COUNT) of capacity *cap: *count and *pp
 * after it when parsed. Returns 1 parsed, 0 declined, -1 no memory. Inlined for each kind, so
 * that each list has a parser of its own. */
static inline __attribute__((always_inline)) int fast_list(const char **pp, const char *end, int kind,
                                                           void **arr, size_t *cap, size_t *count)
{
    const size_t sz = kind == LIST_IDS ? sizeof(int32_t) : 1;
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
            if (list_blocks(&p, end, kind, arr, cap, sz, &n, &t) < 0)
                return -1;
#endif
            uint64_t v;
            if (!fast_elem(&p, end, kind, &v))
                return 0;
            if (kind != LIST_COUNT) {
                if (n == *cap && !grow(arr, cap, n + 1, sz))
                    return -1;
                if (kind == LIST_IDS)
                    ((int32_t *)*arr)[n] = (int32_t)v;
                else
                    ((uint8_t *)*arr)[n] = (uint8_t)v;
            }
            n++;
            if (end - p >= 3 && p[0] == ',' && p[1] == ' ' && elem_start(kind, p[2])) {
                p += 2; /* the usual ", " */
                continue;
            }
            int r = next_item(&p, end, ']');
            if (r < 0)
                return 0;
            if (r == 0)
                break;
        }
    }
    *count = n;
    *pp = p;
    return 1;
}

/* input_ids: kept, or (count_ids) only checked and counted. */
static int fast_ids(dfl_sample *s, const char **pp, const char *end)
{
    if (s->count_ids)
        return fast_list(pp, end, LIST_COUNT, NULL, NULL, &s->n);
    return fast_list(pp, end, LIST_IDS, (void **)&s->ids, &s->ids_cap, &s->n);
}

/* loss_mask (LIST_MASK) or labels (LIST_LABELS): null, as if absent (2, *pp after it or NULL),
 * or the list (as fast_list, has_mask or has_lab set). */
static inline __attribute__((always_inline)) int fast_mask_list(dfl_sample *s, const char **pp, const char *end,
                                                                int kind)
{
    if (*pp < end && **pp == 'n') {
        *pp = literal(*pp, end, "null", 4);
        return 2;
    }
    if (kind == LIST_MASK) {
        s->has_mask = true;
        return fast_list(pp, end, LIST_MASK, (void **)&s->mask, &s->mask_cap, &s->n_mask);
    }
    s->has_lab = true;
    return fast_list(pp, end, LIST_LABELS, (void **)&s->lab, &s->lab_cap, &s->n_lab);
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
            r = fast_mask_list(s, &p, end, LIST_MASK);
        } else if (key_is(&k, "labels", 6)) {
            r = fast_mask_list(s, &p, end, LIST_LABELS);
        } else {
            p = skip_value(p, end, 1);
        }
        if (r <= 0)
            return r;
        if (!p || (r = next_item(&p, end, '}')) < 0)
            return 0;
        if (r == 0)
            break;
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

/* The list v under key: room for its json_array_size(v) elements of sz bytes in *arr, the size in
 * *m. Returns DFL_OK, or the error (not a list, no memory). */
static int json_list(json_t *v, const char *key, void **arr, size_t *cap, size_t sz, size_t *m, dfl_err *e)
{
    if (!json_is_array(v))
        return dfl_fail(e, DFL_EDATA, "%s is not a list", key);
    *m = json_array_size(v);
    if (!grow(arr, cap, *m, sz))
        return dfl_fail(e, DFL_ENOMEM, "out of memory for a sample of %zu tokens", *m);
    return DFL_OK;
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
    if (!dfl_json_depth_ok(line, n, DFL_JSON_MAX_DEPTH))
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
    size_t m;
    if ((rc = json_list(v, "input_ids", (void **)&s->ids, &s->ids_cap, sizeof *s->ids, &m, e)))
        goto out;
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
        if ((rc = json_list(v, "loss_mask", (void **)&s->mask, &s->mask_cap, 1, &m, e)))
            goto out;
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
        if ((rc = json_list(v, "labels", (void **)&s->lab, &s->lab_cap, 1, &m, e)))
            goto out;
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

/* ---- inputs through libarchive ----
 * A compressed input (or archive member) is read by a reader of its own, a "zlayer": libarchive's
 * filters and its raw format over the compressed bytes, which come from our own callback. That
 * lets dfl check what libarchive does not:
 *  - the end: the decompressor must take the compressed data to its last byte. libarchive stops
 *    quietly at bytes that do not start another member (trailing garbage, or a member cut inside
 *    its header); both are invalid data here.
 *  - gzip: libarchive checks neither the CRC-32 nor the length (ISIZE) of a member. The source is
 *    scanned for member headers (1f 8b 08); the 8 bytes before a header are a trailer candidate,
 *    which ends the member where its length says, if that falls in the output block during which
 *    the header was consumed and the CRC-32 of the output since the member's start agrees. The
 *    last member's trailer is the last 8 bytes of the input, and it must agree too.
 * A tar or zip archive inside a compressed input is read by a second reader over the zlayer's
 * output. zstd, xz, bzip2 and lz4 check their own checksums (in libzstd, liblzma, libbz2 and
 * libarchive). */

#define RBUF_SIZE (1u << 20)
#define ZHIST 16 /* bytes of the previous source chunk kept before the current one */

static uint32_t crc_tab[8][256];
#if defined(__x86_64__)
#define CRC_CLMUL 1
#include <immintrin.h>
static bool crc_has_clmul;
static uint64_t crc_k128[2], crc_k512[2]; /* folding constants (see crc_fold_const) */
#endif
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

#if CRC_CLMUL
static uint32_t reflect32(uint32_t v)
{
    uint32_t r = 0;
    for (int i = 0; i < 32; i++)
        r |= ((v >> i) & 1u) << (31 - i);
    return r;
}

/* Folding (carry-less multiplication) for the reflected CRC, worked out here: a 16-byte block
 * X, bit k of which (little-endian lanes) is the coefficient of x^(127-k), is moved D bits
 * further along the message as X x^D mod P, a value of at most 96 bits added into the block
 * there: with H and L its lanes (bit i: x^(63-i)), X x^D = H x^(64+D) + L x^D, and
 * clmul(H, c) has bit k for x^(127-k) when c has bit j for x^(64-j). So c = K x for
 * K = x^(E-1) mod P (E = 64+D, or D): bits 32..63 of c hold K reflected. */
static uint64_t crc_fold_const(int e)
{
    uint32_t k = 1; /* x^0, in the normal (unreflected) order: bit d is x^d */
    for (int i = 0; i < e - 1; i++)
        k = (k & 0x80000000u) ? (k << 1) ^ 0x04C11DB7u : k << 1;
    return (uint64_t)reflect32(k) << 32;
}
#endif

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_tab[t][i] = (crc_tab[t - 1][i] >> 8) ^ crc_tab[0][crc_tab[t - 1][i] & 0xFF];
#if CRC_CLMUL
    crc_has_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    crc_k128[0] = crc_fold_const(64 + 128);
    crc_k128[1] = crc_fold_const(128);
    crc_k512[0] = crc_fold_const(64 + 512);
    crc_k512[1] = crc_fold_const(512);
#endif
}

/* The CRC register (not inverted) after n more bytes, by table (slicing by 8). */
static uint32_t crc_table_run(uint32_t crc, const uint8_t *p, size_t n)
{
    for (; n && ((uintptr_t)p & 7); n--)
        crc = crc_tab[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    for (; n >= 8; n -= 8, p += 8) { /* little-endian words */
        uint64_t w;
        memcpy(&w, p, 8);
        uint32_t lo = (uint32_t)w ^ crc, hi = (uint32_t)(w >> 32);
        crc = crc_tab[7][lo & 0xFF] ^ crc_tab[6][(lo >> 8) & 0xFF] ^ crc_tab[5][(lo >> 16) & 0xFF] ^
              crc_tab[4][lo >> 24] ^ crc_tab[3][hi & 0xFF] ^ crc_tab[2][(hi >> 8) & 0xFF] ^
              crc_tab[1][(hi >> 16) & 0xFF] ^ crc_tab[0][hi >> 24];
    }
    for (; n; n--)
        crc = crc_tab[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

#if CRC_CLMUL
__attribute__((target("pclmul,sse4.1"))) static inline __m128i crc_fold(__m128i x, __m128i k, __m128i next)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)),
                         next);
}

/* The register after n >= 64 more bytes: the register is added into the first 4 bytes (the
 * message's value mod P is what the register tracks), four blocks fold 64 bytes at a time, then
 * into one block and 16 bytes at a time; the last block and the rest go through the table (the
 * register of a block from 0 is its value times x^32 mod P, as for the message it stands for). */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_clmul_run(uint32_t crc, const uint8_t *p, size_t n)
{
    const __m128i k512 = _mm_loadu_si128((const __m128i *)crc_k512);
    const __m128i k128 = _mm_loadu_si128((const __m128i *)crc_k128);
    __m128i x0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)crc));
    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
        x0 = crc_fold(x0, k512, _mm_loadu_si128((const __m128i *)p));
        x1 = crc_fold(x1, k512, _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = crc_fold(x2, k512, _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = crc_fold(x3, k512, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    x1 = crc_fold(x0, k128, x1);
    x2 = crc_fold(x1, k128, x2);
    x3 = crc_fold(x2, k128, x3);
    for (; n >= 16; p += 16, n -= 16)
        x3 = crc_fold(x3, k128, _mm_loadu_si128((const __m128i *)p));
    uint8_t last[16];
    _mm_storeu_si128((__m128i *)last, x3);
    return crc_table_run(crc_table_run(0, last, 16), p, n);
}
#endif

uint32_t dfl_crc32(uint32_t crc, const void *buf, size_t n)
{
    pthread_once(&crc_once, crc_init);
#if CRC_CLMUL
    if (crc_has_clmul && n >= 64)
        return ~crc_clmul_run(~crc, buf, n);
#endif
    return ~crc_table_run(~crc, buf, n);
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

typedef struct gz_cand {
    uint64_t at;             /* offset of the header in the compressed data */
    uint32_t crc, isize;     /* the 8 bytes before it, read as a trailer */
} gz_cand;

typedef struct zlayer {
    struct archive *a;       /* filters + raw (+ empty) over zl_src */
    dfl_input *in;
    const char *name;        /* for messages */
    bool member;             /* source: the current member of in->a (else in->fd) */
    const uint8_t *mblk;     /* member source: the rest of the outer reader's block */
    size_t mblk_n;
    uint8_t *buf;            /* ZHIST bytes of history, then the current chunk */
    size_t hist, chunk;
    uint64_t delivered;      /* source bytes handed to libarchive */
    bool src_eof;
    uint8_t first[4], last[8];
    size_t n_first;
    bool gz;                 /* the source starts as gzip: headers are collected */
    bool check;              /* gzip is the only filter: CRC and length are checked */
    gz_cand *cand;
    size_t n_cand, cap_cand, head;
    uint64_t scan;           /* next header position to look at */
    uint64_t out, mstart;    /* output so far; start of the current member's output */
    uint32_t mcrc;           /* CRC-32 of the current member's output so far */
    const uint8_t *blk;      /* output block being copied out (dfl_input_read), and its rest */
    size_t blk_n;
    bool eof;
    dfl_err err;             /* what failed inside a libarchive callback */
} zlayer;

enum { IN_START, IN_RAW, IN_ARCHIVE, IN_DONE };

struct dfl_input {
    char *path;          /* as given ("-" for stdin) */
    char *disp;          /* for messages */
    char *part_name;     /* current part */
    bool is_stdin;
    int state;
    uint64_t size;
    struct archive *a;   /* the part or archive reader (over z when the input is compressed) */
    zlayer *z;           /* the compressed input, or NULL */
    zlayer *zi;          /* the current compressed archive member, or NULL */
    bool part_eof;       /* the current stream part has no data (an empty input or member) */
    dfl_map map;
    bool regular;        /* a regular file */
    int fd;              /* the input's descriptor while a zlayer reads it */
    volatile sig_atomic_t *stop;
};

static bool stopped(const dfl_input *in) { return in->stop && *in->stop; }

/* Reads up to cap bytes of the input's descriptor into dst (*n = 0 at its end). On a pipe or
 * device it waits with poll(), so that a stop requested by a signal is seen even while no data
 * comes (a plain read() would be restarted). */
static int fd_pull(dfl_input *in, uint8_t *dst, size_t cap, size_t *n, dfl_err *e)
{
    *n = 0;
    for (;;) {
        if (stopped(in))
            return dfl_fail(e, DFL_EINTR, "interrupted");
        if (!in->regular) {
            struct pollfd pfd = {.fd = in->fd, .events = POLLIN};
            int pr = poll(&pfd, 1, 200);
            if (pr < 0 && errno != EINTR)
                return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot read", in->disp);
            if (pr <= 0)
                continue;
        }
        ssize_t r = read(in->fd, dst, cap);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot read", in->disp);
        }
        *n = (size_t)r;
        return DFL_OK;
    }
}

/* Words a libarchive failure of a; a read that ends early (libarchive gives no message then, or
 * liblzma's "no progress") is called truncated. */
static int arch_fail(dfl_input *in, struct archive *a, const char *name, dfl_err *e)
{
    if (stopped(in))
        return dfl_fail(e, DFL_EINTR, "interrupted");
    zlayer *zs[2] = {in->zi, in->z};
    for (int i = 0; i < 2; i++)
        if (zs[i] && zs[i]->err.code) {
            *e = zs[i]->err;
            return e->code;
        }
    const char *m = archive_error_string(a);
    if (!m)
        return dfl_fail(e, DFL_ETRUNC, "%s: truncated: the input ends early", name);
    if (strstr(m, "No progress is possible"))
        return dfl_fail(e, DFL_ETRUNC, "%s: truncated: the compressed data ends early (%s)", name, m);
    return dfl_fail(e, strcasestr(m, "truncated") ? DFL_ETRUNC : DFL_EDATA, "%s: cannot read: %s", name, m);
}

/* The member source: copies the next bytes of the current member of in->a. */
static int member_pull(zlayer *z, uint8_t *dst, size_t cap, size_t *n, dfl_err *e)
{
    *n = 0;
    while (!z->mblk_n) {
        const void *b;
        size_t len;
        la_int64_t off;
        int r = archive_read_data_block(z->in->a, &b, &len, &off);
        if (r == ARCHIVE_EOF)
            return DFL_OK;
        if (r < ARCHIVE_WARN)
            return arch_fail(z->in, z->in->a, z->name, e);
        z->mblk = b;
        z->mblk_n = len;
    }
    size_t k = z->mblk_n < cap ? z->mblk_n : cap;
    memcpy(dst, z->mblk, k);
    z->mblk += k;
    z->mblk_n -= k;
    *n = k;
    return DFL_OK;
}

/* Collects the gzip header candidates of the source bytes not looked at yet. */
static int zl_scan(zlayer *z, dfl_err *e)
{
    uint64_t base = z->delivered - z->chunk - z->hist; /* source offset of the history's start */
    uint64_t lo = z->scan > 20 ? z->scan : 20;         /* 20: the smallest gzip member */
    if (lo < base + 8)
        lo = base + 8;
    if (lo + 4 > z->delivered)
        return DFL_OK;
    const uint8_t *b = z->buf + ZHIST - z->hist, *p = b + (lo - base), *end = b + (z->delivered - base);
    while ((p = memmem(p, (size_t)(end - p), "\x1f\x8b\x08", 3)) && p + 4 <= end) {
        if (!(p[3] & 0xE0)) { /* reserved flag bits clear */
            if (z->head > 1024 && 2 * z->head > z->n_cand) { /* drop those looked at */
                memmove(z->cand, z->cand + z->head, (z->n_cand - z->head) * sizeof *z->cand);
                z->n_cand -= z->head;
                z->head = 0;
            }
            if (!GROW(z->cand, z->cap_cand, z->n_cand + 1))
                return dfl_fail(e, DFL_ENOMEM, "out of memory");
            z->cand[z->n_cand++] = (gz_cand){base + (uint64_t)(p - b), le32(p - 8), le32(p - 4)};
        }
        p++;
    }
    z->scan = z->delivered - 3; /* a header there has not all its 4 bytes yet */
    return DFL_OK;
}

/* Hands the next source chunk to libarchive, keeping ZHIST bytes of the previous one before it. */
static int zl_pull(zlayer *z, dfl_err *e)
{
    size_t keep = z->hist + z->chunk < ZHIST ? z->hist + z->chunk : ZHIST;
    memmove(z->buf + ZHIST - keep, z->buf + ZHIST + z->chunk - keep, keep);
    z->hist = keep;
    z->chunk = 0;
    if (z->src_eof)
        return DFL_OK;
    size_t n;
    int rc = z->member ? member_pull(z, z->buf + ZHIST, RBUF_SIZE, &n, e)
                       : fd_pull(z->in, z->buf + ZHIST, RBUF_SIZE, &n, e);
    if (rc)
        return rc;
    if (n == 0) {
        z->src_eof = true;
        return DFL_OK;
    }
    const uint8_t *p = z->buf + ZHIST;
    for (size_t i = 0; z->n_first < sizeof z->first && i < n; i++)
        z->first[z->n_first++] = p[i];
    if (n >= 8) {
        memcpy(z->last, p + n - 8, 8);
    } else {
        memmove(z->last, z->last + n, 8 - n);
        memcpy(z->last + 8 - n, p, n);
    }
    bool was = z->delivered >= 3;
    z->chunk = n;
    z->delivered += n;
    if (!was && z->delivered >= 3)
        z->gz = z->first[0] == 0x1f && z->first[1] == 0x8b && z->first[2] == 8;
    return z->gz ? zl_scan(z, e) : DFL_OK;
}

static la_ssize_t zl_src(struct archive *a, void *ctx, const void **buf)
{
    zlayer *z = ctx;
    if (zl_pull(z, &z->err)) {
        archive_set_error(a, EIO, "%s", z->err.msg);
        return -1;
    }
    *buf = z->buf + ZHIST;
    return (la_ssize_t)z->chunk;
}

static void zl_free(zlayer *z)
{
    if (!z)
        return;
    if (z->a)
        archive_read_free(z->a);
    free(z->buf);
    free(z->cand);
    free(z);
}

/* Opens a zlayer over the input's descriptor or its current member, and reads its header: *empty
 * when there is no data at all (an empty input, or compressed emptiness). */
static int zl_open(dfl_input *in, const char *name, bool member, zlayer **out, bool *empty, dfl_err *e)
{
    *out = NULL;
    *empty = false;
    zlayer *z = calloc(1, sizeof *z);
    if (!z || !(z->buf = malloc(ZHIST + RBUF_SIZE)) || !(z->a = archive_read_new())) {
        zl_free(z);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    z->in = in;
    z->name = name;
    z->member = member;
    *out = z;
    archive_read_support_filter_all(z->a);
    archive_read_support_format_raw(z->a);
    archive_read_support_format_empty(z->a);
    if (archive_read_open(z->a, z, NULL, zl_src, NULL) != ARCHIVE_OK)
        return arch_fail(in, z->a, name, e);
    struct archive_entry *ent;
    int r = archive_read_next_header(z->a, &ent);
    if (r < ARCHIVE_WARN)
        return arch_fail(in, z->a, name, e);
    int nf = archive_filter_count(z->a);
    z->check = z->gz && nf == 2 && archive_filter_code(z->a, 0) == ARCHIVE_FILTER_GZIP;
    *empty = r == ARCHIVE_EOF;
    return DFL_OK;
}

/* After the last output: the source must be used to its end, and the last gzip trailer agree. */
static int zl_finish(zlayer *z, dfl_err *e)
{
    z->eof = true;
    uint64_t used = (uint64_t)archive_filter_bytes(z->a, -1);
    if (used == z->delivered && !z->src_eof) {
        int rc = zl_pull(z, e);
        if (rc)
            return rc;
    }
    if (used < z->delivered) {
        /* the start of another member (its first bytes as the input's), or something else */
        uint64_t start = z->delivered - z->chunk - z->hist;
        size_t k = 0;
        if (used >= start)
            k = z->delivered - used < 2 ? (size_t)(z->delivered - used) : 2;
        if (k && z->n_first >= k && memcmp(z->buf + ZHIST - z->hist + (used - start), z->first, k) == 0)
            return dfl_fail(e, DFL_ETRUNC, "%s: truncated: an incomplete member at byte %llu of the compressed data",
                            z->name, (unsigned long long)used);
        return dfl_fail(e, DFL_EDATA, "%s: data after the end of the compressed data, at byte %llu",
                        z->name, (unsigned long long)used);
    }
    if (z->check && (le32(z->last) != z->mcrc || le32(z->last + 4) != (uint32_t)(z->out - z->mstart)))
        return dfl_fail(e, DFL_EDATA, "%s: corrupt gzip data: the CRC-32 or length of a member does not match "
                        "its trailer", z->name);
    return DFL_OK;
}

/* Checks an output block against the gzip trailers whose headers were consumed while it was made. */
static void zl_check_block(zlayer *z, const uint8_t *p, size_t n)
{
    uint64_t used = (uint64_t)archive_filter_bytes(z->a, -1);
    size_t done = 0;
    while (z->head < z->n_cand && z->cand[z->head].at < used) {
        gz_cand c = z->cand[z->head++];
        uint64_t lo = z->out + done;
        uint64_t end = lo + (uint32_t)((uint32_t)z->mstart + c.isize - (uint32_t)lo);
        if (end > z->out + n)
            continue;
        uint32_t crc = dfl_crc32(z->mcrc, p + done, (size_t)(end - lo));
        if (crc != c.crc)
            continue;
        z->mcrc = 0;
        z->mstart = end;
        done = (size_t)(end - z->out);
    }
    z->mcrc = dfl_crc32(z->mcrc, p + done, n - done);
}

/* The next output block of z; *n = 0 at its end (after zl_finish's checks). */
static int zl_block(zlayer *z, const uint8_t **b, size_t *n, dfl_err *e)
{
    *n = 0;
    if (z->eof)
        return DFL_OK;
    for (;;) {
        const void *v;
        size_t len;
        la_int64_t off;
        int r = archive_read_data_block(z->a, &v, &len, &off);
        if (r == ARCHIVE_EOF)
            return zl_finish(z, e);
        if (r < ARCHIVE_WARN)
            return arch_fail(z->in, z->a, z->name, e);
        if (!len)
            continue;
        if (z->check)
            zl_check_block(z, v, len);
        z->out += len;
        *b = v;
        *n = len;
        return DFL_OK;
    }
}

/* Reads z to its end (its checks included), dropping the data. */
static int zl_drain(zlayer *z, dfl_err *e)
{
    const uint8_t *b;
    size_t n;
    do {
        int rc = zl_block(z, &b, &n, e);
        if (rc)
            return rc;
    } while (n);
    return DFL_OK;
}

/* The reader of the parts of a compressed input reads the zlayer's output. */
static la_ssize_t zl_out(struct archive *a, void *ctx, const void **buf)
{
    zlayer *z = ((dfl_input *)ctx)->z;
    const uint8_t *b;
    size_t n;
    if (zl_block(z, &b, &n, &z->err)) {
        archive_set_error(a, EIO, "%s", z->err.msg);
        return -1;
    }
    *buf = b;
    return (la_ssize_t)n;
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

static void close_inner(dfl_input *in)
{
    zl_free(in->zi);
    in->zi = NULL;
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

/* At an archive entry: is it a part? Sets up the zlayer of a compressed member. */
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
    in->part_eof = false;
    if (compressed_name(name)) {
        int rc = zl_open(in, in->part_name, true, &in->zi, &in->part_eof, e);
        if (!rc && in->part_eof)
            rc = zl_finish(in->zi, e);
        if (rc)
            return rc;
    }
    p->name = in->part_name;
    *is_part = true;
    return DFL_OK;
}

/* The first part of an input. */
static int first_part(dfl_input *in, dfl_part *p, bool *eof, dfl_err *e)
{
    if (in->regular && in->size == 0) {
        /* an empty plain file: one empty mapped part */
        if (set_part_name(in, NULL))
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        in->state = IN_DONE;
        p->name = in->part_name;
        p->mapped = true;
        return DFL_OK;
    }
    in->fd = in->is_stdin ? 0 : open(in->path, O_RDONLY | O_CLOEXEC);
    if (in->fd < 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", in->disp);
    bool empty;
    int rc = zl_open(in, in->disp, false, &in->z, &empty, e);
    if (rc)
        return rc;
    if (empty) { /* no data (an empty stream, or compressed emptiness): one empty part */
        if ((rc = zl_finish(in->z, e)))
            return rc;
        if (set_part_name(in, NULL))
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        in->state = IN_RAW;
        in->part_eof = true;
        p->name = in->part_name;
        return DFL_OK;
    }
    if (archive_filter_count(in->z->a) <= 1 && in->regular) {
        /* a plain file: read (or mapped) as itself; libarchive may seek in an archive */
        zl_free(in->z);
        in->z = NULL;
        close(in->fd);
        in->fd = -1;
    }
    /* the parts: the raw data, or the members of a tar or zip archive */
    in->a = archive_read_new();
    if (!in->a)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    archive_read_support_format_raw(in->a);
    archive_read_support_format_tar(in->a);
    archive_read_support_format_zip(in->a);
    int r = in->z ? archive_read_open(in->a, in, NULL, zl_out, NULL)
                  : archive_read_open_filename(in->a, in->path, 1 << 20);
    struct archive_entry *ent;
    if (r == ARCHIVE_OK)
        r = archive_read_next_header(in->a, &ent);
    if (r < ARCHIVE_WARN)
        return arch_fail(in, in->a, in->disp, e);
    if (r == ARCHIVE_EOF) {
        if (in->z && (rc = zl_drain(in->z, e)))
            return rc;
        in->state = IN_DONE;
        *eof = true;
        return DFL_OK;
    }
    if ((archive_format(in->a) & ARCHIVE_FORMAT_BASE_MASK) != ARCHIVE_FORMAT_RAW) {
        in->state = IN_ARCHIVE;
        bool is_part;
        return archive_entry_part(in, ent, p, &is_part, e);
    }
    if (set_part_name(in, NULL))
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    p->name = in->part_name;
    if (in->z) { /* a stream */
        in->state = IN_RAW;
        return DFL_OK;
    }
    /* a plain regular file: mapped, so that samples can be re-read by offset */
    archive_read_free(in->a);
    in->a = NULL;
    in->state = IN_DONE;
    if ((rc = dfl_map_open(&in->map, in->path, e)))
        return rc;
    if (in->map.fd >= 0) { /* the mapping outlives it: do not hold a descriptor per input */
        close(in->map.fd);
        in->map.fd = -1;
    }
    p->mapped = true;
    p->data = in->map.data;
    p->size = in->map.size;
    return DFL_OK;
}

int dfl_input_next_part(dfl_input *in, dfl_part *p, bool *eof, dfl_err *e)
{
    *eof = false;
    memset(p, 0, sizeof *p);
    if (in->state == IN_START) {
        int rc = first_part(in, p, eof, e);
        if (rc || *eof || p->name)
            return rc;
    }
    if (in->state == IN_DONE || in->state == IN_RAW) {
        int rc = in->z ? zl_drain(in->z, e) : DFL_OK;
        in->state = IN_DONE;
        close_inner(in);
        *eof = !rc;
        return rc;
    }
    /* IN_ARCHIVE: the next member that is a part */
    close_inner(in);
    for (;;) {
        struct archive_entry *ent;
        int r = archive_read_next_header(in->a, &ent);
        if (r == ARCHIVE_EOF) {
            int rc = in->z ? zl_drain(in->z, e) : DFL_OK;
            in->state = IN_DONE;
            *eof = !rc;
            return rc;
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
    if ((in->state != IN_RAW && in->state != IN_ARCHIVE) || in->part_eof)
        return DFL_OK;
    zlayer *z = in->zi;
    if (z) { /* a compressed member: copy out of its output blocks */
        if (!z->blk_n) {
            int rc = zl_block(z, &z->blk, &z->blk_n, e);
            if (rc)
                return rc;
        }
        size_t k = z->blk_n < cap ? z->blk_n : cap;
        memcpy(buf, z->blk, k);
        z->blk += k;
        z->blk_n -= k;
        *got = k;
        return DFL_OK;
    }
    for (;;) {
        la_ssize_t r = archive_read_data(in->a, buf, cap);
        if (r >= 0) {
            *got = (size_t)r;
            return DFL_OK;
        }
        if (r == ARCHIVE_RETRY)
            continue;
        return arch_fail(in, in->a, in->part_name ? in->part_name : in->disp, e);
    }
}

uint64_t dfl_input_consumed(const dfl_input *in)
{
    if (in->z)
        return (uint64_t)archive_filter_bytes(in->z->a, -1);
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
    zl_free(in->z);
    if (in->map.fd >= 0 || in->map.data)
        dfl_map_close(&in->map);
    if (in->fd > 0)
        close(in->fd);
    free(in->path);
    free(in->disp);
    free(in->part_name);
    free(in);
}
