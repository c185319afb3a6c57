/* dfl-bucket: shard a tokenized dataset (JSON Lines) into sequence-length-bucketed token-batch
 * streams, one per dfl-target worker, with a manifest. The work is in lib/train/bucket.c. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucket.h"
#include "cli.h"
#include "log.h"
#include "util.h"

#define DEFAULT_BUCKETS "512,1024,2048,4096"
#define DEFAULT_MAX_TOKENS 16384

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

static void usage(void)
{
    printf("Usage: %s [options] -o DIR INPUT...\n"
           "       %s --stats [options] INPUT...\n"
           "Shard a tokenized dataset (JSON Lines: input_ids, optional loss_mask or labels) into\n"
           "sequence-length-bucketed token-batch streams DIR/shard-NNNNN.dfl and DIR/manifest.json.\n"
           "INPUT: a file (plain, .gz, .zst, .xz, ...), a tar or zip archive of .jsonl files, or - for stdin.\n"
           "\n"
           "  -o, --output DIR       output directory (created; must be empty unless --force)\n"
           "      --shards N         number of shards (default 1)\n"
           "      --buckets LIST     bucket upper bounds, e.g. 512,1024,2048,4096 (the default),\n"
           "                         or auto:K for K buckets at length quantiles\n"
           "      --max-tokens N     token budget of a batch (default %d; K/M suffixes)\n"
           "      --max-len N        longest sample kept (default: the last bucket bound;\n"
           "                         no limit with auto:K)\n"
           "      --long MODE        truncate (default) or drop samples longer than --max-len\n"
           "      --vocab-size N     check that every token id is below N\n"
           "      --on-error MODE    error (default: a bad record stops with exit 2) or skip (count it)\n"
           "      --seed N           shuffle seed (default 0)\n"
           "      --stats            only print the length histogram and what the bucketing would give\n"
           "      --force            replace a previous output in DIR\n"
           "  -j, --threads N        worker threads (default: all CPUs)\n"
           "  -q, --quiet            errors only\n"
           "  -v, --verbose          more detail\n"
           "  -h, --help             this help\n"
           "  -V, --version          version\n"
           "\n"
           "Exit status: 0 ok, 1 usage or runtime error, 2 invalid data (a bad record, no samples).\n"
           "See dfl-bucket(1).\n",
           dfl_progname, dfl_progname, DEFAULT_MAX_TOKENS);
}

enum { OPT_SHARDS = 256, OPT_BUCKETS, OPT_MAX_TOKENS, OPT_MAX_LEN, OPT_LONG, OPT_VOCAB, OPT_ON_ERROR,
       OPT_SEED, OPT_STATS, OPT_FORCE };

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    static const struct option longopts[] = {
        {"output", required_argument, NULL, 'o'},
        {"shards", required_argument, NULL, OPT_SHARDS},
        {"buckets", required_argument, NULL, OPT_BUCKETS},
        {"max-tokens", required_argument, NULL, OPT_MAX_TOKENS},
        {"max-len", required_argument, NULL, OPT_MAX_LEN},
        {"long", required_argument, NULL, OPT_LONG},
        {"vocab-size", required_argument, NULL, OPT_VOCAB},
        {"on-error", required_argument, NULL, OPT_ON_ERROR},
        {"seed", required_argument, NULL, OPT_SEED},
        {"stats", no_argument, NULL, OPT_STATS},
        {"force", no_argument, NULL, OPT_FORCE},
        {"threads", required_argument, NULL, 'j'},
        {"quiet", no_argument, NULL, 'q'},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    dfl_bucket_opts o;
    memset(&o, 0, sizeof o);
    o.shards = 1;
    o.max_tokens = DEFAULT_MAX_TOKENS;
    o.producer = "dfl-bucket " DFL_VERSION;
    o.stop = &stop_flag;
    const char *buckets = DEFAULT_BUCKETS;
    dfl_err e;
    int64_t v;
    uint64_t u;
    int c;
    while ((c = getopt_long(argc, argv, "o:j:qvhV", longopts, NULL)) != -1) {
        switch (c) {
        case 'o': o.out_dir = optarg; break;
        case OPT_SHARDS:
            if (dfl_parse_i64(optarg, 1, DFL_BUCKET_MAX_SHARDS, &v, "--shards", &e))
                return dfl_cli_usage_error("%s", e.msg);
            o.shards = (uint32_t)v;
            break;
        case OPT_BUCKETS: buckets = optarg; break;
        case OPT_MAX_TOKENS:
            if (dfl_parse_size(optarg, &u, "--max-tokens", &e))
                return dfl_cli_usage_error("%s", e.msg);
            if (u < 1 || u > DFL_BUCKET_MAX_LEN)
                return dfl_cli_usage_error("--max-tokens: %s is out of range [1, %u]", optarg, DFL_BUCKET_MAX_LEN);
            o.max_tokens = u;
            break;
        case OPT_MAX_LEN:
            if (dfl_parse_size(optarg, &u, "--max-len", &e))
                return dfl_cli_usage_error("%s", e.msg);
            if (u < 1 || u > DFL_BUCKET_MAX_LEN)
                return dfl_cli_usage_error("--max-len: %s is out of range [1, %u]", optarg, DFL_BUCKET_MAX_LEN);
            o.max_len = (uint32_t)u;
            break;
        case OPT_LONG:
            if (strcmp(optarg, "truncate") == 0)
                o.long_drop = false;
            else if (strcmp(optarg, "drop") == 0)
                o.long_drop = true;
            else
                return dfl_cli_usage_error("--long: '%s' is not truncate or drop", optarg);
            break;
        case OPT_VOCAB:
            if (dfl_parse_i64(optarg, 1, (int64_t)INT32_MAX + 1, &v, "--vocab-size", &e))
                return dfl_cli_usage_error("%s", e.msg);
            o.vocab_size = v;
            break;
        case OPT_ON_ERROR:
            if (strcmp(optarg, "error") == 0)
                o.skip_bad = false;
            else if (strcmp(optarg, "skip") == 0)
                o.skip_bad = true;
            else
                return dfl_cli_usage_error("--on-error: '%s' is not error or skip", optarg);
            break;
        case OPT_SEED:
            if (dfl_parse_i64(optarg, 0, INT64_MAX, &v, "--seed", &e))
                return dfl_cli_usage_error("%s", e.msg);
            o.seed = (uint64_t)v;
            break;
        case OPT_STATS: o.stats_only = true; break;
        case OPT_FORCE: o.force = true; break;
        case 'j':
            if (dfl_parse_i64(optarg, 1, 1024, &v, "--threads", &e))
                return dfl_cli_usage_error("%s", e.msg);
            o.threads = (int)v;
            break;
        case 'q': dfl_log_level = DFL_LOG_ERROR; break;
        case 'v': dfl_log_level = dfl_log_level < DFL_LOG_VERBOSE ? DFL_LOG_VERBOSE : DFL_LOG_DEBUG; break;
        case 'h': usage(); return 0;
        case 'V': puts(dfl_cli_version_line()); return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
    }
    if (optind >= argc)
        return dfl_cli_usage_error("no input (name files, or - for stdin)");
    if (!o.stats_only && !o.out_dir)
        return dfl_cli_usage_error("no output directory (-o DIR), or --stats");
    uint32_t *bounds = NULL;
    size_t n_bounds = 0;
    if (dfl_bucket_parse_spec(buckets, &bounds, &n_bounds, &o.auto_k, &e))
        return dfl_cli_usage_error("%s", e.msg);
    o.bounds = bounds;
    o.n_bounds = n_bounds;
    o.inputs = (const char *const *)argv + optind;
    o.n_inputs = (size_t)(argc - optind);
    if (o.stats_only && o.out_dir) {
        dfl_verbose("--stats writes nothing: -o %s is ignored", o.out_dir);
        o.out_dir = NULL;
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);

    dfl_bucket_run *r = NULL;
    int rc = dfl_bucket_open(&r, &o, &e);
    if (!rc)
        rc = dfl_bucket_scan(r, &e);
    if (!rc)
        rc = dfl_bucket_plan(r, &e);
    if (!rc && o.stats_only) {
        char *text = dfl_bucket_report(r);
        if (!text) {
            rc = dfl_fail(&e, DFL_ENOMEM, "out of memory");
        } else {
            rc = dfl_write_all(1, text, strlen(text), "stdout", &e);
            free(text);
        }
    } else if (!rc) {
        rc = dfl_bucket_write(r, &e);
    }
    if (!rc) {
        char line[1024];
        dfl_bucket_summary(r, line, sizeof line);
        dfl_info("%s", line);
    }
    dfl_bucket_close(r);
    free(bounds);
    if (rc && stop_flag) /* a signal can also surface as a failed read */
        dfl_fail(&e, DFL_EINTR, "interrupted");
    if (rc)
        return dfl_cli_report(&e);
    return 0;
}
