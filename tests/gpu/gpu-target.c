/* gpu-target.c: the target forward (lib/models/target.c) on the CUDA backend against the transformers
 * oracles (../shared/oracle/qwen3-tiny-a and the hybrid qwen35-tiny-a;
 * tests/fixtures/target/{llama,qwen2}-tiny when present), each sequence alone and all packed in one batch, with the residual adds in the GEMM
 * epilogues (the CUDA default) and as separate passes, and dfl-target --device cuda end to end.
 * Tolerances per row: bf16 activations: relative error ||gpu - ref|| / ||ref|| <= 3e-2 and
 * cosine >= 0.999. Issue #6 asks for 2e-2; on qwen3-tiny-a (norms perturbed away from 1) the H200
 * measured a worst row of 2.68e-2 (73 of 4536 rows above 2e-2, mean 1.24e-2; again 2026-12-01),
 * while transformers' own bf16 forward of the same model gives a worst row of 0.55 and a mean of
 * 7.5e-2 (bench/peers/hf_bf16_vs_oracle.py). bench/peers/bf16_rounding.py, a float32 forward that
 * rounds to bf16 only where ours stores bf16, gives a worst row of 2.40e-2: the bound is one of
 * bf16 storage, not of our kernels; even keeping the residual stream and the q|k|v and gate|up
 * products' outputs in float32 leaves 1.94e-2 (the other rounding points are tensor-core inputs
 * and the stream's format), so 2e-2 on every row is beyond a bf16 forward on this model. The
 * llama and qwen2 fixtures stay below 1.2e-2. f32 activations: relative error <= 1e-4, as on
 * the CPU. Prints a "#" line with the worst figures of each comparison. Skips without a
 * GPU (exit 77). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "backend.h"
#include "frame.h"
#include "safetensors.h"
#include "target.h"
#include "../unit/t.h"
#include "../unit/oracle-ref.h"
#include "gpu-sh.h"

static char self_dir[4096];

#ifdef DFL_CUDA
/* Worst per-row relative error and cosine (NaN sticks to the error). */
typedef struct cmp {
    double rel, cos;
    int64_t rows, over;   /* rows compared; rows whose relative error is above 2e-2 */
    double sum_rel;       /* for the mean */
} cmp;

static void compare(cmp *c, const float *a, const float *b, int64_t rows, int64_t H)
{
    for (int64_t r = 0; r < rows; r++) {
        rowcmp rc = {0};
        for (int64_t i = 0; i < H; i++)
            rowcmp_add(&rc, a[r * H + i], b[r * H + i]);
        double rel = rowcmp_rel(&rc), cs = rowcmp_cos(&rc);
        if (!(rel <= c->rel))
            c->rel = rel;
        c->rows++;
        c->over += !(rel <= 2e-2);
        c->sum_rel += rel;
        if (!(cs >= c->cos))
            c->cos = cs;
    }
}

static bool within(const cmp *c, dfl_dtype act)
{
    if (act == DFL_F32)
        return c->rel <= 1e-4;
    return c->rel <= 3e-2 && c->cos >= 0.999;
}

/* The library forward on CUDA with activations act against a reference directory; fuse: the
 * residual adds in the o_proj / down_proj epilogues. */
static void forward_vs_ref(const char *dir, dfl_dtype act, bool fuse)
{
    dfl_err e = {0};
    ref r;
    if (!ref_load(&r, dir))
        return;
    dfl_be *be = NULL;
    dfl_target *t = NULL;
    dfl_target_ws *ws = NULL;
    void *caps[64] = {0};
    float *host = NULL;
    int32_t *ids = NULL;
    uint8_t *mask = NULL;
    if (dfl_be_cuda_open(&be, 0, act, &e)) {
        T_CHECK(0, "cuda: %s", e.msg);
        goto out;
    }
    if (dfl_target_open(&t, be, dir, 0, &e)) {
        T_CHECK(0, "%s: %s", dir, e.msg);
        goto out;
    }
    t->fuse_residual = fuse;
    int64_t H = t->cfg.hidden_size, total = 0;
    int K = r.n_layers;
    for (int s = 0; s < r.n_seqs; s++)
        total += r.len[s];
    if (dfl_target_ws_new(t, total, r.n_seqs, &ws, &e)) {
        T_CHECK(0, "%s", e.msg);
        goto out;
    }
    int32_t layers[64];
    for (int k = 0; k < K; k++) {
        layers[k] = k;
        if (!(caps[k] = be->ops->alloc(be, (size_t)(total * H) * 4, &e))) {
            T_CHECK(0, "%s", e.msg);
            goto out;
        }
    }
    host = malloc((size_t)(total * H) * 4);
    ids = malloc((size_t)total * 4);
    mask = calloc((size_t)total, 1);
    uint32_t lens[16];
    cmp alone = {.rel = 0, .cos = 1}, packed = {.rel = 0, .cos = 1};
    for (int s = 0; s < r.n_seqs; s++) {
        lens[0] = (uint32_t)r.len[s];
        dfl_batch b = {.index = (uint64_t)s, .n_tokens = (uint64_t)r.len[s], .n_seqs = 1,
                       .seq_lens = lens, .input_ids = r.ids[s], .loss_mask = mask};
        if (dfl_target_forward(t, ws, &b, K, layers, DFL_F32, caps, &e) || be->ops->sync(be, &e)) {
            T_CHECK(0, "seq %d: %s", s, e.msg);
            goto out;
        }
        for (int k = 0; k < K; k++) {
            be->ops->download(be, host, caps[k], (size_t)(r.len[s] * H) * 4);
            compare(&alone, host, ref_layer(&r, s, k), r.len[s], H);
        }
    }
    int64_t off[16], row = 0;
    for (int j = 0; j < r.n_seqs; j++) {
        int s = r.n_seqs - 1 - j;
        lens[j] = (uint32_t)r.len[s];
        off[s] = row;
        memcpy(ids + row, r.ids[s], (size_t)r.len[s] * 4);
        row += r.len[s];
    }
    dfl_batch b = {.n_tokens = (uint64_t)total, .n_seqs = (uint32_t)r.n_seqs, .seq_lens = lens,
                   .input_ids = ids, .loss_mask = mask};
    if (dfl_target_forward(t, ws, &b, K, layers, DFL_F32, caps, &e) || be->ops->sync(be, &e)) {
        T_CHECK(0, "packed: %s", e.msg);
        goto out;
    }
    for (int k = 0; k < K; k++) {
        be->ops->download(be, host, caps[k], (size_t)(total * H) * 4);
        for (int s = 0; s < r.n_seqs; s++)
            compare(&packed, host + off[s] * H, ref_layer(&r, s, k), r.len[s], H);
    }
    const char *how = fuse ? "adds in the GEMMs" : "separate adds";
    printf("# %s act %s, %s: alone rel %.3g cos %.6f; packed rel %.3g cos %.6f (mean rel %.3g; "
           "%lld of %lld rows above 2e-2)\n", dir, dfl_dtype_lower(act), how, alone.rel, alone.cos,
           packed.rel, packed.cos, packed.sum_rel / (double)(packed.rows ? packed.rows : 1),
           (long long)packed.over, (long long)packed.rows);
    T_CHECK(within(&alone, act), "%s %s %s alone: rel %.3g cos %.6f", dir, dfl_dtype_lower(act),
            how, alone.rel, alone.cos);
    T_CHECK(within(&packed, act), "%s %s %s packed: rel %.3g cos %.6f", dir, dfl_dtype_lower(act),
            how, packed.rel, packed.cos);
out:
    for (int k = 0; k < 64; k++)
        if (caps[k])
            be->ops->free(be, caps[k]);
    free(host);
    free(ids);
    free(mask);
    dfl_target_ws_free(t, ws);
    dfl_target_close(t);
    dfl_be_close(be);
    dfl_st_close(r.f);
}

static const char *oracle_dir(void)
{
    static char d[4096];
    const char *o = t_oracle();
    if (!o)
        return NULL;
    snprintf(d, sizeof d, "%s/qwen3-tiny-a", o);
    char cfg[4200];
    snprintf(cfg, sizeof cfg, "%s/config.json", d);
    return access(cfg, R_OK) == 0 ? d : NULL;   /* absent from a partial copy of the oracles */
}

static const char *fixture(const char *name)
{
    static char dir[4096];
    snprintf(dir, sizeof dir, "%s/../../tests/fixtures/target/%s", self_dir, name);
    char p[4200];
    snprintf(p, sizeof p, "%s/ref.safetensors", dir);
    return exists(p) ? dir : NULL;
}

static void test_qwen3_oracle(void)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no CUDA GPU");
    const char *d = oracle_dir();
    if (!d)
        T_SKIP("no oracle");
    forward_vs_ref(d, DFL_BF16, true);
    forward_vs_ref(d, DFL_BF16, false);
    forward_vs_ref(d, DFL_F32, true);
    forward_vs_ref(d, DFL_F32, false);
}

/* One oracle directory through CUDA (skips when it is absent: the device's copy of the oracles
 * may hold only some of them). */
static void oracle_case(const char *name, const dfl_dtype *dts, const bool *fuse, int n)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no CUDA GPU");
    char d[4096];
    T_NEED_ORACLE(d, "config.json", "%s", name);
    for (int i = 0; i < n; i++)
        forward_vs_ref(d, dts[i], fuse[i]);
}

/* qwen35-tiny-a: the hybrid target (Gated DeltaNet and gated attention layers) */
static void test_qwen35_oracle(void)
{
    const dfl_dtype dts[] = {DFL_BF16, DFL_BF16, DFL_F32};
    const bool fuse[] = {true, false, true};
    oracle_case("qwen35-tiny-a", dts, fuse, 3);
}

/* Llama 3.1 rope scaling (llama3 frequencies in the CUDA RoPE table). Qwen3-MoE: gpu-families.c. */
static void test_llama31_oracle(void)
{
    const dfl_dtype dts[] = {DFL_BF16, DFL_F32, DFL_F32};
    const bool fuse[] = {true, true, false};
    oracle_case("llama31-tiny-a", dts, fuse, 3);
}

static void test_fixtures(void)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no CUDA GPU");
    const char *names[] = {"llama-tiny", "qwen2-tiny"};
    int ran = 0;
    for (int i = 0; i < 2; i++) {
        const char *d = fixture(names[i]);
        if (!d)
            continue;
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", d);
        forward_vs_ref(dir, DFL_BF16, true);
        forward_vs_ref(dir, DFL_F32, true);
        ran++;
    }
    if (!ran)
        T_SKIP("no llama/qwen2 fixtures");
}

/* Two hidden-state files batch by batch: the worst row over all; *n the batches compared. */
static cmp compare_files(const char *a, const char *b, int *n)
{
    dfl_err e = {0};
    dfl_reader *ra = NULL, *rb = NULL;
    cmp c = {.rel = 0, .cos = 1};
    *n = 0;
    T_CHECK(dfl_reader_open(&ra, a, NULL, &e) == 0 && dfl_reader_open(&rb, b, NULL, &e) == 0,
            "%s", e.msg);
    if (!ra || !rb)
        goto out;
    T_CHECK(strcmp(dfl_reader_info(ra)->fingerprint, dfl_reader_info(rb)->fingerprint) == 0,
            "same fingerprint on both devices");
    for (;;) {
        dfl_batch ba, bb;
        memset(&ba, 0, sizeof ba);
        memset(&bb, 0, sizeof bb);
        bool ea = false, eb = false;
        if (dfl_reader_next(ra, &ba, &ea, &e) || dfl_reader_next(rb, &bb, &eb, &e)) {
            T_CHECK(0, "%s", e.msg);
            break;
        }
        T_CHECK(ea == eb, "same number of batches");
        if (ea || eb)
            break;
        (*n)++;
        for (uint32_t k = 0; k < ba.n_layers; k++)
            compare(&c, ba.layers[k], bb.layers[k], (int64_t)ba.n_tokens, ba.hidden);
        dfl_batch_free(&ba);
        dfl_batch_free(&bb);
    }
out:
    dfl_reader_close(ra);
    dfl_reader_close(rb);
    return c;
}

/* dfl-target --device cuda end to end: its f32 output against the CPU run's, batch by batch,
 * computing in bf16 (the default: bf16 tolerances) and with --compute f32 (f32 tolerances: an
 * exact check of a model on the GPU); and a batch larger than the buffers is an error on the GPU
 * (not a silent growth). */
static void test_program(void)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no CUDA GPU");
    const char *d = oracle_dir();
    if (!d)
        T_SKIP("no oracle");
    char bin[4200], tools[4200], cmd[16384], tok[4200], gpu[4200], cpu[4200], g32[4200];
    t_build_dir(bin, sizeof bin, "DFL_BIN", self_dir, "bin");
    t_build_dir(tools, sizeof tools, "DFL_TOOLS", self_dir, "tools");
    snprintf(tok, sizeof tok, "%s/tok.dfl", t_tmpdir());
    snprintf(gpu, sizeof gpu, "%s/gpu.dfl", t_tmpdir());
    snprintf(cpu, sizeof cpu, "%s/cpu.dfl", t_tmpdir());
    snprintf(g32, sizeof g32, "%s/gpu-f32.dfl", t_tmpdir());
    snprintf(cmd, sizeof cmd, "'%s/mktokens' --from-ref '%s/ref.safetensors' -o '%s' && "
             "'%s/dfl-target' -q -m '%s' --device cuda --dtype f32 --max-tokens 1024 "
             "--layers 0,1,2,3,4,5 -o '%s' '%s' && "
             "'%s/dfl-target' -q -m '%s' --device cuda --compute f32 --dtype f32 --max-tokens 1024 "
             "--layers 0,1,2,3,4,5 -o '%s' '%s' && "
             "'%s/dfl-target' -q -m '%s' --device cpu --dtype f32 --layers 0,1,2,3,4,5 -o '%s' '%s'",
             tools, d, tok, bin, d, gpu, tok, bin, d, g32, tok, bin, d, cpu, tok);
    int st = system(cmd);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: status %d", cmd, st);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        return;
    int n = 0, n32 = 0;
    cmp c = compare_files(gpu, cpu, &n), c32 = compare_files(g32, cpu, &n32);
    printf("# dfl-target --device cuda (bf16 compute) vs --device cpu: %d batches, rel %.3g cos %.6f\n",
           n, c.rel, c.cos);
    printf("# dfl-target --device cuda --compute f32 vs --device cpu: %d batches, rel %.3g cos %.6f\n",
           n32, c32.rel, c32.cos);
    T_CHECK(n == 5 && n32 == 5, "5 batches");
    T_CHECK(within(&c, DFL_BF16), "cuda vs cpu: rel %.3g cos %.6f", c.rel, c.cos);
    T_CHECK(within(&c32, DFL_F32), "cuda --compute f32 vs cpu: rel %.3g cos %.6f", c32.rel, c32.cos);
    /* through a pipe (no index to size from) and without --max-tokens the buffers fit the first
     * batch (1 token); the next is larger */
    remove(gpu);
    snprintf(cmd, sizeof cmd, "cat '%s' | '%s/dfl-target' -q -m '%s' --device cuda -o '%s' - "
             "2>'%s/err'", tok, bin, d, gpu, t_tmpdir());
    st = system(cmd);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1, "larger batch on the GPU: status %d", st);
    T_CHECK(!exists(gpu), "no output file left behind");
}
#else
static void test_gpu_target(void) { T_SKIP("no CUDA GPU (built without CUDA)"); }
#endif

int main(int argc, char **argv)
{
    t_init(argv[0]);
    char *slash = strrchr(argv[0], '/');
    snprintf(self_dir, sizeof self_dir, "%.*s", slash ? (int)(slash - argv[0]) : 1,
             slash ? argv[0] : ".");
#ifdef DFL_CUDA
    T_RUN(test_qwen3_oracle);
    T_RUN(test_qwen35_oracle);
    T_RUN(test_llama31_oracle);
    T_RUN(test_fixtures);
    T_RUN(test_program);
#else
    T_RUN(test_gpu_target);
#endif
    return t_done();
}
