/* draft_model.c: the DFlash drafter's parameters and training step (doc/dflash-step.md sections 3-5),
 * written against the backend ops only. Every activation the backward needs is kept in the
 * workspace (a backend that is short of memory could recompute a layer's forward instead: each
 * layer's forward reads only its input residual, C and the weights). All buffers are sized by
 * dfl_draft_reserve; a step allocates nothing.
 *
 * The pipeline (draft.h, "Pipelined steps"): a batch is staged into one of IN_SETS input sets
 * (host arrays, pinned on a GPU, and their backend copies): the host builds and checks the
 * per-step arrays, copies the features in, and enqueues the upload on the copy stream, which
 * first waits for the end of the step that last read that set (ev_read); the step waits on the
 * compute stream for the upload (ev_up); the host rewrites a set's host arrays only after its
 * last upload has completed. A step's small results (sums, block metrics, scalars, flags: one
 * contiguous backend block) are copied on the compute stream into one of RES_SLOTS pinned
 * slots, with an event recorded right after; the host reads a slot when it likes (one step later
 * in dfl-draft). On the CPU the same code runs with plain copies and no events. */
#include "draft.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"
#include "draft_rng.h"
#include "json.h"
#include "util.h"

#define IN_SETS 2       /* input sets on an asynchronous backend (1 on the CPU) */
#define RES_SLOTS 2     /* result slots: the step being read and the one just posted */

/* The backend block of a step's small results (one copy to the host). */
typedef struct res_layout {
    size_t sums, bmet, scal, skip, prev_skip, bytes;
} res_layout;

/* One step's inputs: host arrays (pinned on a GPU) and their backend copies. */
typedef struct in_set {
    void *hblock;                /* the host arrays, one allocation */
    int32_t *h_pos;              /* [T+Q] context positions, then block-slot positions */
    int32_t *h_tok, *h_labels;   /* [Q] */
    float *h_weight;             /* [Q] */
    int32_t *h_ctx_start, *h_anchor; /* [B] */
    void *h_feat;                /* [k, T, H] feat_dt, rows packed */
    int32_t *pos, *tok, *labels, *ctx_start, *anchor;   /* backend copies (arena) */
    float *weight;
    void *feat;                  /* [k, T, H] feat_dt */
    /* the batch staged into it */
    int64_t T, B;
    int32_t S;
    dfl_dtype feat_dt;
    float noise_amp;
    uint64_t noise_seed;
    bool full;                   /* staged, not run yet */
    bool uploaded, read;         /* ev_up / ev_read have been recorded */
    dfl_be_event ev_up, ev_read;
} in_set;

/* One result slot (host, pinned on a GPU). */
typedef struct res_slot {
    void *host;                  /* res_layout.bytes */
    int64_t T, B;
    bool have_apply, posted;
    dfl_be_event ev_start, ev_done;
} res_slot;

/* Saved activations of one drafter layer. */
typedef struct layer_acts {
    void *hin;       /* [Q, H] residual in (h[l]; h[0] = embeddings) */
    void *x;         /* [Q, H] input_layernorm(hin) */
    float *rstd1;    /* [Q] */
    void *qraw;      /* [Q, nH*d] x Wq^T */
    void *q;         /* [Q, nH*d] after q_norm + RoPE */
    float *rstdq;    /* [Q*nH] */
    void *kraw;      /* [T+Q, nKV*d] rows [C Wk^T | x Wk^T] */
    void *k;         /* [T+Q, nKV*d] after k_norm + RoPE */
    float *rstdk;    /* [(T+Q)*nKV] */
    void *v;         /* [T+Q, nKV*d] */
    void *o;         /* [Q, nH*d] attention output */
    float *lse;      /* [Q*nH] */
    void *hmid;      /* [Q, H] hin + o Wo^T */
    float *rstd2;    /* [Q] */
    void *y;         /* [Q, H] post_attention_layernorm(hmid) */
    void *gu;        /* [Q, 2I] y [Wgate; Wup]^T */
    void *act;       /* [Q, I] silu(gate) * up */
} layer_acts;

/* Offsets of one layer's tensors in the flat buffer. */
typedef struct layer_w {
    int64_t in_ln, wq, wk, wv, wo, q_norm, k_norm, post_ln, wgu, wdown;
} layer_w;

struct dfl_draft {
    dfl_be *be;
    dfl_draft_config c;
    dfl_draft_tensor *tensors;
    int n_tensors;
    int64_t flat;                /* flat length (elements) */
    int64_t off_fc, off_hnorm, off_norm;
    layer_w *lw;
    float *master, *grad, *adam_m, *adam_v;   /* [flat] f32 */
    void *wts;                   /* [flat] be->wdt (== master when wdt is F32) */
    void *embed, *lm_head;       /* [V, H] be->wdt; lm_head == embed when tied */
    float decay[DFL_DRAFT_MAX_BS];

    /* a step's small results: one backend block (res_layout), allocated with the parameters */
    void *res;
    res_layout rl;
    double *sums;                /* [DFL_SUM_COUNT] */
    double *bmet;                /* [2*bs + 2] block_metrics */
    float *scal;                 /* [4] scale, norm, coef */
    int32_t *skip;               /* [1] */
    int32_t *prev_skip;          /* [1] the previous step's skip (adamw prev_skip) */
    res_slot slots[RES_SLOTS];
    int64_t n_posted, n_collected;
    bool timing;

    /* input sets */
    in_set sets[IN_SETS];
    int n_sets;
    int64_t n_staged, n_run;
    dfl_dtype feat_dt;           /* the features' dtype the sets are sized for */

    /* workspace (dfl_draft_reserve) */
    int64_t capT, capB, chunk;
    void *arena;                 /* one backend allocation */
    uint64_t ws_bytes;
    /* the step's inputs: pointers into the input set it runs on */
    int32_t *pos;                /* [T+Q] context positions, then block-slot positions */
    int32_t *tok, *labels;       /* [Q] */
    float *weight;               /* [Q] */
    int32_t *ctx_start, *anchor; /* [B] */
    const float *h_weight;       /* [Q] the host copies (dfl_draft_activation) */
    const int32_t *h_labels;     /* [Q] */
    /* The LM head and the loss run on the Qs = B (bs - 1) rows of block slots 1..bs-1 only
     * (slot 0 holds the anchor's known token and is never scored; rows whose label is masked
     * stay in, with weight 0): gathered with scored_rows, results scattered back with
     * row_scored. Both maps depend on bs alone and are written once by dfl_draft_reserve. */
    int32_t *scored_rows;        /* [capB*(bs-1)] the row of each scored row */
    int32_t *row_scored;         /* [capB*bs] the scored row of each row, -1 at slot 0 */
    int32_t *labels_s;           /* [Qs] */
    float *weight_s;             /* [Qs] */
    uint8_t *correct_s;          /* [Qs] */
    float *ce;                   /* [Qs] */
    uint8_t *correct;            /* [Q] (0 at slot 0) */
    void *feat;                  /* [k, T, H] act: the set's features, or featc */
    void *featc;                 /* [k, T, H] act: features converted from another dtype */
    void *cpre, *C;              /* [T, H] */
    float *rstdc;                /* [T] */
    layer_acts *la;              /* [layers] */
    void *hL, *z;                /* [Q, H] */
    float *rstdf;                /* [Q] */
    float *lm_work;              /* [chunk * (V + 2)] */
    void *dh, *dx;               /* [Q, H] */
    void *dact;                  /* [Q, I] */
    void *dgu;                   /* [Q, 2I] */
    void *dout, *dq;             /* [Q, nH*d] */
    void *dk, *dv;               /* [T+Q, nKV*d] */
    float *delta;                /* [Q*nH] */
    void *dC;                    /* [T, H] */

    int64_t *h_seq_start;        /* [S+1] host scratch of prepare */
    int64_t capS;

    /* the last step */
    int64_t T, B, Q;
    int32_t S;
    bool have_step, have_apply;
    bool step_posted;            /* the last step's results are posted */
    dfl_dist *comm;              /* data parallel: sums over ranks in dfl_draft_apply (NULL: one) */
};

/* ---- configuration ------------------------------------------------------------------------- */

void dfl_draft_default_layers(int T, int n, int32_t *out)
{
    if (n == 1) {
        out[0] = T / 2;
        return;
    }
    double start = 1, end = T - 3;
    for (int i = 0; i < n; i++) {
        double x = start + i * (end - start) / (n - 1);
        out[i] = (int32_t)nearbyint(x);   /* round half to even, like Python's round */
    }
}

int dfl_draft_config_check(const dfl_draft_config *c, dfl_err *e)
{
    if (c->hidden <= 0 || c->vocab <= 0 || c->intermediate <= 0)
        return dfl_fail(e, DFL_EDATA, "drafter config: hidden_size, vocab_size and intermediate_size "
                        "must be positive (%lld, %lld, %lld)", (long long)c->hidden,
                        (long long)c->vocab, (long long)c->intermediate);
    if (c->vocab > INT32_MAX)
        return dfl_fail(e, DFL_EUNSUP, "drafter config: vocab_size %lld is too large", (long long)c->vocab);
    if (c->n_layers < 1 || c->n_layers > 256)
        return dfl_fail(e, DFL_EDATA, "drafter config: %d drafter layers (1..256)", c->n_layers);
    if (c->n_heads < 1 || c->n_kv < 1 || c->n_heads % c->n_kv)
        return dfl_fail(e, DFL_EDATA, "drafter config: %d attention heads is not a multiple of %d "
                        "key/value heads", c->n_heads, c->n_kv);
    if (c->head_dim < 2 || c->head_dim % 2 || c->head_dim > 512)
        return dfl_fail(e, DFL_EUNSUP, "drafter config: head_dim %d (must be even, 2..512)", c->head_dim);
    if (c->n_feat < 1 || c->n_feat > DFL_DRAFT_MAX_FEAT)
        return dfl_fail(e, DFL_EDATA, "drafter config: %d target layers (1..%d)", c->n_feat,
                        DFL_DRAFT_MAX_FEAT);
    if (c->block_size < 2 || c->block_size > DFL_DRAFT_MAX_BS)
        return dfl_fail(e, DFL_EUNSUP, "drafter config: block_size %d (2..%d)", c->block_size,
                        DFL_DRAFT_MAX_BS);
    if (c->mask_token_id < 0 || c->mask_token_id >= c->vocab)
        return dfl_fail(e, DFL_EDATA, "drafter config: mask_token_id %d is outside the vocabulary "
                        "(0..%lld)", c->mask_token_id, (long long)c->vocab - 1);
    if (!(c->gamma > 0) || !(c->rms_eps > 0) || !(c->rope_theta > 0))
        return dfl_fail(e, DFL_EDATA, "drafter config: gamma, rms_norm_eps and rope_theta must be "
                        "positive");
    if (dfl_draft_n_sliding(c) > 0 && (c->sliding_window < 1 || c->sliding_window > INT32_MAX))
        return dfl_fail(e, DFL_EDATA, "drafter config: sliding_window %lld (the sliding_attention "
                        "layers need a window of 1..%d positions)", (long long)c->sliding_window,
                        INT32_MAX);
    for (int i = 0; i < c->n_feat; i++)
        if (c->target_layers[i] < 0 || (c->n_target_layers > 0 && c->target_layers[i] >= c->n_target_layers))
            return dfl_fail(e, DFL_EDATA, "drafter config: target layer id %d is outside the target's "
                            "%d layers", c->target_layers[i], c->n_target_layers);
    return DFL_OK;
}

int dfl_draft_n_sliding(const dfl_draft_config *c)
{
    int n = 0;
    for (int l = 0; l < c->n_layers && l < DFL_DRAFT_MAX_LAYERS; l++)
        n += c->sliding[l] != 0;
    return n;
}

/* 1: sliding, 0: full, -1: neither */
static int layer_type_of(const char *s, size_t len)
{
    static const struct { const char *name; int v; } names[] = {
        {"sliding", 1}, {"sliding_attention", 1}, {"full", 0}, {"full_attention", 0}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i].name) == len && !memcmp(names[i].name, s, len))
            return names[i].v;
    return -1;
}

int dfl_draft_parse_layer_types(dfl_draft_config *c, const char *spec, int n, const char *what,
                                dfl_err *e)
{
    uint8_t t[DFL_DRAFT_MAX_LAYERS];
    int k = 0;
    const char *p = spec;
    const bool any = n <= 0;
    if (any)
        n = DFL_DRAFT_MAX_LAYERS;
    for (;;) {
        const char *end = strchr(p, ','), *colon;
        size_t len = end ? (size_t)(end - p) : strlen(p);
        colon = memchr(p, ':', len);
        size_t tlen = colon ? (size_t)(colon - p) : len;
        int v = layer_type_of(p, tlen);
        if (v < 0)
            return dfl_fail(e, DFL_EUSAGE, "%s: '%.*s' is not a layer type (sliding, full, "
                            "sliding_attention or full_attention, each optionally :COUNT)", what,
                            (int)len, p);
        long cnt = 1;
        if (colon) {
            char buf[16], *ep;
            size_t nl = len - tlen - 1;
            if (nl == 0 || nl >= sizeof buf)
                return dfl_fail(e, DFL_EUSAGE, "%s: '%.*s': bad count", what, (int)len, p);
            memcpy(buf, colon + 1, nl);
            buf[nl] = 0;
            cnt = strtol(buf, &ep, 10);
            if (*ep || cnt < 1 || cnt > DFL_DRAFT_MAX_LAYERS)
                return dfl_fail(e, DFL_EUSAGE, "%s: '%.*s': bad count", what, (int)len, p);
        }
        if (k + cnt > n)
            return dfl_fail(e, DFL_EUSAGE, "%s: '%s' names more than the drafter's %d layers", what,
                            spec, n);
        for (long i = 0; i < cnt; i++)
            t[k++] = (uint8_t)v;
        if (!end)
            break;
        p = end + 1;
    }
    if (any)
        c->n_layers = n = k;
    if (k != n)
        return dfl_fail(e, DFL_EUSAGE, "%s: '%s' names %d layers, the drafter has %d", what, spec,
                        k, n);
    memset(c->sliding, 0, sizeof c->sliding);
    memcpy(c->sliding, t, (size_t)n);
    return DFL_OK;
}

/* layer_types, use_sliding_window, sliding_window, max_window_layers (after num_hidden_layers).
 * layer_types is taken as it says; sliding_attention layers need sliding_window, and a config
 * that sets use_sliding_window false with them is refused (Qwen3Config would drop the window).
 * Without layer_types, as Qwen3Config: with use_sliding_window and a window, the layers from
 * max_window_layers (default 28) on slide. */
static int layer_types_from_json(dfl_draft_config *c, const json_t *j, const char *what, dfl_err *e)
{
    const json_t *use = json_object_get(j, "use_sliding_window");
    const json_t *sw = json_object_get(j, "sliding_window");
    const json_t *lt = json_object_get(j, "layer_types");
    const json_t *mw = json_object_get(j, "max_window_layers");
    if (use && !json_is_null(use) && !json_is_boolean(use))
        return dfl_fail(e, DFL_EDATA, "%s: 'use_sliding_window' must be true or false", what);
    if (sw && !json_is_null(sw)) {
        if (!json_is_integer(sw) || json_integer_value(sw) < 1 || json_integer_value(sw) > INT32_MAX)
            return dfl_fail(e, DFL_EDATA, "%s: 'sliding_window' must be null or an integer of 1..%d",
                            what, INT32_MAX);
        c->sliding_window = json_integer_value(sw);
    }
    const bool in_use = json_is_true(use) && c->sliding_window > 0;
    if (lt && !json_is_null(lt)) {
        if (!json_is_array(lt) || json_array_size(lt) < 1 || json_array_size(lt) > DFL_DRAFT_MAX_LAYERS)
            return dfl_fail(e, DFL_EDATA, "%s: 'layer_types' must be an array of 1..%d strings",
                            what, DFL_DRAFT_MAX_LAYERS);
        if (c->n_layers > 0 && (int)json_array_size(lt) != c->n_layers)
            return dfl_fail(e, DFL_EDATA, "%s: 'layer_types' has %zu entries for %d layers "
                            "(num_hidden_layers)", what, json_array_size(lt), c->n_layers);
        c->n_layers = (int)json_array_size(lt);
        memset(c->sliding, 0, sizeof c->sliding);
        for (size_t i = 0; i < json_array_size(lt); i++) {
            const json_t *x = json_array_get(lt, i);
            const char *sv = json_is_string(x) ? json_string_value(x) : "";
            int v = !strcmp(sv, "sliding_attention") ? 1 : !strcmp(sv, "full_attention") ? 0 : -1;
            if (v < 0)
                return dfl_fail(e, DFL_EDATA, "%s: 'layer_types[%zu]' must be \"full_attention\" or "
                                "\"sliding_attention\"", what, i);
            c->sliding[i] = (uint8_t)v;
        }
        if (dfl_draft_n_sliding(c) > 0 && c->sliding_window < 1)
            return dfl_fail(e, DFL_EDATA, "%s: 'layer_types' has sliding_attention layers but "
                            "'sliding_window' is not set", what);
        if (dfl_draft_n_sliding(c) > 0 && use && json_is_false(use))
            return dfl_fail(e, DFL_EDATA, "%s: 'layer_types' has sliding_attention layers but "
                            "'use_sliding_window' is false", what);
    } else if (in_use) {
        int64_t first = 28;   /* Qwen3Config's default */
        if (mw && !json_is_null(mw)) {
            if (!json_is_integer(mw) || json_integer_value(mw) < 0)
                return dfl_fail(e, DFL_EDATA, "%s: 'max_window_layers' must be a non-negative "
                                "integer", what);
            first = json_integer_value(mw);
        }
        for (int l = 0; l < c->n_layers && l < DFL_DRAFT_MAX_LAYERS; l++)
            c->sliding[l] = l >= first;
    }
    return DFL_OK;
}

static int json_i(const json_t *j, const char *k, int64_t lo, int64_t hi, int64_t *out,
                  const char *what, dfl_err *e)
{
    const json_t *x = json_object_get(j, k);
    if (!x || json_is_null(x))
        return DFL_OK;
    int64_t v = *out;
    int rc = dfl_json_int(j, k, false, &v, what, e);
    if (rc)
        return rc;
    if (v < lo || v > hi)
        return dfl_fail(e, DFL_EDATA, "%s: '%s' = %lld is out of range (%lld..%lld)", what, k,
                        (long long)v, (long long)lo, (long long)hi);
    *out = v;
    return DFL_OK;
}

int dfl_draft_config_from_json(dfl_draft_config *c, const json_t *j, const char *what, dfl_err *e)
{
    int64_t v;
    int rc;
    if (!json_is_object(j))
        return dfl_fail(e, DFL_EDATA, "%s: not a JSON object", what);
#define GETI(key, field, lo, hi)                                                  \
    do {                                                                          \
        v = c->field;                                                             \
        if ((rc = json_i(j, key, lo, hi, &v, what, e)))                           \
            return rc;                                                            \
        c->field = v;                                                             \
    } while (0)
    GETI("hidden_size", hidden, 1, 1 << 20);
    GETI("vocab_size", vocab, 1, INT32_MAX);
    GETI("intermediate_size", intermediate, 1, 1 << 22);
    GETI("num_hidden_layers", n_layers, 1, 256);
    GETI("num_attention_heads", n_heads, 1, 4096);
    GETI("num_key_value_heads", n_kv, 1, 4096);
    GETI("block_size", block_size, 1, DFL_DRAFT_MAX_BS);
    GETI("num_target_layers", n_target_layers, 1, 100000);
    GETI("max_position_embeddings", max_position, 1, INT64_MAX / 2);
    GETI("bos_token_id", bos_token_id, -1, INT32_MAX);
    GETI("eos_token_id", eos_token_id, -1, INT32_MAX);
    if ((rc = layer_types_from_json(c, j, what, e)))
        return rc;
    if (json_object_get(j, "head_dim") && !json_is_null(json_object_get(j, "head_dim")))
        GETI("head_dim", head_dim, 1, 4096);
    else if (c->n_heads > 0 && c->hidden % c->n_heads == 0)
        c->head_dim = (int)(c->hidden / c->n_heads);
    double d = c->rms_eps;
    if ((rc = dfl_json_num(j, "rms_norm_eps", false, &d, what, e)))
        return rc;
    c->rms_eps = d;
    d = c->rope_theta;
    if ((rc = dfl_json_num(j, "rope_theta", false, &d, what, e)))
        return rc;
    const json_t *rp = json_object_get(j, "rope_parameters");
    if (json_is_object(rp) && (rc = dfl_json_num(rp, "rope_theta", false, &d, what, e)))
        return rc;
    c->rope_theta = d;
    const json_t *dc = json_object_get(j, "dflash_config");
    if (dc && !json_is_null(dc)) {
        if (!json_is_object(dc))
            return dfl_fail(e, DFL_EDATA, "%s: 'dflash_config' must be an object", what);
        v = c->mask_token_id;
        if ((rc = json_i(dc, "mask_token_id", 0, INT32_MAX, &v, what, e)))
            return rc;
        c->mask_token_id = (int32_t)v;
        const json_t *tl = json_object_get(dc, "target_layer_ids");
        if (tl && !json_is_null(tl)) {
            if (!json_is_array(tl) || json_array_size(tl) < 1 || json_array_size(tl) > DFL_DRAFT_MAX_FEAT)
                return dfl_fail(e, DFL_EDATA, "%s: 'dflash_config.target_layer_ids' must be an array "
                                "of 1..%d integers", what, DFL_DRAFT_MAX_FEAT);
            for (size_t i = 0; i < json_array_size(tl); i++) {
                const json_t *x = json_array_get(tl, i);
                if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > 100000)
                    return dfl_fail(e, DFL_EDATA, "%s: 'dflash_config.target_layer_ids[%zu]' is not a "
                                    "layer id", what, i);
                c->target_layers[i] = (int32_t)json_integer_value(x);
            }
            c->n_feat = (int)json_array_size(tl);
        }
        d = c->gamma;
        if ((rc = dfl_json_num(dc, "loss_decay_gamma", false, &d, what, e)))
            return rc;
        c->gamma = d;
    }
#undef GETI
    return DFL_OK;
}

json_t *dfl_draft_config_to_json(const dfl_draft_config *c)
{
    json_t *j = json_object();
    json_t *lt = json_array(), *ids = json_array();
    const int n_sliding = dfl_draft_n_sliding(c);
    for (int i = 0; i < c->n_layers; i++)
        json_array_append_new(lt, json_string(i < DFL_DRAFT_MAX_LAYERS && c->sliding[i]
                                              ? "sliding_attention" : "full_attention"));
    for (int i = 0; i < c->n_feat; i++)
        json_array_append_new(ids, json_integer(c->target_layers[i]));
    json_t *arch = json_array();
    json_array_append_new(arch, json_string("DFlashDraftModel"));
    json_object_set_new(j, "architectures", arch);
    json_object_set_new(j, "attention_bias", json_false());
    json_object_set_new(j, "attention_dropout", json_real(0.0));
    json_t *am = json_object();
    json_object_set_new(am, "AutoModel", json_string("dflash.DFlashDraftModel"));
    json_object_set_new(j, "auto_map", am);
    json_object_set_new(j, "block_size", json_integer(c->block_size));
    if (c->bos_token_id >= 0)
        json_object_set_new(j, "bos_token_id", json_integer(c->bos_token_id));
    if (c->eos_token_id >= 0)
        json_object_set_new(j, "eos_token_id", json_integer(c->eos_token_id));
    json_t *dc = json_object();
    json_object_set_new(dc, "mask_token_id", json_integer(c->mask_token_id));
    json_object_set_new(dc, "target_layer_ids", ids);
    json_object_set_new(dc, "loss_decay_gamma", json_real(c->gamma));
    json_object_set_new(j, "dflash_config", dc);
    json_object_set_new(j, "dtype", json_string("bfloat16"));
    json_object_set_new(j, "head_dim", json_integer(c->head_dim));
    json_object_set_new(j, "hidden_act", json_string("silu"));
    json_object_set_new(j, "hidden_size", json_integer(c->hidden));
    json_object_set_new(j, "initializer_range", json_real(0.02));
    json_object_set_new(j, "intermediate_size", json_integer(c->intermediate));
    json_object_set_new(j, "layer_types", lt);
    json_object_set_new(j, "max_position_embeddings", json_integer(c->max_position));
    json_object_set_new(j, "max_window_layers", json_integer(c->n_layers));
    json_object_set_new(j, "model_type", json_string("qwen3"));
    json_object_set_new(j, "num_attention_heads", json_integer(c->n_heads));
    json_object_set_new(j, "num_hidden_layers", json_integer(c->n_layers));
    json_object_set_new(j, "num_key_value_heads", json_integer(c->n_kv));
    json_object_set_new(j, "num_target_layers", json_integer(c->n_target_layers));
    json_object_set_new(j, "rms_norm_eps", json_real(c->rms_eps));
    json_t *rp = json_object();
    json_object_set_new(rp, "rope_theta", json_real(c->rope_theta));
    json_object_set_new(rp, "rope_type", json_string("default"));
    json_object_set_new(j, "rope_parameters", rp);
    json_object_set_new(j, "rope_scaling", json_null());
    json_object_set_new(j, "rope_theta", json_real(c->rope_theta));
    json_object_set_new(j, "sliding_window", n_sliding ? json_integer(c->sliding_window) : json_null());
    json_object_set_new(j, "tie_word_embeddings", json_false());
    json_object_set_new(j, "use_cache", json_true());
    json_object_set_new(j, "use_sliding_window", json_boolean(n_sliding > 0));
    json_object_set_new(j, "vocab_size", json_integer(c->vocab));
    return j;
}

/* ---- parameters ---------------------------------------------------------------------------- */

/* Appends a tensor of shape [r] (cols == 0) or [r, cols] at the next (16-aligned) offset. */
static void add_tensor(dfl_draft_tensor *t, int *k, int64_t *off, const char *name, int64_t r,
                       int64_t cols, bool align)
{
    if (align)
        *off = (int64_t)DFL_ALIGN_UP((uint64_t)*off, 16);
    dfl_draft_tensor *x = &t[(*k)++];
    snprintf(x->name, sizeof x->name, "%s", name);
    x->ndim = cols > 0 ? 2 : 1;
    x->shape[0] = r;
    x->shape[1] = cols > 0 ? cols : 0;
    x->numel = r * (cols > 0 ? cols : 1);
    x->offset = *off;
    *off += x->numel;
}

int dfl_draft_tensors(const dfl_draft_config *c, dfl_draft_tensor **out, int64_t *flat_len)
{
    int n = 3 + 11 * c->n_layers, k = 0;
    dfl_draft_tensor *t = calloc((size_t)n, sizeof *t);
    if (!t)
        return -1;
    const int64_t H = c->hidden, I = c->intermediate, NQ = (int64_t)c->n_heads * c->head_dim,
                  NK = (int64_t)c->n_kv * c->head_dim, D = c->head_dim;
    int64_t off = 0;
#define ADD(nm_, r_, c_, a_) add_tensor(t, &k, &off, nm_, r_, c_, a_)
    char nm[64];
    ADD("fc.weight", H, (int64_t)c->n_feat * H, 1);
    ADD("hidden_norm.weight", H, 0, 1);
    for (int l = 0; l < c->n_layers; l++) {
#define LNAME(s) (snprintf(nm, sizeof nm, "layers.%d.%s", l, s), nm)
        ADD(LNAME("input_layernorm.weight"), H, 0, 1);
        ADD(LNAME("self_attn.q_proj.weight"), NQ, H, 1);
        ADD(LNAME("self_attn.k_proj.weight"), NK, H, 1);
        ADD(LNAME("self_attn.v_proj.weight"), NK, H, 1);
        ADD(LNAME("self_attn.o_proj.weight"), H, NQ, 1);
        ADD(LNAME("self_attn.q_norm.weight"), D, 0, 1);
        ADD(LNAME("self_attn.k_norm.weight"), D, 0, 1);
        ADD(LNAME("post_attention_layernorm.weight"), H, 0, 1);
        ADD(LNAME("mlp.gate_proj.weight"), I, H, 1);
        ADD(LNAME("mlp.up_proj.weight"), I, H, 0);
        ADD(LNAME("mlp.down_proj.weight"), H, I, 1);
#undef LNAME
    }
    ADD("norm.weight", H, 0, 1);
#undef ADD
    *out = t;
    *flat_len = (int64_t)DFL_ALIGN_UP((uint64_t)off, 16);
    return n;
}

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
    /* the results block, the result slots and the input sets' events */
    res_layout *rl = &m->rl;
    size_t ro = 0;
    rl->sums = ro;
    ro += DFL_SUM_COUNT * sizeof(double);
    rl->bmet = ro;
    ro += (size_t)(2 * c->block_size + 2) * sizeof(double);
    rl->scal = ro;
    ro += 4 * sizeof(float);
    rl->skip = ro;
    ro += sizeof(int32_t);
    rl->prev_skip = ro;
    ro += sizeof(int32_t);
    rl->bytes = ro;
    m->feat_dt = DFL_F32;
    m->n_sets = be->async ? IN_SETS : 1;
    rc = (m->res = be_alloc(be, rl->bytes, e)) ? DFL_OK : (e ? e->code : DFL_ENOMEM);
    for (int i = 0; i < RES_SLOTS && !rc; i++) {
        if (!(m->slots[i].host = be->ops->host_alloc(be, rl->bytes, e)))
            rc = e ? e->code : DFL_ENOMEM;
        else
            rc = be->ops->event_new(be, &m->slots[i].ev_done, false, e);
    }
    for (int i = 0; i < m->n_sets && !rc; i++)
        if (!(rc = be->ops->event_new(be, &m->sets[i].ev_up, false, e)))
            rc = be->ops->event_new(be, &m->sets[i].ev_read, false, e);
    if (rc) {
        dfl_draft_close(m);
        return rc;
    }
    m->sums = (double *)((char *)m->res + rl->sums);
    m->bmet = (double *)((char *)m->res + rl->bmet);
    m->scal = (float *)((char *)m->res + rl->scal);
    m->skip = (int32_t *)((char *)m->res + rl->skip);
    m->prev_skip = (int32_t *)((char *)m->res + rl->prev_skip);
    be->ops->memset0(be, m->res, rl->bytes);
    *out = m;
    return DFL_OK;
}

int dfl_draft_set_timing(dfl_draft *m, bool on, dfl_err *e)
{
    dfl_be *be = m->be;
    if (m->n_posted > m->n_collected)
        return dfl_fail(e, DFL_EUSAGE, "drafter: timing changed with results pending");
    for (int i = 0; i < RES_SLOTS; i++) {
        res_slot *s = &m->slots[i];
        be->ops->event_free(be, s->ev_start);
        be->ops->event_free(be, s->ev_done);
        s->ev_start = s->ev_done = NULL;
        int rc = (on ? be->ops->event_new(be, &s->ev_start, true, e) : DFL_OK);
        if (!rc)
            rc = be->ops->event_new(be, &s->ev_done, on, e);
        if (rc)
            return rc;
    }
    m->timing = on;
    return DFL_OK;
}

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
static void free_workspace(dfl_draft *m)
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
    m->h_weight = NULL;
    m->h_labels = NULL;
    m->capT = m->capB = m->capS = 0;
}

void dfl_draft_close(dfl_draft *m)
{
    if (!m)
        return;
    dfl_be *be = m->be;
    if (m->res && be->async) {   /* copies into host buffers may still be in flight */
        dfl_err se = {0};
        for (int i = 0; i < m->n_sets; i++)
            if (m->sets[i].uploaded)
                be->ops->event_sync(be, m->sets[i].ev_up, &se);
        be->ops->sync(be, &se);
    }
    free_workspace(m);
    for (int i = 0; i < RES_SLOTS; i++) {
        be->ops->host_free(be, m->slots[i].host);
        be->ops->event_free(be, m->slots[i].ev_start);
        be->ops->event_free(be, m->slots[i].ev_done);
    }
    for (int i = 0; i < IN_SETS; i++) {
        be->ops->event_free(be, m->sets[i].ev_up);
        be->ops->event_free(be, m->sets[i].ev_read);
    }
    if (m->res)
        be->ops->free(be, m->res);
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

int dfl_draft_init_random(dfl_draft *m, uint64_t seed, double std, dfl_err *e)
{
    float *h = calloc((size_t)m->flat, sizeof *h);
    if (!h)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    dfl_rng r;
    dfl_rng_seed(&r, seed);
    for (int i = 0; i < m->n_tensors; i++) {
        const dfl_draft_tensor *t = &m->tensors[i];
        for (int64_t j = 0; j < t->numel; j++)
            h[t->offset + j] = t->ndim == 1 ? 1.0f : (float)(std * dfl_rng_normal(&r));
    }
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

/* ---- workspace ----------------------------------------------------------------------------- */

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
    if (host) {
        s->h_pos = pos, s->h_tok = tok, s->h_labels = labels, s->h_ctx_start = ctx_start;
        s->h_anchor = anchor, s->h_weight = weight, s->h_feat = feat;
    } else {
        s->pos = pos, s->tok = tok, s->labels = labels, s->ctx_start = ctx_start;
        s->anchor = anchor, s->weight = weight, s->feat = feat;
    }
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
    m->hL = carve(cv, (size_t)Q * H * as);
    m->z = carve(cv, (size_t)Q * H * as);
    m->rstdf = carve(cv, (size_t)Q * 4);
    m->lm_work = carve(cv, (size_t)m->chunk * (c->vocab + 2) * 4);
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
    const int64_t Q = m->capB * bs, Qs = m->capB * (bs - 1);
    int32_t *h = malloc((size_t)(Q + Qs) * sizeof *h);
    if (!h)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int32_t *sr = h, *rs = h + Qs;
    for (int64_t q = 0; q < Q; q++) {
        const int64_t j = q % bs, i = q / bs * (bs - 1) + j - 1;
        rs[q] = j ? (int32_t)i : -1;
        if (j)
            sr[i] = (int32_t)q;
    }
    int rc = m->be->ops->upload(m->be, m->scored_rows, sr, (size_t)Qs * sizeof *h);
    if (!rc)
        rc = m->be->ops->upload(m->be, m->row_scored, rs, (size_t)Q * sizeof *h);
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
    free_workspace(m);
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
        free_workspace(m);
        return rc;
    }
    for (int i = 0; i < m->n_sets; i++) {
        carver hc = {NULL, 0};
        carve_set(m, &hc, &m->sets[i], true);
        if (!(m->sets[i].hblock = m->be->ops->host_alloc(m->be, hc.off, e))) {
            free_workspace(m);
            return e ? e->code : DFL_ENOMEM;
        }
        hc.base = m->sets[i].hblock;
        hc.off = 0;
        carve_set(m, &hc, &m->sets[i], true);
    }
    m->capS = m->capT;
    m->h_seq_start = malloc((size_t)(m->capS + 1) * sizeof(int64_t));
    if (!m->h_seq_start) {
        free_workspace(m);
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

/* ---- the step ------------------------------------------------------------------------------ */

/* C = alpha op(A) op(B) + beta C with the model's dtypes. */
static int mm(dfl_draft *m, int64_t M, int64_t N, int64_t K, const void *A, dfl_dtype adt,
              int64_t lda, bool ta, const void *B, dfl_dtype bdt, int64_t ldb, bool tb, void *C,
              dfl_dtype cdt, int64_t ldc, float beta)
{
    dfl_mm x = {.M = M, .N = N, .K = K, .A = A, .adt = adt, .lda = lda, .ta = ta, .B = B,
                .bdt = bdt, .ldb = ldb, .tb = tb, .C = C, .cdt = cdt, .ldc = ldc,
                .alpha = 1.0f, .beta = beta};
    return m->be->ops->matmul(m->be, &x);
}

/* y [rows, out] (= or +=) x [rows, in] W^T, W = weight tensor at offset off, [out, in] */
static int linear(dfl_draft *m, void *y, const void *x, int64_t rows, int64_t off, int64_t out,
                  int64_t in, float beta)
{
    dfl_dtype act = m->be->act, wdt = m->be->wdt;
    const void *W = (const char *)m->wts + off * dfl_dtype_size(wdt);
    return mm(m, rows, out, in, x, act, in, false, W, wdt, in, true, y, act, out, beta);
}

/* dW [out, in] += dy^T x over rows */
static int linear_dw(dfl_draft *m, int64_t off, const void *dy, const void *x, int64_t rows,
                     int64_t out, int64_t in)
{
    dfl_dtype act = m->be->act;
    return mm(m, out, in, rows, dy, act, out, true, x, act, in, false, m->grad + off, DFL_F32, in, 1.0f);
}

/* dx [rows, in] (= or +=) dy [rows, out] W */
static int linear_dx(dfl_draft *m, void *dx, const void *dy, int64_t rows, int64_t off, int64_t out,
                     int64_t in, float beta)
{
    dfl_dtype act = m->be->act, wdt = m->be->wdt;
    const void *W = (const char *)m->wts + off * dfl_dtype_size(wdt);
    return mm(m, rows, in, out, dy, act, out, false, W, wdt, in, false, dx, act, in, beta);
}

static inline void *W(dfl_draft *m, int64_t off) { return (char *)m->wts + off * dfl_dtype_size(m->be->wdt); }
static inline void *ACT(dfl_draft *m, void *base, int64_t rows_off, int64_t width)
{
    return (char *)base + rows_off * width * (int64_t)dfl_dtype_size(m->be->act);
}

#define TRY(x)                                                                         \
    do {                                                                               \
        int rc_ = (x);                                                                 \
        if (rc_)                                                                       \
            return dfl_fail(e, rc_, "drafter step: %s failed (%s)", #x, dfl_code_name(rc_)); \
    } while (0)

/* Builds the per-step arrays on the host (positions, block tokens, labels, weights) into a set's
 * host arrays and checks the batch. */
static int prepare(dfl_draft *m, const dfl_draft_input *in, in_set *set, dfl_err *e)
{
    const dfl_draft_config *c = &m->c;
    const int bs = c->block_size;
    if (in->T < 1 || in->S < 1)
        return dfl_fail(e, DFL_EDATA, "drafter step: empty batch (%lld tokens, %d sequences)",
                        (long long)in->T, in->S);
    if (in->T > m->capT || in->n_blocks > m->capB || in->S > m->capS)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: batch of %lld tokens / %d blocks is over the "
                        "reserved %lld / %lld", (long long)in->T, in->n_blocks, (long long)m->capT,
                        (long long)m->capB);
    int64_t *st = m->h_seq_start, t = 0;
    for (int32_t s = 0; s < in->S; s++) {
        st[s] = t;
        if (in->seq_lens[s] == 0)
            return dfl_fail(e, DFL_EDATA, "drafter step: sequence %d is empty", s);
        for (uint32_t i = 0; i < in->seq_lens[s]; i++)
            set->h_pos[t + i] = (int32_t)i;
        t += in->seq_lens[s];
        if (t > in->T)
            break;
    }
    if (t != in->T)
        return dfl_fail(e, DFL_EDATA, "drafter step: sequence lengths add up to %lld, not %lld tokens",
                        (long long)t, (long long)in->T);
    st[in->S] = t;
    for (int64_t i = 0; i < in->T; i++)
        if (in->input_ids[i] < 0 || in->input_ids[i] >= c->vocab)
            return dfl_fail(e, DFL_EDATA, "drafter step: token %d at position %lld is outside the "
                            "vocabulary of %lld", in->input_ids[i], (long long)i, (long long)c->vocab);
    const int64_t T = in->T;
    int32_t prev_seq = 0;
    for (int32_t b = 0; b < in->n_blocks; b++) {
        int32_t s = in->block_seq[b], a = in->block_anchor[b];
        if (s < prev_seq || s >= in->S)
            return dfl_fail(e, DFL_EDATA, "drafter step: block %d: sequence %d out of order or range", b, s);
        prev_seq = s;
        int64_t cs = st[s], L = in->seq_lens[s];
        if (a < 0 || a >= L)
            return dfl_fail(e, DFL_EDATA, "drafter step: block %d: anchor %d outside sequence %d of "
                            "length %lld", b, a, s, (long long)L);
        set->h_ctx_start[b] = (int32_t)cs;
        set->h_anchor[b] = a;
        for (int j = 0; j < bs; j++) {
            int64_t q = (int64_t)b * bs + j, p = a + j;
            set->h_tok[q] = j == 0 ? in->input_ids[cs + a] : c->mask_token_id;
            set->h_pos[T + q] = (int32_t)p;
            bool in_range = p < L;
            set->h_labels[q] = in_range ? in->input_ids[cs + p] : 0;
            set->h_weight[q] = (j >= 1 && in_range && in->loss_mask[cs + p]) ? m->decay[j] : 0.0f;
        }
    }
    return DFL_OK;
}

/* Host part of staging: waits until the set's host arrays are free (their last upload has
 * completed), builds the step's arrays, copies the features in (rows packed). */
static int fill_set(dfl_draft *m, const dfl_draft_input *in, in_set *set, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    const int64_t T = in->T, H = c->hidden;
    const size_t fs = dfl_dtype_size(in->feat_dt);
    if (!dfl_dtype_is_float(in->feat_dt) || fs > dfl_dtype_size(m->feat_dt) ||
        (in->feat_dt != be->act && !m->featc))
        return dfl_fail(e, DFL_EUNSUP, "drafter step: features of dtype %s, the workspace was sized "
                        "for %s", dfl_dtype_name(in->feat_dt), dfl_dtype_name(m->feat_dt));
    int rc;
    if (set->uploaded && (rc = be->ops->event_sync(be, set->ev_up, e)))
        return rc;
    if ((rc = prepare(m, in, set, e)))
        return rc;
    for (int j = 0; j < c->n_feat; j++) {
        char *dst = (char *)set->h_feat + (size_t)j * T * H * fs;
        if (!in->feat[j])
            return dfl_fail(e, DFL_EUSAGE, "drafter step: no features for captured layer %d", j);
        if (in->feat_ld == H)
            memcpy(dst, in->feat[j], (size_t)(T * H) * fs);
        else
            for (int64_t t = 0; t < T; t++)
                memcpy(dst + (size_t)(t * H) * fs, (const char *)in->feat[j] + (size_t)(t * in->feat_ld) * fs,
                       (size_t)H * fs);
    }
    set->T = T;
    set->S = in->S;
    set->B = in->n_blocks;
    set->feat_dt = in->feat_dt;
    set->noise_amp = in->noise_amp;
    set->noise_seed = in->noise_seed;
    return DFL_OK;
}

int dfl_draft_stage(dfl_draft *m, const dfl_draft_input *in, dfl_err *e)
{
    dfl_be *be = m->be;
    if (!m->arena)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: no workspace (dfl_draft_reserve first)");
    in_set *set = &m->sets[m->n_staged % m->n_sets];
    if (set->full)
        return dfl_fail(e, DFL_EUSAGE, "drafter: %d batches staged and not run", m->n_sets);
    int rc = fill_set(m, in, set, e);
    if (rc)
        return rc;
    /* the upload, on the copy stream, after the step that last read the set's backend copies */
    const int64_t T = set->T, B = set->B, Q = B * m->c.block_size;
    const size_t fb = (size_t)m->c.n_feat * (size_t)(T * m->c.hidden) * dfl_dtype_size(set->feat_dt);
    if ((set->read && (rc = be->ops->stream_wait(be, DFL_STREAM_COPY, set->ev_read, e))) ||
        (rc = be->ops->upload_async(be, set->pos, set->h_pos, (size_t)(T + Q) * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->tok, set->h_tok, (size_t)Q * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->labels, set->h_labels, (size_t)Q * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->weight, set->h_weight, (size_t)Q * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->ctx_start, set->h_ctx_start, (size_t)B * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->anchor, set->h_anchor, (size_t)B * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->feat, set->h_feat, fb, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->event_record(be, set->ev_up, DFL_STREAM_COPY, e)))
        return rc;
    set->uploaded = true;
    set->full = true;
    m->n_staged++;
    return DFL_OK;
}

/* The step's inputs on the compute stream: wait for the set's upload, point the model at its
 * arrays, convert the features to the act dtype when they differ, add the noise. */
static int use_set(dfl_draft *m, in_set *set, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    int rc = be->ops->stream_wait(be, DFL_STREAM_COMPUTE, set->ev_up, e);
    if (rc)
        return rc;
    m->pos = set->pos;
    m->tok = set->tok;
    m->labels = set->labels;
    m->weight = set->weight;
    m->ctx_start = set->ctx_start;
    m->anchor = set->anchor;
    m->h_weight = set->h_weight;
    m->h_labels = set->h_labels;
    const int64_t n = (int64_t)c->n_feat * set->T * c->hidden;
    if (set->feat_dt == be->act) {
        m->feat = set->feat;
    } else {
        m->feat = m->featc;
        TRY(be->ops->convert(be, m->feat, be->act, set->feat, set->feat_dt, n));
    }
    if (set->noise_amp > 0)
        TRY(be->ops->uniform_noise(be, m->feat, n, set->noise_amp, set->noise_seed));
    return DFL_OK;
}

/* The attention window of layer l (dfl_dflash_attn.window: 0 = full attention). */
static int32_t layer_window(const dfl_draft_config *c, int l)
{
    return c->sliding[l] ? (int32_t)c->sliding_window : 0;
}

static int layer_forward(dfl_draft *m, int l, void *hout, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    const layer_w *w = &m->lw[l];
    layer_acts *a = &m->la[l];
    const int64_t T = m->T, Q = m->Q, H = c->hidden, I = c->intermediate;
    const int64_t NQ = (int64_t)c->n_heads * c->head_dim, NK = (int64_t)c->n_kv * c->head_dim;
    const size_t as = dfl_dtype_size(be->act);
    const float eps = (float)c->rms_eps, theta = (float)c->rope_theta;

    TRY(be->ops->rmsnorm(be, a->x, a->rstd1, a->hin, W(m, w->in_ln), Q, H, eps));
    /* queries */
    TRY(linear(m, a->qraw, a->x, Q, w->wq, NQ, H, 0.0f));
    TRY(be->ops->copy(be, a->q, a->qraw, (size_t)Q * NQ * as));
    TRY(be->ops->qknorm_rope(be, a->q, NQ, a->rstdq, W(m, w->q_norm), m->pos + T, Q, c->n_heads,
                             c->head_dim, eps, theta));
    /* keys and values: rows [context | block slots] */
    TRY(linear(m, a->kraw, m->C, T, w->wk, NK, H, 0.0f));
    TRY(linear(m, ACT(m, a->kraw, T, NK), a->x, Q, w->wk, NK, H, 0.0f));
    TRY(be->ops->copy(be, a->k, a->kraw, (size_t)(T + Q) * NK * as));
    TRY(be->ops->qknorm_rope(be, a->k, NK, a->rstdk, W(m, w->k_norm), m->pos, T + Q, c->n_kv,
                             c->head_dim, eps, theta));
    TRY(linear(m, a->v, m->C, T, w->wv, NK, H, 0.0f));
    TRY(linear(m, ACT(m, a->v, T, NK), a->x, Q, w->wv, NK, H, 0.0f));
    dfl_dflash_attn at = {
        .q = a->q, .k_ctx = a->k, .v_ctx = a->v, .k_blk = ACT(m, a->k, T, NK),
        .v_blk = ACT(m, a->v, T, NK), .o = a->o, .lse = a->lse, .ctx_start = m->ctx_start,
        .anchor = m->anchor, .n_blocks = (int32_t)m->B, .bs = c->block_size,
        .max_anchor = (int32_t)T, .window = layer_window(c, l), .T_ctx = T,
        .n_heads = c->n_heads, .n_kv = c->n_kv, .d = c->head_dim,
        .scale = 1.0f / sqrtf((float)c->head_dim),
    };
    TRY(be->ops->dflash_attn(be, &at));
    /* residual + MLP */
    TRY(be->ops->copy(be, a->hmid, a->hin, (size_t)Q * H * as));
    TRY(linear(m, a->hmid, a->o, Q, w->wo, H, NQ, 1.0f));
    TRY(be->ops->rmsnorm(be, a->y, a->rstd2, a->hmid, W(m, w->post_ln), Q, H, eps));
    TRY(linear(m, a->gu, a->y, Q, w->wgu, 2 * I, H, 0.0f));
    TRY(be->ops->swiglu(be, a->act, a->gu, Q, I));
    TRY(be->ops->copy(be, hout, a->hmid, (size_t)Q * H * as));
    TRY(linear(m, hout, a->act, Q, w->wdown, H, I, 1.0f));
    return DFL_OK;
}

/* On entry m->dh = dL/d(output of layer l); on exit dL/d(input of layer l). dC accumulates. */
static int layer_backward(dfl_draft *m, int l, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    const layer_w *w = &m->lw[l];
    layer_acts *a = &m->la[l];
    const int64_t T = m->T, Q = m->Q, H = c->hidden, I = c->intermediate;
    const int64_t NQ = (int64_t)c->n_heads * c->head_dim, NK = (int64_t)c->n_kv * c->head_dim;
    const float eps = (float)c->rms_eps, theta = (float)c->rope_theta;

    /* MLP: h_out = hmid + act Wdown^T */
    TRY(linear_dx(m, m->dact, m->dh, Q, w->wdown, H, I, 0.0f));
    TRY(linear_dw(m, w->wdown, m->dh, a->act, Q, H, I));
    TRY(be->ops->swiglu_bwd(be, m->dgu, m->dact, a->gu, Q, I));
    TRY(linear_dw(m, w->wgu, m->dgu, a->y, Q, 2 * I, H));
    TRY(linear_dx(m, m->dx, m->dgu, Q, w->wgu, 2 * I, H, 0.0f));
    TRY(be->ops->rmsnorm_bwd(be, m->dh, m->grad + w->post_ln, m->dx, a->hmid, W(m, w->post_ln),
                             a->rstd2, Q, H, true));
    /* attention: hmid = hin + o Wo^T */
    TRY(linear_dx(m, m->dout, m->dh, Q, w->wo, H, NQ, 0.0f));
    TRY(linear_dw(m, w->wo, m->dh, a->o, Q, H, NQ));
    dfl_dflash_attn at = {
        .q = a->q, .k_ctx = a->k, .v_ctx = a->v, .k_blk = ACT(m, a->k, T, NK),
        .v_blk = ACT(m, a->v, T, NK), .o = a->o, .lse = a->lse, .ctx_start = m->ctx_start,
        .anchor = m->anchor, .n_blocks = (int32_t)m->B, .bs = c->block_size,
        .max_anchor = (int32_t)T, .window = layer_window(c, l), .T_ctx = T,
        .n_heads = c->n_heads, .n_kv = c->n_kv, .d = c->head_dim,
        .scale = 1.0f / sqrtf((float)c->head_dim), .dout = m->dout, .delta = m->delta, .dq = m->dq, .dk_ctx = m->dk, .dv_ctx = m->dv,
        .dk_blk = ACT(m, m->dk, T, NK), .dv_blk = ACT(m, m->dv, T, NK),
    };
    TRY(be->ops->dflash_attn_bwd(be, &at));
    TRY(be->ops->qknorm_rope_bwd(be, m->dq, NQ, m->grad + w->q_norm, a->qraw, W(m, w->q_norm),
                                 a->rstdq, m->pos + T, Q, c->n_heads, c->head_dim, eps, theta));
    TRY(be->ops->qknorm_rope_bwd(be, m->dk, NK, m->grad + w->k_norm, a->kraw, W(m, w->k_norm),
                                 a->rstdk, m->pos, T + Q, c->n_kv, c->head_dim, eps, theta));
    const void *dk_blk = ACT(m, m->dk, T, NK), *dv_blk = ACT(m, m->dv, T, NK);
    TRY(linear_dw(m, w->wq, m->dq, a->x, Q, NQ, H));
    TRY(linear_dw(m, w->wk, dk_blk, a->x, Q, NK, H));
    TRY(linear_dw(m, w->wk, m->dk, m->C, T, NK, H));
    TRY(linear_dw(m, w->wv, dv_blk, a->x, Q, NK, H));
    TRY(linear_dw(m, w->wv, m->dv, m->C, T, NK, H));
    TRY(linear_dx(m, m->dx, m->dq, Q, w->wq, NQ, H, 0.0f));
    TRY(linear_dx(m, m->dx, dk_blk, Q, w->wk, NK, H, 1.0f));
    TRY(linear_dx(m, m->dx, dv_blk, Q, w->wv, NK, H, 1.0f));
    TRY(linear_dx(m, m->dC, m->dk, T, w->wk, NK, H, 1.0f));
    TRY(linear_dx(m, m->dC, m->dv, T, w->wv, NK, H, 1.0f));
    TRY(be->ops->rmsnorm_bwd(be, m->dh, m->grad + w->in_ln, m->dx, a->hin, W(m, w->in_ln),
                             a->rstd1, Q, H, true));
    return DFL_OK;
}

/* The forward (and backward) of the batch in set (see dfl_draft_run). */
static int run_step(dfl_draft *m, in_set *set, bool backward, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    int rc;
    m->T = set->T;
    m->S = set->S;
    m->B = set->B;
    m->Q = m->B * c->block_size;
    const int64_t T = m->T, Q = m->Q, H = c->hidden;
    const size_t as = dfl_dtype_size(be->act);
    const float eps = (float)c->rms_eps;
    TRY(be->ops->memset0(be, m->sums, DFL_SUM_COUNT * sizeof(double)));
    TRY(be->ops->memset0(be, m->bmet, (size_t)(2 * c->block_size + 2) * sizeof(double)));
    if (backward)
        TRY(be->ops->memset0(be, m->grad, (size_t)m->flat * sizeof(float)));

    /* context features: C = hidden_norm(sum_j feat_j fc[:, jH:(j+1)H]^T), one GEMM per layer */
    for (int j = 0; j < c->n_feat; j++) {
        const void *fj = (const char *)m->feat + (size_t)j * T * H * as;
        const void *fcj = (const char *)m->wts + (m->off_fc + (int64_t)j * H) * dfl_dtype_size(be->wdt);
        TRY(mm(m, T, H, H, fj, be->act, H, false, fcj, be->wdt, (int64_t)c->n_feat * H, true,
               m->cpre, be->act, H, j == 0 ? 0.0f : 1.0f));
    }
    TRY(be->ops->rmsnorm(be, m->C, m->rstdc, m->cpre, W(m, m->off_hnorm), T, H, eps));
    if (Q > 0) {
        TRY(be->ops->embedding(be, m->la[0].hin, m->tok, m->embed, Q, H));
        for (int l = 0; l < c->n_layers; l++) {
            void *hout = l + 1 < c->n_layers ? m->la[l + 1].hin : m->hL;
            if ((rc = layer_forward(m, l, hout, e)))
                return rc;
        }
        TRY(be->ops->rmsnorm(be, m->z, m->rstdf, m->hL, W(m, m->off_norm), Q, H, eps));
    }
    /* The LM head and the loss on the scored rows (see scored_rows): z's rows at slots 1..bs-1
     * into dx (free until the backward), their gradient into dh. */
    const int64_t Qs = m->B * (c->block_size - 1);
    dfl_lmce lm = {
        .z = m->dx, .w_lm = m->lm_head, .labels = m->labels_s, .weight = m->weight_s, .Q = Qs,
        .H = H, .V = c->vocab, .sums = m->sums, .correct = m->correct_s, .ce_out = m->ce,
        .dz = backward ? m->dh : NULL, .grad_scale = 1.0f, .work = m->lm_work,
        .chunk_rows = m->chunk,
    };
    if (Q > 0) {
        TRY(be->ops->gather_rows(be, m->dx, m->z, m->scored_rows, Qs, H * (int64_t)as));
        TRY(be->ops->gather_rows(be, m->labels_s, m->labels, m->scored_rows, Qs, 4));
        TRY(be->ops->gather_rows(be, m->weight_s, m->weight, m->scored_rows, Qs, 4));
        TRY(be->ops->lmce(be, &lm));
        TRY(be->ops->gather_rows(be, m->correct, m->correct_s, m->row_scored, Q, 1));
        TRY(be->ops->block_metrics(be, m->bmet, m->correct, m->weight, m->B, c->block_size));
    }
    m->have_step = true;
    if (!backward || Q == 0)
        return DFL_OK;   /* run_step records the set's ev_read */

    /* dz of every row: the scored rows' from dh, zero at slot 0 */
    TRY(be->ops->gather_rows(be, m->dx, m->dh, m->row_scored, Q, H * (int64_t)as));
    TRY(be->ops->rmsnorm_bwd(be, m->dh, m->grad + m->off_norm, m->dx, m->hL, W(m, m->off_norm),
                             m->rstdf, Q, H, false));
    TRY(be->ops->memset0(be, m->dC, (size_t)T * H * as));
    for (int l = c->n_layers - 1; l >= 0; l--)
        if ((rc = layer_backward(m, l, e)))
            return rc;
    /* C = hidden_norm(cpre): dC -> dcpre in place; then fc per captured layer */
    TRY(be->ops->rmsnorm_bwd(be, m->dC, m->grad + m->off_hnorm, m->dC, m->cpre, W(m, m->off_hnorm),
                             m->rstdc, T, H, false));
    for (int j = 0; j < c->n_feat; j++) {
        const void *fj = (const char *)m->feat + (size_t)j * T * H * as;
        TRY(mm(m, H, H, T, m->dC, be->act, H, true, fj, be->act, H, false,
               m->grad + m->off_fc + (int64_t)j * H, DFL_F32, (int64_t)c->n_feat * H, 1.0f));
    }
    return DFL_OK;
}

int dfl_draft_run(dfl_draft *m, bool backward, dfl_err *e)
{
    dfl_be *be = m->be;
    m->have_step = m->have_apply = m->step_posted = false;
    if (!m->embed)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: no target embedding / LM head");
    if (m->n_run >= m->n_staged)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: no batch staged");
    in_set *set = &m->sets[m->n_run % m->n_sets];
    res_slot *slot = &m->slots[m->n_posted % RES_SLOTS];
    int rc = use_set(m, set, e);
    if (!rc && slot->ev_start)
        rc = be->ops->event_record(be, slot->ev_start, DFL_STREAM_COMPUTE, e);
    if (!rc)
        rc = run_step(m, set, backward, e);
    /* the set's backend copies may be overwritten once the step's work so far has run */
    if (!rc && !(rc = be->ops->event_record(be, set->ev_read, DFL_STREAM_COMPUTE, e)))
        set->read = true;
    set->full = false;
    m->n_run++;
    return rc;
}

int dfl_draft_step(dfl_draft *m, const dfl_draft_input *in, bool backward, dfl_err *e)
{
    m->have_step = m->have_apply = false;
    if (m->n_run < m->n_staged)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: a batch is staged (dfl_draft_run it first)");
    int rc = dfl_draft_stage(m, in, e);
    return rc ? rc : dfl_draft_run(m, backward, e);
}
void dfl_draft_set_comm(dfl_draft *m, dfl_dist *comm) { m->comm = comm; }

int dfl_draft_apply(dfl_draft *m, const dfl_draft_optim *o, float lr, int64_t t, dfl_err *e)
{
    dfl_be *be = m->be;
    if (!m->have_step)
        return dfl_fail(e, DFL_EUSAGE, "drafter: apply without a step");
    /* pipelined: when the previous step's results are posted and not collected yet, the caller's
     * t does not count it; adamw takes t + 1, or t when that step turns out skipped (prev_skip) */
    const bool prev_unread = m->n_posted - m->n_collected > (m->step_posted ? 1 : 0);
    TRY(be->ops->copy(be, m->prev_skip, m->skip, sizeof(int32_t)));
    /* Data parallelism: all-reduce the gradients and m->sums over ranks here, so that the norm
     * and the denominator below are global (sums[GRAD_SQ] is still 0 on every rank). */
    if (m->comm) {
        int rc = dfl_dist_allreduce(m->comm, m->grad, m->flat, DFL_F32, e);
        if (!rc)
            rc = dfl_dist_allreduce(m->comm, m->sums, DFL_SUM_COUNT, DFL_F64, e);
        if (!rc)
            rc = dfl_dist_allreduce(m->comm, m->bmet, 2 * m->c.block_size + 2, DFL_F64, e);
        if (rc)
            return rc;
    }
    TRY(be->ops->sumsq(be, &m->sums[DFL_SUM_GRAD_SQ], m->grad, m->flat));
    TRY(be->ops->clip_scale(be, m->scal, m->skip, m->sums, o->max_grad_norm));
    dfl_adamw a = {
        .p = m->master, .g = m->grad, .m = m->adam_m, .v = m->adam_v,
        .p_act = m->wts != m->master ? m->wts : NULL, .n = m->flat, .lr = lr,
        .beta1 = o->beta1, .beta2 = o->beta2, .eps = o->eps, .weight_decay = o->weight_decay,
        .step = prev_unread ? t + 1 : t, .grad_scale = m->scal, .skip = m->skip,
        .prev_skip = prev_unread ? m->prev_skip : NULL,
    };
    TRY(be->ops->adamw(be, &a));
    m->have_apply = true;
    return DFL_OK;
}

int dfl_draft_post(dfl_draft *m, dfl_err *e)
{
    dfl_be *be = m->be;
    if (!m->have_step || m->step_posted)
        return dfl_fail(e, DFL_EUSAGE, "drafter: no step to post (or posted already)");
    if (m->n_posted - m->n_collected >= RES_SLOTS)
        return dfl_fail(e, DFL_EUSAGE, "drafter: %d results posted and not collected", RES_SLOTS);
    res_slot *s = &m->slots[m->n_posted % RES_SLOTS];
    /* on the compute stream, which produced them; the event right after */
    int rc = be->ops->download_async(be, s->host, m->res, m->rl.bytes, DFL_STREAM_COMPUTE, e);
    if (!rc)
        rc = be->ops->event_record(be, s->ev_done, DFL_STREAM_COMPUTE, e);
    if (rc)
        return rc;
    s->T = m->T;
    s->B = m->B;
    s->have_apply = m->have_apply;
    s->posted = true;
    m->n_posted++;
    m->step_posted = true;
    return DFL_OK;
}

int dfl_draft_pending(const dfl_draft *m) { return (int)(m->n_posted - m->n_collected); }

int dfl_draft_collect(dfl_draft *m, dfl_draft_stats *st, dfl_err *e)
{
    dfl_be *be = m->be;
    memset(st, 0, sizeof *st);
    st->gpu_ms = -1;
    if (m->n_collected >= m->n_posted)
        return dfl_fail(e, DFL_EUSAGE, "drafter: no results posted");
    res_slot *s = &m->slots[m->n_collected % RES_SLOTS];
    int rc = be->ops->event_sync(be, s->ev_done, e);
    if (rc)
        return rc;
    if (s->ev_start) {
        float ms;
        if (be->ops->event_elapsed(be, s->ev_start, s->ev_done, &ms, e) == DFL_OK)
            st->gpu_ms = ms;
    }
    const int bs = m->c.block_size;
    const char *h = s->host;
    double sums[DFL_SUM_COUNT], bm[2 * DFL_DRAFT_MAX_BS + 2];
    float scal[4];
    int32_t skip;
    memcpy(sums, h + m->rl.sums, sizeof sums);
    memcpy(bm, h + m->rl.bmet, (size_t)(2 * bs + 2) * sizeof(double));
    memcpy(scal, h + m->rl.scal, sizeof scal);
    memcpy(&skip, h + m->rl.skip, sizeof skip);
    s->posted = false;
    m->n_collected++;
    st->loss_num = sums[DFL_SUM_LOSS_NUM];
    st->loss_den = sums[DFL_SUM_LOSS_DEN];
    st->acc_num = sums[DFL_SUM_ACC_NUM];
    st->acc_den = sums[DFL_SUM_ACC_DEN];
    if (s->have_apply) {
        st->grad_norm = scal[1];
        st->clip_coef = scal[2];
    }
    st->skipped = s->have_apply ? skip != 0 : !isfinite(st->loss_num);
    st->bs = bs;
    st->tokens = s->T;
    st->blocks = s->B;
    for (int j = 1; j < bs; j++) {
        st->slot_count[j] = bm[j];
        st->slot_correct[j] = bm[bs + j];
    }
    st->tau_sum = bm[2 * bs];
    st->tau_blocks = (int64_t)bm[2 * bs + 1];
    return DFL_OK;
}

int dfl_draft_fetch(dfl_draft *m, dfl_draft_stats *st, dfl_err *e)
{
    memset(st, 0, sizeof *st);
    if (!m->have_step)
        return dfl_fail(e, DFL_EUSAGE, "drafter: no step to fetch");
    if (m->n_collected == m->n_posted)   /* fetched already: read it again (after apply, say) */
        m->step_posted = false;
    int rc = m->step_posted ? DFL_OK : dfl_draft_post(m, e);
    while (!rc && m->n_collected < m->n_posted)
        rc = dfl_draft_collect(m, st, e);
    return rc;
}

int dfl_draft_warmup(dfl_draft *m, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    if (!m->arena)
        return dfl_fail(e, DFL_EUSAGE, "drafter warm-up: no workspace");
    if (m->n_run < m->n_staged)
        return dfl_fail(e, DFL_EUSAGE, "drafter warm-up: a batch is staged");
    /* one sequence of capT tokens, capB blocks at anchors 0, 1, ...; zero features; every slot
     * scored */
    const int64_t T = m->capT, B = m->capB < T ? m->capB : T - 1 > 0 ? T - 1 : 1;
    const size_t fs = dfl_dtype_size(m->feat_dt);
    uint32_t len = (uint32_t)T;
    int32_t *ids = calloc((size_t)T, 4), *bseq = calloc((size_t)B, 4), *banc = calloc((size_t)B, 4);
    uint8_t *mask = malloc((size_t)T);
    void *zero = calloc((size_t)(T * c->hidden), fs);
    int rc = DFL_OK;
    if (!ids || !bseq || !banc || !mask || !zero) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    memset(mask, 1, (size_t)T);
    for (int64_t b = 0; b < B; b++)
        banc[b] = (int32_t)(T > 1 ? b % (T - 1) : 0);
    dfl_draft_input in = {.T = T, .S = 1, .seq_lens = &len, .input_ids = ids, .loss_mask = mask,
                          .feat_dt = m->feat_dt, .feat_ld = c->hidden, .n_blocks = (int32_t)B,
                          .block_seq = bseq, .block_anchor = banc};
    for (int j = 0; j < c->n_feat; j++)
        in.feat[j] = zero;
    /* the results block is the last step's until it is posted: keep it */
    const bool pending_step = m->have_step;
    if (pending_step) {
        rc = dfl_fail(e, DFL_EUSAGE, "drafter warm-up: the last step is not posted");
        goto out;
    }
    if (!(rc = dfl_draft_step(m, &in, true, e)))
        rc = be->ops->sync(be, e);
    m->have_step = m->have_apply = false;
out:
    free(ids);
    free(bseq);
    free(banc);
    free(mask);
    free(zero);
    return rc ? dfl_err_prefix(e, "drafter warm-up on %lld tokens, %lld blocks: ", (long long)T,
                               (long long)B) : DFL_OK;
}

void dfl_draft_host_waits(const dfl_draft *m, uint64_t *syncs, uint64_t *event_waits)
{
    m->be->ops->wait_stats(m->be, syncs, event_waits);
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
    const void *src = NULL;
    int64_t need = 0;
    switch (which) {
    case DFL_DRAFT_ACT_CTX: src = m->C; need = m->T * H; break;
    case DFL_DRAFT_ACT_LAYER:
        if (layer < 0 || layer >= m->c.n_layers)
            return dfl_fail(e, DFL_EUSAGE, "no layer %d", layer);
        src = layer + 1 < m->c.n_layers ? m->la[layer + 1].hin : m->hL;
        need = m->Q * H;
        break;
    case DFL_DRAFT_ACT_OUT: src = m->z; need = m->Q * H; break;
    case DFL_DRAFT_ACT_CE: return ce_rows(m, dst, n, e);
    case DFL_DRAFT_ACT_WEIGHT: memcpy(dst, m->h_weight, (size_t)(n < m->Q ? n : m->Q) * 4); return DFL_OK;
    case DFL_DRAFT_ACT_LABEL:
        for (int64_t i = 0; i < m->Q && i < n; i++)
            dst[i] = (float)m->h_labels[i];
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

double dfl_draft_lr(double lr, int64_t s, int64_t warmup, int64_t total)
{
    if (s < 1)
        s = 1;
    if (warmup > 0 && s <= warmup)
        return lr * (double)s / (double)warmup;
    if (total <= warmup)
        return lr;
    double p = (double)(s - warmup) / (double)(total - warmup);
    if (p > 1)
        p = 1;
    return lr * 0.5 * (1.0 + cos(M_PI * p));
}

int dfl_draft_eval(dfl_draft *m, const dfl_draft_input *in, uint8_t *correct, dfl_err *e)
{
    dfl_be *be = m->be;
    const int bs = m->c.block_size;
    if (m->n_run < m->n_staged || m->n_posted > m->n_collected)
        return dfl_fail(e, DFL_EUSAGE, "drafter evaluation: a step is staged or pending");
    if (in->noise_amp > 0)
        return dfl_fail(e, DFL_EUSAGE, "drafter evaluation: no feature noise");
    /* every slot in range weighs 1, so that no decay underflow leaves one unscored */
    float decay[DFL_DRAFT_MAX_BS];
    memcpy(decay, m->decay, sizeof decay);
    for (int j = 0; j < bs; j++)
        m->decay[j] = 1.0f;
    int rc = dfl_draft_step(m, in, false, e);
    memcpy(m->decay, decay, sizeof decay);
    if (!rc && in->n_blocks > 0 &&
        be->ops->download(be, correct, m->correct, (size_t)in->n_blocks * (size_t)bs))
        rc = dfl_fail(e, DFL_EDEVICE, "drafter evaluation: download failed");
    if (!rc)
        rc = be->ops->sync(be, e);
    m->have_step = m->have_apply = false;
    return rc;
}
