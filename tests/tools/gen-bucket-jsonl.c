/* gen-bucket-jsonl: writes a deterministic synthetic tokenized dataset (JSON Lines) to stdout,
 * for dfl-bucket's tests and benchmark. Lines mix the conventions dfl-bucket reads: loss_mask as
 * 0/1, loss_mask as true/false, Hugging Face labels with -100 on the prompt, and neither; plus
 * other keys (an id, a source string with escapes, a nested object) that must be skipped.
 *
 *   gen-bucket-jsonl [--bytes N | --samples N] [--seed S] [--vocab V] [--min-len A] [--max-len B]
 *
 * Lengths are log-uniform in [A, B] (default 8..6000); ids uniform in [0, V) (default 151936). */
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucket.h"
#include "bytes.h"
#include "cli.h"
#include "util.h"

typedef struct out {
    char *buf;
    size_t n, cap;
} out;

static void put(out *o, const char *s, size_t n)
{
    if (!dfl_reserve(&o->buf, &o->cap, o->n + n, 1, 1u << 20)) {
        fprintf(stderr, "gen-bucket-jsonl: out of memory\n");
        exit(1);
    }
    memcpy(o->buf + o->n, s, n);
    o->n += n;
}
#define PUTS(o, s) put((o), (s), strlen(s))

static void put_u(out *o, uint64_t v)
{
    char t[24];
    int k = 0;
    do {
        t[k++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    char r[24];
    for (int i = 0; i < k; i++)
        r[i] = t[k - 1 - i];
    put(o, r, (size_t)k);
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    static const struct option lo[] = {
        {"bytes", required_argument, NULL, 'b'}, {"samples", required_argument, NULL, 'n'},
        {"seed", required_argument, NULL, 's'},  {"vocab", required_argument, NULL, 'V'},
        {"min-len", required_argument, NULL, 'a'}, {"max-len", required_argument, NULL, 'm'},
        {NULL, 0, NULL, 0},
    };
    uint64_t bytes = 0, samples = 1000, seed = 1, vocab = 151936, min_len = 8, max_len = 6000;
    dfl_err e;
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        uint64_t *dst = c == 'b' ? &bytes : c == 'n' ? &samples : c == 's' ? &seed : c == 'V' ? &vocab
                      : c == 'a' ? &min_len : c == 'm' ? &max_len : NULL;
        if (!dst)
            return dfl_cli_usage_error("unknown option");
        if (dfl_parse_size(optarg, dst, lo[0].name, &e))
            return dfl_cli_usage_error("%s", e.msg);
        if (c == 'b')
            samples = 0;
    }
    if (min_len < 1 || max_len < min_len || vocab < 1)
        return dfl_cli_usage_error("bad lengths or vocabulary");
    dfl_rng r;
    dfl_rng_seed(&r, seed);
    out o = {0};
    uint64_t written = 0;
    double lmin = log((double)min_len), lmax = log((double)max_len + 1);
    for (uint64_t i = 0; bytes ? written < bytes : i < samples; i++) {
        double u = (double)(dfl_rng_next(&r) >> 11) / 9007199254740992.0;
        uint64_t len = (uint64_t)exp(lmin + u * (lmax - lmin));
        if (len < min_len)
            len = min_len;
        if (len > max_len)
            len = max_len;
        uint64_t prompt = len * (10 + dfl_rng_below(&r, 50)) / 100;
        int style = (int)dfl_rng_below(&r, 10); /* 0-3 loss_mask 0/1, 4 bools, 5-7 labels, 8-9 none */
        o.n = 0;
        PUTS(&o, "{\"id\": ");
        put_u(&o, i);
        PUTS(&o, ", \"input_ids\": [");
        uint64_t *ids = malloc(len * sizeof *ids);
        if (!ids)
            return 1;
        for (uint64_t k = 0; k < len; k++) {
            ids[k] = dfl_rng_below(&r, vocab);
            if (k)
                PUTS(&o, ", ");
            put_u(&o, ids[k]);
        }
        PUTS(&o, "]");
        if (style <= 4) {
            PUTS(&o, ", \"loss_mask\": [");
            for (uint64_t k = 0; k < len; k++) {
                if (k)
                    PUTS(&o, ", ");
                if (style == 4)
                    PUTS(&o, k < prompt ? "false" : "true");
                else
                    PUTS(&o, k < prompt ? "0" : "1");
            }
            PUTS(&o, "]");
        } else if (style <= 7) {
            PUTS(&o, ", \"labels\": [");
            for (uint64_t k = 0; k < len; k++) {
                if (k)
                    PUTS(&o, ", ");
                if (k < prompt)
                    PUTS(&o, "-100");
                else
                    put_u(&o, ids[k]);
            }
            PUTS(&o, "]");
        }
        free(ids);
        PUTS(&o, ", \"source\": \"gen \\\"synthetic\\\" caf\\u00e9\", \"meta\": {\"turns\": ");
        put_u(&o, 1 + dfl_rng_below(&r, 8));
        PUTS(&o, ", \"score\": 0.5, \"tags\": [\"a\", null, true]}}\n");
        if (fwrite(o.buf, 1, o.n, stdout) != o.n) {
            fprintf(stderr, "gen-bucket-jsonl: write failed\n");
            return 1;
        }
        written += o.n;
    }
    free(o.buf);
    if (fflush(stdout) != 0)
        return 1;
    return 0;
}
