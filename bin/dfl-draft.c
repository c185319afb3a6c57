/* dfl-draft: trains a DFlash drafter from hidden-state streams (dfl-draft(1)). Options, then
 * lib/train/draft_train.c does the work. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "draft_train.h"
#include "log.h"
#include "util.h"

static void usage(void)
{
    printf("Usage: dfl-draft --target DIR --out RUN [options] [INPUT...]\n"
           "Train a DFlash drafter on hidden-state streams (.dfl files, FIFOs, - for stdin).\n"
           "\n"
           "  -t, --target DIR          the target model (config.json, safetensors): embedding, LM head\n"
           "  -o, --out RUN             run directory: checkpoints, metrics.jsonl (locked while running)\n"
           "      --config FILE         drafter config.json (public DFlash layout)\n"
           "      --draft-layers N      drafter layers (default: one per captured target layer)\n"
           "      --block-size N        block size (default 16)\n"
           "      --gamma G             loss decay (default 7)\n"
           "      --mask-token-id ID    mask token (required unless a config gives it)\n"
           "      --layer-types LIST    drafter layer types in order: sliding or full, each\n"
           "                            optionally :COUNT (e.g. sliding:4,full:1; default all full)\n"
           "      --sliding-window W    window of the sliding layers, in positions (e.g. 2048)\n"
           "      --heads N             drafter query heads (default: the target's)\n"
           "      --kv-heads N          drafter key/value heads (default: the target's)\n"
           "      --head-dim N          drafter head dimension (default: the target's)\n"
           "      --intermediate-size N drafter MLP width (default: the target's)\n"
           "      --num-anchors N       anchors per sequence at most (default 512)\n"
           "      --noise-std X         uniform noise of this std on the target features (default 0)\n"
           "      --lr X                peak learning rate (default 6e-4)\n"
           "      --betas B1,B2         AdamW betas (default 0.9,0.999)\n"
           "      --adam-eps X          AdamW epsilon (default 1e-8)\n"
           "      --weight-decay X      AdamW weight decay (default 0)\n"
           "      --max-grad-norm X     global gradient-norm clipping, 0 = off (default 1.0)\n"
           "      --warmup-ratio X      linear warmup share of the steps (default 0.04)\n"
           "      --total-steps N       steps of the schedule (default: batches x epochs)\n"
           "      --epochs E            passes over file inputs (default 1)\n"
           "      --stop-at N           stop at step N with a checkpoint (the schedule is unchanged)\n"
           "      --min-ready N         batches pooled before a step (default 4)\n"
           "      --pool-size N         batches in the pool at most (default 8)\n"
           "      --max-tokens N        size buffers for batches of N tokens (streams)\n"
           "      --max-blocks N        ... and N blocks (default: the most N tokens can have)\n"
           "      --save-every N        checkpoint every N steps, 0 = only at the end (default 1000)\n"
           "      --keep N              keep the newest N checkpoints, 0 = all (default 0)\n"
           "      --on-save CMD         run CMD CHECKPOINT_DIR after each checkpoint\n"
           "      --save-dtype T        weights of model.safetensors: bf16 or f32 (default bf16)\n"
           "      --resume PATH         continue from RUN/latest, RUN/step-N or RUN\n"
           "      --log-every N         metrics line every N steps (default 10)\n"
           "      --max-bad-steps K     stop after K non-finite steps in a row (default 10)\n"
           "      --seed N              seed of anchors, data order, noise and init (default 0)\n"
           "      --init-std X          std of the initial linear weights (default 0.02)\n"
           "      --device DEV          cpu (default), cuda, cuda:N\n"
           "      --threads N           CPU threads (default: all)\n"
           "      --profile             per log window: input wait, host prep, GPU time, host syncs;\n"
           "                            at the end the step's time by kind of work and GEMM shape\n"
           "      --tune                on a GPU, time cuBLASLt's algorithms of each GEMM shape in\n"
           "                            the warm-up and keep the fastest\n"
           "      --no-pipeline         read each step's results before the next step (a check)\n"
           "      --no-verify           skip frame checksums\n"
           "      --allow-truncated     train on the complete batches of an input cut short (no END)\n"
           "      --rendezvous R        data parallel: FILE (shared) or tcp://HOST:PORT of rank 0;\n"
           "                            ranks from RANK/WORLD_SIZE/LOCAL_RANK or SLURM_* variables;\n"
           "                            {rank} in an INPUT becomes the rank\n"
           "      --dist-timeout S      seconds to wait for the other ranks at start (default 600)\n"
           "  -q, --quiet               errors only\n"
           "  -v, --verbose             more detail\n"
           "  -h, --help                this help\n"
           "      --version             version\n"
           "\n"
           "Prints the last checkpoint directory on stdout. Exit status: 0 done, 1 usage or runtime\n"
           "error (or stopped by a signal, after a checkpoint), 2 invalid or mismatched input,\n"
           "or too many non-finite steps.\n");
}

enum {
    O_CONFIG = 256, O_DRAFT_LAYERS, O_BLOCK, O_GAMMA, O_MASK, O_ANCHORS, O_NOISE, O_LR, O_BETAS,
    O_EPS, O_WD, O_CLIP, O_WARMUP, O_TOTAL, O_EPOCHS, O_STOP_AT, O_MIN_READY, O_POOL, O_MAX_TOKENS,
    O_SAVE_EVERY, O_KEEP, O_ON_SAVE, O_SAVE_DTYPE, O_RESUME, O_LOG_EVERY, O_MAX_BAD, O_SEED,
    O_INIT_STD, O_DEVICE, O_THREADS, O_NO_VERIFY, O_ALLOW_TRUNC, O_VERSION, O_MAX_BLOCKS,
    O_PROFILE, O_TUNE, O_NO_PIPELINE, O_RENDEZVOUS, O_DIST_TIMEOUT, O_LAYER_TYPES, O_SLIDING_WINDOW,
    O_HEADS, O_KV_HEADS, O_HEAD_DIM, O_INTERMEDIATE,
};

static const struct option longopts[] = {
    {"target", required_argument, 0, 't'},
    {"out", required_argument, 0, 'o'},
    {"config", required_argument, 0, O_CONFIG},
    {"draft-layers", required_argument, 0, O_DRAFT_LAYERS},
    {"block-size", required_argument, 0, O_BLOCK},
    {"gamma", required_argument, 0, O_GAMMA},
    {"mask-token-id", required_argument, 0, O_MASK},
    {"layer-types", required_argument, 0, O_LAYER_TYPES},
    {"sliding-window", required_argument, 0, O_SLIDING_WINDOW},
    {"heads", required_argument, 0, O_HEADS},
    {"kv-heads", required_argument, 0, O_KV_HEADS},
    {"head-dim", required_argument, 0, O_HEAD_DIM},
    {"intermediate-size", required_argument, 0, O_INTERMEDIATE},
    {"num-anchors", required_argument, 0, O_ANCHORS},
    {"noise-std", required_argument, 0, O_NOISE},
    {"lr", required_argument, 0, O_LR},
    {"betas", required_argument, 0, O_BETAS},
    {"adam-eps", required_argument, 0, O_EPS},
    {"weight-decay", required_argument, 0, O_WD},
    {"max-grad-norm", required_argument, 0, O_CLIP},
    {"warmup-ratio", required_argument, 0, O_WARMUP},
    {"total-steps", required_argument, 0, O_TOTAL},
    {"epochs", required_argument, 0, O_EPOCHS},
    {"stop-at", required_argument, 0, O_STOP_AT},
    {"min-ready", required_argument, 0, O_MIN_READY},
    {"pool-size", required_argument, 0, O_POOL},
    {"max-tokens", required_argument, 0, O_MAX_TOKENS},
    {"max-blocks", required_argument, 0, O_MAX_BLOCKS},
    {"profile", no_argument, 0, O_PROFILE},
    {"tune", no_argument, 0, O_TUNE},
    {"no-pipeline", no_argument, 0, O_NO_PIPELINE},
    {"save-every", required_argument, 0, O_SAVE_EVERY},
    {"keep", required_argument, 0, O_KEEP},
    {"on-save", required_argument, 0, O_ON_SAVE},
    {"save-dtype", required_argument, 0, O_SAVE_DTYPE},
    {"resume", required_argument, 0, O_RESUME},
    {"log-every", required_argument, 0, O_LOG_EVERY},
    {"max-bad-steps", required_argument, 0, O_MAX_BAD},
    {"seed", required_argument, 0, O_SEED},
    {"init-std", required_argument, 0, O_INIT_STD},
    {"device", required_argument, 0, O_DEVICE},
    {"threads", required_argument, 0, O_THREADS},
    {"no-verify", no_argument, 0, O_NO_VERIFY},
    {"allow-truncated", no_argument, 0, O_ALLOW_TRUNC},
    {"rendezvous", required_argument, 0, O_RENDEZVOUS},
    {"dist-timeout", required_argument, 0, O_DIST_TIMEOUT},
    {"quiet", no_argument, 0, 'q'},
    {"verbose", no_argument, 0, 'v'},
    {"help", no_argument, 0, 'h'},
    {"version", no_argument, 0, O_VERSION},
    {0, 0, 0, 0},
};

/* A number in [lo, hi] (doubles); what names the option. */
static int num_opt(const char *s, double lo, double hi, double *out, const char *what, dfl_err *e)
{
    int rc = dfl_parse_double(s, out, what, e);
    if (!rc && !(*out >= lo && *out <= hi))
        rc = dfl_fail(e, DFL_EUSAGE, "%s: %s is out of range (%g..%g)", what, s, lo, hi);
    return rc;
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    dfl_draft_train_opts o;
    dfl_draft_train_defaults(&o);
    dfl_err e = {0};
    int64_t v, threads = 0;
    int c, rc = 0;
    while ((c = getopt_long(argc, argv, "t:o:qvh", longopts, NULL)) != -1) {
        char what[64];
        dfl_cli_opt_name(longopts, c, what, sizeof what);
        switch (c) {
        case 't': o.target_dir = optarg; break;
        case 'o': o.run_dir = optarg; break;
        case O_CONFIG: o.config_path = optarg; break;
        case O_RESUME: o.resume = optarg; break;
        case O_DEVICE: o.device = optarg; break;
        case O_RENDEZVOUS: o.rendezvous = optarg; break;
        case O_DIST_TIMEOUT: rc = num_opt(optarg, 0.1, 86400, &o.dist_timeout, what, &e); break;
        case O_ON_SAVE: o.on_save = optarg; break;
        case O_NO_VERIFY: o.no_verify = true; break;
        case O_ALLOW_TRUNC: o.allow_truncated = true; break;
        case O_DRAFT_LAYERS:
            if (!(rc = dfl_parse_i64(optarg, 1, 256, &v, what, &e)))
                o.draft_layers = (int)v;
            break;
        case O_BLOCK:
            if (!(rc = dfl_parse_i64(optarg, 2, 256, &v, what, &e)))
                o.block_size = (int)v;
            break;
        case O_GAMMA: rc = num_opt(optarg, 1e-6, 1e6, &o.gamma, what, &e); break;
        case O_MASK: rc = dfl_parse_i64(optarg, 0, INT32_MAX, &o.mask_token_id, what, &e); break;
        case O_LAYER_TYPES: o.layer_types = optarg; break;
        case O_SLIDING_WINDOW:
            rc = dfl_parse_i64(optarg, 1, INT32_MAX, &o.sliding_window, what, &e);
            break;
        case O_HEADS:
        case O_KV_HEADS:
        case O_HEAD_DIM:
            if (!(rc = dfl_parse_i64(optarg, 1, c == O_HEAD_DIM ? 512 : 4096, &v, what, &e)))
                *(c == O_HEADS ? &o.heads : c == O_KV_HEADS ? &o.kv_heads : &o.head_dim) = (int)v;
            break;
        case O_INTERMEDIATE: rc = dfl_parse_i64(optarg, 1, 1 << 22, &o.intermediate, what, &e); break;
        case O_ANCHORS:
            if (!(rc = dfl_parse_i64(optarg, 1, 1 << 20, &v, what, &e)))
                o.num_anchors = (int)v;
            break;
        case O_NOISE: rc = num_opt(optarg, 0, 1e6, &o.noise_std, what, &e); break;
        case O_LR: rc = num_opt(optarg, 0, 10, &o.lr, what, &e); break;
        case O_BETAS: {
            char *comma = strchr(optarg, ',');
            if (!comma) {
                rc = dfl_fail(&e, DFL_EUSAGE, "--betas: expected B1,B2 (e.g. 0.9,0.999)");
                break;
            }
            *comma = 0;
            if (!(rc = num_opt(optarg, 0, 0.999999999, &o.beta1, what, &e)))
                rc = num_opt(comma + 1, 0, 0.999999999, &o.beta2, what, &e);
            break;
        }
        case O_EPS: rc = num_opt(optarg, 0, 1, &o.eps, what, &e); break;
        case O_WD: rc = num_opt(optarg, 0, 10, &o.weight_decay, what, &e); break;
        case O_CLIP: rc = num_opt(optarg, 0, 1e9, &o.max_grad_norm, what, &e); break;
        case O_WARMUP: rc = num_opt(optarg, 0, 1, &o.warmup_ratio, what, &e); break;
        case O_TOTAL: rc = dfl_parse_i64(optarg, 1, INT64_MAX / 2, &o.total_steps, what, &e); break;
        case O_EPOCHS:
            if (!(rc = dfl_parse_i64(optarg, 1, 1000000, &v, what, &e)))
                o.epochs = (int)v;
            break;
        case O_STOP_AT: rc = dfl_parse_i64(optarg, 1, INT64_MAX / 2, &o.stop_at, what, &e); break;
        case O_MIN_READY:
            if (!(rc = dfl_parse_i64(optarg, 1, 1 << 20, &v, what, &e)))
                o.min_ready = (int)v;
            break;
        case O_POOL:
            if (!(rc = dfl_parse_i64(optarg, 1, 1 << 20, &v, what, &e)))
                o.pool_size = (int)v;
            break;
        case O_MAX_TOKENS: rc = dfl_parse_i64(optarg, 1, INT32_MAX / 2, &o.max_tokens, what, &e); break;
        case O_MAX_BLOCKS: rc = dfl_parse_i64(optarg, 1, INT32_MAX / 256, &o.max_blocks, what, &e); break;
        case O_PROFILE: o.profile = true; break;
        case O_TUNE: o.tune = true; break;
        case O_NO_PIPELINE: o.no_pipeline = true; break;
        case O_SAVE_EVERY: rc = dfl_parse_i64(optarg, 0, INT64_MAX / 2, &o.save_every, what, &e); break;
        case O_KEEP:
            if (!(rc = dfl_parse_i64(optarg, 0, 1 << 20, &v, what, &e)))
                o.keep = (int)v;
            break;
        case O_SAVE_DTYPE:
            o.save_dtype = dfl_dtype_from_name(optarg);
            if (o.save_dtype != DFL_BF16 && o.save_dtype != DFL_F32)
                rc = dfl_fail(&e, DFL_EUSAGE, "--save-dtype: '%s' (bf16 or f32)", optarg);
            break;
        case O_LOG_EVERY: rc = dfl_parse_i64(optarg, 1, INT64_MAX / 2, &o.log_every, what, &e); break;
        case O_MAX_BAD:
            if (!(rc = dfl_parse_i64(optarg, 1, 1 << 30, &v, what, &e)))
                o.max_bad_steps = (int)v;
            break;
        case O_SEED:
            if (!(rc = dfl_parse_i64(optarg, 0, INT64_MAX, &v, what, &e)))
                o.seed = (uint64_t)v;
            break;
        case O_INIT_STD: rc = num_opt(optarg, 0, 100, &o.init_std, what, &e); break;
        case O_THREADS: rc = dfl_parse_i64(optarg, 1, 4096, &threads, what, &e); break;
        case 'q': dfl_log_level = DFL_LOG_ERROR; break;
        case 'v': dfl_log_level++; break;
        case 'h': usage(); return 0;
        case O_VERSION: puts(dfl_cli_version_line()); return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
        if (rc)
            return dfl_cli_usage_error("%s", e.msg);
    }
    if (!o.target_dir)
        return dfl_cli_usage_error("--target DIR is required");
    if (!o.run_dir)
        return dfl_cli_usage_error("--out RUN is required");
    if (optind >= argc)
        return dfl_cli_usage_error("no input: give hidden-state streams (files, FIFOs, - for stdin)");
    if (o.min_ready > o.pool_size)
        return dfl_cli_usage_error("--min-ready %d is more than --pool-size %d", o.min_ready, o.pool_size);
    o.n_inputs = argc - optind;
    o.inputs = (const char *const *)(argv + optind);
    if (dfl_cli_count_stdin(o.inputs, o.n_inputs) > 1)
        return dfl_cli_usage_error("stdin (-) given more than once");
    dfl_cli_threads(threads);
    o.stop = dfl_cli_stop_on_signals();
    if (!o.rendezvous && getenv("DFL_RENDEZVOUS") && *getenv("DFL_RENDEZVOUS"))
        o.rendezvous = getenv("DFL_RENDEZVOUS");   /* as dfl-train passes it */
    rc = dfl_draft_train(&o, &e);
    if (rc == DFL_OK || rc == DFL_EINTR) {
        char *lat = dfl_path_join(o.run_dir, "latest");
        char *real = lat ? realpath(lat, NULL) : NULL;
        if (real)
            printf("%s\n", real);
        free(real);
        free(lat);
    }
    if (rc)
        return dfl_cli_report(&e);
    return 0;
}
