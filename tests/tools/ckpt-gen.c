/* ckpt-gen.c: writes test and benchmark inputs for dfl-ckpt through the library writers, from a
 * fixed seed (same bytes every run). Values are finite unless a NaN/Inf is planted.
 *
 *   ckpt-gen st OUT DTYPE NTENSORS NUMEL [NAN...]   safetensors: tensors t0..t<N-1>, each NUMEL
 *                                                   elements of DTYPE (bf16 f16 f32 f64)
 *   ckpt-gen ckpt DIR [NAN...]                      a dfl checkpoint directory (model and optimizer
 *                                                   safetensors, config.json, trainer_state.json)
 *   ckpt-gen stream OUT NBATCHES DTYPE [NAN...]     a hidden-state .dfl stream: layers 1,9,17,
 *                                                   hidden 64, 2 or 3 sequences per batch
 *   ckpt-gen tokens OUT NBATCHES                    a token-batch .dfl stream
 *   ckpt-gen drafter DIR CONFIG [NAN...]            a drafter checkpoint for CONFIG (a DFlash
 *                                                   config.json) as dfl-eval reads it: f32
 *                                                   weights in [-2, 2) and config.json; norm.weight
 *                                                   is all zero, so that every logit is 0 and the
 *                                                   drafter proposes token 0 (the first of equal
 *                                                   maxima) at every slot
 *
 * NAN is TENSOR:INDEX:VALUE (VALUE nan, inf or -inf), where TENSOR is a tensor name, or for a
 * stream "batch<N>.layer<L>". NUMEL accepts K/M/G suffixes (powers of 1024). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "draft.h"
#include "dtype.h"
#include "json.h"
#include "frame.h"
#include "safetensors.h"
#include "util.h"

static uint64_t seed = 0x243f6a8885a308d3ull;

static uint64_t rng(void)
{
    seed += 0x9e3779b97f4a7c15ull;
    uint64_t z = seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void die(const char *what, const dfl_err *e)
{
    fprintf(stderr, "ckpt-gen: %s%s%s\n", what, e ? ": " : "", e ? e->msg : "");
    exit(1);
}

static void set_value(void *p, dfl_dtype dt, uint64_t i, double v)
{
    switch (dt) {
    case DFL_BF16: ((uint16_t *)p)[i] = dfl_f32_to_bf16((float)v); break;
    case DFL_F16: ((uint16_t *)p)[i] = dfl_f32_to_f16((float)v); break;
    case DFL_F32: ((float *)p)[i] = (float)v; break;
    case DFL_F64: ((double *)p)[i] = v; break;
    default: die("unsupported dtype", NULL);
    }
}

/* Fills n finite values in [-2, 2) quickly (bf16/f16 from 16 random bits at a time). */
static void fill(void *p, dfl_dtype dt, uint64_t n)
{
    if (dt == DFL_BF16 || dt == DFL_F16) {
        uint16_t *h = p;
        /* sign, exponent in a finite range (bf16: 2^-8..2^0; f16: 2^-8..2^0), random mantissa */
        for (uint64_t i = 0; i < n; i += 4) {
            uint64_t r = rng();
            for (int k = 0; k < 4 && i + (uint64_t)k < n; k++) {
                uint16_t x = (uint16_t)(r >> (16 * k));
                if (dt == DFL_BF16)
                    h[i + k] = (uint16_t)((x & 0x807fu) | (uint16_t)((119u + (x >> 7 & 7u)) << 7));
                else
                    h[i + k] = (uint16_t)((x & 0x83ffu) | (uint16_t)((7u + (x >> 10 & 7u)) << 10));
            }
        }
        return;
    }
    for (uint64_t i = 0; i < n; i++)
        set_value(p, dt, i, (double)(rng() >> 11) * 0x1p-52 - 2.0);
}

typedef struct plant {
    char name[128];
    uint64_t index;
    double value;
} plant;

static size_t parse_plants(int argc, char **argv, plant *pl, size_t max)
{
    size_t n = 0;
    for (int i = 0; i < argc && n < max; i++) {
        char *a = argv[i], *c1 = strchr(a, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c1 || !c2 || (size_t)(c1 - a) >= sizeof pl[n].name)
            die("NAN must be TENSOR:INDEX:VALUE", NULL);
        memcpy(pl[n].name, a, (size_t)(c1 - a));
        pl[n].name[c1 - a] = 0;
        pl[n].index = strtoull(c1 + 1, NULL, 10);
        pl[n].value = strcmp(c2 + 1, "nan") == 0 ? NAN : strcmp(c2 + 1, "inf") == 0 ? INFINITY
                    : strcmp(c2 + 1, "-inf") == 0 ? -INFINITY : strtod(c2 + 1, NULL);
        n++;
    }
    return n;
}

static void apply_plants(const char *name, void *p, dfl_dtype dt, uint64_t n, const plant *pl, size_t np)
{
    for (size_t k = 0; k < np; k++)
        if (strcmp(pl[k].name, name) == 0) {
            if (pl[k].index >= n)
                die("planted index past the end of the tensor", NULL);
            set_value(p, dt, pl[k].index, pl[k].value);
        }
}

static void write_st(const char *out, dfl_dtype dt, int ntensors, uint64_t numel, const plant *pl, size_t np)
{
    dfl_err e;
    dfl_st_writer *w = dfl_st_writer_new();
    void **bufs = calloc((size_t)ntensors, sizeof *bufs);
    if (!w || !bufs)
        die("out of memory", NULL);
    for (int t = 0; t < ntensors; t++) {
        char name[32];
        snprintf(name, sizeof name, "t%d", t);
        bufs[t] = malloc(numel * dfl_dtype_size(dt) + 1);
        if (!bufs[t])
            die("out of memory", NULL);
        fill(bufs[t], dt, numel);
        apply_plants(name, bufs[t], dt, numel, pl, np);
        int64_t shape[1] = {(int64_t)numel};
        if (dfl_st_writer_add(w, name, dt, 1, shape, bufs[t], &e))
            die(name, &e);
    }
    if (dfl_st_writer_meta(w, "format", "pt", &e) || dfl_st_write(w, out, &e))
        die(out, &e);
    dfl_st_writer_free(w);
    for (int t = 0; t < ntensors; t++)
        free(bufs[t]);
    free(bufs);
}

/* A small drafter-like checkpoint directory. */
static void write_ckpt(const char *dir, const plant *pl, size_t np)
{
    dfl_err e;
    if (dfl_mkdir_p(dir, 0755, &e))
        die(dir, &e);
    static const struct { const char *name; int ndim; int64_t shape[2]; } model[] = {
        {"fc.weight", 2, {64, 192}}, {"hidden_norm.weight", 1, {64}},
        {"layers.0.self_attn.q_proj.weight", 2, {64, 64}}, {"layers.0.mlp.down_proj.weight", 2, {64, 128}},
        {"norm.weight", 1, {64}},
    };
    for (int file = 0; file < 2; file++) {
        dfl_st_writer *w = dfl_st_writer_new();
        void *bufs[3 * DFL_ARRAY_LEN(model)];
        size_t nb = 0;
        for (size_t i = 0; i < DFL_ARRAY_LEN(model); i++) {
            static const char *const opt_fields[] = {"master", "exp_avg", "exp_avg_sq"};
            for (int f = 0; f < (file ? 3 : 1); f++) {
                char name[160];
                dfl_dtype dt = file ? DFL_F32 : DFL_BF16;
                if (file)
                    snprintf(name, sizeof name, "%s.%s", model[i].name, opt_fields[f]);
                else
                    snprintf(name, sizeof name, "%s", model[i].name);
                uint64_t n = (uint64_t)model[i].shape[0] * (model[i].ndim > 1 ? (uint64_t)model[i].shape[1] : 1);
                void *p = malloc(n * dfl_dtype_size(dt));
                fill(p, dt, n);
                apply_plants(name, p, dt, n, pl, np);
                if (dfl_st_writer_add(w, name, dt, model[i].ndim, model[i].shape, p, &e))
                    die(name, &e);
                bufs[nb++] = p;
            }
        }
        char *path = dfl_path_join(dir, file ? "optimizer.safetensors" : "model.safetensors");
        if (dfl_st_write(w, path, &e))
            die(path, &e);
        free(path);
        dfl_st_writer_free(w);
        for (size_t i = 0; i < nb; i++)
            free(bufs[i]);
    }
    char *cfg = dfl_path_join(dir, "config.json"), *ts = dfl_path_join(dir, "trainer_state.json");
    const char *cj = "{\"architectures\": [\"DFlashDraftModel\"], \"block_size\": 16, \"hidden_size\": 64,\n"
                     " \"dflash_config\": {\"mask_token_id\": 5, \"target_layer_ids\": [1, 9, 17]}}\n";
    const char *tj = "{\"step\": 1000, \"tokens_seen\": 123456, \"lr\": 0.0003}\n";
    if (dfl_write_file_atomic(cfg, cj, strlen(cj), &e) || dfl_write_file_atomic(ts, tj, strlen(tj), &e))
        die(dir, &e);
    free(cfg);
    free(ts);
}

static void write_stream(const char *out, int nbatches, bool hidden, dfl_dtype dt, const plant *pl, size_t np)
{
    dfl_stream_info in;
    memset(&in, 0, sizeof in);
    in.kind = hidden ? DFL_KIND_HIDDEN : DFL_KIND_TOKENS;
    in.version_major = DFL_FRAME_MAJOR;
    in.version_minor = DFL_FRAME_MINOR;
    snprintf(in.producer, sizeof in.producer, "ckpt-gen");
    in.vocab_size = 1000;
    if (hidden) {
        in.hidden_size = 64;
        in.n_layers = 3;
        in.layers[0] = 1;
        in.layers[1] = 9;
        in.layers[2] = 17;
        in.dtype = dt;
        snprintf(in.fingerprint, sizeof in.fingerprint, "0123456789abcdef0123456789abcdef");
    }
    dfl_err e;
    dfl_writer *w;
    if (dfl_writer_open(&w, out, &in, NULL, &e))
        die(out, &e);
    for (int bi = 0; bi < nbatches; bi++) {
        uint32_t S = 2 + (uint32_t)(bi % 2), lens[3] = {5, 11, 3};
        uint64_t T = 0;
        for (uint32_t s = 0; s < S; s++)
            T += lens[s];
        dfl_batch b = {0};
        if (dfl_batch_alloc(&b, T, S, hidden ? 3 : 0, hidden ? 64 : 0, hidden ? dt : DFL_DT_INVALID, &e))
            die("batch", &e);
        uint32_t *sl = (uint32_t *)b.seq_lens;
        int32_t *ids = (int32_t *)b.input_ids;
        uint8_t *mask = (uint8_t *)b.loss_mask;
        for (uint32_t s = 0; s < S; s++)
            sl[s] = lens[s];
        for (uint64_t t = 0; t < T; t++) {
            ids[t] = (int32_t)(rng() % 1000);
            mask[t] = t % 4 != 0;
        }
        for (uint32_t k = 0; k < b.n_layers; k++) {
            void *p = (void *)b.layers[k];
            fill(p, dt, T * 64);
            char name[64];
            snprintf(name, sizeof name, "batch%d.layer%d", bi, in.layers[k]);
            apply_plants(name, p, dt, T * 64, pl, np);
        }
        if (dfl_writer_batch(w, &b, &e))
            die("batch", &e);
        dfl_batch_free(&b);
    }
    if (dfl_writer_close(w, &e))
        die(out, &e);
}

/* A drafter checkpoint whose proposals are known: token 0 everywhere (see the top). */
static void write_drafter(const char *dir, const char *config, const plant *pl, size_t np)
{
    dfl_err e;
    json_t *j;
    dfl_draft_config c = {.block_size = 16, .gamma = 7, .rms_eps = 1e-6, .rope_theta = 1e6,
                          .mask_token_id = -1};
    if (dfl_json_load_file(config, &j, &e) || dfl_draft_config_from_json(&c, j, config, &e))
        die(config, &e);
    json_decref(j);
    dfl_draft_tensor *t;
    int64_t flat;
    int n = dfl_draft_tensors(&c, &t, &flat);
    if (n < 0 || dfl_mkdir_p(dir, 0755, &e))
        die(dir, n < 0 ? NULL : &e);
    float *buf = malloc((size_t)flat * sizeof *buf);
    dfl_st_writer *w = dfl_st_writer_new();
    if (!buf || !w)
        die("out of memory", NULL);
    for (int i = 0; i < n; i++) {
        float *p = buf + t[i].offset;
        fill(p, DFL_F32, (uint64_t)t[i].numel);
        if (strcmp(t[i].name, "norm.weight") == 0)
            memset(p, 0, (size_t)t[i].numel * sizeof *p);
        apply_plants(t[i].name, p, DFL_F32, (uint64_t)t[i].numel, pl, np);
        if (dfl_st_writer_add(w, t[i].name, DFL_F32, t[i].ndim, t[i].shape, p, &e))
            die(t[i].name, &e);
    }
    char *path = dfl_path_join(dir, "model.safetensors"), *cfg = dfl_path_join(dir, "config.json");
    char *text = NULL;
    size_t len = 0;
    if (dfl_st_write(w, path, &e) || dfl_read_file(config, 1 << 20, &text, &len, &e) ||
        dfl_write_file_atomic(cfg, text, len, &e))
        die(dir, &e);
    dfl_st_writer_free(w);
    free(text);
    free(path);
    free(cfg);
    free(buf);
    free(t);
}

int main(int argc, char **argv)
{
    plant pl[64];
    if (argc >= 6 && strcmp(argv[1], "st") == 0) {
        dfl_dtype dt = dfl_dtype_from_name(argv[3]);
        uint64_t numel;
        dfl_err e;
        if (dt == DFL_DT_INVALID || dfl_parse_size(argv[5], &numel, "NUMEL", &e))
            die("usage: ckpt-gen st OUT DTYPE NTENSORS NUMEL [NAN...]", NULL);
        size_t np = parse_plants(argc - 6, argv + 6, pl, 64);
        write_st(argv[2], dt, atoi(argv[4]), numel, pl, np);
    } else if (argc >= 3 && strcmp(argv[1], "ckpt") == 0) {
        size_t np = parse_plants(argc - 3, argv + 3, pl, 64);
        write_ckpt(argv[2], pl, np);
    } else if (argc >= 5 && strcmp(argv[1], "stream") == 0) {
        dfl_dtype dt = dfl_dtype_from_name(argv[4]);
        if (!dfl_dtype_is_float(dt))
            die("stream: DTYPE must be a float type", NULL);
        size_t np = parse_plants(argc - 5, argv + 5, pl, 64);
        write_stream(argv[2], atoi(argv[3]), true, dt, pl, np);
    } else if (argc >= 4 && strcmp(argv[1], "drafter") == 0) {
        size_t np = parse_plants(argc - 4, argv + 4, pl, 64);
        write_drafter(argv[2], argv[3], pl, np);
    } else if (argc == 4 && strcmp(argv[1], "tokens") == 0) {
        write_stream(argv[2], atoi(argv[3]), false, DFL_DT_INVALID, NULL, 0);
    } else {
        fprintf(stderr, "usage: ckpt-gen st OUT DTYPE NTENSORS NUMEL [NAN...]\n"
                        "       ckpt-gen ckpt DIR [NAN...]\n"
                        "       ckpt-gen stream OUT NBATCHES DTYPE [NAN...]\n"
                        "       ckpt-gen tokens OUT NBATCHES\n"
                        "       ckpt-gen drafter DIR CONFIG [NAN...]\n");
        return 1;
    }
    return 0;
}
