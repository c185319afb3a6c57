/* backend.h: the small op interface that model code (target forward, drafter forward/backward,
 * optimizer) is written against. Two backends implement it: the CPU reference (lib/be_cpu*.c,
 * fp32 compute, OpenBLAS, OpenMP) and CUDA (the .cu files in kernels/, bf16 storage, fp32 accumulation).
 * Model code never knows which one runs it.
 *
 * Conventions:
 *  - Buffers are backend memory (host memory for CPU, device memory for CUDA), obtained from
 *    be_alloc. Matrices are row-major. "act" buffers hold be->act elements, "w" buffers hold
 *    be->wdt elements; f32 / i32 buffers are always float / int32_t.
 *  - Ops are enqueued in order on the backend's current stream (CPU: run at once). They return
 *    0 or an error code (a launch failure); they do not validate data (callers check token ids
 *    and shapes before).
 *  - Shapes in comments: [rows, cols].
 */
#ifndef DFL_BACKEND_H
#define DFL_BACKEND_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"
#include "rope.h"

typedef struct dfl_be dfl_be;

typedef enum { DFL_BE_CPU = 1, DFL_BE_CUDA = 2 } dfl_be_kind;

/* C = alpha * op(A) op(B) + beta * C, op(A) [M,K], op(B) [K,N], C [M,N]; optional bias [N]
 * (f32) added to every row. ta: A is stored [K,M] (lda >= M); else [M,K] (lda >= K). Same for B.
 * beta = 1 accumulates (used for gradients and for the drafter's per-layer feature fusion). */
typedef struct dfl_mm {
    int64_t M, N, K;
    const void *A; dfl_dtype adt; int64_t lda; bool ta;
    const void *B; dfl_dtype bdt; int64_t ldb; bool tb;
    void *C; dfl_dtype cdt; int64_t ldc;
    float alpha, beta;
    const float *bias;
    const void *Cin;   /* with beta != 0, the C that is added when it is not C itself (same
                        * dtype and ldc, no overlap with C; C = alpha op(A) op(B) + beta Cin);
                        * NULL: C */
} dfl_mm;

/* A matmul plan's algorithm as it can be stored and used again (matmul_algo). */
#define DFL_MM_ALGO_BYTES 64
typedef struct dfl_mm_algo {
    uint8_t bytes[DFL_MM_ALGO_BYTES]; /* the algorithm, opaque (CUDA: cuBLASLt's
                                         cublasLtMatmulAlgo_t, which cuBLAS documents as
                                         storable for use with the same cuBLAS) */
    char key[192];                    /* the plan it is for: shape, types, transposes, leading
                                         dimensions, alignments */
    char scope[160];                  /* the GPU and library versions it holds for */
} dfl_mm_algo;

/* The C that m adds: Cin when it is given and beta != 0, else C itself (in place) */
static inline const void *dfl_mm_cin(const dfl_mm *m)
{
    return m->Cin && m->beta != 0.0f ? m->Cin : m->C;
}

/* Variable-length causal attention over packed sequences (the target's prefill).
 * Sequence s occupies rows cu_seqlens[s] .. cu_seqlens[s+1]-1; a query at row t attends to keys
 * of its own sequence at rows <= t. GQA: query head h uses kv head h / (n_heads / n_kv).
 * q, k, v rows have strides ldq, ldk, ldv elements (so a fused QKV output can be used in place);
 * within a row, head h occupies [h*d, (h+1)*d). o [T, n_heads*d] (ldo). */
typedef struct dfl_attn_varlen {
    const void *q; int64_t ldq;
    const void *k; int64_t ldk;
    const void *v; int64_t ldv;
    void *o; int64_t ldo;
    const int32_t *cu_seqlens;   /* [n_seqs+1], backend memory */
    int32_t n_seqs, max_len;
    int64_t T;
    int n_heads, n_kv, d;
    float scale;                 /* usually d^-0.5 */
} dfl_attn_varlen;

/* The gated delta rule of a Gated DeltaNet layer (Qwen3.5 / Qwen3.6 linear attention) over packed
 * sequences, per value head j (key head j / (Hv / Hk)), with state S [dk, dv] starting at zero for
 * every sequence:
 *   g_t = -exp(A_log[j]) * softplus(a[t, j] + dt_bias[j]),  beta_t = sigmoid(b[t, j])
 *   S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
 * (softplus(x) = x above 20, as torch). q and k are used as given (the caller L2-normalises them
 * and scales q). chunk == 0: the token-by-token recurrence (CPU only: the test oracle); chunk > 0:
 * the chunked form (WY representation within chunks of `chunk` tokens of a sequence, one pass
 * over the chunks carrying S), the one the target forward uses. A call with T == 0 only checks
 * that the backend supports the sizes (DFL_EUNSUP with a message otherwise). */
typedef struct dfl_gated_delta {
    const void *q, *k; int64_t ldqk;   /* act [T, Hk*dk] (row stride ldqk) */
    const void *v; int64_t ldv;        /* act [T, Hv*dv] */
    const void *a, *b; int64_t ldab;   /* act [T, Hv]: in_proj_a x, in_proj_b x */
    const float *A_log, *dt_bias;      /* [Hv] f32 */
    void *o; int64_t ldo;              /* act [T, Hv*dv] */
    const int32_t *cu_seqlens;         /* [n_seqs + 1] backend memory */
    int32_t n_seqs, max_len;
    int64_t T;
    int Hk, Hv, dk, dv;
    int chunk;
} dfl_gated_delta;

/* softplus as torch computes it (threshold 20) and the two gates of dfl_gated_delta. */
static inline float dfl_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
static inline float dfl_gdn_g(float a, float A_log, float dt_bias)
{
    return -expf(A_log) * dfl_softplus(a + dt_bias);
}

/* DFlash drafter attention (doc/dflash-step.md section 3, steps 3-5) over a packed batch.
 * Block b (0..n_blocks-1) has bs query slots at rows b*bs .. b*bs+bs-1 of q / k_blk / v_blk / o.
 * Its queries attend to context rows ctx_start[b] .. ctx_start[b] + anchor[b] - 1 of k_ctx/v_ctx
 * (the sequence's rows before its anchor; ctx_start is the sequence's first row) and to all bs
 * rows of their own block; nothing else (a full-attention layer). With window W > 0 (a sliding-
 * window layer, doc/dflash-step.md section 3 and the dflash-swa golden's mask_rule) the query at slot j
 * (position anchor + j) sees only the context rows at positions c with
 * anchor + j - (W - 1) <= c < anchor, and the block rows i <= j (causal inside the block).
 * GQA as above. Blocks are ordered by ctx_start
 * (non-decreasing; blocks of one sequence are contiguous); 0 <= anchor[b] <= max_anchor and
 * ctx_start[b] + anchor[b] <= T_ctx. Rows are dense: q, o, dq, dout have n_heads*d elements per
 * row, the k/v arrays n_kv*d. lse [n_blocks*bs, n_heads] (f32) is written by the forward
 * (log-sum-exp of the scaled scores, natural log) for the backward.
 * Backward: reads q, k_*, v_*, o, lse, dout; uses delta [Q, n_heads] (f32 scratch, = rowsum
 * dout*o per head); WRITES dq, dk_blk, dv_blk and every row of dk_ctx, dv_ctx (rows that no
 * block sees get 0). No output is accumulated, so a backend may compute each row once. */
typedef struct dfl_dflash_attn {
    const void *q;      /* [Q, n_heads*d]  Q = n_blocks*bs */
    const void *k_ctx;  /* [Tctx, n_kv*d] */
    const void *v_ctx;  /* [Tctx, n_kv*d] */
    const void *k_blk;  /* [Q, n_kv*d] */
    const void *v_blk;  /* [Q, n_kv*d] */
    void *o;            /* [Q, n_heads*d] */
    float *lse;         /* [Q, n_heads] */
    const int32_t *ctx_start;  /* [n_blocks] */
    const int32_t *anchor;     /* [n_blocks] */
    /* optional host copies of ctx_start and anchor (NULL: none), from which a backend may size
     * the scratch of a faster backward (CUDA: the score gradients kept between its passes) */
    const int32_t *ctx_start_host, *anchor_host;
    int32_t n_blocks, bs, max_anchor;
    int32_t window;     /* 0: full attention; > 0: sliding window of W positions */
    int64_t T_ctx;
    int n_heads, n_kv, d;
    float scale;
    /* backward only: */
    const void *dout;   /* [Q, n_heads*d] */
    float *delta;       /* [Q, n_heads] f32 scratch */
    void *dq;           /* [Q, n_heads*d]  (written) */
    void *dk_ctx, *dv_ctx; /* [Tctx, n_kv*d] (written) */
    void *dk_blk, *dv_blk; /* [Q, n_kv*d]    (written) */
} dfl_dflash_attn;

/* Slots of the per-step sums array (double, backend memory) shared by lmce, sumsq and
 * clip_scale. With data parallelism the array is summed over ranks (one all-reduce) before
 * clip_scale, which is where the global loss denominator divides the gradients. */
enum {
    DFL_SUM_LOSS_NUM = 0,   /* sum w*ce */
    DFL_SUM_LOSS_DEN = 1,   /* sum w (decayed weights) */
    DFL_SUM_ACC_NUM = 2,    /* scored slots predicted correctly */
    DFL_SUM_ACC_DEN = 3,    /* scored slots */
    DFL_SUM_GRAD_SQ = 4,    /* sum of squares of the gradients of loss_num */
    DFL_SUM_COUNT = 8
};

/* Fused LM head + decay-weighted cross-entropy over Q rows, chunk_rows rows at a time, so that
 * the [Q, V] logits are never held in full. For row q with weight w[q] > 0:
 * ce = logsumexp(z_q W^T) - (z_q W^T)[label]; adds w*ce to sums[LOSS_NUM] and w to
 * sums[LOSS_DEN]; adds 1 to sums[ACC_DEN] and [argmax == label] (first index of the maximum) to
 * sums[ACC_NUM] (sums accumulated in row order, so the result does not depend on threads);
 * correct[q] = (w[q] > 0 && argmax == label); ce_out[q] = ce (0 where w == 0). If dz is
 * non-NULL, writes dz = grad_scale * w * (softmax - onehot(label)) W (zero rows where w == 0):
 * the gradient of grad_scale * loss_num with respect to z. Rows with w == 0 contribute
 * nothing. The logits are those of the backend's activation type: with bf16 activations (a GPU
 * backend) the product is summed in f32 and rounded to bf16 once, as a bf16 model's LM head
 * gives them, and ce, the argmax and G come from those. work: backend f32 scratch of
 * dfl_lmce_work_act(chunk_rows, V, be->act) elements (or dfl_lmce_work's). */
/* f32 elements of lmce's work for chunks of r rows and a vocabulary of V with activations of
 * type act: two [r] row sums and the chunk's logits (f32: [r, V] f32 first; bf16: [r, V] bf16
 * with rows padded to a multiple of 8, last), and room for a backend's own per-row state (up to
 * one 16-byte partial per 1024 logits of a row, and 8 bytes a row), each part aligned to 16
 * bytes. dfl_lmce_work(r, V) is enough for either type. */
static inline int64_t dfl_lmce_work_act(int64_t r, int64_t V, dfl_dtype act)
{
    return (act == DFL_BF16 ? 4 * r * ((V + 7) / 8) : r * V) + 2 * r + 4 * r * ((V + 1023) / 1024) + 2 * r + 16;
}
static inline int64_t dfl_lmce_work(int64_t r, int64_t V)
{
    const int64_t f = dfl_lmce_work_act(r, V, DFL_F32), b = dfl_lmce_work_act(r, V, DFL_BF16);
    return f > b ? f : b;
}

typedef struct dfl_lmce {
    const void *z;          /* [Q, H] act */
    const void *w_lm;       /* [V, H] w (frozen) */
    const int32_t *labels;  /* [Q] */
    const float *weight;    /* [Q] decayed weight, 0 = not scored */
    int64_t Q, H, V;
    double *sums;           /* [DFL_SUM_COUNT] (accumulated) */
    uint8_t *correct;       /* [Q] or NULL */
    float *ce_out;          /* [Q] or NULL */
    void *dz;               /* [Q, H] act, or NULL */
    float grad_scale;
    float *work;            /* [dfl_lmce_work_act(chunk_rows, V, be->act)] f32 scratch */
    int64_t chunk_rows;
    bool tune;              /* time the GEMMs' candidate algorithms on the first whole chunk and
                             * keep the fastest (matmul_tune; a GPU's warm-up); else ignored */
} dfl_lmce;

/* AdamW on f32 master weights, one call per tensor or over one flat buffer of all parameters.
 * g is multiplied by *grad_scale (backend scalar, e.g. clip coefficient / loss_den) first; if
 * *skip != 0 nothing changes. torch.optim.AdamW(foreach=False) semantics (doc/dflash-step.md section 5),
 * step t >= 1: m = m + (1-b1) (g - m) (torch's lerp); v = b2 v + (1-b2) g^2;
 * p = p (1 - lr wd) - (lr / (1-b1^t)) m / (sqrt(v) / sqrt(1-b2^t) + eps), the bias corrections
 * in double. If p_act is non-NULL it receives p converted to be->wdt. */
typedef struct dfl_adamw {
    float *p, *g, *m, *v;
    void *p_act;
    int64_t n;
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;
    const float *grad_scale;    /* backend memory scalar, or NULL for 1 */
    const int32_t *skip;        /* backend memory flag, or NULL */
    /* backend memory flag, or NULL: when non-zero, the step is step - 1 (step >= 2). For callers
     * that enqueue an update before they have read whether the previous one was skipped (the
     * drafter's pipelined loop): they pass the step assuming it was applied, and a copy of the
     * previous *skip here. */
    const int32_t *prev_skip;
} dfl_adamw;

/* The arithmetic of clip_scale, adamw and uniform_noise that every backend shares (the noise
 * generator dfl_noise_u01 among it) is in be_math.h. */

/* Mixture-of-experts routing (the target's sparse MLPs). Every token t picks the top k of E
 * experts by p = softmax(logits[t]) (f32; ties to the lower expert id), in descending order,
 * with weight p (divided by the sum of its k when norm_topk). The (token, choice) pairs are then
 * grouped by expert for the expert GEMMs: expert e owns grouped rows offsets[e] ..
 * offsets[e] + counts[e] - 1, in ascending token order, and its segment is padded to a multiple
 * of DFL_MOE_PAD rows (offsets[e+1] - offsets[e]); rows[g] is the token of grouped row g (-1 on
 * padding) and slot[t k + j] the grouped row of token t's choice j. Everything stays in backend
 * memory (no host round trip); cap >= dfl_moe_cap(T, E, k) rows. */
#define DFL_MOE_PAD 128 /* the CUDA grouped GEMM's largest row tile (a tile never spans two experts) */

static inline int64_t dfl_moe_cap(int64_t T, int64_t E, int64_t k)
{
    return (T * k + E * (DFL_MOE_PAD - 1) + DFL_MOE_PAD - 1) / DFL_MOE_PAD * DFL_MOE_PAD;
}

typedef struct dfl_moe_route {
    const float *logits;  /* [T, E] f32 */
    int64_t T;
    int E, k;
    bool norm_topk;
    int32_t *idx;         /* [T, k] chosen experts */
    float *weight;        /* [T, k] their weights */
    int32_t *counts;      /* [E] */
    int32_t *offsets;     /* [E + 1] */
    int32_t *rows;        /* [cap] */
    int32_t *slot;        /* [T, k] */
    int64_t cap;
} dfl_moe_route;

/* C = A W_e^T for the grouped rows of each expert e (counts and offsets of a dfl_moe_route, in
 * backend memory); rows of C outside every expert's count are left as they are.
 * With rows (the route's rows, backend memory), A holds token rows and grouped row g reads A row
 * rows[g]: the gather fused into the GEMM (no [cap, K] copy). With swiglu (N even), C is
 * [cap, N / 2] and receives silu(P[:, i]) * P[:, N / 2 + i] of the product P, each of P's two
 * values rounded to act first (as moe_matmul then swiglu round them): the expert MLP's gate|up
 * projection and its activation without the [cap, N] intermediate. */
typedef struct dfl_moe_mm {
    const void *A;            /* [cap, K] act, grouped rows; with rows: [T, K] act token rows */
    const void *W;            /* [E, N, K] w: expert e's [N, K] matrix at e N K */
    void *C;                  /* [cap, N] act; with swiglu: [cap, N / 2] */
    const int32_t *counts, *offsets;
    const int32_t *rows;      /* NULL, or [cap]: the token row of A of each grouped row */
    bool swiglu;
    int E;
    int64_t N, K, cap;
} dfl_moe_mm;

/* ---- device plumbing ----
 * What code outside the backends needs of a device besides the ops above: two named streams,
 * events, pinned host memory, asynchronous copies, the allocation freeze, memory figures, GEMM
 * tuning and a device communicator. lib/ reaches a device only through these (no CUDA or NCCL
 * header outside lib/backends/ and kernels/). A backend that runs every op at once (be->async
 * false: the CPU) implements them trivially: events are complete when recorded, asynchronous
 * copies are plain copies, pinned memory is malloc'ed, freeze and tuning do nothing.
 * Every op above runs on DFL_STREAM_COMPUTE; DFL_STREAM_COPY is a second stream for copies that
 * overlap compute, ordered against the first with events. */
typedef struct dfl_be_event_s *dfl_be_event;   /* opaque; NULL on a backend without events */
typedef struct dfl_be_comm_s *dfl_be_comm;     /* opaque device communicator */
enum { DFL_STREAM_COMPUTE = 0, DFL_STREAM_COPY = 1 };

typedef struct dfl_be_mem {
    uint64_t total, free;       /* the device's memory, bytes (0 when not a GPU) */
    uint64_t allocated, peak;   /* held now / at most through alloc */
    uint64_t n_allocs;          /* live allocations */
    uint64_t backend_bytes;     /* the backend's own buffers (workspaces) */
} dfl_be_mem;

/* A communicator's identity, made by rank 0 and sent to the others (dist.c's sockets). */
#define DFL_COMM_ID_BYTES 128

typedef struct dfl_be_ops {
    /* memory */
    void *(*alloc)(dfl_be *be, size_t bytes, dfl_err *e);
    void (*free)(dfl_be *be, void *p);
    int (*upload)(dfl_be *be, void *dst, const void *src, size_t bytes);    /* host -> backend */
    int (*download)(dfl_be *be, void *dst, const void *src, size_t bytes);  /* backend -> host */
    int (*memset0)(dfl_be *be, void *dst, size_t bytes);
    int (*copy)(dfl_be *be, void *dst, const void *src, size_t bytes);
    int (*sync)(dfl_be *be, dfl_err *e);  /* wait for all enqueued work; reports async errors */
    /* device plumbing (see above) */
    /* Host memory for asynchronous copies: pinned on a GPU, malloc'ed elsewhere. */
    void *(*host_alloc)(dfl_be *be, size_t bytes, dfl_err *e);
    void (*host_free)(dfl_be *be, void *p);
    /* Page-lock an existing mapping so that copies from or into it run asynchronously. */
    int (*host_register)(dfl_be *be, void *p, size_t bytes, bool read_only, dfl_err *e);
    int (*host_unregister)(dfl_be *be, void *p, dfl_err *e);
    /* timing: an event that can be given to event_elapsed. */
    int (*event_new)(dfl_be *be, dfl_be_event *ev, bool timing, dfl_err *e);
    void (*event_free)(dfl_be *be, dfl_be_event ev);
    /* Captures the work enqueued on the stream so far. */
    int (*event_record)(dfl_be *be, dfl_be_event ev, int stream, dfl_err *e);
    /* Future work on the stream waits for ev (no host wait). */
    int (*stream_wait)(dfl_be *be, int stream, dfl_be_event ev, dfl_err *e);
    /* *done = whether ev has completed (never blocks). */
    int (*event_query)(dfl_be *be, dfl_be_event ev, bool *done, dfl_err *e);
    /* The host waits for ev (returns at once when it has completed). */
    int (*event_sync)(dfl_be *be, dfl_be_event ev, dfl_err *e);
    /* Milliseconds between two completed timing events (0 on a backend without events). */
    int (*event_elapsed)(dfl_be *be, dfl_be_event a, dfl_be_event b, float *ms, dfl_err *e);
    /* The host waits until everything enqueued on the stream has run. */
    int (*stream_sync)(dfl_be *be, int stream, dfl_err *e);
    /* Copies enqueued on a stream; the host buffer must stay untouched until an event recorded
     * after the copy has completed (asynchronous only with host_alloc'ed or registered memory). */
    int (*upload_async)(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e);
    int (*download_async)(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e);
    /* After freeze(be, true) every alloc fails with a message saying so (the steady state
     * allocates nothing); freeze(be, false) allows it again. */
    void (*freeze)(dfl_be *be, bool frozen);
    /* Counts of the host's waits for the device since the backend opened: whole-stream syncs and
     * waits on events not yet complete (0 on the CPU). */
    void (*wait_stats)(dfl_be *be, uint64_t *syncs, uint64_t *event_waits);
    int (*mem_info)(dfl_be *be, dfl_be_mem *m, dfl_err *e);
    /* Times up to max_algos candidate algorithms for this matmul shape (in `iters` rounds, on
     * the given buffers: C is overwritten) and keeps the fastest for later calls of the same
     * shape (CUDA: at the clocks a long run leaves the GPU, dfl_cuda_matmul_tune);
     * best_ms / first_ms: the chosen one's time and the library's first choice (0 when the backend
     * has nothing to tune). */
    int (*matmul_tune)(dfl_be *be, const dfl_mm *m, int max_algos, int iters, float *best_ms,
                       float *first_ms, dfl_err *e);
    /* The algorithm the plan for m's shape uses, into *a (with its key and scope); with set, the
     * plan takes a->bytes instead, once the library has checked them against the plan
     * (DFL_EDATA when it refuses them, the plan unchanged; a->key and a->scope are not read).
     * DFL_EUNSUP where m's shape has no such plan. NULL where there is nothing to choose (the
     * CPU). */
    int (*matmul_algo)(dfl_be *be, const dfl_mm *m, dfl_mm_algo *a, bool set, dfl_err *e);

    /* The device communicator (be->device_comm: NCCL on CUDA; absent on the CPU, where the host
     * carries the sums). comm_id: rank 0 makes the identity the other ranks join with.
     * comm_init, comm_allreduce (a sum in place over all ranks, f32 or f64, enqueued on the
     * compute stream) and comm_finalize may return before the communicator has finished: poll
     * comm_status until *busy is false. An error (returned, with its message in e) leaves the
     * communicator unusable: comm_abort it. */
    int (*comm_id)(dfl_be *be, uint8_t id[DFL_COMM_ID_BYTES], dfl_err *e);
    int (*comm_init)(dfl_be *be, dfl_be_comm *c, int world, int rank,
                     const uint8_t id[DFL_COMM_ID_BYTES], dfl_err *e);
    int (*comm_status)(dfl_be *be, dfl_be_comm c, bool *busy, dfl_err *e);
    int (*comm_allreduce)(dfl_be *be, dfl_be_comm c, void *buf, int64_t n, dfl_dtype dt, dfl_err *e);
    int (*comm_finalize)(dfl_be *be, dfl_be_comm c, dfl_err *e);
    void (*comm_abort)(dfl_be *be, dfl_be_comm c);    /* never blocks */
    void (*comm_destroy)(dfl_be *be, dfl_be_comm c);

    /* y[n] (dt) = convert(x[n] (st)); float types only */
    int (*convert)(dfl_be *be, void *y, dfl_dtype dt, const void *x, dfl_dtype st, int64_t n);
    int (*matmul)(dfl_be *be, const dfl_mm *m);
    /* out[T,H] act = E[ids[t]] ; E [V,H] w */
    int (*embedding)(dfl_be *be, void *out, const int32_t *ids, const void *E, int64_t T, int64_t H);
    /* y = x / sqrt(mean(x^2) + eps) * w over rows of n; rstd [R] f32 saved if non-NULL.
     * y may equal x. */
    int (*rmsnorm)(dfl_be *be, void *y, float *rstd, const void *x, const void *w, int64_t R,
                   int64_t n, float eps);
    /* h += d (residual), then y = rmsnorm(h) (h, d, y act [R,n]) */
    int (*add_rmsnorm)(dfl_be *be, void *h, const void *d, void *y, float *rstd, const void *w,
                       int64_t R, int64_t n, float eps);
    /* dx (+)= d/dx, dw += d/dw (f32 [n]); x is the norm's input. accumulate_dx: add into dx.
     * dx may be dy when !accumulate_dx. */
    int (*rmsnorm_bwd)(dfl_be *be, void *dx, float *dw, const void *dy, const void *x,
                       const void *w, const float *rstd, int64_t R, int64_t n, bool accumulate_dx);
    /* x [R, ld] (heads at columns [h*d, (h+1)*d) for h < heads) = per-head RMSNorm of src (the
     * same layout; NULL: x itself, in place; otherwise src and x do not overlap) with w [d]
     * (skipped when w == NULL; rstd [R*heads] f32 saved if non-NULL), then RoPE rotate-half with
     * position pos[r] and base theta (inv_freq computed in f32, then rounded to be->rope_dtype
     * when that is DFL_BF16 or DFL_F16). Columns outside the heads are left as they are. */
    int (*qknorm_rope)(dfl_be *be, void *x, const void *src, int64_t ld, float *rstd,
                       const void *w, const int32_t *pos, int64_t R, int heads, int d, float eps,
                       float theta);
    /* Backward of qknorm_rope: dx [R, ld] holds the gradient of the output and is replaced by the
     * gradient of the input; x_in is the op's input (saved before the in-place op); dw += (f32).
     * rstd may be NULL (then recomputed from x_in). */
    int (*qknorm_rope_bwd)(dfl_be *be, void *dx, int64_t ld, float *dw, const void *x_in,
                           const void *w, const float *rstd, const int32_t *pos, int64_t R,
                           int heads, int d, float eps, float theta);
    /* out[r,i] = silu(gu[r,i]) * gu[r,I+i]; gu [R, 2I] (gate | up), out [R, I] */
    int (*swiglu)(dfl_be *be, void *out, const void *gu, int64_t R, int64_t I);
    /* dgu [R, 2I] from dout [R, I] and gu */
    int (*swiglu_bwd)(dfl_be *be, void *dgu, const void *dout, const void *gu, int64_t R, int64_t I);
    /* Optional (NULL where a backend has none): out [R, I] = swiglu(A W^T) for A [R, K] (rows of
     * K) and W [2I, K] (w; the gate rows, then the up rows), each product value rounded to act
     * before the activation: matmul then swiglu without the [R, 2I] intermediate. Returns
     * DFL_EUNSUP, recording nothing (the next sync does not report it), when it does not take
     * the product; the caller then runs matmul and swiglu. With out NULL it only says that (0:
     * it takes it), running nothing. */
    int (*matmul_swiglu)(dfl_be *be, void *out, const void *A, const void *W, int64_t R,
                         int64_t I, int64_t K);
    /* y[n] += x[n] (act) */
    int (*add)(dfl_be *be, void *y, const void *x, int64_t n);
    int (*attn_varlen)(dfl_be *be, const dfl_attn_varlen *a);

    /* hybrid targets (Qwen3.5 / Qwen3.6; CPU: lib/backends/be_cpu_hybrid.c, CUDA:
     * kernels/hybrid.cu) */
    /* zero-centred RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + w) over rows of n, (1 + w) in
     * f32. y may equal x. */
    int (*rmsnorm_1p)(dfl_be *be, void *y, const void *x, const void *w, int64_t R, int64_t n,
                      float eps);
    /* In place on x [R, ld] (heads at columns [h*d, (h+1)*d)): per-head zero-centred RMSNorm
     * with w [d] (1 + w), then RoPE rotate-half on the first rot dims of each head with
     * position pos[r] (inv_freq = 1/theta^(2i/rot), rounded as for qknorm_rope); dims rot..d-1
     * pass through. */
    int (*qknorm_rope_partial)(dfl_be *be, void *x, int64_t ld, const void *w, const int32_t *pos,
                               int64_t R, int heads, int d, int rot, float eps, float theta);
    /* x[r, i] *= sigmoid(g[r, i]) for i < n; x [R, ldx], g [R, ldg] (act) */
    int (*sigmoid_mul)(dfl_be *be, void *x, int64_t ldx, const void *g, int64_t ldg, int64_t R,
                       int64_t n);
    /* Depthwise causal conv1d then SiLU, per sequence: y[t, c] = silu(sum_{j<K, p_t-j >= 0}
     * w[c, K-1-j] x[t-j, c]) with p_t = pos[t] (the position within its sequence: the window
     * never crosses into the previous sequence). x [T, ldx], y [T, ldy] (act, y != x), w [C, K]
     * (w dtype). */
    int (*conv1d_silu)(dfl_be *be, void *y, int64_t ldy, const void *x, int64_t ldx,
                       const void *w, const int32_t *pos, int64_t T, int64_t C, int K);
    /* In place on x [R, ld], heads of d at [h*d, (h+1)*d): x = x / sqrt(sum x^2 + eps) * scale */
    int (*l2norm)(dfl_be *be, void *x, int64_t ld, int64_t R, int heads, int d, float scale,
                  float eps);
    /* Gated RMSNorm, in place on x [R, ldx], heads of d: x = w * rmsnorm(x) * silu(z) per head;
     * z [R, ldz] (act), w [d] (w dtype) */
    int (*gated_rmsnorm)(dfl_be *be, void *x, int64_t ldx, const void *z, int64_t ldz,
                         const void *w, int64_t R, int heads, int d, float eps);
    int (*gated_delta)(dfl_be *be, const dfl_gated_delta *a);

    /* drafter */
    int (*dflash_attn)(dfl_be *be, const dfl_dflash_attn *a);
    int (*dflash_attn_bwd)(dfl_be *be, const dfl_dflash_attn *a);
    int (*lmce)(dfl_be *be, const dfl_lmce *a);
    /* out[0] += sum(x[i]^2) over n f32 values (for the global gradient norm); out is backend
     * memory; the sum does not depend on the number of threads. */
    int (*sumsq)(dfl_be *be, double *out, const float *x, int64_t n);
    /* The optimizer's scalars, computed on the backend from sums (DFL_SUM_*, backend memory):
     * den = sums[LOSS_DEN]; norm = sqrt(sums[GRAD_SQ]) / den (the norm of the gradient of
     * loss = loss_num / den); skip = !(den > 0) || sums[LOSS_NUM] or norm not finite;
     * coef = max_norm > 0 ? min(1, max_norm / (norm + 1e-6)) : 1 (torch clip_grad_norm_).
     * Writes out[0] = coef / den (the adamw grad_scale), out[1] = norm, out[2] = coef (f32,
     * backend memory) and *skip (i32, backend memory). */
    int (*clip_scale)(dfl_be *be, float *out, int32_t *skip, const double *sums, float max_norm);
    /* Metrics of an lmce over n_blocks blocks of bs slots (correct and weight as given to it),
     * accumulated into out (double, backend memory, 2*bs + 2 values): out[j] += [weight > 0] and
     * out[bs + j] += correct for slot j of every block; for every block whose slot 1 is scored,
     * out[2*bs] += 1 + the number of leading slots from slot 1 that are correct (the acceptance
     * length) and out[2*bs + 1] += 1. */
    int (*block_metrics)(dfl_be *be, double *out, const uint8_t *correct, const float *weight,
                         int64_t n_blocks, int bs);
    int (*adamw)(dfl_be *be, const dfl_adamw *a);
    /* x[i] += amp * (2 dfl_noise_u01(seed, i) - 1) for i < n (act): uniform noise on the
     * target features (dfl-draft --noise-std). */
    int (*uniform_noise)(dfl_be *be, void *x, int64_t n, float amp, uint64_t seed);
    /* For i < n: dst row i = src row rows[i], or zero bytes where rows[i] < 0 (rows: int32,
     * backend memory). Rows are row_bytes bytes of any element type, copied exactly; dst and
     * src do not overlap. The drafter gathers the scored rows of a step (block slots 1..bs-1)
     * before the LM head with it, and scatters their gradients back with an inverse map that
     * is -1 at the slot-0 rows. */
    int (*gather_rows)(dfl_be *be, void *dst, const void *src, const int32_t *rows, int64_t n,
                       int64_t row_bytes);
    /* For i < n: dst row i = the sum of src rows off[i] .. off[i+1]-1 (act, rows of w; off:
     * int32 [n+1], non-decreasing, backend memory), added in row order in f32 and rounded to
     * act once; 0 for an empty segment. dst and src do not overlap. The drafter sums the
     * gradients at a block's mask-token rows of its first layer with it (draft_step.c). */
    int (*segment_sum)(dfl_be *be, void *dst, const void *src, const int32_t *off, int64_t n,
                       int64_t w);

    /* mixture of experts (the target's sparse MLPs; see dfl_moe_route) */
    int (*moe_route)(dfl_be *be, const dfl_moe_route *r);
    /* dst[g] (act [cap, H]) = src[rows[g]] (act [T, H]) for the grouped rows g of every expert;
     * padding rows (rows[g] < 0, g < offsets[E]) are zeroed, rows from offsets[E] untouched. */
    int (*moe_gather)(dfl_be *be, void *dst, const void *src, const int32_t *rows,
                      const int32_t *offsets, int E, int64_t cap, int64_t H);
    int (*moe_matmul)(dfl_be *be, const dfl_moe_mm *m);
    /* out[t] (act [T, H]) = (out[t] when accumulate, else 0) + sum over j < k of
     * weight[t k + j] y[slot[t k + j]] (y act [cap, H]), summed in f32 in j order, then (when
     * shared is non-NULL: a shared expert) + sigmoid(shared_gate[t]) shared[t] (shared act
     * [T, H], shared_gate f32 [T] logits). */
    int (*moe_combine)(dfl_be *be, void *out, const void *y, const int32_t *slot,
                       const float *weight, int64_t T, int k, int64_t H, bool accumulate,
                       const void *shared, const float *shared_gate);
} dfl_be_ops;

struct dfl_be {
    dfl_be_kind kind;
    char name[32];          /* "cpu", "cuda:0" */
    dfl_dtype act;          /* activation storage: F32 on CPU, BF16 (or F32) on CUDA */
    dfl_dtype wdt;          /* compute-weight storage: F32 on CPU, BF16 (or F32) on CUDA */
    int threads;            /* CPU threads */
    /* RoPE inverse frequencies 1/theta^(2i/d) are computed in f32 and then rounded to this dtype
     * when it is DFL_BF16 or DFL_F16 (anything else: kept in f32). Transformers does this to a
     * model loaded in bf16 (the inv_freq buffer is cast with the model), so the target forward
     * sets it to its checkpoint's dtype to match; the drafter leaves it 0 (f32, doc/dflash-step.md). */
    dfl_dtype rope_dtype;
    /* What the backend does differently, for model and driver code that must know (it never
     * asks which backend it runs on): */
    bool async;             /* ops are enqueued and run later (events and streams matter) */
    bool device_comm;       /* has the comm_* ops */
    bool fuse_residual;     /* the target forward fuses residual adds into add_rmsnorm */
    int64_t lmce_rows;      /* rows of the LM head + cross-entropy per chunk (lmce's chunk_rows) */
    /* RoPE scaling of the model being run (rope.h), or NULL for the default frequencies; set by
     * the target forward like rope_dtype. The ops compute their frequencies with
     * dfl_rope_inv_freq_scaled(.., theta, rope_scaling, rope_dtype). */
    const dfl_rope_scaling *rope_scaling;
    const dfl_be_ops *ops;
    void *impl;             /* backend state */
};

/* "cpu", "cuda", "cuda:N". act_dtype DFL_DT_INVALID = the backend's default. */
int dfl_be_open(dfl_be **be, const char *device, dfl_dtype act_dtype, dfl_err *e);
void dfl_be_close(dfl_be *be);
/* The device a rank of a data-parallel run opens for a --device string: a GPU kind without an
 * index ("cuda") means the GPU of the rank's local rank; anything else is taken as given. */
const char *dfl_be_device_for_rank(const char *device, int local_rank, char *buf, size_t n);
/* True when this build has the CUDA backend and a usable GPU exists. */
bool dfl_be_cuda_available(void);

/* CPU backend constructor (lib/backends/be_cpu.c); the CUDA one is in kernels/. */
int dfl_be_cpu_open(dfl_be **be, int threads, dfl_err *e);
#ifdef DFL_CUDA
int dfl_be_cuda_open(dfl_be **be, int device, dfl_dtype act, dfl_err *e);
int dfl_be_cuda_count(void);
#endif

/* RoPE inverse frequencies as both backends compute them (host code): inv[i] = 1 / theta^(2i/d)
 * in f32, as transformers computes them, then rounded to round_to when it is DFL_BF16 or DFL_F16
 * (see dfl_be.rope_dtype). inv has d/2 entries. */
static inline void dfl_rope_inv_freq(float *inv, int d, float theta, dfl_dtype round_to)
{
    for (int i = 0; i < d / 2; i++) {
        inv[i] = 1.0f / powf(theta, (float)(2 * i) / (float)d);
        if (round_to == DFL_BF16)
            inv[i] = dfl_bf16_to_f32(dfl_f32_to_bf16(inv[i]));
        else if (round_to == DFL_F16)
            inv[i] = dfl_f16_to_f32(dfl_f32_to_f16(inv[i]));
    }
}

/* Helpers over ops, for readable model code. */
static inline void *be_alloc(dfl_be *be, size_t bytes, dfl_err *e) { return be->ops->alloc(be, bytes, e); }

/* Free device memory in bytes (0 when unknown or not a GPU). */
static inline uint64_t dfl_be_mem_free(dfl_be *be)
{
    dfl_be_mem m = {0};
    return be->ops->mem_info(be, &m, NULL) == 0 ? m.free : 0;
}

#endif
