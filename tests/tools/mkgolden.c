/* mkgolden: writes a small drafter-step golden of the project's own (the fixture
 * tests/fixtures/golden/drafter-small.safetensors) in the layout build/tests/dflash-golden reads:
 * the keys of the shared SpecForge golden (weights, frozen embedding and LM head, sequences with
 * fixed anchors, loss and accuracy, gradients, the weights after one AdamW step, per-sequence
 * parts, slot_decay_weight, extra.* and dbg.* activations, "config" and "adamw" metadata).
 *
 *   mkgolden [--seed N] [--oracle DIR] [--golden-bin PATH] [-v] OUT
 *
 * It is a regression golden, not an independent oracle: every value comes from the drafter's CPU
 * step (lib/models/draft_step.c on the CPU backend, the calls dflash-golden makes) on a random
 * configuration drawn from --seed (H 32, V 256, I 64, 2 layers, 4 query / 2 key-value heads of 16,
 * block 8, 3 target features, 3 sequences of 20-60 tokens with a prompt and holes in the loss
 * mask; anchors by the shared golden's rule). So that it is made only by a build that reproduces
 * the public code, mkgolden first runs dflash-golden on DIR/dflash-tiny/golden.safetensors (DIR:
 * --oracle, else $DFL_ORACLE) and refuses (exit 1, nothing written) unless every check passes.
 * As the shared golden did, some scored non-anchor labels are overwritten with the drafter's own
 * predictions before the step (the drafter's outputs depend on the anchor tokens only), so that
 * the accuracy is not ~0; the smallest top-1/top-2 logit gap over the scored slots must be at
 * least MIN_MARGIN (else another seed is needed), so that no argmax is a near tie. The file is
 * written as OUT.partial, checked by dflash-golden, and renamed to OUT only if that passes.
 * Deterministic: the same seed and build give the same bytes on one kind of CPU, whatever its
 * thread settings (the step runs on one thread: OpenBLAS's sgemm rounds differently with another
 * thread count, and its kernels differ between CPU models). Exit 0 written, 1 otherwise. */
#include <errno.h>
#include <stdarg.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "cli.h"
#include "draft.h"
#include "draft_rng.h"
#include "json.h"
#include "safetensors.h"
#include "util.h"

enum { H = 32, V = 256, INTER = 64, NL = 2, NH = 4, NKV = 2, HD = 16, BS = 8, NF = 3, NS = 3,
       N_TARGET_LAYERS = 6 };
static const int32_t target_layers[NF] = {1, 3, 5};
#define GAMMA 4.0
#define LR 1e-3
#define BETA1 0.9
#define BETA2 0.95
#define ADAM_EPS 1e-8
#define WEIGHT_DECAY 0.1   /* not 0: the decoupled decay term is part of what is checked */
#define MIN_MARGIN 1e-4    /* f32 logits summed in another order differ by ~1e-6 */
#define KH ((int64_t)NF * H)

static int verbose;

void openblas_set_num_threads(int n);   /* OpenBLAS's (its cblas.h clashes with backend.h) */

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "mkgolden: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size);
    if (!p)
        die("out of memory");
    return p;
}

/* Runs dflash-golden FILE with its output on our stderr (all of it with -v or when it fails,
 * else only its last line); returns its exit status (-1 when it could not run). */
static int run_golden(const char *bin, const char *file)
{
    int fd[2];
    if (pipe(fd))
        die("pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close(fd[0]);
        close(fd[1]);
        execl(bin, bin, file, (char *)NULL);
        fprintf(stderr, "cannot run %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    close(fd[1]);
    char *out = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 > cap) {
            cap = cap ? 2 * cap : 65536;
            out = realloc(out, cap);
            if (!out)
                die("out of memory");
        }
        ssize_t k = read(fd[0], out + len, cap - len - 1);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    close(fd[0]);
    out[len] = 0;
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (verbose || rc != 0) {
        fputs(out, stderr);
    } else {
        while (len > 0 && out[len - 1] == '\n')
            out[--len] = 0;
        char *last = strrchr(out, '\n');
        fprintf(stderr, "  %s\n", last ? last + 1 : out);
    }
    free(out);
    return rc;
}

/* ---- the random configuration ------------------------------------------------------------ */

typedef struct seq {
    int32_t L, na;
    int32_t *ids, *mask, *anchors;   /* int32 as the golden stores them */
    float *hidden;                   /* [L, KH] */
} seq;

/* A loss mask: a prompt (0s), a response (1s) with one hole, sometimes unscored tokens at the end. */
static void make_mask(dfl_rng *r, int32_t L, int32_t *m)
{
    int32_t prompt = (int32_t)dfl_rng_below(r, (uint64_t)L / 4 + 1);
    int32_t hole = prompt + 4 + (int32_t)dfl_rng_below(r, (uint64_t)(L - prompt - 8));
    int32_t hole_len = 1 + (int32_t)dfl_rng_below(r, 3);
    int32_t tail = dfl_rng_below(r, 2) ? 1 + (int32_t)dfl_rng_below(r, 3) : 0;
    for (int32_t i = 0; i < L; i++)
        m[i] = i >= prompt && !(i >= hole && i < hole + hole_len) && i < L - tail;
}

/* The shared golden's anchors: the valid positions a (a + 1 < L, m[a] = m[a+1] = 1) in ascending
 * order, every third one from the first, the last one, and every one whose a + 2 is unscored. */
static int32_t make_anchors(const int32_t *m, int32_t L, int32_t *out)
{
    int32_t n = 0, nc = 0, last = -1;
    for (int32_t a = 0; a + 1 < L; a++) {
        if (!(m[a] && m[a + 1]))
            continue;
        if (nc++ % 3 == 0 || (a + 2 < L && !m[a + 2]))
            out[n++] = a;
        last = a;
    }
    if (last >= 0 && (n == 0 || out[n - 1] != last))
        out[n++] = last;
    return n;
}

static void fill_normal(dfl_rng *r, float *x, int64_t n, double scale, double offset)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(offset + scale * dfl_rng_normal(r));
}

/* ---- the step ------------------------------------------------------------------------------ */

typedef struct batch {
    int64_t T;
    int32_t B;
    uint32_t lens[NS];
    int32_t *ids;
    uint8_t *mask;
    float *hidden;
    int32_t *bseq, *banchor;
    int64_t t0[NS];                  /* first token of each sequence */
    int32_t b0[NS + 1];              /* first block of each sequence */
} batch;

static void pack(const seq *s, batch *b)
{
    memset(b, 0, sizeof *b);
    for (int i = 0; i < NS; i++) {
        b->t0[i] = b->T;
        b->b0[i] = b->B;
        b->lens[i] = (uint32_t)s[i].L;
        b->T += s[i].L;
        b->B += s[i].na;
    }
    b->b0[NS] = b->B;
    b->ids = xcalloc((size_t)b->T, 4);
    b->mask = xcalloc((size_t)b->T, 1);
    b->hidden = xcalloc((size_t)(b->T * KH), 4);
    b->bseq = xcalloc((size_t)b->B, 4);
    b->banchor = xcalloc((size_t)b->B, 4);
    for (int i = 0; i < NS; i++) {
        for (int32_t t = 0; t < s[i].L; t++) {
            b->ids[b->t0[i] + t] = s[i].ids[t];
            b->mask[b->t0[i] + t] = (uint8_t)s[i].mask[t];
        }
        memcpy(b->hidden + b->t0[i] * KH, s[i].hidden, (size_t)(s[i].L * KH) * 4);
        for (int32_t k = 0; k < s[i].na; k++) {
            b->bseq[b->b0[i] + k] = i;
            b->banchor[b->b0[i] + k] = s[i].anchors[k];
        }
    }
}

/* The whole batch (only < 0) or sequence `only` alone as a step's input. */
static dfl_draft_input input_of(const batch *b, int only)
{
    static const int32_t zeros[4096];
    int64_t t0 = only < 0 ? 0 : b->t0[only];
    dfl_draft_input in = {.feat_dt = DFL_F32, .feat_ld = KH};
    in.T = only < 0 ? b->T : b->lens[only];
    in.S = only < 0 ? NS : 1;
    in.seq_lens = only < 0 ? b->lens : b->lens + only;
    in.input_ids = b->ids + t0;
    in.loss_mask = b->mask + t0;
    in.n_blocks = only < 0 ? b->B : b->b0[only + 1] - b->b0[only];
    in.block_seq = only < 0 ? b->bseq : zeros;
    in.block_anchor = b->banchor + (only < 0 ? 0 : b->b0[only]);
    for (int j = 0; j < NF; j++)
        in.feat[j] = b->hidden + t0 * KH + (int64_t)j * H;
    return in;
}

static void step(dfl_draft *m, const batch *b, int only, bool backward, dfl_draft_stats *st)
{
    dfl_err e = {0};
    dfl_draft_input in = input_of(b, only);
    if (dfl_draft_step(m, &in, backward, &e) || dfl_draft_fetch(m, st, &e))
        die("the CPU step: %s", e.msg);
}

/* Host logits z W^T (double) of every slot of the last forward: the argmax (first maximum) and
 * the top-1/top-2 gap of each. */
static void predict(dfl_draft *m, const float *lm_head, int64_t Q, int32_t *pred, double *gap)
{
    dfl_err e = {0};
    float *z = xcalloc((size_t)(Q * H), 4);
    if (dfl_draft_activation(m, DFL_DRAFT_ACT_OUT, 0, z, Q * H, &e))
        die("the CPU step's output: %s", e.msg);
    double *lg = xcalloc(V, sizeof *lg);
    for (int64_t q = 0; q < Q; q++) {
        const float *zq = z + q * H;
        for (int32_t v = 0; v < V; v++) {
            lg[v] = 0;
            for (int k = 0; k < H; k++)
                lg[v] += (double)zq[k] * lm_head[(int64_t)v * H + k];
        }
        int32_t top = 0;
        for (int32_t v = 1; v < V; v++)
            top = lg[v] > lg[top] ? v : top;
        double second = -INFINITY;
        for (int32_t v = 0; v < V; v++)
            second = v != top && lg[v] > second ? lg[v] : second;
        pred[q] = top;
        gap[q] = lg[top] - second;
    }
    free(lg);
    free(z);
}

/* ---- the file ------------------------------------------------------------------------------ */

static void add(dfl_st_writer *w, const char *name, dfl_dtype dt, int ndim, const int64_t *shape,
                const void *data)
{
    dfl_err e = {0};
    if (dfl_st_writer_add(w, name, dt, ndim, shape, data, &e))
        die("%s", e.msg);
}

/* A [1] f32 scalar; the value must outlive the writer: kept in a table. */
static void add_scalar(dfl_st_writer *w, const char *name, double v)
{
    static float vals[64];
    static int n;
    if (n == (int)DFL_ARRAY_LEN(vals))
        die("too many scalars");
    vals[n] = (float)v;
    add(w, name, DFL_F32, 1, (const int64_t[]){1}, &vals[n++]);
}

static void add_stats(dfl_st_writer *w, const char *prefix, const dfl_draft_stats *st)
{
    static const char *const key[] = {"loss", "loss_num", "loss_den", "accuracy", "acc_num", "acc_den"};
    double val[] = {st->loss_num / st->loss_den, st->loss_num, st->loss_den, st->acc_num / st->acc_den,
                    st->acc_num, st->acc_den};
    for (int i = 0; i < 6; i++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%s%s", prefix, key[i]);
        add_scalar(w, nm, val[i]);
    }
}

static void meta(dfl_st_writer *w, const char *key, const char *value)
{
    dfl_err e = {0};
    if (dfl_st_writer_meta(w, key, value, &e))
        die("%s", e.msg);
}

static char *config_json(uint64_t seed, const seq *s)
{
    json_t *layers = json_array(), *seqs = json_array();
    for (int i = 0; i < NF; i++)
        json_array_append_new(layers, json_integer(target_layers[i]));
    for (int i = 0; i < NS; i++)
        json_array_append_new(seqs, json_pack("{s:i, s:i}", "length", s[i].L, "anchors", s[i].na));
    json_t *j = json_pack(
        "{s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:f, s:o, s:I, s:o,"
        " s:{s:f, s:[f, f], s:f, s:f}}",
        "vocab_size", V, "hidden_size", H, "num_target_layers", N_TARGET_LAYERS, "num_draft_layers", NL,
        "num_attention_heads", NH, "num_key_value_heads", NKV, "head_dim", HD, "intermediate_size", INTER,
        "block_size", BS, "num_target_features", NF, "mask_token_id", V - 1,
        "max_position_embeddings", 4096, "rms_norm_eps", 1e-6, "rope_theta", 1e6,
        "loss_decay_gamma", GAMMA, "target_layer_ids", layers, "seed", (json_int_t)seed, "seqs", seqs,
        "adamw", "lr", LR, "betas", BETA1, BETA2, "eps", ADAM_EPS, "weight_decay", WEIGHT_DECAY);
    if (!j)
        die("out of memory");
    char *out = dfl_json_dump(j, 0);
    json_decref(j);
    return out;
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    int64_t seed = 20261201;
    const char *oracle = getenv("DFL_ORACLE"), *golden_bin = NULL;
    dfl_err e = {0};
    static const struct option lo[] = {{"seed", 1, 0, 's'}, {"oracle", 1, 0, 'o'},
                                       {"golden-bin", 1, 0, 'g'}, {"verbose", 0, 0, 'v'},
                                       {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "vh", lo, NULL)) != -1) {
        switch (c) {
        case 's':
            if (dfl_parse_i64(optarg, 0, INT64_MAX, &seed, "--seed", &e))
                return dfl_cli_usage_error("%s", e.msg);
            break;
        case 'o': oracle = optarg; break;
        case 'g': golden_bin = optarg; break;
        case 'v': verbose = 1; break;
        case 'h':
            printf("usage: mkgolden [--seed N] [--oracle DIR] [--golden-bin PATH] [-v] OUT\n");
            return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
    }
    if (argc - optind != 1)
        return dfl_cli_usage_error("expected OUT");
    const char *out = argv[optind];
    char bin[4200], self[4096], ofile[4200], partial[4200];
    if (!golden_bin) {   /* $DFL_TESTBIN, else BUILD/tests beside BUILD/tools/mkgolden */
        const char *tb = getenv("DFL_TESTBIN");
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        self[n > 0 ? n : 0] = 0;
        char *slash = strrchr(self, '/');
        if (slash)
            *slash = 0;
        snprintf(bin, sizeof bin, "%s/dflash-golden", tb && *tb ? tb : strcat(self, "/../tests"));
        golden_bin = bin;
    }

    /* 1. the CPU step against the public code */
    if (!oracle || !*oracle)
        die("no oracle directory (--oracle DIR or DFL_ORACLE): the fixture is made only by a build "
            "that reproduces the shared golden");
    snprintf(ofile, sizeof ofile, "%s/dflash-tiny/golden.safetensors", oracle);
    dfl_st_file *of;
    if (dfl_st_open(&of, ofile, &e))
        die("the shared golden: %s", e.msg);
    const char *sf = dfl_st_meta(of, "specforge_commit");
    char specforge[64];
    snprintf(specforge, sizeof specforge, "%s", sf ? sf : "unknown");
    dfl_st_close(of);
    fprintf(stderr, "mkgolden: %s %s\n", golden_bin, ofile);
    int rc = run_golden(golden_bin, ofile);
    if (rc != 0)
        die("this build does not reproduce the shared golden %s (dflash-golden exit %d): %s not "
            "written", ofile, rc, out);

    /* 2. the configuration, weights and sequences, from the seed */
    openblas_set_num_threads(1);
    dfl_rng r;
    dfl_rng_seed(&r, (uint64_t)seed);
    dfl_draft_config cfg = {.hidden = H, .vocab = V, .intermediate = INTER, .n_layers = NL,
                            .n_heads = NH, .n_kv = NKV, .head_dim = HD, .n_feat = NF,
                            .n_target_layers = N_TARGET_LAYERS, .block_size = BS,
                            .mask_token_id = V - 1, .gamma = GAMMA, .rms_eps = 1e-6,
                            .rope_theta = 1e6, .max_position = 4096, .bos_token_id = -1,
                            .eos_token_id = -1};
    memcpy(cfg.target_layers, target_layers, sizeof target_layers);
    dfl_be *be;
    dfl_draft *m;
    if (dfl_be_cpu_open(&be, 1, &e) || dfl_draft_open(&m, be, &cfg, &e))
        die("%s", e.msg);
    int nt;
    const dfl_draft_tensor *tl = dfl_draft_tensor_list(m, &nt);
    const int64_t flat = dfl_draft_flat_len(m);
    float *w0 = xcalloc((size_t)flat, 4), *grad = xcalloc((size_t)flat, 4),
          *w1 = xcalloc((size_t)flat, 4);
    for (int i = 0; i < nt; i++)   /* norms 1 + 0.3 N(0,1), linear N(0,1) / sqrt(in) */
        fill_normal(&r, w0 + tl[i].offset, tl[i].numel,
                    tl[i].ndim == 1 ? 0.3 : 1.0 / sqrt((double)tl[i].shape[1]), tl[i].ndim == 1);
    float *embed = xcalloc(V * H, 4), *lm_head = xcalloc(V * H, 4);
    fill_normal(&r, embed, V * H, 1.0, 0);
    fill_normal(&r, lm_head, V * H, 1.5 / sqrt((double)H), 0);
    seq s[NS];
    for (int i = 0; i < NS; i++) {
        s[i].L = 20 + (int32_t)dfl_rng_below(&r, 41);
        s[i].ids = xcalloc((size_t)s[i].L, 4);
        s[i].mask = xcalloc((size_t)s[i].L, 4);
        s[i].anchors = xcalloc((size_t)s[i].L, 4);
        s[i].hidden = xcalloc((size_t)(s[i].L * KH), 4);
        make_mask(&r, s[i].L, s[i].mask);
        for (int32_t t = 0; t < s[i].L; t++)   /* never the mask token */
            s[i].ids[t] = (int32_t)dfl_rng_below(&r, V - 1);
        fill_normal(&r, s[i].hidden, s[i].L * KH, 1.0, 0);
        s[i].na = make_anchors(s[i].mask, s[i].L, s[i].anchors);
        if (s[i].na == 0)
            die("seed %lld: sequence %d has no valid anchor", (long long)seed, i);
    }
    const dfl_st_tensor et = {.name = "target.embed_tokens.weight", .dtype = DFL_F32, .ndim = 2,
                              .shape = {V, H}, .numel = V * H, .data = embed};
    const dfl_st_tensor lt = {.name = "target.lm_head.weight", .dtype = DFL_F32, .ndim = 2,
                              .shape = {V, H}, .numel = V * H, .data = lm_head};
    batch b;
    pack(s, &b);
    const int64_t Q = (int64_t)b.B * BS;
    if (dfl_draft_upload(m, DFL_DRAFT_MASTER, w0, &e) || dfl_draft_set_frozen(m, &et, &lt, &e) ||
        dfl_draft_reserve(m, b.T, b.B, 0, &e))
        die("%s", e.msg);

    /* 3. non-trivial accuracy: about half of the scored non-anchor labels become the prediction
     * of the block that has them nearest its anchor */
    dfl_draft_stats st;
    int32_t *pred = xcalloc((size_t)Q, 4);
    double *gap = xcalloc((size_t)Q, sizeof *gap);
    step(m, &b, -1, false, &st);
    predict(m, lm_head, Q, pred, gap);
    int n_set = 0;
    for (int i = 0; i < NS; i++) {
        int32_t *is_anchor = xcalloc((size_t)s[i].L, 4), *from = xcalloc((size_t)s[i].L, 4);
        for (int32_t k = 0; k < s[i].na; k++) {
            is_anchor[s[i].anchors[k]] = 1;
            for (int32_t j = 1; j < BS && s[i].anchors[k] + j < s[i].L; j++)
                from[s[i].anchors[k] + j] = (b.b0[i] + k) * BS + j + 1;   /* later anchors win */
        }
        for (int32_t p = 0; p < s[i].L; p++) {
            if (!s[i].mask[p] || is_anchor[p] || !from[p] || dfl_rng_below(&r, 2))
                continue;
            int32_t v = pred[from[p] - 1];
            if (v != V - 1) {
                s[i].ids[p] = b.ids[b.t0[i] + p] = v;
                n_set++;
            }
        }
        free(is_anchor), free(from);
    }

    /* 4. the golden step: each sequence alone, then the batch with its gradients, then AdamW */
    dfl_draft_stats per[NS];
    for (int i = 0; i < NS; i++)
        step(m, &b, i, false, &per[i]);
    step(m, &b, -1, true, &st);
    predict(m, lm_head, Q, pred, gap);
    float *ctx = xcalloc((size_t)(b.T * H), 4), *ce = xcalloc((size_t)Q, 4),
          *wt = xcalloc((size_t)Q, 4), *act[NL + 1];
    rc = dfl_draft_activation(m, DFL_DRAFT_ACT_CTX, 0, ctx, b.T * H, &e) ||
         dfl_draft_activation(m, DFL_DRAFT_ACT_CE, 0, ce, Q, &e) ||
         dfl_draft_activation(m, DFL_DRAFT_ACT_WEIGHT, 0, wt, Q, &e);
    for (int l = 0; l <= NL && !rc; l++) {
        act[l] = xcalloc((size_t)(Q * H), 4);
        rc = dfl_draft_activation(m, l == NL ? DFL_DRAFT_ACT_OUT : DFL_DRAFT_ACT_LAYER, l, act[l],
                                  Q * H, &e);
    }
    dfl_draft_optim opt = {BETA1, BETA2, ADAM_EPS, WEIGHT_DECAY, 0.0f};
    if (rc || dfl_draft_download(m, DFL_DRAFT_GRAD, grad, &e) ||
        dfl_draft_apply(m, &opt, LR, 1, &e) || dfl_draft_download(m, DFL_DRAFT_MASTER, w1, &e))
        die("%s", e.msg);
    double sq = 0, margin = INFINITY, hits = 0;
    for (int64_t k = 0; k < flat; k++) {
        grad[k] = (float)(grad[k] / st.loss_den);
        sq += (double)grad[k] * grad[k];
    }

    /* 5. the padded [S, N*bs, ...] layout of dbg.*; the scored slots' argmax gap */
    int32_t N = 0, Lmax = 0;
    for (int i = 0; i < NS; i++) {
        N = s[i].na > N ? s[i].na : N;
        Lmax = s[i].L > Lmax ? s[i].L : Lmax;
    }
    const int64_t slots = (int64_t)NS * N * BS;
    float *pctx = xcalloc((size_t)(NS * Lmax * H), 4), *pce = xcalloc((size_t)slots, 4),
          *pw0 = xcalloc((size_t)slots, 4), *pact[NL + 1];
    int32_t *ppred = xcalloc((size_t)slots, 4), *plab = xcalloc((size_t)slots, 4);
    for (int l = 0; l <= NL; l++)
        pact[l] = xcalloc((size_t)(slots * H), 4);
    for (int i = 0; i < NS; i++) {
        memcpy(pctx + (int64_t)i * Lmax * H, ctx + b.t0[i] * H, (size_t)(s[i].L * H) * 4);
        for (int32_t n = 0; n < s[i].na; n++)
            for (int j = 0; j < BS; j++) {
                int64_t q = (int64_t)(b.b0[i] + n) * BS + j, g = ((int64_t)i * N + n) * BS + j;
                int32_t pos = s[i].anchors[n] + j;
                bool scored = wt[q] > 0;
                pce[g] = ce[q];
                pw0[g] = scored;
                ppred[g] = pred[q];
                plab[g] = s[i].ids[pos < s[i].L ? pos : s[i].L - 1];
                for (int l = 0; l <= NL; l++)
                    memcpy(pact[l] + g * H, act[l] + q * H, H * 4);
                if (scored) {
                    margin = fmin(margin, gap[q]);
                    hits += pred[q] == plab[g];
                }
            }
    }
    fprintf(stderr, "mkgolden: seed %lld: %d sequences (%u, %u, %u tokens), %d blocks, loss %.6f, "
            "accuracy %.0f/%.0f (%d labels set to predictions), smallest top-2 gap %.3g\n",
            (long long)seed, NS, b.lens[0], b.lens[1], b.lens[2], b.B, st.loss_num / st.loss_den,
            st.acc_num, st.acc_den, n_set, margin);
    if (!(margin >= MIN_MARGIN))
        die("seed %lld: a scored slot's top-1/top-2 logit gap is %.3g (< %g): its argmax could "
            "flip on another machine; try another --seed", (long long)seed, margin, MIN_MARGIN);
    if (hits != st.acc_num)
        die("the host argmax finds %.0f correct slots, the CPU step %.0f", hits, st.acc_num);

    /* 6. the file */
    dfl_st_writer *w = dfl_st_writer_new();
    if (!w)
        die("out of memory");
    char nm[160];
    for (int i = 0; i < nt; i++) {
        const int64_t *shp = tl[i].shape;
        add(w, tl[i].name, DFL_F32, tl[i].ndim, shp, w0 + tl[i].offset);
        snprintf(nm, sizeof nm, "grad.%s", tl[i].name);
        add(w, nm, DFL_F32, tl[i].ndim, shp, grad + tl[i].offset);
        snprintf(nm, sizeof nm, "after_adamw.%s", tl[i].name);
        add(w, nm, DFL_F32, tl[i].ndim, shp, w1 + tl[i].offset);
    }
    add(w, et.name, DFL_F32, 2, et.shape, embed);
    add(w, lt.name, DFL_F32, 2, lt.shape, lm_head);
    int32_t lens32[NS];
    for (int i = 0; i < NS; i++) {
        lens32[i] = s[i].L;
        snprintf(nm, sizeof nm, "seq%d.input_ids", i);
        add(w, nm, DFL_I32, 1, (const int64_t[]){s[i].L}, s[i].ids);
        snprintf(nm, sizeof nm, "seq%d.loss_mask", i);
        add(w, nm, DFL_I32, 1, (const int64_t[]){s[i].L}, s[i].mask);
        snprintf(nm, sizeof nm, "seq%d.hidden_states", i);
        add(w, nm, DFL_F32, 2, (const int64_t[]){s[i].L, KH}, s[i].hidden);
        snprintf(nm, sizeof nm, "seq%d.anchors", i);
        add(w, nm, DFL_I32, 1, (const int64_t[]){s[i].na}, s[i].anchors);
        snprintf(nm, sizeof nm, "seq%d.", i);
        add_stats(w, nm, &per[i]);
    }
    add(w, "seq_lens", DFL_I32, 1, (const int64_t[]){NS}, lens32);
    add(w, "target_layer_ids", DFL_I32, 1, (const int64_t[]){NF}, target_layers);
    add_stats(w, "", &st);
    add_scalar(w, "grad_norm", sqrt(sq));
    add_scalar(w, "extra.min_top2_margin_scored", margin);
    float decay[BS], sc[BS], sn[BS], ap[BS];
    for (int j = 0; j < BS; j++) {
        decay[j] = (float)exp(-(j > 0 ? j - 1 : 0) / GAMMA);
        sc[j] = (float)st.slot_correct[j];
        sn[j] = (float)st.slot_count[j];
        ap[j] = sn[j] > 0 ? sc[j] / sn[j] : 0;
    }
    add(w, "slot_decay_weight", DFL_F32, 1, (const int64_t[]){BS}, decay);
    add(w, "extra.slot_correct", DFL_F32, 1, (const int64_t[]){BS}, sc);
    add(w, "extra.slot_count", DFL_F32, 1, (const int64_t[]){BS}, sn);
    add(w, "extra.acc_per_slot", DFL_F32, 1, (const int64_t[]){BS}, ap);
    add(w, "dbg.target_ctx", DFL_F32, 3, (const int64_t[]){NS, Lmax, H}, pctx);
    for (int l = 0; l <= NL; l++) {
        snprintf(nm, sizeof nm, l == NL ? "dbg.draft_out" : "dbg.layer%d.out", l);
        add(w, nm, DFL_F32, 3, (const int64_t[]){NS, N * BS, H}, pact[l]);
    }
    const int64_t sh3[] = {NS, N, BS};
    add(w, "dbg.ce", DFL_F32, 3, sh3, pce);
    add(w, "dbg.weight_mask", DFL_F32, 3, sh3, pw0);
    add(w, "dbg.pred_ids", DFL_I32, 3, sh3, ppred);
    add(w, "dbg.target_ids", DFL_I32, 3, sh3, plab);
    char *cj = config_json((uint64_t)seed, s), adam[256], trick[256], check[512], seedtxt[32];
    snprintf(adam, sizeof adam, "{\"betas\":[%g,%g],\"eps\":%g,\"grad_clipping\":\"none\",\"lr\":%g,"
             "\"steps\":1,\"weight_decay\":%g}", BETA1, BETA2, ADAM_EPS, LR, WEIGHT_DECAY);
    snprintf(trick, sizeof trick, "%d non-anchor scored tokens of seq*.input_ids (as saved) were set "
             "to the drafter's own argmax before the step so that accuracy is not ~0", n_set);
    snprintf(check, sizeof check, "before writing, dflash-golden of the same build passed every check "
             "on the shared golden dflash-tiny/golden.safetensors (SpecForge commit %s)", specforge);
    snprintf(seedtxt, sizeof seedtxt, "%lld", (long long)seed);
    meta(w, "format", "dflash-golden-v1");
    meta(w, "origin", "dfl tests/tools/mkgolden: a regression golden of the project's own CPU step "
         "(lib/models/draft_step.c on the CPU backend, f32), not an independent oracle");
    meta(w, "oracle_check", check);
    meta(w, "config", cj);
    meta(w, "adamw", adam);
    meta(w, "seed", seedtxt);
    meta(w, "accuracy_trick", trick);
    meta(w, "anchor_rule", "as the shared golden: the valid anchors C (a + 1 < L, m[a] = m[a+1] = 1) "
         "ascending; anchors = sorted(C[::3] | {C[-1]} | {a in C : a + 2 < L and m[a+2] = 0})");
    meta(w, "init_rule", "xoshiro256** (dfl_rng) from the seed: weights in flat order, 1-D "
         "1+0.3*N(0,1), 2-D N(0,1)/sqrt(in); embed N(0,1); lm_head N(0,1)*1.5/sqrt(H); per sequence "
         "length 20..60, loss mask, ids in [0, V-2], hidden states N(0,1)");
    snprintf(partial, sizeof partial, "%s.partial", out);
    if (dfl_st_write(w, partial, &e))
        die("%s", e.msg);
    dfl_st_writer_free(w);
    free(cj);

    /* 7. the file passes the check it is made for, then takes its name */
    fprintf(stderr, "mkgolden: %s %s\n", golden_bin, partial);
    rc = run_golden(golden_bin, partial);
    if (rc != 0) {
        unlink(partial);
        die("dflash-golden exit %d on the new file: %s not written", rc, out);
    }
    if (rename(partial, out)) {
        int err = errno;
        unlink(partial);
        die("rename %s to %s: %s", partial, out, strerror(err));
    }
    fprintf(stderr, "mkgolden: wrote %s\n", out);

    for (int i = 0; i < NS; i++)
        free(s[i].ids), free(s[i].mask), free(s[i].anchors), free(s[i].hidden);
    for (int l = 0; l <= NL; l++)
        free(act[l]), free(pact[l]);
    free(b.ids), free(b.mask), free(b.hidden), free(b.bseq), free(b.banchor);
    free(w0), free(grad), free(w1), free(embed), free(lm_head), free(pred), free(gap);
    free(ctx), free(ce), free(wt), free(pctx), free(pce), free(pw0), free(ppred), free(plab);
    dfl_draft_close(m);
    dfl_be_close(be);
    return 0;
}
