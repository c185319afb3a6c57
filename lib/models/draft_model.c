/* draft_model.c: the DFlash drafter object (draft_int.h): open and close, its parameters (the
 * f32 master copy, the compute weights, the gradients and AdamW moments in flat buffers; the
 * frozen target embedding and LM head), their upload and download, and the step's activations
 * read back for the tests. The math is draft_step.c, the workspace draft_workspace.c, the staging
 * and the step's driver draft_stage.c. */
#include "draft_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "draft_rng.h"

const dfl_draft_config *dfl_draft_cfg(const dfl_draft *m) { return &m->c; }
const dfl_draft_tensor *dfl_draft_tensor_list(const dfl_draft *m, int *n)
{
    *n = m->n_tensors;
    return m->tensors;
}
int64_t dfl_draft_flat_len(const dfl_draft *m) { return m->flat; }

static int64_t find_off(const dfl_draft *m, const char *name)
{
    for (int i = 0; i < m->n_tensors; i++)
        if (strcmp(m->tensors[i].name, name) == 0)
            return m->tensors[i].offset;
    return -1;
}

int dfl_draft_open(dfl_draft **out, dfl_be *be, const dfl_draft_config *c, dfl_err *e)
{
    *out = NULL;
    int rc = dfl_draft_config_check(c, e);
    if (rc)
        return rc;
    const dfl_be_ops *o = be->ops;
    if (!o->rmsnorm_bwd || !o->qknorm_rope_bwd || !o->swiglu_bwd || !o->dflash_attn ||
        !o->dflash_attn_bwd || !o->lmce || !o->sumsq || !o->clip_scale || !o->block_metrics ||
        !o->adamw || !o->uniform_noise || !o->gather_rows)
        return dfl_fail(e, DFL_EUNSUP, "the %s backend has no drafter training ops yet (use "
                        "--device cpu)", be->name);
    dfl_draft *m = calloc(1, sizeof *m);
    if (!m)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    m->be = be;
    m->c = *c;
    m->n_tensors = dfl_draft_tensors(c, &m->tensors, &m->flat);
    m->lw = calloc((size_t)c->n_layers, sizeof *m->lw);
    m->la = calloc((size_t)c->n_layers, sizeof *m->la);
    if (m->n_tensors < 0 || !m->lw || !m->la) {
        dfl_draft_close(m);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    m->off_fc = find_off(m, "fc.weight");
    m->off_hnorm = find_off(m, "hidden_norm.weight");
    m->off_norm = find_off(m, "norm.weight");
    for (int l = 0; l < c->n_layers; l++) {
        char nm[96];
#define OFF(field, s) (snprintf(nm, sizeof nm, "layers.%d.%s", l, s), m->lw[l].field = find_off(m, nm))
        OFF(in_ln, "input_layernorm.weight");
        OFF(wq, "self_attn.q_proj.weight");
        OFF(wk, "self_attn.k_proj.weight");
        OFF(wv, "self_attn.v_proj.weight");
        OFF(wo, "self_attn.o_proj.weight");
        OFF(q_norm, "self_attn.q_norm.weight");
        OFF(k_norm, "self_attn.k_norm.weight");
        OFF(post_ln, "post_attention_layernorm.weight");
        OFF(wgu, "mlp.gate_proj.weight");
        OFF(wdown, "mlp.down_proj.weight");
#undef OFF
    }
    for (int j = 0; j < c->block_size; j++)
        m->decay[j] = (float)exp(-(double)(j > 1 ? j - 1 : 0) / c->gamma);
    size_t fb = (size_t)m->flat * sizeof(float);
    m->master = be_alloc(be, fb, e);
    m->grad = m->master ? be_alloc(be, fb, e) : NULL;
    m->adam_m = m->grad ? be_alloc(be, fb, e) : NULL;
    m->adam_v = m->adam_m ? be_alloc(be, fb, e) : NULL;
    if (!m->adam_v) {
        dfl_draft_close(m);
        return e ? e->code : DFL_ENOMEM;
    }
    if (be->wdt == DFL_F32) {
        m->wts = m->master;
    } else {
        m->wts = be_alloc(be, (size_t)m->flat * dfl_dtype_size(be->wdt), e);
        if (!m->wts) {
            dfl_draft_close(m);
            return e ? e->code : DFL_ENOMEM;
        }
        be->ops->memset0(be, m->wts, (size_t)m->flat * dfl_dtype_size(be->wdt));
    }
    be->ops->memset0(be, m->master, fb);
    be->ops->memset0(be, m->grad, fb);
    be->ops->memset0(be, m->adam_m, fb);
    be->ops->memset0(be, m->adam_v, fb);
    m->feat_dt = DFL_F32;
    if ((rc = dfl_draft_stage_open(m, e))) {
        dfl_draft_close(m);
        return rc;
    }
    *out = m;
    return DFL_OK;
}

void dfl_draft_close(dfl_draft *m)
{
    if (!m)
        return;
    dfl_be *be = m->be;
    dfl_draft_stage_drain(m);
    dfl_draft_free_workspace(m);
    dfl_draft_stage_close(m);
    if (m->wts && m->wts != m->master)
        be->ops->free(be, m->wts);
    if (m->lm_head && m->lm_head != m->embed)
        be->ops->free(be, m->lm_head);
    if (m->embed)
        be->ops->free(be, m->embed);
    if (m->master)
        be->ops->free(be, m->master);
    if (m->grad)
        be->ops->free(be, m->grad);
    if (m->adam_m)
        be->ops->free(be, m->adam_m);
    if (m->adam_v)
        be->ops->free(be, m->adam_v);
    free(m->tensors);
    free(m->lw);
    free(m->la);
    free(m);
}

/* master (host copy) -> backend master and compute weights */
static int push_master(dfl_draft *m, const float *host, dfl_err *e)
{
    dfl_be *be = m->be;
    int rc = be->ops->upload(be, m->master, host, (size_t)m->flat * sizeof(float));
    if (!rc && m->wts != m->master)
        rc = be->ops->convert(be, m->wts, be->wdt, m->master, DFL_F32, m->flat);
    if (rc)
        return dfl_fail(e, rc, "drafter: cannot upload the weights");
    return DFL_OK;
}

/* Fresh weights, in parallel and the same for any number of threads: each tensor's elements
 * go in pieces of INIT_PIECE, each piece from its own generator seeded by (seed, tensor,
 * piece), two normals per Box-Muller pair (cos and sin). One serial generator took ~30-80 ns
 * an element, a minute or two for the 1.7e9 weights of a Qwen3.6-27B drafter. */
#define INIT_PIECE (1 << 20)

int dfl_draft_init_random(dfl_draft *m, uint64_t seed, double std, dfl_err *e)
{
    float *h = calloc((size_t)m->flat, sizeof *h);   /* padding between tensors stays 0 */
    int64_t *first = malloc(((size_t)m->n_tensors + 1) * sizeof *first);
    if (!h || !first) {
        free(h);
        free(first);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    /* pieces numbered across tensors: tensor i has pieces first[i] .. first[i+1]-1 */
    first[0] = 0;
    for (int i = 0; i < m->n_tensors; i++)
        first[i + 1] = first[i] + (m->tensors[i].numel + INIT_PIECE - 1) / INIT_PIECE;
    const int64_t n_pieces = first[m->n_tensors];
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t p = 0; p < n_pieces; p++) {
        int i = 0;
        while (first[i + 1] <= p)
            i++;
        const dfl_draft_tensor *t = &m->tensors[i];
        const int64_t j0 = (p - first[i]) * INIT_PIECE;
        const int64_t n = t->numel - j0 < INIT_PIECE ? t->numel - j0 : INIT_PIECE;
        float *out = h + t->offset + j0;
        if (t->ndim == 1) {
            for (int64_t j = 0; j < n; j++)
                out[j] = 1.0f;
            continue;
        }
        dfl_rng r;
        dfl_rng_seed(&r, dfl_hash2(dfl_hash2(seed, (uint64_t)i), (uint64_t)(p - first[i])));
        for (int64_t j = 0; j < n; j += 2) {
            double a, b;
            dfl_rng_normal2(&r, &a, &b);
            out[j] = (float)(std * a);
            if (j + 1 < n)
                out[j + 1] = (float)(std * b);
        }
    }
    free(first);
    int rc = push_master(m, h, e);
    free(h);
    return rc;
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
}

int dfl_draft_load_weights(dfl_draft *m, const dfl_st_file *f, const char *prefix, dfl_err *e)
{
    float *h = calloc((size_t)m->flat, sizeof *h);
    if (!h)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int rc = DFL_OK;
    for (int i = 0; i < m->n_tensors && !rc; i++) {
        const dfl_draft_tensor *t = &m->tensors[i];
        char nm[160];
        snprintf(nm, sizeof nm, "%s%s", prefix, t->name);
        const dfl_st_tensor *s = dfl_st_find(f, nm);
        if (!s) {
            rc = dfl_fail(e, DFL_EMISMATCH, "%s: no tensor '%s'", f->path, nm);
            break;
        }
        bool ok = s->ndim == t->ndim && s->shape[0] == t->shape[0] &&
                  (t->ndim == 1 || s->shape[1] == t->shape[1]);
        if (!ok) {
            char have[96], need[64];
            shape_str(have, sizeof have, s->ndim, s->shape);
            shape_str(need, sizeof need, t->ndim, t->shape);
            rc = dfl_fail(e, DFL_EMISMATCH, "%s: tensor '%s' has shape %s, the drafter needs %s",
                          f->path, nm, have, need);
            break;
        }
        if (!dfl_dtype_is_float(s->dtype) ||
            !dfl_convert(h + t->offset, DFL_F32, s->data, s->dtype, (size_t)t->numel))
            rc = dfl_fail(e, DFL_EUNSUP, "%s: tensor '%s' has dtype %s (need a float type)", f->path,
                          nm, dfl_dtype_name(s->dtype));
    }
    if (!rc)
        rc = push_master(m, h, e);
    free(h);
    return rc;
}

static int upload_frozen(dfl_draft *m, void **dst, const dfl_st_tensor *t, const char *what, dfl_err *e)
{
    dfl_be *be = m->be;
    const int64_t V = m->c.vocab, H = m->c.hidden;
    if (t->ndim != 2 || t->shape[0] != V || t->shape[1] != H)
        return dfl_fail(e, DFL_EMISMATCH, "%s '%s': shape [%lld, %lld], the drafter needs [%lld, %lld] "
                        "(vocab, hidden)", what, t->name, (long long)(t->ndim > 0 ? t->shape[0] : 0),
                        (long long)(t->ndim > 1 ? t->shape[1] : 0), (long long)V, (long long)H);
    if (!dfl_dtype_is_float(t->dtype))
        return dfl_fail(e, DFL_EUNSUP, "%s '%s': dtype %s is not a float type", what, t->name,
                        dfl_dtype_name(t->dtype));
    size_t n = (size_t)(V * H);
    *dst = be_alloc(be, n * dfl_dtype_size(be->wdt), e);
    if (!*dst)
        return e ? e->code : DFL_ENOMEM;
    /* convert on the host in slices, upload each */
    const size_t slice = 1 << 20;
    void *tmp = malloc(slice * dfl_dtype_size(be->wdt));
    if (!tmp)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    size_t es = dfl_dtype_size(t->dtype), ds = dfl_dtype_size(be->wdt);
    for (size_t i = 0; i < n; i += slice) {
        size_t k = n - i < slice ? n - i : slice;
        dfl_convert(tmp, be->wdt, (const char *)t->data + i * es, t->dtype, k);
        be->ops->upload(be, (char *)*dst + i * ds, tmp, k * ds);
    }
    free(tmp);
    return DFL_OK;
}

int dfl_draft_set_frozen(dfl_draft *m, const dfl_st_tensor *embed, const dfl_st_tensor *lm_head,
                         dfl_err *e)
{
    int rc = upload_frozen(m, &m->embed, embed, "target embedding", e);
    if (rc)
        return rc;
    if (!lm_head) {
        m->lm_head = m->embed;
        return DFL_OK;
    }
    return upload_frozen(m, &m->lm_head, lm_head, "target LM head", e);
}

static float *flat_ptr(dfl_draft *m, int which)
{
    return which == DFL_DRAFT_MASTER ? m->master : which == DFL_DRAFT_GRAD ? m->grad
         : which == DFL_DRAFT_ADAM_M ? m->adam_m : m->adam_v;
}

int dfl_draft_download(dfl_draft *m, int which, float *dst, dfl_err *e)
{
    if (m->be->ops->download(m->be, dst, flat_ptr(m, which), (size_t)m->flat * sizeof(float)))
        return dfl_fail(e, DFL_EDEVICE, "drafter: download failed");
    return m->be->ops->sync(m->be, e);
}

int dfl_draft_upload(dfl_draft *m, int which, const float *src, dfl_err *e)
{
    if (which == DFL_DRAFT_MASTER)
        return push_master(m, src, e);
    if (m->be->ops->upload(m->be, flat_ptr(m, which), src, (size_t)m->flat * sizeof(float)))
        return dfl_fail(e, DFL_EDEVICE, "drafter: upload failed");
    return DFL_OK;
}

/* DFL_DRAFT_ACT_CE: the scored rows' cross-entropies, spread over the step's rows (0 at slot 0,
 * as for every unscored row). */
static int ce_rows(dfl_draft *m, float *dst, int64_t n, dfl_err *e)
{
    const int bs = m->c.block_size;
    const int64_t Qs = m->B * (bs - 1);
    if (n < m->Q)
        return dfl_fail(e, DFL_EUSAGE, "activation buffer of %lld for %lld values", (long long)n,
                        (long long)m->Q);
    if (Qs > 0 && m->be->ops->download(m->be, dst, m->ce, (size_t)Qs * sizeof *dst))
        return dfl_fail(e, DFL_EDEVICE, "drafter: download failed");
    int rc = m->be->ops->sync(m->be, e);
    /* backwards: the scored row of q is below q, so it is read before it is overwritten */
    for (int64_t q = m->Q - 1; q >= 0 && !rc; q--)
        dst[q] = q % bs ? dst[q / bs * (bs - 1) + q % bs - 1] : 0.0f;
    return rc;
}

int dfl_draft_activation(dfl_draft *m, int which, int layer, float *dst, int64_t n, dfl_err *e)
{
    dfl_be *be = m->be;
    const int64_t H = m->c.hidden;
    const size_t as = dfl_dtype_size(be->act);
    const void *src = NULL;
    int64_t need = 0;
    switch (which) {
    case DFL_DRAFT_ACT_CTX: src = m->C; need = m->T * H; break;
    case DFL_DRAFT_ACT_LAYER:
        if (layer < 0 || layer >= m->c.n_layers)
            return dfl_fail(e, DFL_EUSAGE, "no layer %d", layer);
        need = m->Q * H;
        if (layer + 1 < m->c.n_layers) {
            src = m->la[layer + 1].hin;
            break;
        }
        /* the last layer's output exists at the scored rows only: spread, 0 at slot 0 */
        TRY(be->ops->gather_rows(be, m->dx, m->hL, m->row_scored, m->Q, H * (int64_t)as));
        src = m->dx;
        break;
    case DFL_DRAFT_ACT_OUT:   /* z: the norm again (of the scored rows, into dh), spread into dx */
        TRY(be->ops->rmsnorm(be, m->dh, NULL, m->hL, (const char *)m->wts + m->off_norm *
                             dfl_dtype_size(be->wdt), m->B * (m->c.block_size - 1), H,
                             (float)m->c.rms_eps));
        TRY(be->ops->gather_rows(be, m->dx, m->dh, m->row_scored, m->Q, H * (int64_t)as));
        src = m->dx;
        need = m->Q * H;
        break;
    case DFL_DRAFT_ACT_CE: return ce_rows(m, dst, n, e);
    case DFL_DRAFT_ACT_WEIGHT: memcpy(dst, m->h_in.weight, (size_t)(n < m->Q ? n : m->Q) * 4); return DFL_OK;
    case DFL_DRAFT_ACT_LABEL:
        for (int64_t i = 0; i < m->Q && i < n; i++)
            dst[i] = (float)m->h_in.labels[i];
        return DFL_OK;
    default: return dfl_fail(e, DFL_EUSAGE, "unknown activation %d", which);
    }
    if (n < need)
        return dfl_fail(e, DFL_EUSAGE, "activation buffer of %lld for %lld values", (long long)n,
                        (long long)need);
    dfl_dtype dt = be->act;
    if (dt == DFL_F32)
        TRY(be->ops->download(be, dst, src, (size_t)need * 4));
    else {
        void *tmp = malloc((size_t)need * dfl_dtype_size(dt));
        if (!tmp)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        be->ops->download(be, tmp, src, (size_t)need * dfl_dtype_size(dt));
        dfl_convert(dst, DFL_F32, tmp, dt, (size_t)need);
        free(tmp);
    }
    return be->ops->sync(be, e);
}
