/* target.c: the target model on a backend: loading (checked tensor table, host conversion to
 * the backend's weight dtype, fused q|k|v and gate|up matrices), activation buffers, and the
 * packed variable-length prefill forward that captures chosen layers (see target.h): one
 * layer_forward per decoder layer, its mixer dispatched on the layer's kind (dense or gated
 * attention here, Gated DeltaNet in gdn.c). */
#include "target.h"

#include "batch_check.h"
#include "target_fwd.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "log.h"
#include "safetensors.h"
#include "util.h"

/* ---- loading ---- */

#define STAGE_ELEMS ((size_t)1 << 22) /* host staging for conversion: 4M elements */

typedef struct loader {
    dfl_target *t;
    const dfl_st_model *m;
    void *stage;           /* [STAGE_ELEMS] of max(wdt, f32) */
} loader;

/* Backend buffer of n elements of dt, counted in t->weight_bytes. */
static void *walloc(dfl_target *t, uint64_t n, dfl_dtype dt, const char *what, dfl_err *e)
{
    size_t bytes = (size_t)n * dfl_dtype_size(dt);
    void *p = t->be->ops->alloc(t->be, bytes, e);
    if (!p) {
        dfl_err_prefix(e, "%s: ", what);
        return NULL;
    }
    t->weight_bytes += bytes;
    return p;
}

/* Converts elements [from, from + n) of tensor src to dt on the host, chunk by chunk, and
 * uploads them to dst starting at element dst_off. */
static int put_range(loader *L, void *dst, uint64_t dst_off, dfl_dtype dt, const dfl_st_tensor *src,
                     uint64_t from, uint64_t n, dfl_err *e)
{
    dfl_be *be = L->t->be;
    size_t ds = dfl_dtype_size(dt), ss = dfl_dtype_size(src->dtype);
    for (uint64_t i = 0; i < n; i += STAGE_ELEMS) {
        size_t m = (size_t)(n - i < STAGE_ELEMS ? n - i : STAGE_ELEMS);
        if (!dfl_convert(L->stage, dt, (const char *)src->data + (from + i) * ss, src->dtype, m))
            return dfl_fail(e, DFL_EUNSUP, "%s: tensor %s: cannot convert %s to %s", src->file,
                            src->name, dfl_dtype_lower(src->dtype), dfl_dtype_lower(dt));
        int rc = be->ops->upload(be, (char *)dst + (dst_off + i) * ds, L->stage, m * ds);
        if (!rc)
            rc = be->ops->sync(be, e); /* the staging buffer is reused next */
        if (rc)
            return dfl_fail(e, rc, "%s: uploading tensor %s to %s failed", src->file, src->name,
                            be->name);
    }
    return DFL_OK;
}

/* The whole tensor src. */
static int put(loader *L, void *dst, uint64_t dst_off, dfl_dtype dt, const dfl_st_tensor *src,
               dfl_err *e)
{
    return put_range(L, dst, dst_off, dt, src, 0, src->numel, e);
}

/* Looks up (and checks) tensor PREFIXlayers.L.SUFFIX of shape [d0], [d0, d1] or [d0, 1, d1]
 * (ndim 3: a depthwise conv1d weight). */
static int get(const dfl_st_model *m, const char *prefix, const dfl_st_tensor **out, int ndim,
               int64_t d0, int64_t d1, dfl_err *e, int64_t l, const char *suffix)
{
    char name[256];
    snprintf(name, sizeof name, "%slayers.%lld.%s", prefix, (long long)l, suffix);
    int64_t shape[3] = {d0, d1, 0};
    if (ndim == 3) {
        shape[1] = 1;
        shape[2] = d1;
    }
    return dfl_st_model_get(m, name, ndim, shape, out, e);
}

/* The shared expert of sparse layer l (models with one): mlp.shared_expert.{gate,up}_proj
 * [Is, H], down_proj [H, Is] and the gate mlp.shared_expert_gate [1, H], checked; with L also
 * uploaded (gate|up fused). */
static int shared_find(const dfl_st_model *m, const char *prefix, const dfl_hf_config *c, int64_t l,
                       loader *L, dfl_err *e)
{
    int64_t H = c->hidden_size, Is = c->shared_intermediate;
    if (!Is)
        return DFL_OK;
    const dfl_st_tensor *g, *u, *dn, *sg;
    int rc;
    if ((rc = get(m, prefix, &g, 2, Is, H, e, l, "mlp.shared_expert.gate_proj.weight")) ||
        (rc = get(m, prefix, &u, 2, Is, H, e, l, "mlp.shared_expert.up_proj.weight")) ||
        (rc = get(m, prefix, &dn, 2, H, Is, e, l, "mlp.shared_expert.down_proj.weight")) ||
        (rc = get(m, prefix, &sg, 2, 1, H, e, l, "mlp.shared_expert_gate.weight")) || !L)
        return rc;
    dfl_moe_weights *w = &L->t->layers[l].moe;
    dfl_dtype wdt = L->t->be->wdt;
    char what[64];
    snprintf(what, sizeof what, "layer %lld shared expert", (long long)l);
    if (!(w->sgu = walloc(L->t, (uint64_t)(2 * Is * H), wdt, what, e)) ||
        !(w->sdown = walloc(L->t, (uint64_t)(H * Is), wdt, what, e)) ||
        !(w->sgate = walloc(L->t, (uint64_t)H, wdt, what, e)))
        return e->code;
    if ((rc = put(L, w->sgu, 0, wdt, g, e)) || (rc = put(L, w->sgu, (uint64_t)(Is * H), wdt, u, e)) ||
        (rc = put(L, w->sdown, 0, wdt, dn, e)))
        return rc;
    return put(L, w->sgate, 0, wdt, sg, e);
}

/* The MoE tensors of sparse layer l, checked: the router mlp.gate [E, H] and every expert's
 * gate/up [Im, H] and down [H, Im] (or, as the published Qwen3.5-MoE checkpoints and
 * transformers 5 store them, all experts stacked: mlp.experts.gate_up_proj [E, 2 Im, H], expert
 * e's gate rows then its up rows, and mlp.experts.down_proj [E, H, Im]), and (qwen3_5_moe) the
 * shared expert's. With L, also uploads them into w (fused gate|up per expert). */
static int moe_find(const dfl_st_model *m, const char *prefix, const dfl_hf_config *c, int64_t l,
                    loader *L, dfl_err *e)
{
    int64_t H = c->hidden_size, Im = c->moe_intermediate, E = c->n_experts;
    const dfl_st_tensor *router, *g, *u, *dn;
    int rc = get(m, prefix, &router, 2, E, H, e, l, "mlp.gate.weight");
    dfl_target_layer *w = L ? &L->t->layers[l] : NULL;
    dfl_dtype wdt = L ? L->t->be->wdt : DFL_F32;
    char what[64];
    snprintf(what, sizeof what, "layer %lld experts", (long long)l);
    if (!rc && w) {
        w->is_moe = true;
        if (!(w->moe.router = walloc(L->t, (uint64_t)(E * H), wdt, what, e)) ||
            !(w->moe.wgu = walloc(L->t, (uint64_t)(E * 2 * Im * H), wdt, what, e)) ||
            !(w->moe.wdown = walloc(L->t, (uint64_t)(E * H * Im), wdt, what, e)))
            return e->code;
        rc = put(L, w->moe.router, 0, wdt, router, e);
    }
    char stacked[256];
    snprintf(stacked, sizeof stacked, "%slayers.%lld.mlp.experts.gate_up_proj", prefix, (long long)l);
    if (!rc && dfl_st_model_find(m, stacked)) {
        int64_t sgu[3] = {E, 2 * Im, H}, sdn[3] = {E, H, Im};
        if ((rc = dfl_st_model_get(m, stacked, 3, sgu, &g, e)))
            return rc;
        snprintf(stacked, sizeof stacked, "%slayers.%lld.mlp.experts.down_proj", prefix, (long long)l);
        if ((rc = dfl_st_model_get(m, stacked, 3, sdn, &dn, e)) ||
            (w && ((rc = put(L, w->moe.wgu, 0, wdt, g, e)) || (rc = put(L, w->moe.wdown, 0, wdt, dn, e)))))
            return rc;
        return shared_find(m, prefix, c, l, L, e);
    }
    for (int64_t x = 0; x < E && !rc; x++) {
        char name[96];
        snprintf(name, sizeof name, "mlp.experts.%lld.gate_proj.weight", (long long)x);
        if ((rc = get(m, prefix, &g, 2, Im, H, e, l, name)))
            break;
        snprintf(name, sizeof name, "mlp.experts.%lld.up_proj.weight", (long long)x);
        if ((rc = get(m, prefix, &u, 2, Im, H, e, l, name)))
            break;
        snprintf(name, sizeof name, "mlp.experts.%lld.down_proj.weight", (long long)x);
        if ((rc = get(m, prefix, &dn, 2, H, Im, e, l, name)))
            break;
        if (w && ((rc = put(L, w->moe.wgu, (uint64_t)(x * 2 * Im * H), wdt, g, e)) ||
                  (rc = put(L, w->moe.wgu, (uint64_t)((x * 2 + 1) * Im * H), wdt, u, e)) ||
                  (rc = put(L, w->moe.wdown, (uint64_t)(x * H * Im), wdt, dn, e))))
            break;
    }
    return rc ? rc : shared_find(m, prefix, c, l, L, e);
}

/* The tensors of one layer, checked. */
typedef struct layer_src {
    const dfl_st_tensor *ln1, *ln2, *q, *k, *v, *o, *qn, *kn, *gate, *up, *down;
    const dfl_st_tensor *bq, *bk, *bv, *bo, *bgate, *bup, *bdown;
    const dfl_st_tensor *in_qkv, *in_z, *in_b, *in_a, *conv, *A_log, *dt_bias, *gnorm, *out;
} layer_src;

static int find_layer(const dfl_st_model *m, const char *prefix, const dfl_hf_config *c, int64_t l,
                      layer_src *s, dfl_err *e)
{
    int64_t H = c->hidden_size, d = c->head_dim, nq = c->n_heads * d, nkv = c->n_kv_heads * d;
    int64_t I = c->intermediate_size;
    int kind = c->layer_kind[l];
#define GET(dst, nd, a, b, suffix)                                                        \
    do {                                                                                  \
        int rc_ = get(m, prefix, &(dst), nd, a, b, e, l, suffix);                         \
        if (rc_)                                                                          \
            return rc_;                                                                   \
    } while (0)
    memset(s, 0, sizeof *s);
    GET(s->ln1, 1, H, 0, "input_layernorm.weight");
    GET(s->ln2, 1, H, 0, "post_attention_layernorm.weight");
    if (kind == DFL_LAYER_GDN) {
        dfl_gdn_dims g = dfl_gdn_dims_of(c);
        int64_t Hv = c->lin_v_heads;
        GET(s->in_qkv, 2, g.conv_dim, H, "linear_attn.in_proj_qkv.weight");
        GET(s->in_z, 2, g.value_dim, H, "linear_attn.in_proj_z.weight");
        GET(s->in_b, 2, Hv, H, "linear_attn.in_proj_b.weight");
        GET(s->in_a, 2, Hv, H, "linear_attn.in_proj_a.weight");
        GET(s->conv, 3, g.conv_dim, c->lin_conv, "linear_attn.conv1d.weight");
        GET(s->A_log, 1, Hv, 0, "linear_attn.A_log");
        GET(s->dt_bias, 1, Hv, 0, "linear_attn.dt_bias");
        GET(s->gnorm, 1, c->lin_v_dim, 0, "linear_attn.norm.weight");
        GET(s->out, 2, H, g.value_dim, "linear_attn.out_proj.weight");
        goto mlp;
    }
    /* gated attention: q_proj gives [query | gate] per head */
    GET(s->q, 2, kind == DFL_LAYER_GATED_ATTN ? 2 * nq : nq, H, "self_attn.q_proj.weight");
    GET(s->k, 2, nkv, H, "self_attn.k_proj.weight");
    GET(s->v, 2, nkv, H, "self_attn.v_proj.weight");
    GET(s->o, 2, H, nq, "self_attn.o_proj.weight");
    if (c->qk_norm) {
        GET(s->qn, 1, d, 0, "self_attn.q_norm.weight");
        GET(s->kn, 1, d, 0, "self_attn.k_norm.weight");
    }
    if (c->qkv_bias) {
        GET(s->bq, 1, nq, 0, "self_attn.q_proj.bias");
        GET(s->bk, 1, nkv, 0, "self_attn.k_proj.bias");
        GET(s->bv, 1, nkv, 0, "self_attn.v_proj.bias");
    }
    if (c->o_bias)
        GET(s->bo, 1, H, 0, "self_attn.o_proj.bias");
mlp:
    if (dfl_hf_layer_is_moe(c, l)) {
        int rc_ = moe_find(m, prefix, c, l, NULL, e);
        if (rc_)
            return rc_;
    } else {
        GET(s->gate, 2, I, H, "mlp.gate_proj.weight");
        GET(s->up, 2, I, H, "mlp.up_proj.weight");
        GET(s->down, 2, H, I, "mlp.down_proj.weight");
    }
    if (c->mlp_bias) {
        GET(s->bgate, 1, I, 0, "mlp.gate_proj.bias");
        GET(s->bup, 1, I, 0, "mlp.up_proj.bias");
        GET(s->bdown, 1, H, 0, "mlp.down_proj.bias");
    }
#undef GET
    return DFL_OK;
}

static int load_layer(loader *L, const layer_src *s, dfl_target_layer *w, int64_t l, dfl_err *e)
{
    dfl_target *t = L->t;
    const dfl_hf_config *c = &t->cfg;
    dfl_dtype wdt = t->be->wdt;
    int64_t H = c->hidden_size, d = c->head_dim, nq = c->n_heads * d, nkv = c->n_kv_heads * d;
    int64_t I = c->intermediate_size, nqkv = nq + 2 * nkv;
    char what[64];
    snprintf(what, sizeof what, "layer %lld", (long long)l);
    int rc = 0;
#define ALLOC(dst, n, dt)                                                                 \
    do {                                                                                  \
        if (!((dst) = walloc(t, (uint64_t)(n), dt, what, e)))                             \
            return e->code;                                                               \
    } while (0)
#define PUT(dst, off, dt, src)                                                            \
    do {                                                                                  \
        if ((rc = put(L, dst, (uint64_t)(off), dt, src, e)))                              \
            return rc;                                                                    \
    } while (0)
    w->kind = c->layer_kind[l];
    ALLOC(w->ln1, H, wdt);
    PUT(w->ln1, 0, wdt, s->ln1);
    ALLOC(w->ln2, H, wdt);
    PUT(w->ln2, 0, wdt, s->ln2);
    if (w->kind == DFL_LAYER_GDN) {
        dfl_gdn_dims g = dfl_gdn_dims_of(c);
        int64_t Hv = c->lin_v_heads;
        ALLOC(w->w_in, g.n_in * H, wdt);
        PUT(w->w_in, 0, wdt, s->in_qkv);
        PUT(w->w_in, g.conv_dim * H, wdt, s->in_z);
        PUT(w->w_in, (g.conv_dim + g.value_dim) * H, wdt, s->in_b);
        PUT(w->w_in, (g.conv_dim + g.value_dim + Hv) * H, wdt, s->in_a);
        ALLOC(w->conv_w, g.conv_dim * c->lin_conv, wdt);
        PUT(w->conv_w, 0, wdt, s->conv);
        ALLOC(w->A_log, Hv, DFL_F32);
        PUT(w->A_log, 0, DFL_F32, s->A_log);
        ALLOC(w->dt_bias, Hv, DFL_F32);
        PUT(w->dt_bias, 0, DFL_F32, s->dt_bias);
        ALLOC(w->gdn_norm, c->lin_v_dim, wdt);
        PUT(w->gdn_norm, 0, wdt, s->gnorm);
        ALLOC(w->w_out, H * g.value_dim, wdt);
        PUT(w->w_out, 0, wdt, s->out);
        goto mlp;
    }
    if (w->kind == DFL_LAYER_GATED_ATTN) {
        /* q_proj rows per head h: [2hd, 2hd + d) query, [2hd + d, 2(h+1)d) gate; stored as
         * every head's query rows, then every head's gate rows, then k | v */
        nqkv += nq;
        ALLOC(w->wqkv, nqkv * H, wdt);
        for (int64_t h = 0; h < c->n_heads; h++) {
            if ((rc = put_range(L, w->wqkv, h * d * H, wdt, s->q, 2 * h * d * H, d * H, e)) ||
                (rc = put_range(L, w->wqkv, (nq + h * d) * H, wdt, s->q, (2 * h + 1) * d * H,
                                d * H, e)))
                return rc;
        }
        PUT(w->wqkv, 2 * nq * H, wdt, s->k);
        PUT(w->wqkv, (2 * nq + nkv) * H, wdt, s->v);
    } else {
        ALLOC(w->wqkv, nqkv * H, wdt);
        PUT(w->wqkv, 0, wdt, s->q);
        PUT(w->wqkv, nq * H, wdt, s->k);
        PUT(w->wqkv, (nq + nkv) * H, wdt, s->v);
    }
    if (s->bq) {
        ALLOC(w->bqkv, nqkv, DFL_F32);
        PUT(w->bqkv, 0, DFL_F32, s->bq);
        PUT(w->bqkv, nq, DFL_F32, s->bk);
        PUT(w->bqkv, nq + nkv, DFL_F32, s->bv);
    }
    if (s->qn) {
        ALLOC(w->q_norm, d, wdt);
        PUT(w->q_norm, 0, wdt, s->qn);
        ALLOC(w->k_norm, d, wdt);
        PUT(w->k_norm, 0, wdt, s->kn);
    }
    ALLOC(w->wo, H * nq, wdt);
    PUT(w->wo, 0, wdt, s->o);
    if (s->bo) {
        ALLOC(w->bo, H, DFL_F32);
        PUT(w->bo, 0, DFL_F32, s->bo);
    }
mlp:
    if (!s->gate) /* a sparse layer */
        return moe_find(L->m, t->prefix, c, l, L, e);
    ALLOC(w->wgu, 2 * I * H, wdt);
    PUT(w->wgu, 0, wdt, s->gate);
    PUT(w->wgu, I * H, wdt, s->up);
    if (s->bgate) {
        ALLOC(w->bgu, 2 * I, DFL_F32);
        PUT(w->bgu, 0, DFL_F32, s->bgate);
        PUT(w->bgu, I, DFL_F32, s->bup);
    }
    ALLOC(w->wdown, H * I, wdt);
    PUT(w->wdown, 0, wdt, s->down);
    if (s->bdown) {
        ALLOC(w->bdown, H, DFL_F32);
        PUT(w->bdown, 0, DFL_F32, s->bdown);
    }
#undef ALLOC
#undef PUT
    return DFL_OK;
}

/* Whether the backend's gated delta rule takes this model's linear-attention sizes (a call with
 * no tokens only checks them), before anything is uploaded. */
static int check_gdn_sizes(dfl_target *t, const char *dir, dfl_err *e)
{
    const dfl_hf_config *c = &t->cfg;
    dfl_gated_delta g = {.Hk = (int)c->lin_k_heads, .Hv = (int)c->lin_v_heads,
                         .dk = (int)c->lin_k_dim, .dv = (int)c->lin_v_dim, .chunk = DFL_GDN_CHUNK};
    int rc = t->be->ops->gated_delta(t->be, &g);
    dfl_err se = {0};
    t->be->ops->sync(t->be, &se); /* takes the backend's recorded message, if any */
    if (rc)
        return dfl_fail(e, DFL_EUNSUP, "%s: linear_key_head_dim = %lld, linear_value_head_dim = "
                        "%lld, linear_num_key_heads = %lld, linear_num_value_heads = %lld: not "
                        "supported on %s%s%s", dir, (long long)c->lin_k_dim, (long long)c->lin_v_dim,
                        (long long)c->lin_k_heads, (long long)c->lin_v_heads, t->be->name,
                        se.msg[0] ? ": " : "", se.msg);
    return DFL_OK;
}

int dfl_target_open(dfl_target **out, dfl_be *be, const char *dir, int n_load, dfl_err *e)
{
    *out = NULL;
    dfl_target *t = calloc(1, sizeof *t);
    if (!t)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    t->be = be;
    t->fuse_residual = be->fuse_residual;
    json_t *cfg = NULL;
    dfl_st_model *m = NULL;
    loader L = {.t = t};
    layer_src src;
    int rc = dfl_hf_config_load(dir, &t->cfg, &cfg, e);
    if (rc)
        goto fail;
    const dfl_hf_config *c = &t->cfg;
    if ((rc = dfl_st_model_open(&m, dir, e)))
        goto fail;
    L.m = m;
    /* Check the whole tensor table first, so that a broken model fails before any upload. */
    const dfl_st_tensor *emb, *norm;
    int64_t shape[2] = {c->vocab_size, c->hidden_size};
    /* the text model of a multimodal checkpoint (qwen3_5) is under model.language_model.; its
     * model.visual.* and mtp.* tensors are not read */
    snprintf(t->prefix, sizeof t->prefix, "%s",
             dfl_st_model_find(m, "model.language_model.embed_tokens.weight")
                 ? "model.language_model." : "model.");
    char name[96];
    snprintf(name, sizeof name, "%sembed_tokens.weight", t->prefix);
    if ((rc = dfl_st_model_get(m, name, 2, shape, &emb, e)))
        goto fail;
    snprintf(name, sizeof name, "%snorm.weight", t->prefix);
    if ((rc = dfl_st_model_get(m, name, 1, &c->hidden_size, &norm, e)))
        goto fail;
    for (int64_t l = 0; l < c->n_layers; l++)
        if ((rc = find_layer(m, t->prefix, c, l, &src, e)))
            goto fail;
    if (c->n_linear && (rc = check_gdn_sizes(t, dir, e)))
        goto fail;
    /* RoPE as transformers runs the checkpoint: inv_freq rounded to the load dtype. */
    t->rope_dtype = c->dtype ? c->dtype : emb->dtype;
    if ((rc = dfl_hf_fingerprint_of(cfg, m, t->fingerprint, e)))
        goto fail;

    t->n_loaded = n_load <= 0 || n_load > c->n_layers ? (int)c->n_layers : n_load;
    t->layers = calloc((size_t)t->n_loaded, sizeof *t->layers);
    L.stage = malloc(STAGE_ELEMS * 4);
    if (!t->layers || !L.stage) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto fail;
    }
    if (!(t->embed = walloc(t, (uint64_t)(c->vocab_size * c->hidden_size), be->wdt, "embedding", e))) {
        rc = e->code;
        goto fail;
    }
    if ((rc = put(&L, t->embed, 0, be->wdt, emb, e)))
        goto fail;
    for (int l = 0; l < t->n_loaded; l++) {
        if ((rc = find_layer(m, t->prefix, c, l, &src, e)) ||
            (rc = load_layer(&L, &src, &t->layers[l], l, e)))
            goto fail;
    }
    free(L.stage);
    dfl_st_model_close(m);
    json_decref(cfg);
    *out = t;
    return DFL_OK;
fail:
    free(L.stage);
    dfl_st_model_close(m);
    json_decref(cfg);
    dfl_target_close(t);
    return rc;
}

void dfl_target_close(dfl_target *t)
{
    if (!t)
        return;
    dfl_be *be = t->be;
    dfl_target_prof_free(t);
#define FREE(p)                                                                           \
    do {                                                                                  \
        if (p)                                                                            \
            be->ops->free(be, (void *)(p));                                               \
    } while (0)
    if (t->layers) {
        for (int l = 0; l < t->n_loaded; l++) {
            dfl_target_layer *w = &t->layers[l];
            FREE(w->ln1); FREE(w->ln2); FREE(w->wqkv); FREE(w->bqkv); FREE(w->q_norm);
            FREE(w->k_norm); FREE(w->wo); FREE(w->bo); FREE(w->wgu); FREE(w->bgu);
            FREE(w->wdown); FREE(w->bdown); FREE(w->w_in); FREE(w->conv_w); FREE(w->A_log);
            FREE(w->dt_bias); FREE(w->gdn_norm); FREE(w->w_out);
            FREE(w->moe.router); FREE(w->moe.wgu); FREE(w->moe.wdown);
            FREE(w->moe.sgu); FREE(w->moe.sdown); FREE(w->moe.sgate);
        }
        free(t->layers);
    }
    FREE(t->embed);
#undef FREE
    free(t);
}

/* ---- captured layers ---- */

int dfl_target_parse_layers(const char *spec, int64_t n_layers, int32_t *out, int *n, dfl_err *e)
{
    *n = 0;
    if (!spec || strcmp(spec, "auto") == 0)
        return dfl_hf_auto_layers(n_layers, 5, out, n, e);
    if (strncmp(spec, "auto:", 5) == 0) {
        int64_t k;
        int rc = dfl_parse_i64(spec + 5, 1, DFL_MAX_LAYERS, &k, "--layers auto:K", e);
        if (rc)
            return rc;
        return dfl_hf_auto_layers(n_layers, (int)k, out, n, e);
    }
    int64_t *v = NULL;
    size_t k = 0;
    int rc = dfl_parse_i64_list(spec, 0, INT32_MAX, DFL_MAX_LAYERS, &v, &k, "--layers", e);
    if (rc)
        return rc;
    for (size_t i = 0; i < k; i++) {
        if (v[i] >= n_layers) {
            rc = dfl_fail(e, DFL_EUSAGE, "--layers: layer %lld does not exist (the model has %lld "
                          "layers, 0..%lld)", (long long)v[i], (long long)n_layers,
                          (long long)n_layers - 1);
            break;
        }
        if (i && v[i] <= v[i - 1]) {
            rc = dfl_fail(e, DFL_EUSAGE, "--layers: '%s': layer ids must be ascending and distinct",
                          spec);
            break;
        }
        out[i] = (int32_t)v[i];
    }
    free(v);
    if (!rc)
        *n = (int)k;
    return rc;
}

/* ---- activation buffers ---- */

void dfl_target_ws_free(const dfl_target *t, dfl_target_ws *ws)
{
    if (!ws)
        return;
    if (ws->arena)
        t->be->ops->free(t->be, ws->arena);
    if (ws->moe_block)
        t->be->ops->free(t->be, ws->moe_block);
    free(ws->pos_host);
    free(ws->cu_host);
    free(ws);
}

#define WS_ALIGN 256 /* every buffer of the arena starts on this boundary */

/* The arena's buffers, in order, with their sizes (false on overflow). */
#define WS_BUFS 9
typedef struct ws_plan {
    uint64_t bytes[WS_BUFS];
    uint64_t total;
} ws_plan;

static bool ws_plan_of(const dfl_target *t, int64_t max_tokens, int64_t max_seqs, ws_plan *p)
{
    const dfl_hf_config *c = &t->cfg;
    int64_t H = c->hidden_size, d = c->head_dim, I = c->intermediate_size;
    int64_t nq = c->n_heads * d, nqkv = nq + 2 * c->n_kv_heads * d;
    if (c->n_linear < c->n_layers && c->arch == DFL_HF_QWEN35)
        nqkv += nq; /* gated attention: the gates */
    int64_t w1 = nqkv > 2 * I ? nqkv : 2 * I, w2 = nq > I ? nq : I, wl = 0;
    if (c->n_linear) {
        dfl_gdn_dims g = dfl_gdn_dims_of(c);
        w1 = g.n_in > w1 ? g.n_in : w1;
        w2 = g.conv_dim > w2 ? g.conv_dim : w2;
        wl = g.value_dim;
    }
    uint64_t as = dfl_dtype_size(t->be->act), T = (uint64_t)max_tokens;
    uint64_t elems[WS_BUFS] = {T * (uint64_t)H, T * (uint64_t)H, T * (uint64_t)H, T * (uint64_t)w1,
                               T * (uint64_t)w2, T, T, (uint64_t)max_seqs + 1, T * (uint64_t)wl};
    uint64_t size[WS_BUFS] = {as, as, as, as, as, 4, 4, 4, as};
    p->total = 0;
    for (int i = 0; i < WS_BUFS; i++) {
        uint64_t b;
        if (!dfl_mul_u64(elems[i], size[i], &b) || b > UINT64_MAX / 2)
            return false;
        p->bytes[i] = (b + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN;
        if (!dfl_add_u64(p->total, p->bytes[i], &p->total))
            return false;
    }
    return p->total <= SIZE_MAX / 2;
}

uint64_t dfl_target_ws_bytes(const dfl_target *t, int64_t max_tokens, int64_t max_seqs)
{
    ws_plan p;
    if (max_tokens < 1)
        max_tokens = 1;
    if (max_seqs < 1)
        max_seqs = 1;
    if (!ws_plan_of(t, max_tokens, max_seqs, &p))
        return 0;
    uint64_t moe = t->cfg.n_experts ? dfl_moe_ws_bytes(&t->cfg, t->be, max_tokens) : 0;
    if (t->cfg.n_experts && !moe)
        return 0;
    return dfl_add_u64(p.total, moe, &p.total) ? p.total : 0;
}

int dfl_target_ws_new(const dfl_target *t, int64_t max_tokens, int64_t max_seqs,
                      dfl_target_ws **out, dfl_err *e)
{
    return dfl_target_ws_new_ex(t, max_tokens, max_seqs, 0, out, e);
}

int dfl_target_ws_new_ex(const dfl_target *t, int64_t max_tokens, int64_t max_seqs,
                         uint64_t extra_bytes, dfl_target_ws **out, dfl_err *e)
{
    *out = NULL;
    dfl_be *be = t->be;
    if (max_tokens < 1)
        max_tokens = 1;
    if (max_seqs < 1)
        max_seqs = 1;
    if (max_tokens > INT32_MAX || max_seqs > INT32_MAX)
        return dfl_fail(e, DFL_EUSAGE, "batch of %lld tokens, %lld sequences: too large",
                        (long long)max_tokens, (long long)max_seqs);
    ws_plan p;
    uint64_t total;
    if (!ws_plan_of(t, max_tokens, max_seqs, &p) || !dfl_add_u64(p.total, extra_bytes, &total) ||
        total > SIZE_MAX / 2)
        return dfl_fail(e, DFL_ENOMEM, "activation buffers for %lld tokens: size overflow",
                        (long long)max_tokens);
    dfl_target_ws *ws = calloc(1, sizeof *ws);
    if (!ws)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    ws->max_tokens = max_tokens;
    ws->max_seqs = max_seqs;
    if (!(ws->arena = be->ops->alloc(be, (size_t)total, e))) {
        char b1[32], b2[32];
        dfl_err_prefix(e, "activation buffers for %lld tokens (%s, %s of them for the captured "
                       "layers): ", (long long)max_tokens,
                       dfl_fmt_bytes((double)total, b1, sizeof b1),
                       dfl_fmt_bytes((double)extra_bytes, b2, sizeof b2));
        dfl_target_ws_free(t, ws);
        return e->code;
    }
    ws->bytes = total;
    void **ptrs[WS_BUFS] = {&ws->h, &ws->x, &ws->delta, &ws->big1, &ws->big2, (void **)&ws->ids,
                            (void **)&ws->pos, (void **)&ws->cu, &ws->lin};
    char *at = ws->arena;
    for (int i = 0; i < WS_BUFS; i++) {
        *ptrs[i] = p.bytes[i] ? at : NULL;
        at += p.bytes[i];
    }
    if (extra_bytes) {
        ws->extra = at;
        ws->extra_bytes = extra_bytes;
    }
    if (t->cfg.n_experts) {
        uint64_t mb = dfl_moe_ws_bytes(&t->cfg, be, max_tokens);
        if (!mb || mb > SIZE_MAX / 2) {
            dfl_target_ws_free(t, ws);
            return dfl_fail(e, DFL_ENOMEM, "expert buffers for %lld tokens: size overflow",
                            (long long)max_tokens);
        }
        if (!(ws->moe_block = be->ops->alloc(be, (size_t)mb, e))) {
            dfl_err_prefix(e, "expert buffers for %lld tokens: ", (long long)max_tokens);
            dfl_target_ws_free(t, ws);
            return e->code;
        }
        dfl_moe_ws_carve(&t->cfg, be, max_tokens, ws->moe_block, &ws->moe);
        ws->bytes += mb;
    }
    ws->pos_host = malloc((size_t)max_tokens * sizeof *ws->pos_host);
    ws->cu_host = malloc((size_t)(max_seqs + 1) * sizeof *ws->cu_host);
    if (!ws->pos_host || !ws->cu_host) {
        dfl_target_ws_free(t, ws);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    *out = ws;
    return DFL_OK;
}

/* ---- forward ---- */

int dfl_target_check_batch(const dfl_target *t, const dfl_batch *b, dfl_err *e)
{
    return dfl_target_check_vocab(t->cfg.vocab_size, b, e);
}

int dfl_target_check_vocab(int64_t V, const dfl_batch *b, dfl_err *e)
{
    /* the same passes as the frame reader and writer (batch_check.h) */
    uint64_t sum = 0;
    uint32_t longest = 0;
    (void)dfl_seq_lens_scan(b->seq_lens, b->n_seqs, &sum, &longest);
    if (sum != b->n_tokens)
        return dfl_fail(e, DFL_EDATA, "batch %llu: sequence lengths add up to %llu, not %llu tokens",
                        (unsigned long long)b->index, (unsigned long long)sum,
                        (unsigned long long)b->n_tokens);
    uint32_t lim = V < 0 ? 0 : V > (int64_t)UINT32_MAX ? UINT32_MAX : (uint32_t)V;
    int64_t bad = dfl_ids_first_bad(b->input_ids, b->n_tokens, lim);
    if (bad < 0)
        return DFL_OK;
    uint32_t s = 0;
    uint64_t start = 0;
    while (s + 1 < b->n_seqs && start + b->seq_lens[s] <= (uint64_t)bad)
        start += b->seq_lens[s++];
    return dfl_fail(e, DFL_EDATA, "batch %llu, sequence %u, position %llu: token id %d is out of "
                    "range for the model's vocab_size %lld", (unsigned long long)b->index, s,
                    (unsigned long long)((uint64_t)bad - start), b->input_ids[bad], (long long)V);
}

int32_t dfl_target_positions(const dfl_batch *b, int32_t *pos, int32_t *cu)
{
    int32_t max_len = 0;
    cu[0] = 0;
    for (uint64_t s = 0, row = 0; s < b->n_seqs; s++) {
        int32_t n = (int32_t)b->seq_lens[s];
        for (int32_t j = 0; j < n; j++)
            pos[row++] = j;
        cu[s + 1] = cu[s] + n;
        if (n > max_len)
            max_len = n;
    }
    return max_len;
}

/* C [T, N] (act) = A [T, K] (act) W^T (+ bias) (+ C when accumulate), W [N, K] (w). */
int dfl_target_linear(dfl_be *be, void *C, const void *A, const void *W, const float *bias,
                      int64_t T, int64_t N, int64_t K, bool accumulate)
{
    dfl_mm m = {
        .M = T, .N = N, .K = K,
        .A = A, .adt = be->act, .lda = K, .ta = false,
        .B = W, .bdt = be->wdt, .ldb = K, .tb = true,
        .C = C, .cdt = be->act, .ldc = N,
        .alpha = 1.0f, .beta = accumulate ? 1.0f : 0.0f, .bias = bias,
    };
    return be->ops->matmul(be, &m);
}

int dfl_target_fwd_linear(const dfl_target_fwd *f, void *C, const void *A, const void *W,
                          const float *bias, int64_t N, int64_t K)
{
    int span = dfl_tp_begin(f, DFL_TP_GEMM);
    int rc = dfl_target_linear(f->t->be, C, A, W, bias, f->T, N, K, false);
    dfl_tp_end_gemm(f, span, N, K, false);
    return rc;
}

int dfl_target_residual_linear(const dfl_target_fwd *f, const void *A, const void *W,
                               const float *bias, int64_t K)
{
    dfl_be *be = f->t->be;
    int64_t H = f->t->cfg.hidden_size;
    int span = dfl_tp_begin(f, DFL_TP_GEMM);
    void *out = f->t->fuse_residual ? f->ws->h : f->ws->delta;
    int rc = dfl_target_linear(be, out, A, W, bias, f->T, H, K, f->t->fuse_residual);
    dfl_tp_end_gemm(f, span, H, K, f->t->fuse_residual);
    if (rc || f->t->fuse_residual)
        return rc;
    return be->ops->add(be, f->ws->h, f->ws->delta, f->T * H);
}

int dfl_target_forward(dfl_target *t, dfl_target_ws *ws, const dfl_batch *b, int n_caps,
                       const int32_t *layers, dfl_dtype cap_dt, void *const *caps, dfl_err *e)
{
    dfl_be *be = t->be;
    int64_t T = (int64_t)b->n_tokens, S = b->n_seqs;
    if (T > ws->max_tokens || S > ws->max_seqs)
        return dfl_fail(e, DFL_EUSAGE, "batch %llu: %lld tokens in %lld sequences is more than the "
                        "buffers hold (%lld tokens, %lld sequences)", (unsigned long long)b->index,
                        (long long)T, (long long)S, (long long)ws->max_tokens,
                        (long long)ws->max_seqs);
    int rc = dfl_target_check_batch(t, b, e);
    if (rc)
        return rc;
    if (T == 0)
        return dfl_target_forward_staged(t, ws, b->index, 0, S, 0, n_caps, layers, cap_dt, caps, e);
    int32_t max_len = dfl_target_positions(b, ws->pos_host, ws->cu_host);
    if ((rc = be->ops->upload(be, ws->ids, b->input_ids, (size_t)T * 4)) ||
        (rc = be->ops->upload(be, ws->pos, ws->pos_host, (size_t)T * 4)) ||
        (rc = be->ops->upload(be, ws->cu, ws->cu_host, (size_t)(S + 1) * 4)))
        return dfl_fail(e, rc, "batch %llu: uploading the token ids to %s failed (%s)",
                        (unsigned long long)b->index, be->name, dfl_code_name(rc));
    return dfl_target_forward_staged(t, ws, b->index, T, S, max_len, n_caps, layers, cap_dt, caps, e);
}

/* The decoder norm: ordinary or zero-centred (qwen3_5) RMSNorm of h into x. */
static int norm(const dfl_target_fwd *f, const void *w)
{
    dfl_be *be = f->t->be;
    const dfl_hf_config *c = &f->t->cfg;
    float eps = (float)c->rms_norm_eps;
    if (c->norm_1p)
        return be->ops->rmsnorm_1p(be, f->ws->x, f->ws->h, w, f->T, c->hidden_size, eps);
    return be->ops->rmsnorm(be, f->ws->x, NULL, f->ws->h, w, f->T, c->hidden_size, eps);
}

/* Causal attention over x: dense (q/k norm where the model has it, RoPE) or gated (zero-centred
 * q/k norm, partial RoPE, output * sigmoid(gate)). */
static int attention(const dfl_target_fwd *f, const dfl_target_layer *w)
{
    dfl_target *t = f->t;
    dfl_be *be = t->be;
    const dfl_be_ops *ops = be->ops;
    const dfl_hf_config *c = &t->cfg;
    dfl_target_ws *ws = f->ws;
    int64_t H = c->hidden_size, d = c->head_dim, T = f->T;
    int64_t nq = c->n_heads * d, nkv = c->n_kv_heads * d;
    bool gated = w->kind == DFL_LAYER_GATED_ATTN;
    int64_t qw = gated ? 2 * nq : nq;   /* columns before k: queries (and gates) */
    int64_t nqkv = qw + 2 * nkv;
    float eps = (float)c->rms_norm_eps, theta = (float)c->rope_theta;
    dfl_dtype act = be->act;
    void *qkv = ws->big1;   /* [T, nqkv] */
    void *att = ws->big2;   /* [T, nq] */
    int rc;
    if ((rc = dfl_target_fwd_linear(f, qkv, ws->x, w->wqkv, w->bqkv, nqkv, H)))
        return rc;
    if (gated) {
        if ((rc = ops->qknorm_rope_partial(be, qkv, nqkv, w->q_norm, ws->pos, T, (int)c->n_heads,
                                           (int)d, (int)c->rot_dim, eps, theta)) ||
            (rc = ops->qknorm_rope_partial(be, dfl_act_at(qkv, qw, act), nqkv, w->k_norm, ws->pos, T,
                                           (int)c->n_kv_heads, (int)d, (int)c->rot_dim, eps, theta)))
            return rc;
    } else if ((rc = ops->qknorm_rope(be, qkv, NULL, nqkv, NULL, w->q_norm, ws->pos, T, (int)c->n_heads,
                                      (int)d, eps, theta)) ||
               (rc = ops->qknorm_rope(be, dfl_act_at(qkv, nq, act), NULL, nqkv, NULL, w->k_norm, ws->pos, T,
                                      (int)c->n_kv_heads, (int)d, eps, theta))) {
        return rc;
    }
    dfl_attn_varlen a = {
        .q = qkv, .ldq = nqkv,
        .k = dfl_act_at(qkv, qw, act), .ldk = nqkv,
        .v = dfl_act_at(qkv, qw + nkv, act), .ldv = nqkv,
        .o = att, .ldo = nq,
        .cu_seqlens = ws->cu, .n_seqs = (int32_t)f->S, .max_len = f->max_len, .T = T,
        .n_heads = (int)c->n_heads, .n_kv = (int)c->n_kv_heads, .d = (int)d,
        /* yarn multiplies cos and sin by attention_factor: q.k by its square */
        .scale = (float)(c->rope.attention_factor * c->rope.attention_factor / sqrt((double)d)),
    };
    int span = dfl_tp_begin(f, DFL_TP_ATTN);
    rc = ops->attn_varlen(be, &a);
    dfl_tp_end(f, span, 0);
    if (rc)
        return rc;
    if (gated && (rc = ops->sigmoid_mul(be, att, nq, dfl_act_at(qkv, nq, act), nqkv, T, nq)))
        return rc;
    return dfl_target_residual_linear(f, att, w->wo, w->bo, nq);
}

static int mlp(const dfl_target_fwd *f, const dfl_target_layer *w)
{
    dfl_be *be = f->t->be;
    int64_t H = f->t->cfg.hidden_size, I = f->t->cfg.intermediate_size;
    if (w->is_moe) {
        /* a sparse layer: the router and the experts (moe.c), added to h */
        dfl_target *t = f->t;
        float *ro = t->router_out ? t->router_out[w - t->layers] : NULL;
        bool fuse = t->fuse_residual;
        int span = dfl_tp_begin(f, DFL_TP_MOE);
        int rc = dfl_moe_forward(be, &t->cfg, &f->ws->moe, &w->moe, f->ws->x, f->T,
                                 fuse ? f->ws->h : f->ws->delta, fuse, ro);
        dfl_tp_end(f, span, 0);
        if (rc || fuse)
            return rc;
        return be->ops->add(be, f->ws->h, f->ws->delta, f->T * H);
    }
    void *gu = f->ws->big1;    /* [T, 2I] */
    void *mo = f->ws->big2;    /* [T, I] */
    int rc;
    if (!w->bgu && be->ops->matmul_swiglu &&
        be->ops->matmul_swiglu(be, NULL, f->ws->x, w->wgu, f->T, I, H) == 0) {
        /* the product and its activation in one (a backend that takes it: CUDA's TMA GEMM) */
        int span = dfl_tp_begin(f, DFL_TP_GEMM);
        rc = be->ops->matmul_swiglu(be, mo, f->ws->x, w->wgu, f->T, I, H);
        dfl_tp_end_gemm(f, span, 2 * I, H, false);
        return rc ? rc : dfl_target_residual_linear(f, mo, w->wdown, w->bdown, I);
    }
    if ((rc = dfl_target_fwd_linear(f, gu, f->ws->x, w->wgu, w->bgu, 2 * I, H)) ||
        (rc = be->ops->swiglu(be, mo, gu, f->T, I)))
        return rc;
    return dfl_target_residual_linear(f, mo, w->wdown, w->bdown, I);
}

/* One decoder layer: h = h + mixer(norm(h)); h = h + mlp(norm(h)). Leaves the layer's output in
 * ws->h. */
static int layer_forward(const dfl_target_fwd *f, const dfl_target_layer *w)
{
    int rc;
    if ((rc = norm(f, w->ln1)))
        return rc;
    switch (w->kind) {
    case DFL_LAYER_ATTN:
    case DFL_LAYER_GATED_ATTN: rc = attention(f, w); break;
    case DFL_LAYER_GDN: rc = dfl_gdn_forward(f, w); break;
    default: rc = DFL_EUNSUP;
    }
    if (rc || (rc = norm(f, w->ln2)))
        return rc;
    return mlp(f, w);
}

int dfl_target_forward_staged(dfl_target *t, dfl_target_ws *ws, uint64_t index, int64_t T,
                              int64_t S, int32_t max_len, int n_caps, const int32_t *layers,
                              dfl_dtype cap_dt, void *const *caps, dfl_err *e)
{
    dfl_be *be = t->be;
    const dfl_be_ops *ops = be->ops;
    int rc;
    if (n_caps < 1 || n_caps > DFL_MAX_LAYERS)
        return dfl_fail(e, DFL_EUSAGE, "forward: %d captured layers (1..%d)", n_caps, DFL_MAX_LAYERS);
    for (int k = 0; k < n_caps; k++)
        if (layers[k] < 0 || layers[k] >= t->n_loaded || (k && layers[k] <= layers[k - 1]))
            return dfl_fail(e, DFL_EUSAGE, "forward: captured layer %d is not ascending or not "
                            "loaded (%d layers loaded)", layers[k], t->n_loaded);
    if (T > ws->max_tokens || S > ws->max_seqs)
        return dfl_fail(e, DFL_EUSAGE, "batch %llu: %lld tokens in %lld sequences is more than the "
                        "buffers hold (%lld tokens, %lld sequences)", (unsigned long long)index,
                        (long long)T, (long long)S, (long long)ws->max_tokens,
                        (long long)ws->max_seqs);
    if (T == 0)
        return DFL_OK;

    int64_t H = t->cfg.hidden_size;
    int last = layers[n_caps - 1], next = 0;
    dfl_target_fwd f = {.t = t, .ws = ws, .T = T, .S = S, .max_len = max_len};
    be->rope_dtype = t->rope_dtype;
    be->rope_scaling = t->cfg.rope.kind != DFL_ROPE_DEFAULT ? &t->cfg.rope : NULL;
    if ((rc = ops->embedding(be, ws->h, ws->ids, t->embed, T, H)))
        goto fail;
    for (int l = 0; l <= last; l++) {
        if ((rc = layer_forward(&f, &t->layers[l])))
            goto fail;
        if (layers[next] == l && (rc = ops->convert(be, caps[next++], cap_dt, ws->h, be->act, T * H)))
            goto fail;
    }
    return DFL_OK;
fail:
    return dfl_fail(e, rc, "batch %llu: forward on %s failed (%s)", (unsigned long long)index,
                    be->name, dfl_code_name(rc));
}

int dfl_target_gemms(const dfl_target *t, const dfl_target_ws *ws, int64_t T, dfl_mm out[4])
{
    const dfl_hf_config *c = &t->cfg;
    dfl_be *be = t->be;
    if (t->n_loaded < 1 || T < 1 || T > ws->max_tokens)
        return DFL_EUSAGE;
    const dfl_target_layer *w = &t->layers[0];
    int64_t H = c->hidden_size, d = c->head_dim, I = c->intermediate_size;
    int64_t nq = c->n_heads * d, nqkv = nq + 2 * c->n_kv_heads * d;
    if (w->kind == DFL_LAYER_GATED_ATTN)
        nqkv += nq;
    const void *in_w = w->wqkv, *out_w = w->wo, *out_a = ws->big2;
    const float *in_b = w->bqkv, *out_b = w->bo;
    int64_t n_in = nqkv, k_out = nq;
    if (w->kind == DFL_LAYER_GDN) {
        dfl_gdn_dims g = dfl_gdn_dims_of(c);
        in_w = w->w_in;
        in_b = out_b = NULL;
        out_w = w->w_out;
        out_a = ws->lin;
        n_in = g.n_in;
        k_out = g.value_dim;
    }
    bool f = t->fuse_residual;
    struct {
        void *C;
        const void *A, *W;
        const float *bias;
        int64_t N, K;
        bool acc;
    } g[4] = {
        {ws->big1, ws->x, in_w, in_b, n_in, H, false},
        {f ? ws->h : ws->delta, out_a, out_w, out_b, H, k_out, f},
        {ws->big1, ws->x, w->wgu, w->bgu, 2 * I, H, false},
        {f ? ws->h : ws->delta, ws->big2, w->wdown, w->bdown, H, I, f},
    };
    for (int i = 0; i < 4; i++) {
        if (i >= 2 && w->is_moe) { /* the experts' GEMMs are not cuBLAS GEMMs: M = 0, nothing */
            out[i] = (dfl_mm){.M = 0};
            continue;
        }
        out[i] = (dfl_mm){
            .M = T, .N = g[i].N, .K = g[i].K,
            .A = g[i].A, .adt = be->act, .lda = g[i].K, .ta = false,
            .B = g[i].W, .bdt = be->wdt, .ldb = g[i].K, .tb = true,
            .C = g[i].C, .cdt = be->act, .ldc = g[i].N,
            .alpha = 1.0f, .beta = g[i].acc ? 1.0f : 0.0f, .bias = g[i].bias,
        };
    }
    return DFL_OK;
}
