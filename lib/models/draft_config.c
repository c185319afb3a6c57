/* draft_config.c: the DFlash drafter's configuration (config.json in and out, the layer types
 * and their command-line form, the checks) and the list of its trained tensors with their offsets
 * in the flat parameter buffer (doc/dflash-step.md section 1). Pure functions of the config. */
#include "draft.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "util.h"

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

/* ---- the tensor list ---------------------------------------------------------------------- */

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
