/* test-bucket.c: the JSON Lines sample reader (fast scanner against jansson on a corpus of tricky
 * lines and on random mutations), the inputs through libarchive, and the bucketing: auto
 * bounds, packing, shuffling, dealing to shards. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucket.h"
#include "jsonl.h"
#include "util.h"
#include "t.h"

/* ---- the parser ---- */

/* OK: good, parsed by the fast path; SLOW: good, left to the jansson path; BAD: rejected. */
enum { BAD = 0, OK = 1, SLOW = 2 };

typedef struct tline {
    int want;           /* OK, SLOW or BAD */
    const char *line;
    int n;              /* expected token count for OK lines (-1: do not check) */
    const char *mask;   /* expected mask as "0101..." for OK lines, NULL: do not check */
} tline;

static const tline corpus[] = {
    {OK, "{\"input_ids\": [1, 2, 3]}", 3, "111"},
    {OK, "{\"input_ids\":[1,2,3],\"loss_mask\":[0,1,1]}", 3, "011"},
    {OK, "  {  \"loss_mask\" : [ true , false ] , \"input_ids\" : [ 7 , 8 ] }  \r", 2, "10"},
    {OK, "{\"input_ids\": [5, 6, 7], \"labels\": [-100, -100, 7]}", 3, "001"},
    {OK, "{\"input_ids\": [5, 6, 7], \"labels\": [-100, 0, -1]}", 3, "011"},
    {OK, "{\"input_ids\": [5, 6], \"loss_mask\": [1, 0], \"labels\": [-100, -100]}", 2, "10"},
    {SLOW, "{\"input_ids\": [5, 6], \"loss_mask\": [1, 0], \"labels\": [1.5, \"x\"]}", 2, "10"},
    {OK, "{\"input_ids\": [5, 6], \"loss_mask\": null, \"labels\": [-100, 3]}", 2, "01"},
    {OK, "{\"input_ids\": [5, 6], \"labels\": null}", 2, "11"},
    {SLOW, "{\"text\": \"a\\u0000b\", \"input_ids\": [5, 6], \"m\": [\"\\u0000\"]}", 2, "11"}, /* \u0000 in other values */
    {OK, "{\"input_ids\": [0, 2147483647]}", 2, "11"},
    {SLOW, "{\"input_ids\": [-0]}", 1, "1"},
    {OK, "{\"text\": \"a \\\"quoted\\\" \\\\ \\/ \\b\\f\\n\\r\\t x\", \"input_ids\": [1]}", 1, "1"},
    {OK, "{\"text\": \"caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80\", \"input_ids\": [1]}", 1, "1"},
    {OK, "{\"text\": \"\\u00e9\\u65e5\\ud83d\\ude00\\uFFFF\", \"input_ids\": [1]}", 1, "1"},
    {OK, "{\"meta\": {\"a\": [1, 2.5, -3e10, 1E-400, true, false, null, {}, []], \"b\": {\"c\": \"d\"}}, \"input_ids\": [4]}", 1, "1"},
    {OK, "{\"n\": -9223372036854775808, \"m\": 9223372036854775807, \"input_ids\": [4]}", 1, "1"},
    {OK, "{\"x\": 1.7976931348623157e308, \"input_ids\": [4]}", 1, "1"},
    {OK, "{\"input_ids\": [4], \"a\": {\"input_ids\": 1}, \"b\": {\"input_ids\": 2}}", 1, "1"},
    {SLOW, "{\"input\\u005fids\": [4]}", 1, "1"},        /* escaped key: the jansson path */
    {SLOW, "{\"input_ids\": [4], \"loss_mask\": [-0]}", 1, "0"},
    {OK, "{\"input_ids\": [1, 2], \"loss_mask\": [1, 1], \"\xc3\xa9\": 1}", 2, "11"},
    /* not JSON, not a sample */
    {BAD, "not json", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2,]}", -1, NULL},
    {BAD, "{\"input_ids\": [1 2]}", -1, NULL},
    {BAD, "{\"input_ids\": [01]}", -1, NULL},
    {BAD, "{\"input_ids\": [1]} x", -1, NULL},
    {BAD, "{\"input_ids\": [1]}{}", -1, NULL},
    {BAD, "{\"input_ids\": [1],}", -1, NULL},
    {BAD, "{\"input_ids\": [1]", -1, NULL},
    {BAD, "[1, 2, 3]", -1, NULL},
    {BAD, "{}", -1, NULL},
    {BAD, "{\"ids\": [1]}", -1, NULL},
    {BAD, "{\"input_ids\": null}", -1, NULL},
    {BAD, "{\"input_ids\": []}", -1, NULL},
    {BAD, "{\"input_ids\": \"1 2 3\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1.0]}", -1, NULL},
    {BAD, "{\"input_ids\": [1e2]}", -1, NULL},
    {BAD, "{\"input_ids\": [-1]}", -1, NULL},
    {BAD, "{\"input_ids\": [2147483648]}", -1, NULL},
    {BAD, "{\"input_ids\": [99999999999999999999]}", -1, NULL},
    {BAD, "{\"input_ids\": [true]}", -1, NULL},
    {BAD, "{\"input_ids\": [\"1\"]}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"loss_mask\": [1]}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"loss_mask\": [1, 2]}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"loss_mask\": [1, 0.5]}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"loss_mask\": [1, 1.0]}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"loss_mask\": \"11\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"loss_mask\": [1, null]}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"labels\": [1]}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"labels\": [1, -100.0]}", -1, NULL},
    {BAD, "{\"input_ids\": [1, 2], \"labels\": [1, 99999999999999999999]}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"input_ids\": [2]}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": 1, \"a\": 2}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": {\"b\": 1, \"b\": 2}}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"input\\u005fids\": [2]}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\\u0000\": 1}", -1, NULL}, /* \u0000 in a key */
    {BAD, "{\"input_ids\": [1], \"a\": \"\\ud800\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\\udc00\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\\ud800\\u0041\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\\x\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\\u12g4\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"tab\there\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\xc3\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\xc0\xaf\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\xe0\x80\xaf\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\xed\xa0\x80\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\xf4\x90\x80\x80\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": \"\xff\"}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": 1e400}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": -1e400}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": 9223372036854775808}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": -9223372036854775809}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": 1.}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": .5}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": +1}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": -}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": 1e}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": 0x10}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": truex}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": nul}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": NaN}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": [1,]}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": {\"b\"}}", -1, NULL},
    {BAD, "{\"input_ids\": [1], \"a\": 'x'}", -1, NULL},
    {BAD, "{\"input_ids\": [1], a: 1}", -1, NULL},
    {BAD, "\xef\xbb\xbf{\"input_ids\": [1]}", -1, NULL},
};

static void mask_str(const dfl_sample *s, char *out, size_t cap)
{
    size_t i;
    for (i = 0; i < s->n && i + 1 < cap; i++)
        out[i] = (char)('0' + s->mask[i]);
    out[i] = 0;
}

/* Fast path and jansson path on one line: the fast path may decline, but when it accepts, the
 * jansson path accepts with the same result; when the jansson path rejects, the fast path
 * declines. Returns the jansson verdict (1 ok, 0 bad); *fast gets the fast verdict. */
static int compare_paths(const char *line, size_t n, int *fast, const char *what)
{
    dfl_sample a = {0}, b = {0};
    dfl_err e;
    int f = dfl_sample_parse_fast(&a, line, n);
    int j = dfl_sample_parse_json(&b, line, n, &e) == DFL_OK;
    *fast = f;
    T_CHECK(f >= 0, "%s: fast path out of memory", what);
    if (f == 1) {
        T_CHECK(j, "%s: fast path accepted a line jansson rejects (%s)", what, e.msg);
        if (j) {
            T_CHECK(a.n == b.n, "%s: %zu vs %zu tokens", what, a.n, b.n);
            if (a.n == b.n) {
                T_CHECK(memcmp(a.ids, b.ids, a.n * 4) == 0, "%s: ids differ", what);
                T_CHECK(memcmp(a.mask, b.mask, a.n) == 0, "%s: masks differ", what);
            }
        }
    }
    dfl_sample_free(&a);
    dfl_sample_free(&b);
    return j;
}

static void test_corpus(void)
{
    for (size_t i = 0; i < DFL_ARRAY_LEN(corpus); i++) {
        const tline *t = &corpus[i];
        char what[64];
        snprintf(what, sizeof what, "corpus line %zu", i);
        size_t n = strlen(t->line);
        int f;
        int j = compare_paths(t->line, n, &f, what);
        T_CHECK(j == (t->want != BAD), "%s: jansson path says %s, expected %s: %s", what, j ? "ok" : "bad",
                t->want ? "ok" : "bad", t->line);
        T_CHECK(f == (t->want == OK), "%s: fast path %s: %s", what, f == 1 ? "parsed it" : "declined",
                t->line);
        /* the combined entry point */
        dfl_sample s = {0};
        dfl_err e;
        bool blank;
        int rc = dfl_sample_parse(&s, t->line, n, &blank, &e);
        T_CHECK((rc == DFL_OK) == (t->want != BAD), "%s: dfl_sample_parse rc %d: %s", what, rc,
                rc ? e.msg : "");
        if (rc == DFL_OK && t->want != BAD) {
            if (t->n >= 0)
                T_EQ_INT(s.n, t->n, what);
            if (t->mask) {
                char m[64];
                mask_str(&s, m, sizeof m);
                T_CHECK(strcmp(m, t->mask) == 0, "%s: mask %s, expected %s", what, m, t->mask);
            }
        }
        if (rc != DFL_OK)
            T_CHECK(rc == DFL_EDATA && e.msg[0], "%s: error code %d without message", what, rc);
        dfl_sample_free(&s);
    }
}

/* Nesting: 64 levels (the object and 63 arrays) are accepted by both paths, 65 by neither. */
static void test_depth(void)
{
    for (int depth = 63; depth <= 66; depth++) {
        char line[512];
        size_t n = (size_t)snprintf(line, sizeof line, "{\"input_ids\": [1], \"z\": ");
        for (int i = 1; i < depth; i++)
            line[n++] = '[';
        line[n++] = '1';
        for (int i = 1; i < depth; i++)
            line[n++] = ']';
        line[n++] = '}';
        int f;
        char what[32];
        snprintf(what, sizeof what, "depth %d", depth);
        int j = compare_paths(line, n, &f, what);
        T_EQ_INT(j, depth <= 64, what);
        T_EQ_INT(f, depth <= 64, what);
    }
}

static void test_messages(void)
{
    static const struct {
        const char *line, *msg;
    } cases[] = {
        {"nope", "not valid JSON"},
        {"{\"a\": 1}", "missing input_ids"},
        {"{\"input_ids\": []}", "input_ids is empty"},
        {"{\"input_ids\": [1, 2], \"loss_mask\": [1]}", "loss_mask has 1 values for 2 input_ids"},
        {"{\"input_ids\": [1, 2], \"labels\": [1]}", "labels has 1 values for 2 input_ids"},
        {"{\"input_ids\": [1, -3]}", "input_ids[1] = -3 is negative"},
        {"{\"input_ids\": [1, 2.5]}", "input_ids[1] is not an integer"},
        {"{\"input_ids\": [3000000000]}", "input_ids[0] = 3000000000 does not fit"},
        {"{\"input_ids\": [1], \"loss_mask\": [2]}", "loss_mask[0] = 2 is not 0, 1, true or false"},
        {"{\"input_ids\": [1], \"input_ids\": [1]}", "duplicate"},
        {"[1]", "not a JSON object"},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(cases); i++) {
        dfl_sample s = {0};
        dfl_err e;
        bool blank;
        int rc = dfl_sample_parse(&s, cases[i].line, strlen(cases[i].line), &blank, &e);
        T_CHECK(rc == DFL_EDATA && strstr(e.msg, cases[i].msg), "'%s': rc %d, message '%s', expected '%s'",
                cases[i].line, rc, rc ? e.msg : "", cases[i].msg);
        dfl_sample_free(&s);
    }
    dfl_sample s = {0};
    dfl_err e;
    bool blank = false;
    T_CHECK(dfl_sample_parse(&s, " \t\r", 3, &blank, &e) == DFL_OK && blank, "blank line");
    T_CHECK(dfl_sample_parse(&s, "", 0, &blank, &e) == DFL_OK && blank, "empty line");
    dfl_sample_free(&s);
}

/* Random mutations of good lines: the two paths must agree (fast accepts only what jansson
 * accepts, with the same data; jansson rejects only what fast declines). */
static void test_mutations(void)
{
    static const char *seeds[] = {
        "{\"input_ids\": [1, 22, 333], \"loss_mask\": [0, 1, true], \"text\": \"h\\u00e9\\n\\ud83d\\ude00 x\", \"m\": {\"a\": [1.5e3, null, false]}}",
        "{\"labels\": [-100, 5, 6], \"input_ids\": [4, 5, 6], \"id\": -12, \"f\": 0.25}",
        "{\"input_ids\":[0,1,2,3,4,5,6,7,8,9,10,2147483647],\"loss_mask\":[1,1,1,1,1,1,1,1,1,1,1,0]}",
    };
    static const char alphabet[] = "{}[]\":,-+.eE0123456789 \t\\utrfalsn\x80\xc3\xa9\xff";
    dfl_rng r;
    dfl_rng_seed(&r, 12345);
    char buf[512];
    int agree_fast = 0, total = 0;
    for (int it = 0; it < 20000; it++) {
        const char *s0 = seeds[dfl_rng_below(&r, DFL_ARRAY_LEN(seeds))];
        size_t n = strlen(s0);
        memcpy(buf, s0, n);
        int muts = 1 + (int)dfl_rng_below(&r, 3);
        for (int m = 0; m < muts; m++) {
            size_t pos = n ? (size_t)dfl_rng_below(&r, n) : 0;
            char c = alphabet[dfl_rng_below(&r, sizeof alphabet - 1)];
            switch (dfl_rng_below(&r, 3)) {
            case 0: /* replace */
                if (n)
                    buf[pos] = c;
                break;
            case 1: /* insert */
                if (n + 1 < sizeof buf) {
                    memmove(buf + pos + 1, buf + pos, n - pos);
                    buf[pos] = c;
                    n++;
                }
                break;
            default: /* delete */
                if (n) {
                    memmove(buf + pos, buf + pos + 1, n - pos - 1);
                    n--;
                }
            }
        }
        int f;
        char what[64];
        snprintf(what, sizeof what, "mutation %d", it);
        int j = compare_paths(buf, n, &f, what);
        if (t_case_failed_) {
            fprintf(stderr, "  line: %.*s\n", (int)n, buf);
            return;
        }
        total += j;
        agree_fast += j && f == 1;
    }
    /* both verdicts occur, and the fast path takes most of the good lines */
    T_CHECK(total > 100 && total < 20000, "%d of 20000 mutations parse", total);
    T_CHECK(agree_fast * 10 >= total * 8, "fast path took %d of %d good mutations", agree_fast, total);
}

/* Long lists, where the fast path reads 64 bytes at a time: mostly in the usual form (numbers of
 * up to 8 digits after "," or ", "), with now and then an element or a separator that is not
 * (other whitespace, 9 digits or more, leading zeros, signs, fractions, true, 2), so that blocks
 * stop at every kind of byte and in every position. */
typedef struct lbuf {
    char *p;
    size_t n, cap;
} lbuf;

static void lput(lbuf *b, const char *s)
{
    size_t k = strlen(s);
    if (b->n + k + 1 > b->cap) {
        b->cap = (b->n + k + 1) * 2;
        b->p = realloc(b->p, b->cap);
        if (!b->p)
            abort();
    }
    memcpy(b->p + b->n, s, k + 1);
    b->n += k;
}

static void lput_num(lbuf *b, dfl_rng *r, int digits)
{
    char t[32];
    int k = 0;
    t[k++] = (char)('1' + dfl_rng_below(r, 9));
    while (k < digits)
        t[k++] = (char)('0' + dfl_rng_below(r, 10));
    t[k] = 0;
    lput(b, t);
}

/* 1 in `odd` elements or separators is out of the usual form */
static void lput_list(lbuf *b, dfl_rng *r, int kind, size_t n, size_t prompt, uint64_t odd)
{
    static const char *const seps[] = {" , ", ",\t", ",  ", "\r,", " ,", ",\r "};
    static const char *const odd_ids[] = {"0", "012", "-5", "1.0", "1e3", "true", "2147483647", "2147483648",
                                          "123456789", "00", "-0", "99999999999"};
    static const char *const odd_mask[] = {"2", "true", "false", "01", "1.0", "-0", "10", "null"};
    static const char *const odd_lab[] = {"-0", "-01", "-", "--1", "-1000", "-10", "-100.0", "0",
                                          "1234567890123456789", "-123456789012345678", "-1e2", "+1"};
    bool compact = dfl_rng_below(r, 4) == 0;
    lput(b, "[");
    for (size_t i = 0; i < n; i++) {
        if (i)
            lput(b, dfl_rng_below(r, odd) == 0 ? seps[dfl_rng_below(r, DFL_ARRAY_LEN(seps))]
                                               : compact ? "," : ", ");
        bool o = dfl_rng_below(r, odd) == 0;
        if (kind == 0) {
            if (o)
                lput(b, odd_ids[dfl_rng_below(r, DFL_ARRAY_LEN(odd_ids))]);
            else
                lput_num(b, r, 1 + (int)dfl_rng_below(r, 8));
        } else if (kind == 1) {
            lput(b, o ? odd_mask[dfl_rng_below(r, DFL_ARRAY_LEN(odd_mask))] : i < prompt ? "0" : "1");
        } else if (kind == 3) { /* true and false, with a 0 or 1 now and then */
            lput(b, o ? (i < prompt ? "0" : "1") : i < prompt ? "false" : "true");
        } else {
            if (o)
                lput(b, odd_lab[dfl_rng_below(r, DFL_ARRAY_LEN(odd_lab))]);
            else if (i < prompt)
                lput(b, "-100");
            else
                lput_num(b, r, 1 + (int)dfl_rng_below(r, 8));
        }
    }
    lput(b, "]");
}

static void test_long_lists(void)
{
    dfl_rng r;
    dfl_rng_seed(&r, 777);
    lbuf b = {0};
    int good = 0, fast_good = 0;
    for (int it = 0; it < 6000; it++) {
        size_t n = 1 + dfl_rng_below(&r, 300), prompt = dfl_rng_below(&r, n + 1);
        uint64_t odd = dfl_rng_below(&r, 3) == 0 ? 1000000 : 20 + dfl_rng_below(&r, 400);
        int kind = (int)dfl_rng_below(&r, 4); /* ids only, loss_mask, labels, loss_mask of booleans */
        b.n = 0;
        lput(&b, "{\"id\": 7, \"input_ids\": ");
        lput_list(&b, &r, 0, n, 0, odd);
        if (kind) {
            lput(&b, kind == 2 ? ", \"labels\": " : ", \"loss_mask\": ");
            size_t m = dfl_rng_below(&r, 50) == 0 ? n + 1 : n;
            lput_list(&b, &r, kind, m, prompt, odd);
        }
        lput(&b, "}");
        size_t len = b.n;
        char what[64];
        snprintf(what, sizeof what, "long line %d", it);
        int f;
        int j = compare_paths(b.p, len, &f, what);
        good += j;
        fast_good += j && f == 1;
        /* the same line counted (ids not kept), and followed by more text (a line and what comes
         * after it in the buffer) */
        dfl_sample a = {0}, c = {0};
        int fa = dfl_sample_parse_fast(&a, b.p, len);
        c.count_ids = true;
        int fc = dfl_sample_parse_fast(&c, b.p, len);
        T_EQ_INT(fc, fa, what);
        if (fc == 1 && fa == 1) {
            T_CHECK(c.n == a.n, "%s: counted %zu ids, read %zu", what, c.n, a.n);
            T_CHECK(c.n == a.n && memcmp(c.mask, a.mask, a.n) == 0, "%s: masks differ when counting", what);
        }
        lput(&b, "\n");
        for (int k = 0; k < 40; k++)
            lput(&b, dfl_rng_below(&r, 2) ? "1, " : "23,");
        const char *eol = NULL;
        int fe = dfl_sample_parse_fast_eol(&c, b.p, b.p + b.n, &eol);
        T_EQ_INT(fe, fa, what);
        if (fe == 1) {
            T_CHECK(eol == b.p + len, "%s: the line ends at %td, not %zu", what, eol - b.p, len);
            T_CHECK(c.n == a.n, "%s: %zu ids before a newline, %zu alone", what, c.n, a.n);
        }
        dfl_sample_free(&a);
        dfl_sample_free(&c);
        if (t_case_failed_) {
            fprintf(stderr, "  line: %.*s\n", (int)len, b.p);
            break;
        }
    }
    free(b.p);

    /* both verdicts occur, and the fast path takes nearly all good lines */
    T_CHECK(good > 1000 && good < 5900, "%d of 6000 long lines parse", good);
    T_CHECK(fast_good * 100 >= good * 95, "fast path took %d of %d good long lines", fast_good, good);
}

/* ---- planning ---- */

static void test_rng(void)
{
    /* xoshiro256** seeded through splitmix64, as published (values from an independent
     * implementation) */
    static const uint64_t want0[] = {0x99ec5f36cb75f2b4ull, 0xbf6e1f784956452aull, 0x1a5f849d4933e6e0ull};
    static const uint64_t want42[] = {0x15780b2e0c2ec716ull, 0x6104d9866d113a7eull, 0xae17533239e499a1ull};
    dfl_rng r;
    dfl_rng_seed(&r, 0);
    for (int i = 0; i < 3; i++)
        T_CHECK(dfl_rng_next(&r) == want0[i], "seed 0 draw %d", i);
    dfl_rng_seed(&r, 42);
    for (int i = 0; i < 3; i++)
        T_CHECK(dfl_rng_next(&r) == want42[i], "seed 42 draw %d", i);
    static const uint64_t ns[] = {1, 2, 3, 7, 1000, (1ull << 63) + 1, UINT64_MAX};
    for (size_t k = 0; k < DFL_ARRAY_LEN(ns); k++)
        for (int i = 0; i < 1000; i++) {
            uint64_t v = dfl_rng_below(&r, ns[k]);
            if (v >= ns[k]) {
                T_CHECK(v < ns[k], "below(%llu) gave %llu", (unsigned long long)ns[k], (unsigned long long)v);
                break;
            }
        }
    /* a shuffle is a permutation, the same for the same seed, different for another */
    uint32_t a[100], b[100], c[100];
    for (int i = 0; i < 100; i++)
        a[i] = b[i] = c[i] = (uint32_t)i;
    dfl_rng_seed(&r, 7);
    dfl_rng_shuffle_u32(&r, a, 100);
    dfl_rng_seed(&r, 7);
    dfl_rng_shuffle_u32(&r, b, 100);
    dfl_rng_seed(&r, 8);
    dfl_rng_shuffle_u32(&r, c, 100);
    T_CHECK(memcmp(a, b, sizeof a) == 0, "same seed, same shuffle");
    T_CHECK(memcmp(a, c, sizeof a) != 0, "another seed, another shuffle");
    int seen[100] = {0}, moved = 0;
    for (int i = 0; i < 100; i++) {
        seen[a[i]]++;
        moved += a[i] != (uint32_t)i;
    }
    for (int i = 0; i < 100; i++)
        T_CHECK(seen[i] == 1, "value %d appears %d times", i, seen[i]);
    T_CHECK(moved > 80, "only %d of 100 moved", moved);
}

static void test_spec(void)
{
    dfl_err e;
    uint32_t *b, k;
    size_t n;
    T_CHECK(dfl_bucket_parse_spec("512,1024,2048", &b, &n, &k, &e) == 0 && n == 3 && k == 0 && b[0] == 512 &&
                b[2] == 2048, "list");
    free(b);
    T_CHECK(dfl_bucket_parse_spec("auto:6", &b, &n, &k, &e) == 0 && k == 6 && !b, "auto");
    T_CHECK(dfl_bucket_parse_spec("1024,512", &b, &n, &k, &e) == DFL_EUSAGE && strstr(e.msg, "increase"),
            "decreasing: %s", e.msg);
    T_CHECK(dfl_bucket_parse_spec("512,512", &b, &n, &k, &e) == DFL_EUSAGE, "equal");
    T_CHECK(dfl_bucket_parse_spec("0,512", &b, &n, &k, &e) == DFL_EUSAGE, "zero");
    T_CHECK(dfl_bucket_parse_spec("auto:0", &b, &n, &k, &e) == DFL_EUSAGE, "auto:0");
    T_CHECK(dfl_bucket_parse_spec("auto:x", &b, &n, &k, &e) == DFL_EUSAGE, "auto:x");
    T_CHECK(dfl_bucket_parse_spec("big", &b, &n, &k, &e) == DFL_EUSAGE, "words");
}

static void test_auto_bounds(void)
{
    dfl_err e;
    uint32_t lens[100], bounds[8];
    size_t nb;
    for (int i = 0; i < 100; i++)
        lens[i] = (uint32_t)((i * 37) % 100 + 1); /* 1..100 in a scrambled order */
    T_CHECK(dfl_bucket_auto_bounds(lens, 100, 4, bounds, &nb, &e) == 0 && nb == 4 && bounds[0] == 25 &&
                bounds[1] == 50 && bounds[2] == 75 && bounds[3] == 100, "quartiles of 1..100: %zu", nb);
    T_CHECK(dfl_bucket_auto_bounds(lens, 100, 3, bounds, &nb, &e) == 0 && nb == 3 && bounds[0] == 34 &&
                bounds[1] == 67 && bounds[2] == 100, "thirds of 1..100 (ceil(j*100/3)): %u %u %u", bounds[0],
            bounds[1], bounds[2]);
    for (int i = 0; i < 10; i++)
        lens[i] = 7;
    T_CHECK(dfl_bucket_auto_bounds(lens, 10, 3, bounds, &nb, &e) == 0 && nb == 1 && bounds[0] == 7,
            "equal lengths collapse");
    lens[0] = 9;
    lens[1] = 3;
    T_CHECK(dfl_bucket_auto_bounds(lens, 2, 5, bounds, &nb, &e) == 0 && nb == 2 && bounds[0] == 3 &&
                bounds[1] == 9, "more buckets than samples");
    T_CHECK(dfl_bucket_auto_bounds(lens, 0, 5, bounds, &nb, &e) != 0, "no lengths");
    static const uint32_t b2[] = {512, 1024};
    T_EQ_INT(dfl_bucket_find(b2, 2, 1), 0, "1");
    T_EQ_INT(dfl_bucket_find(b2, 2, 512), 0, "512");
    T_EQ_INT(dfl_bucket_find(b2, 2, 513), 1, "513");
    T_EQ_INT(dfl_bucket_find(b2, 2, 1024), 1, "1024");
    T_EQ_INT(dfl_bucket_find(b2, 2, 1025), 2, "1025");
}

typedef struct packed {
    dfl_bk_batch *b;
    size_t nb, cb;
    uint32_t *m;
    size_t nm, cm;
} packed;

static void pack_free(packed *p)
{
    free(p->b);
    free(p->m);
    memset(p, 0, sizeof *p);
}

static void test_pack_rules(void)
{
    dfl_err e;
    packed p = {0};
    /* first fit: 6 opens a batch, 5 does not fit it, 4 fills it (room 0 < min_len 1: closed),
     * 3 joins 5 */
    uint32_t lens[] = {6, 5, 4, 3};
    uint32_t order[] = {0, 1, 2, 3};
    T_CHECK(dfl_bucket_pack(order, 4, lens, 1, 10, 3, &p.b, &p.nb, &p.cb, &p.m, &p.nm, &p.cm, &e) == 0, "pack");
    T_EQ_INT(p.nb, 2, "batches");
    if (p.nb == 2) {
        T_CHECK(p.b[0].n_seqs == 2 && p.m[p.b[0].first] == 0 && p.m[p.b[0].first + 1] == 2 &&
                    p.b[0].n_tokens == 10 && p.b[0].max_len == 6 && p.b[0].bucket == 3, "first batch: 0 and 2");
        T_CHECK(p.b[1].n_seqs == 2 && p.m[p.b[1].first] == 1 && p.m[p.b[1].first + 1] == 3 &&
                    p.b[1].n_tokens == 8, "second batch: 1 and 3");
    }
    pack_free(&p);
    /* room below the bucket's shortest length closes a batch: bucket (5, 10], budget 12 */
    uint32_t l2[] = {7, 6, 8};
    T_CHECK(dfl_bucket_pack(order, 3, l2, 6, 12, 0, &p.b, &p.nb, &p.cb, &p.m, &p.nm, &p.cm, &e) == 0, "pack");
    /* 7 leaves room 5 < 6: closed at once; 6 stays open (room 6); 8 does not fit it and leaves
     * room 4: closed at once; 6 is closed at the end */
    T_EQ_INT(p.nb, 3, "three batches");
    if (p.nb == 3)
        T_CHECK(p.m[p.b[0].first] == 0 && p.m[p.b[1].first] == 2 && p.m[p.b[2].first] == 1,
                "closing order 0, 2, 1");
    pack_free(&p);
    /* at most DFL_BUCKET_OPEN open batches: the oldest is closed first */
    uint32_t l3[20], o3[20];
    for (int i = 0; i < 20; i++) {
        l3[i] = 6;
        o3[i] = (uint32_t)i;
    }
    T_CHECK(dfl_bucket_pack(o3, 20, l3, 1, 10, 0, &p.b, &p.nb, &p.cb, &p.m, &p.nm, &p.cm, &e) == 0, "pack");
    T_EQ_INT(p.nb, 20, "one each");
    for (size_t i = 0; i < p.nb; i++)
        T_CHECK(p.m[p.b[i].first] == i, "batch %zu holds %u", i, p.m[p.b[i].first]);
    pack_free(&p);
    /* longer than the budget: a batch of its own, right away */
    uint32_t l4[] = {3, 25, 3};
    T_CHECK(dfl_bucket_pack(order, 3, l4, 1, 10, 0, &p.b, &p.nb, &p.cb, &p.m, &p.nm, &p.cm, &e) == 0, "pack");
    T_CHECK(p.nb == 2 && p.b[0].n_seqs == 1 && p.b[0].n_tokens == 25 && p.b[1].n_seqs == 2 &&
                p.b[1].n_tokens == 6, "oversize alone");
    pack_free(&p);
}

/* Random buckets: every sample exactly once, budgets kept, shapes right. */
static void test_pack_random(void)
{
    dfl_err e;
    dfl_rng r;
    dfl_rng_seed(&r, 99);
    for (int it = 0; it < 50; it++) {
        size_t n = 1 + (size_t)dfl_rng_below(&r, 2000);
        uint32_t lo = 1 + (uint32_t)dfl_rng_below(&r, 500), hi = lo + (uint32_t)dfl_rng_below(&r, 2000);
        uint64_t budget = 1 + dfl_rng_below(&r, 8192);
        uint32_t *lens = malloc(n * 4), *order = malloc(n * 4);
        int *seen = calloc(n, sizeof *seen);
        for (size_t i = 0; i < n; i++) {
            lens[i] = lo + (uint32_t)dfl_rng_below(&r, hi - lo + 1);
            order[i] = (uint32_t)i;
        }
        dfl_rng_shuffle_u32(&r, order, n);
        packed p = {0};
        T_CHECK(dfl_bucket_pack(order, n, lens, lo, budget, 1, &p.b, &p.nb, &p.cb, &p.m, &p.nm, &p.cm, &e) == 0,
                "pack");
        T_EQ_INT(p.nm, n, "members");
        size_t next = 0;
        for (size_t b = 0; b < p.nb; b++) {
            const dfl_bk_batch *bt = &p.b[b];
            T_CHECK(bt->first == next && bt->n_seqs >= 1, "batch %zu layout", b);
            next += bt->n_seqs;
            uint64_t tok = 0;
            uint32_t mx = 0;
            for (uint32_t k = 0; k < bt->n_seqs; k++) {
                uint32_t s = p.m[bt->first + k];
                seen[s]++;
                tok += lens[s];
                mx = lens[s] > mx ? lens[s] : mx;
            }
            T_CHECK(tok == bt->n_tokens && mx == bt->max_len, "batch %zu totals", b);
            T_CHECK(tok <= budget || bt->n_seqs == 1, "batch %zu: %llu tokens over %llu", b,
                    (unsigned long long)tok, (unsigned long long)budget);
        }
        for (size_t i = 0; i < n; i++)
            if (seen[i] != 1) {
                T_CHECK(seen[i] == 1, "sample %zu packed %d times", i, seen[i]);
                break;
            }
        pack_free(&p);
        free(lens);
        free(order);
        free(seen);
        if (t_case_failed_)
            return;
    }
}

/* Dealing matches the rule: each batch to the shard with the fewest tokens, ties lowest index. */
static void test_deal(void)
{
    dfl_rng r;
    dfl_rng_seed(&r, 5);
    for (int it = 0; it < 200; it++) {
        size_t n = (size_t)dfl_rng_below(&r, 300);
        uint32_t shards = 1 + (uint32_t)dfl_rng_below(&r, 9);
        dfl_bk_batch *b = calloc(n + 1, sizeof *b);
        uint32_t *order = malloc((n + 1) * 4);
        for (size_t i = 0; i < n; i++) {
            b[i].n_tokens = 1 + dfl_rng_below(&r, it % 2 ? 4 : 20000); /* small values: many ties */
            order[i] = (uint32_t)i;
        }
        dfl_rng_shuffle_u32(&r, order, n);
        dfl_bucket_deal(b, order, n, shards);
        uint64_t tok[16] = {0};
        for (size_t i = 0; i < n; i++) {
            const dfl_bk_batch *bt = &b[order[i]];
            uint32_t best = 0;
            for (uint32_t s = 1; s < shards; s++)
                if (tok[s] < tok[best])
                    best = s;
            if (bt->shard != best) {
                T_CHECK(bt->shard == best, "iteration %d, batch %zu: shard %u, expected %u", it, i, bt->shard, best);
                break;
            }
            tok[best] += bt->n_tokens;
        }
        free(b);
        free(order);
        if (t_case_failed_)
            return;
    }
}

/* dfl_crc32 (the gzip CRC-32): the check value of the catalogue, then against a bit-at-a-time
 * reference over every length to 300 at every alignment, longer ones (the folding path from 64
 * bytes, where the CPU has it) and split at many points. */
static uint32_t crc_ref(uint32_t crc, const uint8_t *p, size_t n)
{
    crc = ~crc;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1)));
    }
    return ~crc;
}

static void test_crc32(void)
{
    T_EQ_INT(dfl_crc32(0, "123456789", 9), 0xCBF43926u, "crc32 check value");
    T_EQ_INT(dfl_crc32(0, "", 0), 0, "crc32 of nothing");
    uint8_t buf[4200];
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < sizeof buf; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (uint8_t)x;
    }
    int bad = 0;
    for (size_t off = 0; off < 8; off++)
        for (size_t n = 0; n <= 300; n++)
            bad += dfl_crc32(0, buf + off, n) != crc_ref(0, buf + off, n);
    for (size_t n = 301; n <= 4096; n += 61)
        bad += dfl_crc32(0xA5A5A5A5u, buf + 3, n) != crc_ref(0xA5A5A5A5u, buf + 3, n);
    for (size_t cut = 0; cut <= 4000; cut += 13)
        bad += dfl_crc32(dfl_crc32(0, buf, cut), buf + cut, 4000 - cut) != crc_ref(0, buf, 4000);
    T_EQ_INT(bad, 0, "crc32 disagreements with the reference");
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_corpus);
    T_RUN(test_depth);
    T_RUN(test_messages);
    T_RUN(test_mutations);
    T_RUN(test_long_lists);
    T_RUN(test_rng);
    T_RUN(test_spec);
    T_RUN(test_auto_bounds);
    T_RUN(test_pack_rules);
    T_RUN(test_pack_random);
    T_RUN(test_deal);
    T_RUN(test_crc32);
    return t_done();
}
