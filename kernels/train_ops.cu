/* train_ops.cu: the CUDA backend's drafter training ops other than attention: RMSNorm backward,
 * per-head q/k RMSNorm + RoPE backward, SwiGLU backward, the fused LM head + cross-entropy
 * (lmce), the gradient sum of squares, the clipping scalars, AdamW and the uniform feature noise.
 * The CPU reference is lib/backends/be_cpu_train.c; T is the activation type (bf16 or f32), arithmetic is
 * f32 (double where the CPU op sums many terms in double), one rounding per output.
 *
 * Determinism: no float atomics anywhere. Every reduction over rows (the weight gradients of the
 * norms, sumsq, the loss sums) runs in two passes: blocks write partial sums (double) for fixed
 * row ranges, then a second kernel adds them in block order. The block count depends only on the
 * problem's shape, never on the device, so the same inputs give the same bytes on every run (and
 * on every GPU model). The partials live in the backend's cuBLAS workspace (cuda_impl.ws, 32 MiB):
 * every op runs on the backend's one compute stream, so no GEMM can be using it between the two
 * kernels of a reduction. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "be_cuda.cuh"
#include "dflash_ptx.cuh"
#include "train_kernels.cuh"

#define TR_THREADS 256

static inline int tr_max_blocks(dfl_be *be) { return cuda_of(be)->sm_count * 32; }

/* The backend's scratch for partial sums (see the file comment); NULL if too small. */
static void *tr_scratch(dfl_be *be, size_t bytes)
{
    cuda_impl *im = cuda_of(be);
    return bytes <= im->ws_bytes ? im->ws : NULL;
}

#define TR_SCRATCH_DOUBLES(be) (cuda_of(be)->ws_bytes / sizeof(double))

/* The norms' backward kernels: the faster ones (rmsnorm_bwd_pf_kernel where its four blocks a
 * multiprocessor fit, qknorm_rope_bwd_row_kernel for heads of 128, tr_colsum_kernel<
 * TR_COLSUM_AHEAD>) by default; DFL_CUDA_NORM_BWD=0 in the environment selects the first ones
 * (rmsnorm_bwd_kernel, qknorm_rope_bwd_kernel, tr_colsum_kernel<1>), to compare them. Read at
 * every call (a getenv is little beside a pass over the activations), so that a test or a
 * benchmark can run both. On the H200 (bench-train-ops --norms, the 8B drafter's shapes) the
 * faster ones took rmsnorm_bwd [32768, 4096] in 0.358 ms against 0.446 (71% of the copy
 * bandwidth against 57%), qknorm_rope_bwd q [32768, 32 x 128] in 0.270 against 0.526 (70%
 * against 36%) and k [45056, 8 x 128] in 0.172 against 0.224 ms. */
static bool norm_bwd_fast(void)
{
    const char *v = getenv("DFL_CUDA_NORM_BWD");
    return !(v && v[0] == '0' && !v[1]);
}

static int tr_colsum(dfl_be *be, float *dw, const double *part, int nb, int64_t n, const char *op)
{
    cudaStream_t s = cuda_of(be)->stream;
    if (!norm_bwd_fast()) {
        unsigned g = (unsigned)((n + TR_THREADS - 1) / TR_THREADS);
        tr_colsum_kernel<1><<<g, TR_THREADS, 0, s>>>(dw, part, nb, n);
    } else {
        /* 64 threads a block: more multiprocessors for the few columns of the norms */
        unsigned g = (unsigned)((n + 63) / 64);
        tr_colsum_kernel<TR_COLSUM_AHEAD><<<g, 64, 0, s>>>(dw, part, nb, n);
    }
    return cuda_launch_check(be, op);
}

/* ------------------------------------------------------------------------------------------ */
/* rmsnorm_bwd: block b takes rows [b*rpb, (b+1)*rpb); thread t holds the column packs
 * t, t + blockDim, ... (at most P) of every row it visits, so the row never leaves registers:
 * dot = sum(w dy x) over the row (block sum), dx = rstd (w dy - x rstd dot rstd / n), and the
 * thread's share of dw (sum over the block's rows of dy x rstd, f32 over at most rpb <= 64 rows)
 * goes to part[b] (double), which tr_colsum adds up in block order. */

template <typename T, int VEC>
static int launch_rmsnorm_bwd(dfl_be *be, void *dx, float *dw, const void *dy, const void *x,
                              const void *w, const float *rstd, int64_t R, int64_t n, bool acc)
{
    const int64_t nv = n / VEC;
    int64_t th = (nv + 1) / 2;                 /* about two packs per thread */
    th = (th + 31) / 32 * 32;
    if (th < 64)
        th = 64;
    if (th > RB_MAX_THREADS)
        th = RB_MAX_THREADS;
    int64_t p = (nv + th - 1) / th;
    /* blocks: a function of the shape only (deterministic partial sums), at most 64 rows each */
    int64_t nb = (R + 3) / 4;
    if (nb > 512)
        nb = 512;
    if (nb < (R + 63) / 64)
        nb = (R + 63) / 64;
    if (dw && nb * n > (int64_t)TR_SCRATCH_DOUBLES(be))
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_bwd: %lld rows of %lld values: too many for "
                            "the weight-gradient scratch", (long long)R, (long long)n);
    if (nb < 1)
        nb = 1;
    int64_t rpb = (R + nb - 1) / nb;
    nb = (R + rpb - 1) / rpb;
    double *part = dw ? (double *)tr_scratch(be, (size_t)(nb * n) * sizeof(double)) : NULL;
    cudaStream_t s = cuda_of(be)->stream;
#define RB_CASE(PP)                                                                            \
    rmsnorm_bwd_kernel<T, VEC, PP><<<(unsigned)nb, (unsigned)th, 0, s>>>(                     \
        (T *)dx, part, (const T *)dy, (const T *)x, (const T *)w, rstd, R, n, rpb, acc)
    /* register budget: P * VEC values of dy, x, w and dw per thread */
    constexpr int PMAX = VEC == 1 ? 16 : VEC == 4 ? 8 : 4;
    if (p > PMAX)
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_bwd: rows of %lld values are too long (at most "
                            "%d)", (long long)n, PMAX * RB_MAX_THREADS * VEC);
    /* the faster kernel where four blocks fit a multiprocessor (at most 64 registers a thread),
     * for packed rows (VEC > 1) */
    const bool pf = VEC > 1 && th <= 256 && norm_bwd_fast();
#define RB_PF_CASE(PP)                                                                         \
    rmsnorm_bwd_pf_kernel<T, VEC, PP><<<(unsigned)nb, (unsigned)th,                           \
                                        rb_pf_smem_bytes(PP, VEC, (int)th), s>>>(              \
        (T *)dx, part, (const T *)dy, (const T *)x, (const T *)w, rstd, R, n, rpb, acc)
    if (pf && p <= 1) {
        RB_PF_CASE(1);
    } else if (pf && p <= 2) {
        RB_PF_CASE(2);
    } else if (p <= 1)
        RB_CASE(1);
    else if (p <= 2)
        RB_CASE(2);
    else if (p <= 4)
        RB_CASE(4);
    else if constexpr (PMAX >= 8) {
        if (p <= 8)
            RB_CASE(8);
        else if constexpr (PMAX >= 16)
            RB_CASE(16);
    }
#undef RB_CASE
#undef RB_PF_CASE
    int rc = cuda_launch_check(be, "rmsnorm_bwd");
    if (rc || !dw)
        return rc;
    return tr_colsum(be, dw, part, (int)nb, n, "rmsnorm_bwd (dw)");
}

int cuda_rmsnorm_bwd(dfl_be *be, void *dx, float *dw, const void *dy, const void *x, const void *w,
                     const float *rstd, int64_t R, int64_t n, bool accumulate_dx)
{
    if (R <= 0 || n <= 0)
        return 0;
    if (!rstd)
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_bwd: needs the forward's rstd");
    if (R > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_bwd: %lld rows is too many", (long long)R);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    bool a16 = is_aligned(dx, 16) && is_aligned(dy, 16) && is_aligned(x, 16) && is_aligned(w, 16);
    if (be->act == DFL_BF16)
        return n % 8 == 0 && a16 ? launch_rmsnorm_bwd<bf16, 8>(be, dx, dw, dy, x, w, rstd, R, n, accumulate_dx)
                                 : launch_rmsnorm_bwd<bf16, 1>(be, dx, dw, dy, x, w, rstd, R, n, accumulate_dx);
    return n % 4 == 0 && a16 ? launch_rmsnorm_bwd<float, 4>(be, dx, dw, dy, x, w, rstd, R, n, accumulate_dx)
                             : launch_rmsnorm_bwd<float, 1>(be, dx, dw, dy, x, w, rstd, R, n, accumulate_dx);
}

/* ------------------------------------------------------------------------------------------ */
/* qknorm_rope_bwd: one warp per (row, head), lanes laid out as in the forward (lane l holds
 * elements i = (l + 32 j) P + p of the first half and i + d/2 of the second). The gradient
 * through RoPE is the inverse rotation; through the norm, as rmsnorm_bwd. Block b takes the
 * (row, head) items [b*ipb, (b+1)*ipb); its warps' dw shares are added in warp order into
 * part[b]. */

template <typename T, int P>
static void launch_qkb(cudaStream_t s, unsigned blocks, int maxj, T *x, int64_t ld, double *part,
                       const T *xin, const T *w, const float *rstd, const int32_t *pos,
                       const float *inv, int64_t R, int heads, int d, float eps, int64_t ipb)
{
#define QKB_CASE(J)                                                                           \
    case J:                                                                                  \
        qknorm_rope_bwd_kernel<T, P, J><<<blocks, QKB_WARPS * 32, 0, s>>>(                    \
            x, ld, part, xin, w, rstd, pos, inv, R, heads, d, eps, ipb);                      \
        break;
    switch (maxj) {
        QKB_CASE(1)
        QKB_CASE(2)
        default:
        QKB_CASE(4)
    }
#undef QKB_CASE
}

int cuda_qknorm_rope_bwd(dfl_be *be, void *dx, int64_t ld, float *dw, const void *x_in, const void *w,
                         const float *rstd, const int32_t *pos, int64_t R, int heads, int d,
                         float eps, float theta)
{
    if (R <= 0 || heads <= 0)
        return 0;
    if (d <= 0 || d % 2 || d > 512)
        return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope_bwd: head dimension %d (even, at most 512)", d);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    const float *inv = NULL;
    if ((rc = cuda_rope_table(be, theta, d, &inv)))
        return rc;
    const int half = d / 2;
    const size_t es = dfl_dtype_size(be->act);
    cudaStream_t s = cuda_of(be)->stream;
    /* the faster kernel: heads of 128, 16-byte aligned rows */
    const int64_t nbr = (R + QKR_ROWS - 1) / QKR_ROWS;
    if (norm_bwd_fast() && d == QKV_D && ld % (int64_t)(16 / es) == 0 && is_aligned(dx, 16) &&
        is_aligned(x_in, 16) && nbr <= INT32_MAX && nbr * d <= (int64_t)TR_SCRATCH_DOUBLES(be)) {
        double *part = w && dw ? (double *)tr_scratch(be, (size_t)(nbr * d) * sizeof(double)) : NULL;
        if (be->act == DFL_BF16)
            qknorm_rope_bwd_row_kernel<bf16><<<(unsigned)nbr, QKR_WARPS * 32, 0, s>>>(
                (bf16 *)dx, ld, part, (const bf16 *)x_in, (const bf16 *)w, rstd, pos, inv, R, heads, eps);
        else
            qknorm_rope_bwd_row_kernel<float><<<(unsigned)nbr, QKR_WARPS * 32, 0, s>>>(
                (float *)dx, ld, part, (const float *)x_in, (const float *)w, rstd, pos, inv, R, heads, eps);
        rc = cuda_launch_check(be, "qknorm_rope_bwd");
        if (rc || !part)
            return rc;
        return tr_colsum(be, dw, part, (int)nbr, d, "qknorm_rope_bwd (dw)");
    }
    const int P = (half % 2 == 0 && ld % 2 == 0 && is_aligned(dx, 2 * es) && is_aligned(x_in, 2 * es)) ? 2 : 1;
    int need = (half + 32 * P - 1) / (32 * P), maxj = 1;
    while (maxj < need)
        maxj *= 2;
    if (maxj > 4)   /* d = 512 with P = 1: 8 */
        return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope_bwd: head dimension %d needs 2-element "
                            "aligned rows", d);
    const int64_t items = R * heads;
    int64_t nb = (items + 63) / 64;
    if (nb > 1024)
        nb = 1024;
    int64_t ipb = (items + nb - 1) / nb;
    nb = (items + ipb - 1) / ipb;
    double *part = NULL;
    if (w && dw) {
        part = (double *)tr_scratch(be, (size_t)(nb * d) * sizeof(double));
        if (!part)
            return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope_bwd: scratch too small");
    }
    if (be->act == DFL_BF16) {
        if (P == 2)
            launch_qkb<bf16, 2>(s, (unsigned)nb, maxj, (bf16 *)dx, ld, part, (const bf16 *)x_in,
                                (const bf16 *)w, rstd, pos, inv, R, heads, d, eps, ipb);
        else
            launch_qkb<bf16, 1>(s, (unsigned)nb, maxj, (bf16 *)dx, ld, part, (const bf16 *)x_in,
                                (const bf16 *)w, rstd, pos, inv, R, heads, d, eps, ipb);
    } else {
        if (P == 2)
            launch_qkb<float, 2>(s, (unsigned)nb, maxj, (float *)dx, ld, part, (const float *)x_in,
                                 (const float *)w, rstd, pos, inv, R, heads, d, eps, ipb);
        else
            launch_qkb<float, 1>(s, (unsigned)nb, maxj, (float *)dx, ld, part, (const float *)x_in,
                                 (const float *)w, rstd, pos, inv, R, heads, d, eps, ipb);
    }
    rc = cuda_launch_check(be, "qknorm_rope_bwd");
    if (rc || !part)
        return rc;
    return tr_colsum(be, dw, part, (int)nb, d, "qknorm_rope_bwd (dw)");
}

/* ------------------------------------------------------------------------------------------ */
/* swiglu_bwd: dgate = dout * up * sg (1 + g (1 - sg)), dup = dout * silu(g); one block per row
 * (grid-stride over rows), packs of VEC columns. */

static int row_threads_tr(int64_t nvec)
{
    int64_t t = (nvec + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : t > TR_THREADS ? TR_THREADS : t);
}

template <typename T>
static int launch_swiglu_bwd(dfl_be *be, void *dgu, const void *dout, const void *gu, int64_t R, int64_t I)
{
    constexpr int V = 16 / sizeof(T);
    cudaStream_t s = cuda_of(be)->stream;
    unsigned blocks = (unsigned)(R < tr_max_blocks(be) ? R : tr_max_blocks(be));
    if (I % V == 0 && is_aligned(dgu, 16) && is_aligned(dout, 16) && is_aligned(gu, 16))
        swiglu_bwd_kernel<T, V><<<blocks, row_threads_tr(I / V), 0, s>>>((T *)dgu, (const T *)dout,
                                                                         (const T *)gu, R, I);
    else
        swiglu_bwd_kernel<T, 1><<<blocks, row_threads_tr(I), 0, s>>>((T *)dgu, (const T *)dout,
                                                                     (const T *)gu, R, I);
    return cuda_launch_check(be, "swiglu_bwd");
}

int cuda_swiglu_bwd(dfl_be *be, void *dgu, const void *dout, const void *gu, int64_t R, int64_t I)
{
    return cuda_by_act(be, R <= 0 || I <= 0,
                       [&](auto t) { return launch_swiglu_bwd<decltype(t)>(be, dgu, dout, gu, R, I); });
}

/* ------------------------------------------------------------------------------------------ */
/* sumsq: block b sums x[b*cs, (b+1)*cs) in double (16-byte loads when aligned); one warp adds
 * the block sums in a fixed order into out[0]. cs depends on n only. */

#define SUMSQ_MAXB 1024

int cuda_sumsq(dfl_be *be, double *out, const float *x, int64_t n)
{
    if (n <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    int64_t nb = (n + 16383) / 16384;
    if (nb > SUMSQ_MAXB)
        nb = SUMSQ_MAXB;
    int64_t cs = (n + nb - 1) / nb;
    cs = (cs + 3) / 4 * 4;
    nb = (n + cs - 1) / cs;
    double *part = (double *)tr_scratch(be, (size_t)nb * sizeof(double));
    cudaStream_t s = cuda_of(be)->stream;
    sumsq_part_kernel<<<(unsigned)nb, SUMSQ_THREADS, 0, s>>>(part, x, n, cs, is_aligned(x, 16));
    if ((rc = cuda_launch_check(be, "sumsq")))
        return rc;
    sumsq_final_kernel<<<1, 32, 0, s>>>(out, part, (int)nb);
    return cuda_launch_check(be, "sumsq (final)");
}

/* ------------------------------------------------------------------------------------------ */
/* clip_scale: the CPU op's double arithmetic, on one thread (sqrt and division are correctly
 * rounded on the device, so the results are the CPU's bit for bit). */

int cuda_clip_scale(dfl_be *be, float *out, int32_t *skip, const double *sums, float max_norm)
{
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    clip_scale_kernel<<<1, 1, 0, cuda_of(be)->stream>>>(out, skip, sums, max_norm);
    return cuda_launch_check(be, "clip_scale");
}

/* ------------------------------------------------------------------------------------------ */
/* block_metrics: per-slot counts and acceptance lengths of an lmce's rows (one small kernel; the
 * sums are of integers, exact in double, so they do not depend on order) */

int cuda_block_metrics(dfl_be *be, double *out, const uint8_t *correct, const float *weight,
                       int64_t n_blocks, int bs)
{
    if (n_blocks <= 0 || bs <= 0)
        return 0;
    if (bs > BM_THREADS)
        return cuda_op_fail(be, DFL_EUNSUP, "block_metrics: block size %d (at most %d)", bs, BM_THREADS);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    block_metrics_kernel<<<1, BM_THREADS, 0, cuda_of(be)->stream>>>(out, correct, weight, n_blocks, bs);
    return cuda_launch_check(be, "block_metrics");
}

/* ------------------------------------------------------------------------------------------ */
/* adamw: per element be_math.h's dfl_adamw_one, each operation rounded to f32 (explicit _rn
 * intrinsics on the device, so that the compiler cannot contract them into FMAs), with the scalars
 * of dfl_adam_scalars_at computed on the host. The CPU op (lib/backends/be_cpu_train.c) runs the
 * same functions, so results agree bit for bit with a CPU build that does not contract a*b+c into
 * FMAs (the default x86-64 build). p_act gets p rounded to be->wdt
 * (round to nearest even) in the same pass. *skip != 0: nothing is written. *prev_skip != 0:
 * the scalars of step - 1 (computed on the host too) are used. */

int cuda_adamw(dfl_be *be, const dfl_adamw *a)
{
    if (a->n <= 0)
        return 0;
    if (a->step < 1)
        return cuda_op_fail(be, DFL_EUSAGE, "adamw: step %lld (the first step is 1)", (long long)a->step);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    /* step t, and t - 1 for a skipped previous update (prev_skip) */
    const dfl_adam_scalars c = dfl_adam_scalars_at(a, a->step);
    const dfl_adam_scalars c_prev = dfl_adam_scalars_at(a, a->step < 2 ? a->step : a->step - 1);
    void *pa = a->p_act && a->p_act != (void *)a->p ? a->p_act : NULL;
    bool vec = is_aligned(a->p, 16) && is_aligned(a->g, 16) && is_aligned(a->m, 16) && is_aligned(a->v, 16) &&
               (!pa || is_aligned(pa, 4 * dfl_dtype_size(be->wdt)));
    unsigned g = grid_for((a->n + 3) / 4, TR_THREADS, tr_max_blocks(be));
    cudaStream_t s = cuda_of(be)->stream;
    if (pa && be->wdt == DFL_BF16)
        adamw_kernel<bf16><<<g, TR_THREADS, 0, s>>>(a->p, a->g, a->m, a->v, (bf16 *)pa, a->n, c,
                                                    c_prev, a->prev_skip, a->grad_scale, a->skip, vec);
    else
        adamw_kernel<float><<<g, TR_THREADS, 0, s>>>(a->p, a->g, a->m, a->v, (float *)pa, a->n, c,
                                                     c_prev, a->prev_skip, a->grad_scale, a->skip, vec);
    return cuda_launch_check(be, "adamw");
}

/* ------------------------------------------------------------------------------------------ */
/* uniform_noise: x[i] += amp * (2 u_i - 1), u_i = dfl_noise_u01(seed, i), computed
 * with the same f32 operations as the CPU op (be_math.h's dfl_noise_add), then rounded to the act type. */

int cuda_uniform_noise(dfl_be *be, void *x, int64_t n, float amp, uint64_t seed)
{
    if (n <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    unsigned g = grid_for(n, TR_THREADS, tr_max_blocks(be));
    cudaStream_t s = cuda_of(be)->stream;
    if (be->act == DFL_BF16)
        uniform_noise_kernel<bf16><<<g, TR_THREADS, 0, s>>>((bf16 *)x, n, amp, seed);
    else
        uniform_noise_kernel<float><<<g, TR_THREADS, 0, s>>>((float *)x, n, amp, seed);
    return cuda_launch_check(be, "uniform_noise");
}

/* ------------------------------------------------------------------------------------------ */
/* lmce: per chunk of nr rows,
 *  1. logits [nr, V] = z W^T (cuBLASLt, into work): f32 in f32 mode; in bf16 mode bf16 (f32
 *     accumulation, one rounding), the logits a bf16 model's LM head gives, as the public
 *     trainer and the PyTorch peer have them;
 *  2. the row work (train_kernels.cuh): lmce_stats_kernel reduces each slice of each scored row
 *     to a (max, sum of exp in double, first argmax) partial, lmce_finish_kernel combines a row's
 *     partials in a fixed order into its log-sum-exp, ce and hit; then, if dz is wanted,
 *     lmce_grad_kernel writes G = grad_scale w (softmax - onehot(label)) in place over the logits
 *     (bf16 mode: rows of ldg = V rounded up to 8). Rows with w == 0 get G = 0;
 *  3. one warp adds the chunk's per-row w*ce, w, hits and counts into sums in a fixed order;
 *  4. dz rows = G W (cuBLASLt).
 * With a->tune, both GEMMs' algorithms are timed on the first whole chunk (dfl_cuda_matmul_tune:
 * it drains the stream; for a warm-up) and the fastest kept for every later call of the shape.
 * work: lmce_work_layout (train_kernels.cuh). */

/* a->tune: the fastest of cuBLASLt's candidate algorithms for one of lmce's GEMMs, kept in its plan */
static int lmce_tune(dfl_be *be, const dfl_mm *m)
{
    dfl_err te = {0};
    int rc = dfl_cuda_matmul_tune(be, m, 16, 4, NULL, NULL, &te);
    return rc ? cuda_op_fail(be, rc, "lmce: timing the GEMM's algorithms: %s", te.msg) : 0;
}

/* the row work of the chunk of rows [r0, r0 + nr) over its logits x (row stride wl.ldx), in their
 * type: statistics, finish, and G when grad */
template <typename X>
static void lmce_rows(cudaStream_t s, const LmceWork &wl, X *x, const dfl_lmce *a, int64_t r0, int64_t nr,
                      bool grad)
{
    lmce_stats_kernel<<<lmce_stats_grid(wl, nr), LMCE_THREADS, 0, s>>>(x, a->V, wl.ldx, r0, a->weight, wl.part,
                                                                       wl.S);
    lmce_finish_kernel<<<lmce_finish_grid(nr), LMCE_FIN_WARPS * 32, 0, s>>>(
        x, wl.ldx, r0, nr, a->labels, a->weight, wl.part, wl.S, wl.lse, a->correct, a->ce_out, wl.row_wce,
        wl.row_hit);
    if (grad)
        lmce_grad_kernel<<<lmce_grad_grid<X>(a->V, nr), LMCE_THREADS, 0, s>>>(
            x, a->V, wl.ldx, r0, a->labels, a->weight, a->grad_scale, wl.lse);
}

int cuda_lmce(dfl_be *be, const dfl_lmce *a)
{
    if (a->Q <= 0)
        return 0;
    if (a->V <= 0 || a->H <= 0)
        return cuda_op_fail(be, DFL_EUSAGE, "lmce: vocabulary %lld, hidden %lld", (long long)a->V,
                            (long long)a->H);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    const int64_t V = a->V, H = a->H, CR = a->chunk_rows > 0 ? a->chunk_rows : 1;
    if (CR > 65535)   /* a grid's y dimension */
        return cuda_op_fail(be, DFL_EUNSUP, "lmce: chunk of %lld rows (at most 65535)", (long long)CR);
    const bool bf = be->act == DFL_BF16;
    if (bf && be->wdt != DFL_BF16)
        return cuda_op_fail(be, DFL_EUNSUP, "lmce: bf16 activations need bf16 weights");
    const LmceWork wl = lmce_work_layout(a->work, CR, V, bf);
    if ((const char *)wl.end > (const char *)(a->work + dfl_lmce_work_act(CR, V, be->act)))
        return cuda_op_fail(be, DFL_EUSAGE, "lmce: work layout past dfl_lmce_work_act");
    const size_t as = dfl_dtype_size(be->act);
    cudaStream_t s = cuda_of(be)->stream;
    for (int64_t r0 = 0; r0 < a->Q; r0 += CR) {
        const int64_t nr = a->Q - r0 < CR ? a->Q - r0 : CR;
        dfl_mm mm;
        memset(&mm, 0, sizeof mm);
        mm.M = nr;
        mm.N = V;
        mm.K = H;
        mm.A = (const char *)a->z + (size_t)(r0 * H) * as;
        mm.adt = be->act;
        mm.lda = H;
        mm.B = a->w_lm;
        mm.bdt = be->wdt;
        mm.ldb = H;
        mm.tb = true;
        mm.C = wl.x;
        mm.cdt = bf ? DFL_BF16 : DFL_F32;
        mm.ldc = wl.ldx;
        mm.alpha = 1.0f;
        mm.beta = 0.0f;
        const bool tune = a->tune && r0 == 0 && nr == CR;
        if ((tune && (rc = lmce_tune(be, &mm))) ||
            (rc = be->ops->matmul(be, &mm)))
            return rc;
        const bool grad = a->dz != NULL;
        if (bf)
            lmce_rows(s, wl, (bf16 *)wl.x, a, r0, nr, grad);
        else
            lmce_rows(s, wl, (float *)wl.x, a, r0, nr, grad);
        if ((rc = cuda_launch_check(be, "lmce (row statistics, gradient)")))
            return rc;
        lmce_sums_kernel<<<1, 32, 0, s>>>(a->sums, wl.row_wce, wl.row_hit, a->weight, r0, nr);
        if ((rc = cuda_launch_check(be, "lmce (sums)")))
            return rc;
        if (grad) {
            dfl_mm mz;
            memset(&mz, 0, sizeof mz);
            mz.M = nr;
            mz.N = H;
            mz.K = V;
            mz.A = wl.x;   /* G, in place over the logits */
            mz.adt = be->act;
            mz.lda = wl.ldx;
            mz.B = a->w_lm;
            mz.bdt = be->wdt;
            mz.ldb = H;
            mz.C = (char *)a->dz + (size_t)(r0 * H) * as;
            mz.cdt = be->act;
            mz.ldc = H;
            mz.alpha = 1.0f;
            mz.beta = 0.0f;
            if ((tune && (rc = lmce_tune(be, &mz))) ||
                (rc = be->ops->matmul(be, &mz)))
                return rc;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* segment_sum: one thread per (segment, column), the columns of a warp adjacent (coalesced);
 * each adds its segment's rows in order in f32 and rounds once, as the CPU op does. */
template <typename T>
static __global__ void segment_sum_kernel(T *dst, const T *src, const int32_t *off, int64_t n,
                                          int64_t w)
{
    const int64_t total = n * w;
    for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < total;
         x += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = x / w, k = x - i * w;
        float acc = 0.0f;
        for (int64_t r = off[i]; r < off[i + 1]; r++)
            acc += to_f32(src[r * w + k]);
        dst[x] = from_f32<T>(acc);
    }
}

int cuda_segment_sum(dfl_be *be, void *dst, const void *src, const int32_t *off, int64_t n,
                     int64_t w)
{
    if (n <= 0 || w <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    const unsigned g = grid_for(n * w, TR_THREADS, tr_max_blocks(be));
    if (be->act == DFL_BF16)
        segment_sum_kernel<bf16><<<g, TR_THREADS, 0, s>>>((bf16 *)dst, (const bf16 *)src, off, n, w);
    else
        segment_sum_kernel<float><<<g, TR_THREADS, 0, s>>>((float *)dst, (const float *)src, off, n, w);
    return cuda_launch_check(be, "segment_sum");
}

/* gather_rows: one thread per word of the output (16-byte words when the row size and both
 * pointers allow, else 4-byte, else bytes); a copy, so the result is the CPU op's bit for bit. */

template <typename Wd>
static __global__ void gather_rows_kernel(Wd *dst, const Wd *src, const int32_t *rows, int64_t n,
                                          int64_t wpr)
{
    const int64_t total = n * wpr;
    for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < total;
         x += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = x / wpr, k = x - i * wpr;
        const int32_t r = rows[i];
        Wd v = {};
        if (r >= 0)
            v = src[(int64_t)r * wpr + k];
        dst[x] = v;
    }
}

int cuda_gather_rows(dfl_be *be, void *dst, const void *src, const int32_t *rows, int64_t n,
                     int64_t row_bytes)
{
    if (n <= 0 || row_bytes <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    const int mb = tr_max_blocks(be);
    if (row_bytes % 16 == 0 && is_aligned(dst, 16) && is_aligned(src, 16)) {
        const int64_t w = row_bytes / 16;
        gather_rows_kernel<uint4><<<grid_for(n * w, TR_THREADS, mb), TR_THREADS, 0, s>>>(
            (uint4 *)dst, (const uint4 *)src, rows, n, w);
    } else if (row_bytes % 4 == 0 && is_aligned(dst, 4) && is_aligned(src, 4)) {
        const int64_t w = row_bytes / 4;
        gather_rows_kernel<uint32_t><<<grid_for(n * w, TR_THREADS, mb), TR_THREADS, 0, s>>>(
            (uint32_t *)dst, (const uint32_t *)src, rows, n, w);
    } else {
        gather_rows_kernel<uint8_t><<<grid_for(n * row_bytes, TR_THREADS, mb), TR_THREADS, 0, s>>>(
            (uint8_t *)dst, (const uint8_t *)src, rows, n, row_bytes);
    }
    return cuda_launch_check(be, "gather_rows");
}
