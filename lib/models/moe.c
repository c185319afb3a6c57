/* moe.c: the mixture-of-experts MLP on the backend ops (see moe.h). */
#include "moe.h"

#include "util.h"

#define MOE_ALIGN 256

/* The buffers' sizes in bytes, in carve order (false on overflow). */
#define MOE_BUFS 13

static bool moe_sizes(const dfl_hf_config *c, const dfl_be *be, int64_t T, uint64_t b[MOE_BUFS])
{
    if (c->n_experts <= 0 || T < 1)
        return false;
    uint64_t E = (uint64_t)c->n_experts, k = (uint64_t)c->top_k, H = (uint64_t)c->hidden_size;
    uint64_t Im = (uint64_t)c->moe_intermediate, as = dfl_dtype_size(be->act);
    uint64_t cap = (uint64_t)dfl_moe_cap(T, c->n_experts, c->top_k), t = (uint64_t)T;
    if (t > (1ull << 31) / k || cap >= (1ull << 31))
        return false; /* grouped rows are int32 */
    uint64_t Is = (uint64_t)c->shared_intermediate, ts = Is ? t : 0;
    uint64_t n[MOE_BUFS][2] = {{t * E, 4}, {t * k, 4}, {t * k, 4}, {E, 4}, {E + 1, 4}, {cap, 4},
                               {t * k, 4}, {cap * Im, as}, {cap * H, as}, {ts, 4}, {ts * 2 * Is, as}, {ts * Is, as},
                               {ts * H, as}};
    for (int i = 0; i < MOE_BUFS; i++) {
        if (!dfl_mul_u64(n[i][0], n[i][1], &b[i]) || b[i] > UINT64_MAX / 4)
            return false;
        b[i] = (b[i] + MOE_ALIGN - 1) / MOE_ALIGN * MOE_ALIGN;
    }
    return true;
}

uint64_t dfl_moe_ws_bytes(const dfl_hf_config *c, const dfl_be *be, int64_t max_tokens)
{
    uint64_t b[MOE_BUFS], total = 0;
    if (!moe_sizes(c, be, max_tokens, b))
        return 0;
    for (int i = 0; i < MOE_BUFS; i++)
        if (!dfl_add_u64(total, b[i], &total))
            return 0;
    return total;
}

void dfl_moe_ws_carve(const dfl_hf_config *c, const dfl_be *be, int64_t max_tokens, void *block,
                      dfl_moe_ws *m)
{
    uint64_t b[MOE_BUFS];
    moe_sizes(c, be, max_tokens, b);
    m->max_tokens = max_tokens;
    m->cap = dfl_moe_cap(max_tokens, c->n_experts, c->top_k);
    void **ptrs[MOE_BUFS] = {(void **)&m->logits, (void **)&m->idx, (void **)&m->weight,
                             (void **)&m->counts, (void **)&m->offsets, (void **)&m->rows,
                             (void **)&m->slot, &m->act, &m->y,
                             (void **)&m->sg, &m->sgu, &m->sact, &m->sy};
    char *at = block;
    for (int i = 0; i < MOE_BUFS; i++) {
        *ptrs[i] = b[i] ? at : NULL;
        at += b[i];
    }
}

int dfl_moe_forward(dfl_be *be, const dfl_hf_config *c, const dfl_moe_ws *m,
                    const dfl_moe_weights *w, const void *x, int64_t T, void *out,
                    bool accumulate, float *router_out)
{
    const dfl_be_ops *ops = be->ops;
    int64_t H = c->hidden_size, Im = c->moe_intermediate, E = c->n_experts;
    int k = (int)c->top_k;
    int64_t cap = dfl_moe_cap(T, E, k);
    if (T > m->max_tokens)
        return DFL_EUSAGE;
    int rc;
    /* router logits in f32 from the (act) normed hidden state */
    dfl_mm g = {
        .M = T, .N = E, .K = H,
        .A = x, .adt = be->act, .lda = H, .ta = false,
        .B = w->router, .bdt = be->wdt, .ldb = H, .tb = true,
        .C = m->logits, .cdt = DFL_F32, .ldc = E,
        .alpha = 1.0f, .beta = 0.0f,
    };
    if ((rc = ops->matmul(be, &g)))
        return rc;
    if (router_out && (rc = ops->copy(be, router_out, m->logits, (size_t)(T * E) * sizeof(float))))
        return rc;
    dfl_moe_route r = {
        .logits = m->logits, .T = T, .E = (int)E, .k = k, .norm_topk = c->norm_topk_prob,
        .idx = m->idx, .weight = m->weight, .counts = m->counts, .offsets = m->offsets,
        .rows = m->rows, .slot = m->slot, .cap = cap,
    };
    if ((rc = ops->moe_route(be, &r)))
        return rc;
    /* gate|up with the gather of x's rows and the SwiGLU fused in: act directly */
    dfl_moe_mm up = {.A = x, .W = w->wgu, .C = m->act, .counts = m->counts, .offsets = m->offsets,
                     .rows = m->rows, .swiglu = true, .E = (int)E, .N = 2 * Im, .K = H,
                     .cap = cap};
    dfl_moe_mm down = {.A = m->act, .W = w->wdown, .C = m->y, .counts = m->counts,
                       .offsets = m->offsets, .E = (int)E, .N = H, .K = Im, .cap = cap};
    if ((rc = ops->moe_matmul(be, &up)) || (rc = ops->moe_matmul(be, &down)))
        return rc;
    const void *sy = NULL;
    if (c->shared_intermediate) {
        /* the shared expert: a dense SwiGLU MLP of every token, and its gate logit in f32 */
        int64_t Is = c->shared_intermediate;
        dfl_mm su = {
            .M = T, .N = 2 * Is, .K = H,
            .A = x, .adt = be->act, .lda = H, .B = w->sgu, .bdt = be->wdt, .ldb = H, .tb = true,
            .C = m->sgu, .cdt = be->act, .ldc = 2 * Is, .alpha = 1.0f,
        };
        dfl_mm sd = {
            .M = T, .N = H, .K = Is,
            .A = m->sact, .adt = be->act, .lda = Is, .B = w->sdown, .bdt = be->wdt, .ldb = Is,
            .tb = true, .C = m->sy, .cdt = be->act, .ldc = H, .alpha = 1.0f,
        };
        dfl_mm sg = {
            .M = T, .N = 1, .K = H,
            .A = x, .adt = be->act, .lda = H, .B = w->sgate, .bdt = be->wdt, .ldb = H, .tb = true,
            .C = m->sg, .cdt = DFL_F32, .ldc = 1, .alpha = 1.0f,
        };
        if ((rc = ops->matmul(be, &su)) || (rc = ops->swiglu(be, m->sact, m->sgu, T, Is)) ||
            (rc = ops->matmul(be, &sd)) || (rc = ops->matmul(be, &sg)))
            return rc;
        sy = m->sy;
    }
    return ops->moe_combine(be, out, m->y, m->slot, m->weight, T, k, H, accumulate, sy,
                            sy ? m->sg : NULL);
}
