/* draftdata: writes hidden-state streams for dfl-draft's tests without running a target:
 *   draftdata TARGET_DIR OUT [options]     (OUT "-" = stdout)
 * The header names TARGET_DIR (its fingerprint, hidden size, vocabulary). Every sequence follows
 * t[i+1] = (5 t[i] + 3) mod (V - 1) from a random first token (so the continuations are
 * predictable and the mask token V-1 never occurs), the first two tokens of each sequence are
 * unscored, and the features of layer j for token t are row t of a fixed random table (the same
 * for every stream). Options make the bad inputs of the tests: --nan-batch, --nan-from, --cut,
 * --fingerprint, --layers, --hidden, and, for inputs without a valid anchor, --len 1 (every
 * sequence one token) and --mask PATTERN (the loss mask of each sequence: PATTERN's 0s and 1s,
 * repeated, instead of the default 0 0 1 1 1 ...). For benchmarks at a real target's size (bench/draft):
 * --exact-len (every sequence --len tokens) and --table-rows N (a table of N rows per layer, row
 * = token mod N, instead of one per vocabulary entry, which would be 12 GB for an 8B target).
 * --also-seed N appends to every batch the sequences that --seed N would make (the batches of
 * two streams merged: one rank's view of two data-parallel ranks).
 * --ids A,B,C... makes every sequence exactly these tokens, and --mask 0011.. (one 0/1 a token)
 * gives their loss_mask (default: the first two 0), for dfl-eval's hand-worked cases.
 * Deterministic: the same options give the same bytes. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "draft_rng.h"
#include "frame.h"
#include "hfmodel.h"
#include "util.h"

static void usage(void)
{
    printf("usage: draftdata TARGET_DIR OUT [--batches N] [--seqs S] [--len L] [--layers 1,2]\n"
           "       [--dtype bf16|f32] [--seed N] [--nan-batch K] [--nan-from K] [--cut BYTES]\n"
           "       [--no-index] [--also-seed N]\n"
           "       [--fingerprint HEX] [--hidden H] [--delay-ms MS]\n"
           "       [--exact-len] [--table-rows N] [--ids A,B,..] [--mask 0011..]\n");
}

/* An error after the tables exist: stop the stream (a consumer that went away, a full disk) and
 * free what main allocated, so that the sanitized build sees no leak. */
static int fail(dfl_writer *w, float *tab, int64_t *lay, dfl_err *e)
{
    if (w)
        dfl_writer_abort(w);
    free(tab);
    free(lay);
    return dfl_cli_report(e);
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    int64_t batches = 8, seqs = 4, len = 32, seed = 1, nan_batch = -1, nan_from = -1, cut = 0;
    int64_t hidden = 0, delay = 0, table_rows = 0, also_seed = -1;
    bool exact_len = false;
    const char *layers_s = "1,2", *fp_override = NULL, *mask_s = NULL;
    int64_t *fixed = NULL;   /* --ids */
    size_t n_fixed = 0;
    dfl_dtype dt = DFL_BF16;
    bool no_index = false;
    dfl_err e = {0};
    static const struct option lo[] = {
        {"batches", 1, 0, 'b'}, {"seqs", 1, 0, 's'}, {"len", 1, 0, 'l'}, {"layers", 1, 0, 'L'},
        {"dtype", 1, 0, 'd'}, {"seed", 1, 0, 'S'}, {"nan-batch", 1, 0, 'n'}, {"nan-from", 1, 0, 'N'}, {"cut", 1, 0, 'c'},
        {"no-index", 0, 0, 'x'}, {"fingerprint", 1, 0, 'f'}, {"hidden", 1, 0, 'H'},
        {"delay-ms", 1, 0, 'D'}, {"exact-len", 0, 0, 'E'}, {"table-rows", 1, 0, 'R'},
        {"also-seed", 1, 0, 'A'}, {"ids", 1, 0, 'I'}, {"mask", 1, 0, 'M'}, {"help", 0, 0, 'h'},
        {0, 0, 0, 0}};
    int c, rc = 0;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'b': rc = dfl_parse_i64(optarg, 0, 1 << 20, &batches, "--batches", &e); break;
        case 's': rc = dfl_parse_i64(optarg, 1, 1 << 16, &seqs, "--seqs", &e); break;
        case 'l': rc = dfl_parse_i64(optarg, 1, 1 << 20, &len, "--len", &e); break;
        case 'M':
            mask_s = optarg;
            if (!*optarg || strspn(optarg, "01") != strlen(optarg))
                return dfl_cli_usage_error("--mask: '%s' is not a pattern of 0s and 1s", optarg);
            break;
        case 'L': layers_s = optarg; break;
        case 'd': dt = dfl_dtype_from_name(optarg); break;
        case 'S': rc = dfl_parse_i64(optarg, 0, INT64_MAX, &seed, "--seed", &e); break;
        case 'n': rc = dfl_parse_i64(optarg, 0, 1 << 20, &nan_batch, "--nan-batch", &e); break;
        case 'N': rc = dfl_parse_i64(optarg, 0, 1 << 20, &nan_from, "--nan-from", &e); break;
        case 'c': rc = dfl_parse_i64(optarg, 1, 1 << 30, &cut, "--cut", &e); break;
        case 'x': no_index = true; break;
        case 'f': fp_override = optarg; break;
        case 'H': rc = dfl_parse_i64(optarg, 1, 1 << 16, &hidden, "--hidden", &e); break;
        case 'D': rc = dfl_parse_i64(optarg, 0, 100000, &delay, "--delay-ms", &e); break;
        case 'E': exact_len = true; break;
        case 'R': rc = dfl_parse_i64(optarg, 1, INT32_MAX, &table_rows, "--table-rows", &e); break;
        case 'A': rc = dfl_parse_i64(optarg, 0, INT64_MAX, &also_seed, "--also-seed", &e); break;
        case 'I': rc = dfl_parse_i64_list(optarg, 0, INT32_MAX, 1 << 20, &fixed, &n_fixed, "--ids", &e); break;
        case 'h': usage(); return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
        if (rc)
            return dfl_cli_usage_error("%s", e.msg);
    }
    if (argc - optind != 2)
        return dfl_cli_usage_error("expected TARGET_DIR OUT");
    if (mask_s && fixed && strlen(mask_s) != n_fixed)
        return dfl_cli_usage_error("--mask with --ids: one 0 or 1 per token");
    if (fixed && n_fixed < 2)
        return dfl_cli_usage_error("--ids: at least 2 tokens");
    const char *dir = argv[optind], *out = argv[optind + 1];
    dfl_hf_drafter_target tc;   /* any target a drafter can have (Qwen3.5 included) */
    char fp[33];
    if ((rc = dfl_hf_drafter_target_load(dir, &tc, fp, &e)))
        return dfl_cli_report(&e);
    int64_t *lay;
    size_t nl;
    if ((rc = dfl_parse_i64_list(layers_s, 0, 1000, DFL_MAX_LAYERS, &lay, &nl, "--layers", &e)))
        return dfl_cli_usage_error("%s", e.msg);
    const int64_t H = hidden ? hidden : tc.hidden_size, V = tc.vocab_size;
    const int64_t rows = table_rows && table_rows < V ? table_rows : V;   /* feature table rows */
    dfl_stream_info info = {.kind = DFL_KIND_HIDDEN, .version_major = DFL_FRAME_MAJOR,
                            .version_minor = DFL_FRAME_MINOR, .vocab_size = V, .hidden_size = H,
                            .n_layers = (int)nl, .dtype = dt};
    snprintf(info.producer, sizeof info.producer, "draftdata (dfl tests)");
    for (size_t i = 0; i < nl; i++)
        info.layers[i] = (int32_t)lay[i];
    snprintf(info.fingerprint, sizeof info.fingerprint, "%s", fp_override ? fp_override : fp);
    /* the feature tables: fixed, whatever the stream's seed */
    float *tab = malloc((size_t)nl * rows * H * sizeof *tab);
    dfl_rng r;
    dfl_rng_seed(&r, 0x7ab1e5);
    for (int64_t i = 0; i < (int64_t)nl * rows * H; i++)
        tab[i] = (float)dfl_rng_normal(&r);
    dfl_rng_seed(&r, (uint64_t)seed);
    dfl_rng r2;   /* --also-seed: the second stream's generator */
    dfl_rng_seed(&r2, (uint64_t)(also_seed >= 0 ? also_seed : 0));
    const int parts = also_seed >= 0 ? 2 : 1;
    if (seqs * parts > (1 << 16))
        return dfl_cli_usage_error("--seqs %lld: too many sequences with --also-seed", (long long)seqs);
    dfl_writer *w;
    dfl_writer_opts wo = {.no_index = no_index};
    if ((rc = dfl_writer_open(&w, out, &info, &wo, &e)))
        return fail(NULL, tab, lay, &e);
    for (int64_t bi = 0; bi < batches; bi++) {
        static uint32_t lens[1 << 16];
        static int64_t first[1 << 16];
        uint64_t T = 0;
        for (int p = 0; p < parts; p++) {   /* per stream: the lengths, then the first tokens */
            dfl_rng *g = p ? &r2 : &r;
            for (int64_t s = p * seqs; s < (p + 1) * seqs; s++) {
                lens[s] = fixed ? (uint32_t)n_fixed : exact_len ? (uint32_t)len
                                    : (uint32_t)(len / 2 + (int64_t)dfl_rng_below(g, (uint64_t)(len - len / 2 + 1)));
                if (lens[s] < 2)
                    lens[s] = len < 2 ? 1 : 2;   /* --len 1: one token each */
                T += lens[s];
            }
            for (int64_t s = p * seqs; s < (p + 1) * seqs; s++)
                first[s] = (int64_t)dfl_rng_below(g, (uint64_t)(V - 1));
        }
        const int64_t nseq = seqs * parts;
        dfl_batch b;
        if ((rc = dfl_batch_alloc(&b, T, (uint32_t)nseq, (uint32_t)nl, (uint32_t)H, dt, &e)))
            return fail(w, tab, lay, &e);
        uint32_t *sl = (uint32_t *)b.seq_lens;
        int32_t *ids = (int32_t *)b.input_ids;
        uint8_t *mask = (uint8_t *)b.loss_mask;
        uint64_t t = 0;
        for (int64_t s = 0; s < nseq; s++) {
            sl[s] = lens[s];
            int64_t tok = first[s];
            for (uint32_t i = 0; i < lens[s]; i++, t++) {
                ids[t] = fixed ? (int32_t)fixed[i] : (int32_t)tok;
                mask[t] = mask_s ? mask_s[i % strlen(mask_s)] == '1' : i >= 2;
                tok = (5 * tok + 3) % (V - 1);
            }
        }
        float *row = malloc((size_t)H * sizeof *row);
        for (size_t j = 0; j < nl; j++)
            for (t = 0; t < T; t++) {
                for (int64_t h = 0; h < H; h++)
                    row[h] = bi == nan_batch || (nan_from >= 0 && bi >= nan_from) ? NAN : tab[((int64_t)j * rows + ids[t] % rows) * H + h % tc.hidden_size];
                dfl_convert((char *)b.layers[j] + t * H * dfl_dtype_size(dt), dt, row, DFL_F32, (size_t)H);
            }
        free(row);
        rc = dfl_writer_batch(w, &b, &e);
        dfl_batch_free(&b);
        if (rc)
            return fail(w, tab, lay, &e);
        if (delay)
            usleep((useconds_t)delay * 1000);
    }
    if ((rc = dfl_writer_close(w, &e)))
        return fail(NULL, tab, lay, &e);
    if (cut > 0 && strcmp(out, "-") != 0) {
        FILE *f = fopen(out, "r+");
        if (!f || fseek(f, 0, SEEK_END) != 0)
            return 1;
        long size = ftell(f);
        fclose(f);
        if (truncate(out, size > cut ? size - cut : 0) != 0)
            return 1;
    }
    free(tab);
    free(lay);
    free(fixed);
    return 0;
}
