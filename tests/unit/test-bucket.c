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
    {BAD, "{\"input_ids\": [1], \"a\": \"\\u0000\"}", -1, NULL},
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

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_corpus);
    T_RUN(test_depth);
    T_RUN(test_messages);
    T_RUN(test_mutations);
    return t_done();
}
