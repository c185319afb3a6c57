/* draft_workspace.c: the drafter's workspace, planned and carved out of one backend allocation
 * (the arena): the input sets' backend arrays, every activation the backward needs (a backend
 * that is short of memory could recompute a layer's forward instead: each layer's forward reads
 * only its input residual, C and the weights), the gradients of the activations and the LM
 * head's scratch, sized by dfl_draft_reserve for the largest batch; a step allocates nothing.
 * The same carving, run once without a base, is the plan: it counts the bytes. */
#include "draft_int.h"

#include <stdlib.h>
#include <string.h>

#include "util.h"

int dfl_draft_set_feat_dtype(dfl_draft *m, dfl_dtype dt, dfl_err *e)
{
    if (dt != DFL_BF16 && dt != DFL_F16 && dt != DFL_F32)
        return dfl_fail(e, DFL_EUNSUP, "drafter: feature dtype %s", dfl_dtype_name(dt));
    if (m->arena && dt != m->feat_dt)
        return dfl_fail(e, DFL_EUSAGE, "drafter: feature dtype set after the workspace");
    m->feat_dt = dt;
    return DFL_OK;
}

/* Frees the arena and the input sets' host arrays (the caller made sure that no copy is in
 * flight: dfl_draft_reserve grows only on a synchronous backend, and close drains first). */
void dfl_draft_free_workspace(dfl_draft *m)
{
    if (m->arena)
        m->be->ops->free(m->be, m->arena);
    m->arena = NULL;
    for (int i = 0; i < m->n_sets; i++) {
        in_set *s = &m->sets[i];
        m->be->ops->host_free(m->be, s->hblock);
        s->hblock = NULL;
        s->full = s->uploaded = s->read = false;
    }
    free(m->h_seq_start);
    m->h_seq_start = NULL;
    memset(&m->h_in, 0, sizeof m->h_in);
    m->capT = m->capB = m->capS = 0;
}

/* Carves buffers out of one arena: first pass counts, second assigns. */
typedef struct carver {
    char *base;
    size_t off;
} carver;

static void *carve(carver *cv, size_t bytes)
{
    cv->off = DFL_ALIGN_UP(cv->off, 256);
    void *p = cv->base ? cv->base + cv->off : NULL;
    cv->off += bytes ? bytes : 1;
    return p;
}

/* An input set's arrays: the host ones (host) or the backend ones. */
static void carve_set(dfl_draft *m, carver *cv, in_set *s, bool host)
{
    const dfl_draft_config *c = &m->c;
    const int64_t T = m->capT, B = m->capB, Q = B * c->block_size;
    int32_t *pos = carve(cv, (size_t)(T + Q) * 4), *tok = carve(cv, (size_t)Q * 4),
            *labels = carve(cv, (size_t)Q * 4), *ctx_start = carve(cv, (size_t)B * 4),
            *anchor = carve(cv, (size_t)B * 4);
    float *weight = carve(cv, (size_t)Q * 4);
    void *feat = carve(cv, (size_t)c->n_feat * T * c->hidden * dfl_dtype_size(m->feat_dt));
    *(host ? &s->h : &s->d) = (step_arrays){.pos = pos, .tok = tok, .labels = labels,
                                            .weight = weight, .ctx_start = ctx_start,
                                            .anchor = anchor, .feat = feat};
}

static void carve_all(dfl_draft *m, carver *cv)
{
    const dfl_draft_config *c = &m->c;
    const size_t as = dfl_dtype_size(m->be->act);
    const int64_t T = m->capT, Q = m->capB * c->block_size, H = c->hidden, I = c->intermediate;
    const int64_t NQ = (int64_t)c->n_heads * c->head_dim, NK = (int64_t)c->n_kv * c->head_dim;
    const int64_t TQ = T + Q, Qs = m->capB * (c->block_size - 1);
    for (int i = 0; i < m->n_sets; i++)
        carve_set(m, cv, &m->sets[i], false);
    m->scored_rows = carve(cv, (size_t)Qs * 4);
    m->row_scored = carve(cv, (size_t)Q * 4);
    m->pair_rows = carve(cv, (size_t)(2 * m->capB + 1) * 4);
    m->row_pair = carve(cv, (size_t)Q * 4);
    m->labels_s = carve(cv, (size_t)Qs * 4);
    m->weight_s = carve(cv, (size_t)Qs * 4);
    m->correct_s = carve(cv, (size_t)Qs);
    m->ce = carve(cv, (size_t)Qs * 4);
    m->correct = carve(cv, (size_t)Q);
    m->featc = m->feat_dt != m->be->act ? carve(cv, (size_t)c->n_feat * T * H * as) : NULL;
    m->cpre = carve(cv, (size_t)T * H * as);
    m->C = carve(cv, (size_t)T * H * as);
    m->rstdc = carve(cv, (size_t)T * 4);
    for (int l = 0; l < c->n_layers; l++) {
        layer_acts *a = &m->la[l];
        a->hin = carve(cv, (size_t)Q * H * as);
        a->x = carve(cv, (size_t)Q * H * as);
        a->rstd1 = carve(cv, (size_t)Q * 4);
        a->qraw = carve(cv, (size_t)Q * NQ * as);
        a->q = carve(cv, (size_t)Q * NQ * as);
        a->rstdq = carve(cv, (size_t)Q * c->n_heads * 4);
        a->kraw = carve(cv, (size_t)TQ * NK * as);
        a->k = carve(cv, (size_t)TQ * NK * as);
        a->rstdk = carve(cv, (size_t)TQ * c->n_kv * 4);
        a->v = carve(cv, (size_t)TQ * NK * as);
        a->o = carve(cv, (size_t)Q * NQ * as);
        a->lse = carve(cv, (size_t)Q * c->n_heads * 4);
        a->hmid = carve(cv, (size_t)Q * H * as);
        a->rstd2 = carve(cv, (size_t)Q * 4);
        a->y = carve(cv, (size_t)Q * H * as);
        a->gu = carve(cv, (size_t)Q * 2 * I * as);
        a->act = carve(cv, (size_t)Q * I * as);
    }
    m->os = carve(cv, (size_t)Qs * NQ * as);
    m->hL = carve(cv, (size_t)Qs * H * as);
    m->rstd_s = carve(cv, (size_t)Qs * 4);
    m->lm_work = carve(cv, (size_t)dfl_lmce_work_act(m->chunk, c->vocab, m->be->act) * 4);
    m->dh = carve(cv, (size_t)Q * H * as);
    m->dx = carve(cv, (size_t)Q * H * as);
    m->dact = carve(cv, (size_t)Q * I * as);
    m->dgu = carve(cv, (size_t)Q * 2 * I * as);
    m->dout = carve(cv, (size_t)Q * NQ * as);
    m->dq = carve(cv, (size_t)Q * NQ * as);
    m->dk = carve(cv, (size_t)TQ * NK * as);
    m->dv = carve(cv, (size_t)TQ * NK * as);
    m->delta = carve(cv, (size_t)Q * c->n_heads * 4);
    m->dC = carve(cv, (size_t)T * H * as);
}

/* The constant maps between the rows of a step and its scored rows (see scored_rows). */
static int upload_row_maps(dfl_draft *m, dfl_err *e)
{
    const int bs = m->c.block_size;
    const int64_t B = m->capB, Q = B * bs, Qs = B * (bs - 1);
    int32_t *h = malloc((size_t)(2 * Q + Qs + 2 * B + 1) * sizeof *h);
    if (!h)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int32_t *sr = h, *rs = h + Qs, *pr = rs + Q, *rp = pr + 2 * B + 1;
    for (int64_t q = 0; q < Q; q++) {
        const int64_t j = q % bs, i = q / bs * (bs - 1) + j - 1;
        rs[q] = j ? (int32_t)i : -1;
        if (j)
            sr[i] = (int32_t)q;
        rp[q] = (int32_t)(2 * (q / bs) + (j ? 1 : 0));
    }
    for (int64_t p = 0; p <= 2 * B; p++)
        pr[p] = (int32_t)(p / 2 * bs + p % 2);
    int rc = m->be->ops->upload(m->be, m->scored_rows, sr, (size_t)Qs * sizeof *h);
    if (!rc)
        rc = m->be->ops->upload(m->be, m->row_scored, rs, (size_t)Q * sizeof *h);
    if (!rc)
        rc = m->be->ops->upload(m->be, m->pair_rows, pr, (size_t)(2 * B + 1) * sizeof *h);
    if (!rc)
        rc = m->be->ops->upload(m->be, m->row_pair, rp, (size_t)Q * sizeof *h);
    free(h);
    return rc ? dfl_fail(e, rc, "drafter workspace: cannot upload the row maps") : DFL_OK;
}

int dfl_draft_reserve(dfl_draft *m, int64_t max_tokens, int64_t max_blocks, int64_t lmce_chunk,
                      dfl_err *e)
{
    if (lmce_chunk <= 0) {
        /* CPU: small chunks stay in cache. GPU: each chunk re-reads the whole [V, H] head, so
         * chunks must be large for the two GEMMs to be compute-bound (1024 rows x 152K vocab
         * = 622 MB of f32 work space), but no larger than the rows there are. */
        lmce_chunk = m->be->lmce_rows > 0 ? m->be->lmce_rows : 64;
        int64_t rows = (max_blocks < 1 ? 1 : max_blocks) * (m->c.block_size - 1);
        if (lmce_chunk > rows)
            lmce_chunk = rows;
    }
    if (max_tokens < 1)
        max_tokens = 1;
    if (max_blocks < 1)
        max_blocks = 1;
    if (m->arena && max_tokens <= m->capT && max_blocks <= m->capB && lmce_chunk <= m->chunk)
        return DFL_OK;
    if (m->arena) {
        if (max_tokens < m->capT)
            max_tokens = m->capT;
        if (max_blocks < m->capB)
            max_blocks = m->capB;
        if (lmce_chunk < m->chunk)
            lmce_chunk = m->chunk;
    }
    if (max_tokens > INT32_MAX / 2 || max_blocks > INT32_MAX / DFL_DRAFT_MAX_BS)
        return dfl_fail(e, DFL_EUNSUP, "drafter: %lld tokens / %lld blocks per batch is too many",
                        (long long)max_tokens, (long long)max_blocks);
    if (m->arena && m->be->async)
        return dfl_fail(e, DFL_EUSAGE, "drafter: the %s workspace is sized once (%lld tokens, "
                        "%lld blocks); %lld tokens, %lld blocks do not fit", m->be->name,
                        (long long)m->capT, (long long)m->capB, (long long)max_tokens,
                        (long long)max_blocks);
    for (int i = 0; i < m->n_sets; i++)
        if (m->sets[i].full)
            return dfl_fail(e, DFL_EUSAGE, "drafter: workspace resized with a batch staged");
    dfl_draft_free_workspace(m);
    m->capT = max_tokens;
    m->capB = max_blocks;
    m->chunk = lmce_chunk;
    carver cv = {NULL, 0};
    carve_all(m, &cv);
    uint64_t avail = dfl_be_mem_free(m->be), margin = 256ull << 20;   /* cuBLAS, kernels */
    if (avail && cv.off + margin > avail) {
        char b1[32], b2[32], b3[32];
        int64_t T = m->capT, B = m->capB;
        m->capT = m->capB = 0;
        return dfl_fail(e, DFL_ENOMEM, "%s: batches of up to %lld tokens and %lld blocks need %s "
                        "of device memory for the drafter's workspace (and %s of margin), but only "
                        "%s is free with the weights loaded; lower --max-tokens / --max-blocks "
                        "(or --num-anchors)", m->be->name, (long long)T, (long long)B,
                        dfl_fmt_bytes((double)cv.off, b1, sizeof b1),
                        dfl_fmt_bytes((double)margin, b2, sizeof b2),
                        dfl_fmt_bytes((double)avail, b3, sizeof b3));
    }
    m->arena = be_alloc(m->be, cv.off, e);
    if (!m->arena) {
        char b1[32];
        m->capT = m->capB = 0;
        return e ? dfl_err_prefix(e, "drafter workspace for %lld tokens, %lld blocks (%s): ",
                                  (long long)max_tokens, (long long)max_blocks,
                                  dfl_fmt_bytes((double)cv.off, b1, sizeof b1)) : DFL_ENOMEM;
    }
    m->ws_bytes = cv.off;
    cv.base = m->arena;
    cv.off = 0;
    carve_all(m, &cv);
    m->be->ops->memset0(m->be, m->arena, cv.off);
    int rc = upload_row_maps(m, e);
    if (rc) {
        dfl_draft_free_workspace(m);
        return rc;
    }
    for (int i = 0; i < m->n_sets; i++) {
        carver hc = {NULL, 0};
        carve_set(m, &hc, &m->sets[i], true);
        if (!(m->sets[i].hblock = m->be->ops->host_alloc(m->be, hc.off, e))) {
            dfl_draft_free_workspace(m);
            return e ? e->code : DFL_ENOMEM;
        }
        hc.base = m->sets[i].hblock;
        hc.off = 0;
        carve_set(m, &hc, &m->sets[i], true);
    }
    m->capS = m->capT;
    m->h_seq_start = malloc((size_t)(m->capS + 1) * sizeof(int64_t));
    if (!m->h_seq_start) {
        dfl_draft_free_workspace(m);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    return DFL_OK;
}

void dfl_draft_capacity(const dfl_draft *m, int64_t *max_tokens, int64_t *max_blocks,
                        uint64_t *bytes)
{
    *max_tokens = m->capT;
    *max_blocks = m->capB;
    if (bytes)
        *bytes = m->arena ? m->ws_bytes : 0;
}
