/* dfl-eval: the acceptance length that greedy speculative decoding gets with a trained drafter,
 * offline, from hidden-state streams (dfl-eval(1)). Options, then lib/train/eval.c does the work;
 * this file prints the report (text on stderr, JSON on stdout). */
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "eval.h"
#include "log.h"
#include "util.h"

static void usage(void)
{
    printf("Usage: dfl-eval --draft CKPT --target DIR [options] [STREAM...]\n"
           "The acceptance length (tau) that greedy speculative decoding gets with a drafter, computed\n"
           "offline on hidden-state streams (.dfl files, FIFOs, - for stdin; default -).\n"
           "\n"
           "  -d, --draft CKPT          drafter checkpoint directory (model.safetensors, config.json),\n"
           "                            or a run directory (its latest)\n"
           "  -t, --target DIR          the target model the streams come from\n"
           "      --block-size N        evaluate blocks of N tokens (default: the drafter's)\n"
           "      --per-sequence        JSON Lines: one line per sequence, then the total\n"
           "      --max-tokens N        tokens of context per drafter forward (default 16384, 65536 on CUDA)\n"
           "      --max-blocks N        blocks per forward (default 4096 / 32768 on CUDA, over the block size)\n"
           "      --device DEV          cpu (default), cuda, cuda:N\n"
           "      --threads N           CPU threads (default: all)\n"
           "      --progress S          a progress line every S seconds (default 10, 0 = none)\n"
           "      --no-verify           skip frame checksums\n"
           "  -q, --quiet               errors only (no text report)\n"
           "  -v, --verbose             more detail\n"
           "  -h, --help                this help\n"
           "      --version             version\n"
           "\n"
           "tau equals a serving engine's when the text is the target's own greedy output and the\n"
           "engine verifies greedily; otherwise it is an estimate. Prints one JSON object on stdout.\n"
           "Exit status: 0 done, 1 usage or runtime error (or stopped by a signal), 2 invalid or\n"
           "mismatched input (another target, other layers, no response position, a bad checkpoint).\n");
}

enum { O_BLOCK = 256, O_PER_SEQ, O_MAX_TOKENS, O_MAX_BLOCKS, O_DEVICE, O_THREADS, O_PROGRESS,
       O_NO_VERIFY, O_VERSION };

static const struct option longopts[] = {
    {"draft", required_argument, 0, 'd'},
    {"target", required_argument, 0, 't'},
    {"block-size", required_argument, 0, O_BLOCK},
    {"per-sequence", no_argument, 0, O_PER_SEQ},
    {"max-tokens", required_argument, 0, O_MAX_TOKENS},
    {"max-blocks", required_argument, 0, O_MAX_BLOCKS},
    {"device", required_argument, 0, O_DEVICE},
    {"threads", required_argument, 0, O_THREADS},
    {"progress", required_argument, 0, O_PROGRESS},
    {"no-verify", no_argument, 0, O_NO_VERIFY},
    {"quiet", no_argument, 0, 'q'},
    {"verbose", no_argument, 0, 'v'},
    {"help", no_argument, 0, 'h'},
    {"version", no_argument, 0, O_VERSION},
    {0, 0, 0, 0},
};

/* Writes one JSON line on stdout (a failed write is an error: the report would be lost). */
static int put_json(json_t *j, dfl_err *e)
{
    char *s = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(10));
    json_decref(j);
    if (!s)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int rc = DFL_OK;
    if (fputs(s, stdout) == EOF || fputc('\n', stdout) == EOF || fflush(stdout) == EOF)
        rc = dfl_fail(e, DFL_EIO, "standard output: write error");
    free(s);
    return rc;
}

static int on_seq(void *ctx, const dfl_eval_seq *q, dfl_err *e)
{
    (void)ctx;
    json_t *j = json_object();
    json_object_set_new(j, "kind", json_string("sequence"));
    json_object_set_new(j, "input", json_string(q->input));
    json_object_set_new(j, "batch", json_integer(q->batch));
    json_object_set_new(j, "sequence", json_integer(q->seq));
    json_object_set_new(j, "length", json_integer(q->len));
    json_t *s = dfl_eval_stats_json(q->st);
    json_object_update(j, s);
    json_decref(s);
    return put_json(j, e);
}

/* The text report on stderr. */
static void report(const dfl_eval_stats *st, const dfl_eval_info *in)
{
    const int bs = st->bs;
    const double tau = st->steps ? (double)st->tokens / (double)st->steps : 0;
    const int64_t fw = st->spans + st->steps, tok = st->spans + st->tokens;
    fprintf(stderr, "%s: %s on %s, blocks of %d (trained: %d)\n", dfl_progname, in->ckpt,
            in->device, bs, in->trained_bs);
    fprintf(stderr, "  sequences:        %lld (%lld without a response), %lld response spans\n",
            (long long)st->sequences, (long long)st->skipped, (long long)st->spans);
    fprintf(stderr, "  tau:              %.3f tokens per drafting step (%lld tokens in %lld steps)\n",
            tau, (long long)st->tokens, (long long)st->steps);
    fprintf(stderr, "  target forwards:  %lld for %lld response tokens: speed-up bound %.2fx\n",
            (long long)fw, (long long)tok, fw ? (double)tok / (double)fw : 0.0);
    fprintf(stderr, "  accepted length:  ");
    for (int n = 1; n <= bs; n++)
        fprintf(stderr, "%s%d: %.1f%%", n > 1 ? "  " : "", n,
                st->steps ? 100.0 * (double)st->hist[n] / (double)st->steps : 0.0);
    fprintf(stderr, "\n  slot acceptance:  ");
    for (int j = 1; j < bs; j++)
        fprintf(stderr, "%s%d: %.3f", j > 1 ? "  " : "", j,
                st->slot_n[j] ? (double)st->slot_acc[j] / (double)st->slot_n[j] : 0.0);
    fprintf(stderr, "\n  time:             %.2f s, %lld drafter forwards over %lld blocks "
            "(%.0f response tokens/s)\n", in->seconds, (long long)in->forwards,
            (long long)in->blocks, in->seconds > 0 ? (double)tok / in->seconds : 0.0);
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    dfl_eval_opts o = {.progress_every = 10};
    dfl_err e = {0};
    bool per_seq = false;
    int64_t v, threads = 0;
    int c, rc = 0;
    while ((c = getopt_long(argc, argv, "d:t:qvh", longopts, NULL)) != -1) {
        char what[64];
        dfl_cli_opt_name(longopts, c, what, sizeof what);
        switch (c) {
        case 'd': o.draft = optarg; break;
        case 't': o.target_dir = optarg; break;
        case O_BLOCK:
            if (!(rc = dfl_parse_i64(optarg, 2, 256, &v, what, &e)))
                o.block_size = (int)v;
            break;
        case O_PER_SEQ: per_seq = true; break;
        case O_MAX_TOKENS: rc = dfl_parse_i64(optarg, 1, INT32_MAX / 2, &o.max_tokens, what, &e); break;
        case O_MAX_BLOCKS: rc = dfl_parse_i64(optarg, 1, INT32_MAX / 256, &o.max_blocks, what, &e); break;
        case O_DEVICE: o.device = optarg; break;
        case O_THREADS: rc = dfl_parse_i64(optarg, 1, 4096, &threads, what, &e); break;
        case O_PROGRESS: rc = dfl_parse_double(optarg, &o.progress_every, what, &e);
            if (!rc && !(o.progress_every >= 0))
                rc = dfl_fail(&e, DFL_EUSAGE, "--progress: '%s' is not a number of seconds", optarg);
            break;
        case O_NO_VERIFY: o.no_verify = true; break;
        case 'q': dfl_log_level = DFL_LOG_ERROR; break;
        case 'v': dfl_log_level++; break;
        case 'h': usage(); return 0;
        case O_VERSION: puts(dfl_cli_version_line()); return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
        if (rc)
            return dfl_cli_usage_error("%s", e.msg);
    }
    if (!o.draft)
        return dfl_cli_usage_error("--draft CKPT is required");
    if (!o.target_dir)
        return dfl_cli_usage_error("--target DIR is required");
    static const char *const dash[] = {"-"};
    o.n_inputs = argc - optind;
    o.inputs = o.n_inputs ? (const char *const *)(argv + optind) : dash;
    if (!o.n_inputs)
        o.n_inputs = 1;
    int nstdin = dfl_cli_count_stdin(o.inputs, o.n_inputs);
    if (nstdin > 1)
        return dfl_cli_usage_error("stdin (-) given more than once");
    if (nstdin && isatty(STDIN_FILENO))
        return dfl_cli_usage_error("no input: give hidden-state streams (files, FIFOs, - for stdin), "
                                   "not a terminal");
    dfl_cli_threads(threads);
    if (dfl_log_level < DFL_LOG_INFO)
        o.progress_every = 0;
    if (per_seq)
        o.on_seq = on_seq;
    o.stop = dfl_cli_stop_on_signals();
    dfl_eval_stats st;
    dfl_eval_info info;
    rc = dfl_eval_run(&o, &st, &info, &e);
    if (rc)
        return dfl_cli_report(&e);
    json_t *j = json_object();
    json_object_set_new(j, "kind", json_string("total"));
    json_object_set_new(j, "draft", json_string(info.ckpt));
    json_object_set_new(j, "device", json_string(info.device));
    json_object_set_new(j, "trained_block_size", json_integer(info.trained_bs));
    json_t *s = dfl_eval_stats_json(&st);
    json_object_update(j, s);
    json_decref(s);
    json_object_set_new(j, "drafter_forwards", json_integer(info.forwards));
    json_object_set_new(j, "blocks_computed", json_integer(info.blocks));
    json_object_set_new(j, "seconds", json_real(info.seconds));
    if ((rc = put_json(j, &e)))
        return dfl_cli_report(&e);
    if (dfl_log_level >= DFL_LOG_INFO)
        report(&st, &info);
    return 0;
}
