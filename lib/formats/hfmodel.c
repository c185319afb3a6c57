/* hfmodel.c: config.json parsing for qwen3 / qwen3_moe / llama / qwen2 / qwen3_5 / qwen3_5_moe
 * targets, the model fingerprint, and the default choice of captured layers (see hfmodel.h). */
#include "hfmodel.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "json.h"
#include "util.h"

/* A positive integer key within [1, max]. */
static int get_dim(const json_t *cfg, const char *key, bool required, int64_t max, int64_t *out,
                   const char *what, dfl_err *e)
{
    int64_t v = 0;
    bool present = json_object_get(cfg, key) && !json_is_null(json_object_get(cfg, key));
    int rc = dfl_json_int(cfg, key, required, &v, what, e);
    if (rc)
        return rc;
    if (!present)
        return DFL_OK;
    if (v < 1 || v > max)
        return dfl_fail(e, DFL_EDATA, "%s: %s = %lld is out of range [1, %lld]", what, key,
                        (long long)v, (long long)max);
    *out = v;
    return DFL_OK;
}

/* Keys whose presence with a non-zero value means a mixture-of-experts model. */
static const char *const moe_keys[] = {"num_experts", "num_local_experts", "n_routed_experts",
                                       "num_experts_per_tok", "moe_intermediate_size",
                                       "n_shared_experts"};

/* A number member where.key of a rope object; absent or null leaves *out (or, when required,
 * is DFL_EDATA naming the field and the rope type that needs it). */
static int rope_num(const json_t *obj, const char *where, const char *key, const char *rt,
                    bool required, double *out, const char *what, dfl_err *e)
{
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        if (required)
            return dfl_fail(e, DFL_EDATA, "%s: %s.%s is missing (rope_type '%s' needs it)", what,
                            where, key, rt);
        return DFL_OK;
    }
    if (!json_is_number(v) || !isfinite(json_number_value(v)))
        return dfl_fail(e, DFL_EDATA, "%s: %s.%s must be a finite number", what, where, key);
    *out = json_number_value(v);
    return DFL_OK;
}

/* original_max_position_embeddings as transformers 5 standardizes it: the top-level key first,
 * then the rope object's, then max_position_embeddings. */
static int rope_original(const json_t *cfg, const json_t *obj, const char *where, const char *rt,
                         double *out, const char *what, dfl_err *e)
{
    double v = 0;
    int rc;
    if ((rc = rope_num(cfg, "config", "original_max_position_embeddings", rt, false, &v, what, e)) ||
        (!v && (rc = rope_num(obj, where, "original_max_position_embeddings", rt, false, &v, what,
                               e))) ||
        (!v && (rc = rope_num(cfg, "config", "max_position_embeddings", rt, false, &v, what, e))))
        return rc;
    if (!v)
        return dfl_fail(e, DFL_EDATA, "%s: %s.original_max_position_embeddings is missing (rope_type "
                        "'%s' needs it) and max_position_embeddings is not set", what, where, rt);
    if (!(v >= 1 && v <= 1e12))
        return dfl_fail(e, DFL_EDATA, "%s: %s.original_max_position_embeddings = %g is out of range",
                        what, where, v);
    *out = v;
    return DFL_OK;
}

/* yarn's default attention factor (transformers' get_mscale). */
static double yarn_mscale(double scale, double m)
{
    return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

/* The rope scaling of a rope_scaling or rope_parameters object (where names it); partial_ok: a
 * partial_rotary_factor other than 1 may stand in it (qwen3_5 reads it elsewhere). */
static int parse_rope(const json_t *cfg, const json_t *obj, const char *where, bool partial_ok,
                      dfl_rope_scaling *rs, const char *what, dfl_err *e)
{
    memset(rs, 0, sizeof *rs);
    rs->attention_factor = 1.0;
    const char *rt = "default", *key = "rope_type";
    const char *keys[] = {"type", "rope_type"}; /* rope_type wins over the old spelling */
    for (size_t i = 0; i < DFL_ARRAY_LEN(keys); i++) {
        json_t *t = json_object_get(obj, keys[i]);
        if (!t || json_is_null(t))
            continue;
        if (!json_is_string(t))
            return dfl_fail(e, DFL_EDATA, "%s: %s.%s must be a string", what, where, keys[i]);
        rt = json_string_value(t);
        key = keys[i];
    }
    json_t *f = json_object_get(obj, "partial_rotary_factor");
    if (!partial_ok && f && !json_is_null(f) && !(json_is_number(f) && json_number_value(f) == 1.0))
        return dfl_fail(e, DFL_EUNSUP, "%s: %s.partial_rotary_factor is not supported (only 1.0)",
                        what, where);
    int rc = DFL_OK;
    if (strcmp(rt, "default") == 0)
        return DFL_OK;
    if (strcmp(rt, "linear") == 0) {
        rs->kind = DFL_ROPE_LINEAR;
        rc = rope_num(obj, where, "factor", rt, true, &rs->factor, what, e);
    } else if (strcmp(rt, "llama3") == 0) {
        rs->kind = DFL_ROPE_LLAMA3;
        if ((rc = rope_num(obj, where, "factor", rt, true, &rs->factor, what, e)) ||
            (rc = rope_num(obj, where, "low_freq_factor", rt, true, &rs->low_freq_factor, what, e)) ||
            (rc = rope_num(obj, where, "high_freq_factor", rt, true, &rs->high_freq_factor, what, e)) ||
            (rc = rope_original(cfg, obj, where, rt, &rs->original_max_pos, what, e)))
            return rc;
        if (!(rs->low_freq_factor >= 1e-6 && rs->high_freq_factor > rs->low_freq_factor &&
              rs->high_freq_factor <= 1e6))
            return dfl_fail(e, DFL_EDATA, "%s: %s.high_freq_factor = %g must be greater than "
                            "low_freq_factor = %g, both within [1e-6, 1e6]", what, where,
                            rs->high_freq_factor, rs->low_freq_factor);
    } else if (strcmp(rt, "yarn") == 0) {
        rs->kind = DFL_ROPE_YARN;
        double mscale = 0, mscale_all = 0, att = 0, max_pos = 0;
        bool have_att = json_object_get(obj, "attention_factor") &&
                        !json_is_null(json_object_get(obj, "attention_factor"));
        if ((rc = rope_original(cfg, obj, where, rt, &rs->original_max_pos, what, e)) ||
            (rc = rope_num(obj, where, "factor", rt, false, &rs->factor, what, e)) ||
            (rc = rope_num(obj, where, "attention_factor", rt, false, &att, what, e)) ||
            (rc = rope_num(obj, where, "mscale", rt, false, &mscale, what, e)) ||
            (rc = rope_num(obj, where, "mscale_all_dim", rt, false, &mscale_all, what, e)) ||
            (rc = rope_num(obj, where, "beta_fast", rt, false, &rs->beta_fast, what, e)) ||
            (rc = rope_num(obj, where, "beta_slow", rt, false, &rs->beta_slow, what, e)) ||
            (rc = rope_num(cfg, "config", "max_position_embeddings", rt, false, &max_pos, what, e)))
            return rc;
        if (!rs->factor && max_pos) /* transformers: the ratio of the two lengths */
            rs->factor = max_pos / rs->original_max_pos;
        if (!rs->factor)
            return dfl_fail(e, DFL_EDATA, "%s: %s.factor is missing (rope_type 'yarn' needs it)",
                            what, where);
        if (!rs->beta_fast) /* transformers: `or 32`, `or 1` */
            rs->beta_fast = 32;
        if (!rs->beta_slow)
            rs->beta_slow = 1;
        rs->truncate = true;
        if ((rc = dfl_json_bool(obj, "truncate", false, &rs->truncate, what, e)))
            return rc;
        if (have_att)
            rs->attention_factor = att;
        else if (mscale && mscale_all)
            rs->attention_factor = yarn_mscale(rs->factor, mscale) / yarn_mscale(rs->factor, mscale_all);
        else
            rs->attention_factor = yarn_mscale(rs->factor, 1.0);
        if (!(rs->attention_factor > 0 && rs->attention_factor < 1e3) ||
            !(rs->beta_fast > 0 && rs->beta_fast < 1e6) || !(rs->beta_slow > 0 && rs->beta_slow < 1e6))
            return dfl_fail(e, DFL_EDATA, "%s: %s: attention_factor %g, beta_fast %g, beta_slow %g: "
                            "out of range", what, where, rs->attention_factor, rs->beta_fast,
                            rs->beta_slow);
    } else {
        return dfl_fail(e, DFL_EUNSUP, "%s: %s.%s is '%s': this rope scaling is not supported "
                        "(rope_type default, linear, llama3 or yarn)", what, where, key, rt);
    }
    if (rc)
        return rc;
    if (!(rs->factor >= 1e-6 && rs->factor <= 1e6))
        return dfl_fail(e, DFL_EDATA, "%s: %s.factor = %g is out of range", what, where, rs->factor);
    return DFL_OK;
}

const char *dfl_layer_kind_name(int kind)
{
    switch (kind) {
    case DFL_LAYER_ATTN: return "attention";
    case DFL_LAYER_GATED_ATTN: return "gated attention";
    case DFL_LAYER_GDN: return "gated deltanet";
    default: return "unknown";
    }
}

/* The largest conv kernel and value/key head ratio the backends' kernels take. */
#define DFL_GDN_MAX_CONV 8

/* qwen3_5 / qwen3_5_moe (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration):
 * the text model is text_config (model_type qwen3_5_text / qwen3_5_moe_text); the top level may
 * carry the dtype and quantization_config. */
static int parse_qwen35_wrapper(const json_t *cfg, const char *mt, const char *what,
                                dfl_hf_config *c, dfl_err *e)
{
    bool moe = strcmp(mt, "qwen3_5_moe") == 0;
    const char *text_mt = moe ? "qwen3_5_moe_text" : "qwen3_5_text";
    json_t *tc = json_object_get(cfg, "text_config");
    if (!tc || !json_is_object(tc))
        return dfl_fail(e, DFL_EDATA, "%s: model_type '%s' needs a text_config object", what, mt);
    json_t *q = json_object_get(cfg, "quantization_config");
    if (q && !json_is_null(q))
        return dfl_fail(e, DFL_EUNSUP, "%s: quantization_config is set: quantized weights are not "
                        "supported (use bf16, f16 or f32 weights)", what);
    json_t *tmt = json_object_get(tc, "model_type");
    if (tmt && !(json_is_string(tmt) && strcmp(json_string_value(tmt), text_mt) == 0))
        return dfl_fail(e, DFL_EUNSUP, "%s: text_config.model_type is %s%s%s: only %s is "
                        "supported in model_type '%s'", what, json_is_string(tmt) ? "'" : "",
                        json_is_string(tmt) ? json_string_value(tmt) : "not a string",
                        json_is_string(tmt) ? "'" : "", text_mt, mt);
    char sub[4200];
    snprintf(sub, sizeof sub, "%s: text_config", what);
    json_t *copy = json_deep_copy(tc);
    if (!copy)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    json_object_set_new(copy, "model_type", json_string(text_mt));
    /* the load dtype is usually given at the top level only */
    const char *dts[] = {"dtype", "torch_dtype"};
    for (size_t i = 0; i < DFL_ARRAY_LEN(dts); i++)
        if (!json_object_get(copy, dts[i]) && json_object_get(cfg, dts[i]))
            json_object_set(copy, dts[i], json_object_get(cfg, dts[i]));
    if (!json_object_get(copy, "tie_word_embeddings") && json_object_get(cfg, "tie_word_embeddings"))
        json_object_set(copy, "tie_word_embeddings", json_object_get(cfg, "tie_word_embeddings"));
    int rc = dfl_hf_config_parse(copy, sub, c, e);
    json_decref(copy);
    if (!rc)
        snprintf(c->model_type, sizeof c->model_type, "%s", mt);
    return rc;
}

/* The hybrid part of a qwen3_5_text config: layer kinds, partial RoPE, the linear-attention
 * sizes. */
static int parse_qwen35(const json_t *cfg, const char *what, dfl_hf_config *c, dfl_err *e)
{
    int rc;
    json_t *lt = json_object_get(cfg, "layer_types");
    if (lt && !json_is_null(lt)) {
        if (!json_is_array(lt))
            return dfl_fail(e, DFL_EDATA, "%s: layer_types must be an array", what);
        if ((int64_t)json_array_size(lt) != c->n_layers)
            return dfl_fail(e, DFL_EDATA, "%s: layer_types has %zu entries for num_hidden_layers = "
                            "%lld", what, json_array_size(lt), (long long)c->n_layers);
        for (size_t i = 0; i < json_array_size(lt); i++) {
            json_t *v = json_array_get(lt, i);
            const char *s = json_is_string(v) ? json_string_value(v) : NULL;
            if (s && strcmp(s, "full_attention") == 0)
                c->layer_kind[i] = DFL_LAYER_GATED_ATTN;
            else if (s && strcmp(s, "linear_attention") == 0)
                c->layer_kind[i] = DFL_LAYER_GDN;
            else
                return dfl_fail(e, DFL_EUNSUP, "%s: layer_types[%zu] is %s%s%s: only "
                                "linear_attention and full_attention layers are supported", what, i,
                                s ? "'" : "", s ? s : "not a string", s ? "'" : "");
        }
    } else {
        int64_t interval = 4;
        if ((rc = get_dim(cfg, "full_attention_interval", false, 4096, &interval, what, e)))
            return rc;
        for (int64_t i = 0; i < c->n_layers; i++)
            c->layer_kind[i] = (i + 1) % interval == 0 ? DFL_LAYER_GATED_ATTN : DFL_LAYER_GDN;
    }
    for (int64_t i = 0; i < c->n_layers; i++)
        c->n_linear += c->layer_kind[i] == DFL_LAYER_GDN;

    /* partial RoPE: top level, else rope_parameters, else transformers' default 0.25 */
    double prf = 0.25;
    json_t *rp = json_object_get(cfg, "rope_parameters");
    if (rp && json_is_object(rp) && json_object_get(rp, "partial_rotary_factor") &&
        (rc = dfl_json_num(rp, "partial_rotary_factor", false, &prf, what, e)))
        return rc;
    if (json_object_get(cfg, "partial_rotary_factor") &&
        (rc = dfl_json_num(cfg, "partial_rotary_factor", false, &prf, what, e)))
        return rc;
    if (!(prf > 0 && prf <= 1))
        return dfl_fail(e, DFL_EDATA, "%s: partial_rotary_factor = %g is out of range (0, 1]", what,
                        prf);
    c->rot_dim = (int64_t)((double)c->head_dim * prf); /* Python's int(): truncation */
    if (c->rot_dim < 2 || c->rot_dim % 2)
        return dfl_fail(e, DFL_EUNSUP, "%s: partial_rotary_factor = %g gives %lld rotary dims of "
                        "head_dim %lld: not supported (even, at least 2)", what, prf,
                        (long long)c->rot_dim, (long long)c->head_dim);
    bool gate = true;
    if ((rc = dfl_json_bool(cfg, "attn_output_gate", false, &gate, what, e)))
        return rc;
    if (!gate)
        return dfl_fail(e, DFL_EUNSUP, "%s: attn_output_gate is false: only gated attention is "
                        "supported for qwen3_5", what);

    if (!c->n_linear)
        return DFL_OK;
    if ((rc = get_dim(cfg, "linear_num_key_heads", true, 4096, &c->lin_k_heads, what, e)) ||
        (rc = get_dim(cfg, "linear_key_head_dim", true, 1024, &c->lin_k_dim, what, e)) ||
        (rc = get_dim(cfg, "linear_num_value_heads", true, 4096, &c->lin_v_heads, what, e)) ||
        (rc = get_dim(cfg, "linear_value_head_dim", true, 1024, &c->lin_v_dim, what, e)) ||
        (rc = get_dim(cfg, "linear_conv_kernel_dim", true, 1024, &c->lin_conv, what, e)))
        return rc;
    if (c->lin_v_heads % c->lin_k_heads)
        return dfl_fail(e, DFL_EUNSUP, "%s: linear_num_value_heads = %lld is not a multiple of "
                        "linear_num_key_heads = %lld: not supported", what,
                        (long long)c->lin_v_heads, (long long)c->lin_k_heads);
    if (c->lin_conv > DFL_GDN_MAX_CONV)
        return dfl_fail(e, DFL_EUNSUP, "%s: linear_conv_kernel_dim = %lld is not supported (at "
                        "most %d)", what, (long long)c->lin_conv, DFL_GDN_MAX_CONV);
    return DFL_OK;
}

/* The mixture-of-experts fields of a qwen3_moe config, or (hybrid) of a qwen3_5_moe_text one:
 * there, as in transformers' Qwen3_5MoeTextConfig, every layer is sparse, the router always
 * renormalises its top k (decoder_sparse_step, mlp_only_layers and norm_topk_prob are not read)
 * and each sparse MLP has a shared expert of shared_expert_intermediate_size. */
static int parse_moe(const json_t *cfg, dfl_hf_config *c, bool hybrid, const char *what, dfl_err *e)
{
    int rc;
    int64_t a = 0, b = 0;
    if ((rc = get_dim(cfg, "num_experts", false, 1 << 16, &a, what, e)) ||
        (rc = get_dim(cfg, "num_local_experts", false, 1 << 16, &b, what, e)))
        return rc;
    if (a && b && a != b)
        return dfl_fail(e, DFL_EDATA, "%s: num_experts = %lld and num_local_experts = %lld disagree",
                        what, (long long)a, (long long)b);
    c->n_experts = a ? a : b;
    if (!c->n_experts)
        return dfl_fail(e, DFL_EDATA, "%s: num_experts is missing (model_type '%s' needs it)", what,
                        c->model_type);
    if ((rc = get_dim(cfg, "num_experts_per_tok", false, c->n_experts, &c->top_k, what, e)) ||
        (rc = get_dim(cfg, "moe_intermediate_size", false, 1 << 22, &c->moe_intermediate, what, e)))
        return rc;
    if (!c->top_k || !c->moe_intermediate)
        return dfl_fail(e, DFL_EDATA, "%s: %s is missing (model_type '%s' needs it)", what,
                        !c->top_k ? "num_experts_per_tok" : "moe_intermediate_size", c->model_type);
    c->sparse_step = 1;
    if (hybrid) {
        c->norm_topk_prob = true;
        if ((rc = get_dim(cfg, "shared_expert_intermediate_size", false, 1 << 22,
                          &c->shared_intermediate, what, e)))
            return rc;
        if (!c->shared_intermediate)
            return dfl_fail(e, DFL_EDATA, "%s: shared_expert_intermediate_size is missing "
                            "(model_type '%s' needs it)", what, c->model_type);
        return DFL_OK;
    }
    if ((rc = get_dim(cfg, "decoder_sparse_step", false, 1 << 20, &c->sparse_step, what, e)) ||
        (rc = dfl_json_bool(cfg, "norm_topk_prob", false, &c->norm_topk_prob, what, e)))
        return rc;
    json_t *mo = json_object_get(cfg, "mlp_only_layers");
    if (mo && !json_is_null(mo)) {
        if (!json_is_array(mo))
            return dfl_fail(e, DFL_EDATA, "%s: mlp_only_layers must be an array of layer ids", what);
        for (size_t i = 0; i < json_array_size(mo); i++) {
            json_t *v = json_array_get(mo, i);
            if (!json_is_integer(v) || json_integer_value(v) < 0 ||
                json_integer_value(v) >= c->n_layers)
                return dfl_fail(e, DFL_EDATA, "%s: mlp_only_layers[%zu] is not a layer id in [0, %lld)",
                                what, i, (long long)c->n_layers);
            int64_t l = json_integer_value(v);
            c->mlp_only[l / 64] |= 1ull << (l % 64);
        }
    }
    json_t *sh = json_object_get(cfg, "shared_expert_intermediate_size");
    if (sh && !json_is_null(sh) && !(json_is_number(sh) && json_number_value(sh) == 0))
        return dfl_fail(e, DFL_EUNSUP, "%s: shared_expert_intermediate_size is set: shared experts "
                        "are not supported in model_type '%s'", what, c->model_type);
    return DFL_OK;
}

bool dfl_hf_layer_is_moe(const dfl_hf_config *c, int64_t l)
{
    if (c->n_experts <= 0 || l < 0 || l >= DFL_HF_MAX_LAYERS)
        return false;
    if (c->mlp_only[l / 64] & (1ull << (l % 64)))
        return false;
    return (l + 1) % c->sparse_step == 0;
}

int dfl_hf_config_parse(const json_t *cfg, const char *what, dfl_hf_config *c, dfl_err *e)
{
    memset(c, 0, sizeof *c);
    c->rope.attention_factor = 1.0;
    if (!json_is_object(cfg))
        return dfl_fail(e, DFL_EDATA, "%s: expected a JSON object", what);
    int rc;
    const char *mt = NULL;
    if ((rc = dfl_json_str(cfg, "model_type", true, &mt, what, e)))
        return rc;
    if (strcmp(mt, "qwen3") == 0)
        c->arch = DFL_HF_QWEN3;
    else if (strcmp(mt, "llama") == 0)
        c->arch = DFL_HF_LLAMA;
    else if (strcmp(mt, "qwen2") == 0)
        c->arch = DFL_HF_QWEN2;
    else if (strcmp(mt, "qwen3_moe") == 0)
        c->arch = DFL_HF_QWEN3_MOE;
    else if (strcmp(mt, "qwen3_5") == 0 || strcmp(mt, "qwen3_5_moe") == 0)
        return parse_qwen35_wrapper(cfg, mt, what, c, e);
    else if (strcmp(mt, "qwen3_5_text") == 0 || strcmp(mt, "qwen3_5_moe_text") == 0)
        c->arch = DFL_HF_QWEN35;
    else
        return dfl_fail(e, DFL_EUNSUP, "%s: model_type '%s' is not supported (supported: qwen3, "
                        "qwen3_moe, llama, qwen2, qwen3_5, qwen3_5_text, qwen3_5_moe, "
                        "qwen3_5_moe_text)", what, mt);
    bool hybrid = c->arch == DFL_HF_QWEN35;
    /* mixture-of-experts MLPs: qwen3_moe, and qwen3_5_moe_text (hybrid, with a shared expert) */
    bool moe = c->arch == DFL_HF_QWEN3_MOE || strcmp(mt, "qwen3_5_moe_text") == 0;
    snprintf(c->model_type, sizeof c->model_type, "%s", mt);

    /* Features we do not implement: refuse them by name rather than compute something else. */
    if (json_object_get(cfg, "quantization_config") &&
        !json_is_null(json_object_get(cfg, "quantization_config")))
        return dfl_fail(e, DFL_EUNSUP, "%s: quantization_config is set: quantized weights are not "
                        "supported (use bf16, f16 or f32 weights)", what);
    for (size_t i = 0; i < DFL_ARRAY_LEN(moe_keys) && !moe; i++) {
        json_t *v = json_object_get(cfg, moe_keys[i]);
        if (v && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == 0))
            return dfl_fail(e, DFL_EUNSUP, "%s: %s is set: mixture-of-experts models are not "
                            "supported (dense models only)", what, moe_keys[i]);
    }
    const char *act = "silu";
    if ((rc = dfl_json_str(cfg, "hidden_act", false, &act, what, e)))
        return rc;
    if (strcmp(act, "silu") != 0 && strcmp(act, "swish") != 0)
        return dfl_fail(e, DFL_EUNSUP, "%s: hidden_act '%s' is not supported (only silu)", what, act);
    json_t *rs = json_object_get(cfg, "rope_scaling");
    bool have_rs = false;
    if (rs && !json_is_null(rs)) {
        if (!json_is_object(rs))
            return dfl_fail(e, DFL_EDATA, "%s: rope_scaling must be an object", what);
        if (!json_object_get(rs, "rope_type") && !json_object_get(rs, "type"))
            return dfl_fail(e, DFL_EUNSUP, "%s: rope_scaling is set without a rope_type: rope "
                            "scaling is not supported", what);
        if ((rc = parse_rope(cfg, rs, "rope_scaling", false, &c->rope, what, e)))
            return rc;
        have_rs = true;
    }
    json_t *prf = json_object_get(cfg, "partial_rotary_factor");
    if (!hybrid && prf && !json_is_null(prf) && !(json_is_number(prf) && json_number_value(prf) == 1.0))
        return dfl_fail(e, DFL_EUNSUP, "%s: partial_rotary_factor is not supported (only 1.0)", what);
    bool use_sw = false;
    if ((rc = dfl_json_bool(cfg, "use_sliding_window", false, &use_sw, what, e)))
        return rc;
    json_t *sw = json_object_get(cfg, "sliding_window");
    if (use_sw && sw && !json_is_null(sw))
        return dfl_fail(e, DFL_EUNSUP, "%s: sliding_window is set and use_sliding_window is true: "
                        "sliding-window attention is not supported", what);
    json_t *lt = json_object_get(cfg, "layer_types");
    if (!hybrid && lt && !json_is_null(lt)) {
        if (!json_is_array(lt))
            return dfl_fail(e, DFL_EDATA, "%s: layer_types must be an array", what);
        for (size_t i = 0; i < json_array_size(lt); i++) {
            json_t *v = json_array_get(lt, i);
            if (!json_is_string(v) || strcmp(json_string_value(v), "full_attention") != 0)
                return dfl_fail(e, DFL_EUNSUP, "%s: layer_types[%zu] is %s%s%s: only "
                                "full_attention layers are supported", what, i,
                                json_is_string(v) ? "'" : "",
                                json_is_string(v) ? json_string_value(v) : "not a string",
                                json_is_string(v) ? "'" : "");
        }
    }

    /* Sizes. */
    if ((rc = get_dim(cfg, "hidden_size", true, 1 << 20, &c->hidden_size, what, e)) ||
        (rc = get_dim(cfg, "num_hidden_layers", true, 4096, &c->n_layers, what, e)) ||
        (rc = get_dim(cfg, "num_attention_heads", true, 4096, &c->n_heads, what, e)) ||
        /* qwen3_5_moe_text has no dense MLP: transformers deletes intermediate_size */
        (rc = get_dim(cfg, "intermediate_size", !moe || !hybrid, 1 << 22, &c->intermediate_size,
                      what, e)) ||
        (rc = get_dim(cfg, "vocab_size", true, INT32_MAX, &c->vocab_size, what, e)))
        return rc;
    c->n_kv_heads = c->n_heads;
    if ((rc = get_dim(cfg, "num_key_value_heads", false, 4096, &c->n_kv_heads, what, e)))
        return rc;
    if (c->n_heads % c->n_kv_heads)
        return dfl_fail(e, DFL_EDATA, "%s: num_attention_heads = %lld is not a multiple of "
                        "num_key_value_heads = %lld", what, (long long)c->n_heads,
                        (long long)c->n_kv_heads);
    c->head_dim = 0;
    if ((rc = get_dim(cfg, "head_dim", false, 1024, &c->head_dim, what, e)))
        return rc;
    if (!c->head_dim) {
        if (c->hidden_size % c->n_heads)
            return dfl_fail(e, DFL_EDATA, "%s: hidden_size = %lld is not a multiple of "
                            "num_attention_heads = %lld and head_dim is not given", what,
                            (long long)c->hidden_size, (long long)c->n_heads);
        c->head_dim = c->hidden_size / c->n_heads;
    }
    if (c->head_dim % 2 || c->head_dim > 1024)
        return dfl_fail(e, DFL_EUNSUP, "%s: head_dim = %lld is not supported (even, at most 1024)",
                        what, (long long)c->head_dim);

    c->rms_norm_eps = 1e-6;
    if ((rc = dfl_json_num(cfg, "rms_norm_eps", false, &c->rms_norm_eps, what, e)))
        return rc;
    if (!(c->rms_norm_eps > 0 && c->rms_norm_eps < 1))
        return dfl_fail(e, DFL_EDATA, "%s: rms_norm_eps = %g is out of range (0, 1)", what,
                        c->rms_norm_eps);

    /* RoPE base: top-level rope_theta (transformers 4 and real checkpoints) or
     * rope_parameters.rope_theta (transformers 5). */
    c->rope_theta = 10000.0;
    bool have_theta = false;
    json_t *rp = json_object_get(cfg, "rope_parameters");
    if (rp && !json_is_null(rp)) {
        if (!json_is_object(rp))
            return dfl_fail(e, DFL_EDATA, "%s: rope_parameters must be an object", what);
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)rp, k, v) {
            if (json_is_object(v))
                return dfl_fail(e, DFL_EUNSUP, "%s: rope_parameters.%s: per-layer-type rope "
                                "parameters are not supported", what, k);
        }
        /* transformers 5 takes rope_scaling over rope_parameters; both set must agree */
        dfl_rope_scaling rp_rope;
        if ((rc = parse_rope(cfg, rp, "rope_parameters", hybrid, &rp_rope, what, e)))
            return rc;
        if (have_rs && !dfl_rope_scaling_eq(&rp_rope, &c->rope))
            return dfl_fail(e, DFL_EDATA, "%s: rope_scaling (rope_type '%s') and rope_parameters "
                            "(rope_type '%s') disagree", what, dfl_rope_kind_name(c->rope.kind),
                            dfl_rope_kind_name(rp_rope.kind));
        if (!have_rs)
            c->rope = rp_rope;
        if (json_object_get(rp, "rope_theta") && !json_is_null(json_object_get(rp, "rope_theta"))) {
            if ((rc = dfl_json_num(rp, "rope_theta", true, &c->rope_theta, what, e)))
                return rc;
            have_theta = true;
        }
    }
    json_t *rt = json_object_get(cfg, "rope_theta");
    if (rt && !json_is_null(rt)) {
        double t;
        if ((rc = dfl_json_num(cfg, "rope_theta", true, &t, what, e)))
            return rc;
        if (have_theta && t != c->rope_theta)
            return dfl_fail(e, DFL_EDATA, "%s: rope_theta = %g and rope_parameters.rope_theta = %g "
                            "disagree", what, t, c->rope_theta);
        c->rope_theta = t;
    }
    if (!(c->rope_theta > 1 && c->rope_theta < 1e30))
        return dfl_fail(e, DFL_EDATA, "%s: rope_theta = %g is out of range", what, c->rope_theta);

    /* The load dtype: transformers casts the RoPE inv_freq buffer to it (see dfl_be.rope_dtype). */
    const char *dts[] = {"dtype", "torch_dtype"};
    for (size_t i = 0; i < DFL_ARRAY_LEN(dts) && !c->dtype; i++) {
        const char *v = NULL;
        json_t *j = json_object_get(cfg, dts[i]);
        if (!j || !json_is_string(j))
            continue; /* absent, null, or an object (per-module dtypes): ignored */
        v = json_string_value(j);
        if (strcmp(v, "bfloat16") == 0)
            c->dtype = DFL_BF16;
        else if (strcmp(v, "float16") == 0)
            c->dtype = DFL_F16;
        else if (strcmp(v, "float32") == 0)
            c->dtype = DFL_F32;
        else if (strcmp(v, "auto") != 0)
            return dfl_fail(e, DFL_EUNSUP, "%s: %s '%s' is not supported (bfloat16, float16 or "
                            "float32)", what, dts[i], v);
    }
    if ((rc = dfl_json_bool(cfg, "tie_word_embeddings", false, &c->tie_word_embeddings, what, e)))
        return rc;
    bool attn_bias = false, mlp_bias = false;
    if ((rc = dfl_json_bool(cfg, "attention_bias", false, &attn_bias, what, e)))
        return rc;
    if ((rc = dfl_json_bool(cfg, "mlp_bias", false, &mlp_bias, what, e)))
        return rc;
    /* As transformers builds the layers: qwen2 always has q/k/v biases and no o_proj bias;
     * llama and qwen3 put attention_bias on q/k/v/o; only llama reads mlp_bias. */
    c->rot_dim = c->head_dim;
    switch (c->arch) {
    case DFL_HF_QWEN3_MOE:
        if ((rc = parse_moe(cfg, c, false, what, e)))
            return rc;
        /* the attention is qwen3's */
        __attribute__((fallthrough));
    case DFL_HF_QWEN3:
        c->qk_norm = true;
        c->qkv_bias = c->o_bias = attn_bias;
        break;
    case DFL_HF_QWEN35:
        c->qk_norm = true;
        c->norm_1p = true;
        if (attn_bias)
            return dfl_fail(e, DFL_EUNSUP, "%s: attention_bias is true: not supported for qwen3_5",
                            what);
        /* the partial-RoPE ops of the gated attention use the default frequencies */
        if (c->rope.kind != DFL_ROPE_DEFAULT)
            return dfl_fail(e, DFL_EUNSUP, "%s: rope_type '%s' with partial rotary (qwen3_5) is not "
                            "supported (only rope_type default)", what,
                            dfl_rope_kind_name(c->rope.kind));
        if ((rc = parse_qwen35(cfg, what, c, e)))
            return rc;
        if (moe && (rc = parse_moe(cfg, c, true, what, e)))
            return rc;
        break;
    case DFL_HF_LLAMA:
        c->qkv_bias = c->o_bias = attn_bias;
        c->mlp_bias = mlp_bias;
        break;
    case DFL_HF_QWEN2:
        c->qkv_bias = true;
        break;
    }
    return DFL_OK;
}

int dfl_hf_config_load(const char *dir, dfl_hf_config *c, json_t **json, dfl_err *e)
{
    if (json)
        *json = NULL;
    char *path = dfl_path_join(dir, "config.json");
    if (!path)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    json_t *cfg = NULL;
    int rc = dfl_json_load_file(path, &cfg, e);
    if (!rc)
        rc = dfl_hf_config_parse(cfg, path, c, e);
    free(path);
    if (!rc && json)
        *json = cfg;
    else
        json_decref(cfg);
    return rc;
}

/* ---- the drafter's view of a target ---------------------------------------------------------- */

/* The text models of the Qwen3.5 family (hybrid linear / full attention). */
static bool is_qwen35_text(const char *mt)
{
    return !strcmp(mt, "qwen3_5_text") || !strcmp(mt, "qwen3_5_moe_text");
}

/* An optional integer that may be null (-1 then). */
static int opt_token(const json_t *j, const char *key, int64_t *out, const char *what, dfl_err *e)
{
    *out = -1;
    const json_t *v = json_object_get(j, key);
    if (!v || json_is_null(v) || json_is_array(v))
        return DFL_OK;   /* lists of eos ids: not one id */
    int64_t x;
    int rc = dfl_json_int(j, key, false, &x, what, e);
    if (!rc && x >= 0)
        *out = x;
    return rc;
}

int dfl_hf_drafter_target_parse(const json_t *cfg, const char *what, dfl_hf_drafter_target *t,
                                dfl_err *e)
{
    memset(t, 0, sizeof *t);
    if (!json_is_object(cfg))
        return dfl_fail(e, DFL_EDATA, "%s: expected a JSON object", what);
    const json_t *tc = json_object_get(cfg, "text_config");
    const char *mt = NULL;
    int rc;
    if (tc && !json_is_null(tc)) {
        if (!json_is_object(tc))
            return dfl_fail(e, DFL_EDATA, "%s: text_config must be an object", what);
        if ((rc = dfl_json_str(tc, "model_type", true, &mt, what, e)))
            return rc;
        if (!is_qwen35_text(mt))
            return dfl_fail(e, DFL_EUNSUP, "%s: text_config.model_type '%s' is not supported (a "
                            "drafter's target with a text_config: qwen3_5_text, qwen3_5_moe_text)",
                            what, mt);
        snprintf(t->embed_name, sizeof t->embed_name, "model.language_model.embed_tokens.weight");
    } else {
        tc = cfg;
        if ((rc = dfl_json_str(cfg, "model_type", true, &mt, what, e)))
            return rc;
        if (!is_qwen35_text(mt)) {
            /* the dense families: dfl-target's own parser, with its checks */
            dfl_hf_config c;
            if ((rc = dfl_hf_config_parse(cfg, what, &c, e)))
                return rc;
            snprintf(t->model_type, sizeof t->model_type, "%s", c.model_type);
            t->hidden_size = c.hidden_size, t->vocab_size = c.vocab_size, t->n_layers = c.n_layers;
            t->n_heads = c.n_heads, t->n_kv_heads = c.n_kv_heads, t->head_dim = c.head_dim;
            t->intermediate_size = c.intermediate_size;
            t->rms_norm_eps = c.rms_norm_eps, t->rope_theta = c.rope_theta;
            t->tie_word_embeddings = c.tie_word_embeddings;
            goto names;
        }
        snprintf(t->embed_name, sizeof t->embed_name, "model.embed_tokens.weight");
    }
    snprintf(t->model_type, sizeof t->model_type, "%s", mt);
    if ((rc = get_dim(tc, "hidden_size", true, 1 << 20, &t->hidden_size, what, e)) ||
        (rc = get_dim(tc, "num_hidden_layers", true, 4096, &t->n_layers, what, e)) ||
        (rc = get_dim(tc, "num_attention_heads", true, 4096, &t->n_heads, what, e)) ||
        (rc = get_dim(tc, "vocab_size", true, INT32_MAX, &t->vocab_size, what, e)) ||
        (rc = get_dim(tc, "intermediate_size", false, 1 << 22, &t->intermediate_size, what, e)))
        return rc;
    t->n_kv_heads = t->n_heads;
    if ((rc = get_dim(tc, "num_key_value_heads", false, 4096, &t->n_kv_heads, what, e)))
        return rc;
    if ((rc = get_dim(tc, "head_dim", false, 1024, &t->head_dim, what, e)))
        return rc;
    if (!t->head_dim)
        t->head_dim = t->hidden_size / t->n_heads;
    t->rms_norm_eps = 1e-6;
    if ((rc = dfl_json_num(tc, "rms_norm_eps", false, &t->rms_norm_eps, what, e)))
        return rc;
    t->rope_theta = 10000.0;
    const json_t *rp = json_object_get(tc, "rope_parameters");
    if (json_is_object(rp) && (rc = dfl_json_num(rp, "rope_theta", false, &t->rope_theta, what, e)))
        return rc;
    if ((rc = dfl_json_num(tc, "rope_theta", false, &t->rope_theta, what, e)))
        return rc;
    /* tie_word_embeddings: the text config's, else the top level's */
    if ((rc = dfl_json_bool(cfg, "tie_word_embeddings", false, &t->tie_word_embeddings, what, e)) ||
        (rc = dfl_json_bool(tc, "tie_word_embeddings", false, &t->tie_word_embeddings, what, e)))
        return rc;
names:
    if (!t->embed_name[0])
        snprintf(t->embed_name, sizeof t->embed_name, "model.embed_tokens.weight");
    snprintf(t->lm_head_name, sizeof t->lm_head_name, "lm_head.weight");
    int64_t v = 0;
    if (get_dim(tc, "max_position_embeddings", false, INT64_MAX / 2, &v, what, NULL) == 0)
        t->max_position = v;
    if ((rc = opt_token(tc, "bos_token_id", &t->bos_token_id, what, e)) ||
        (rc = opt_token(tc, "eos_token_id", &t->eos_token_id, what, e)))
        return rc;
    return DFL_OK;
}

int dfl_hf_drafter_target_load(const char *dir, dfl_hf_drafter_target *t, char fp[33], dfl_err *e)
{
    char *path = dfl_path_join(dir, "config.json");
    json_t *cfg = NULL;
    dfl_st_model *m = NULL;
    int rc = path ? dfl_json_load_file(path, &cfg, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
    if (!rc)
        rc = dfl_hf_drafter_target_parse(cfg, path, t, e);
    if (!rc && fp && !(rc = dfl_st_model_open(&m, dir, e)))
        rc = dfl_hf_fingerprint_of(cfg, m, fp, e);
    dfl_st_model_close(m);
    json_decref(cfg);
    free(path);
    return rc;
}

/* A growing byte buffer for the fingerprint's input. */
typedef struct fbuf {
    char *p;
    size_t n, cap;
    bool oom;
} fbuf;

static void fb_put(fbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void fb_str(fbuf *b, const char *s) { fb_put(b, s, strlen(s)); }

int dfl_hf_fingerprint_of(const json_t *cfg, const dfl_st_model *m, char out[33], dfl_err *e)
{
    out[0] = 0;
    char *js = dfl_json_dump(cfg, 0);
    if (!js)
        return dfl_fail(e, DFL_ENOMEM, "fingerprint: cannot serialize config.json");
    fbuf b = {0};
    fb_str(&b, "dfl model fingerprint v1\nconfig ");
    fb_str(&b, js);
    fb_str(&b, "\n");
    free(js);
    for (size_t i = 0; i < m->n; i++) {
        const dfl_st_tensor *t = m->t[i];
        char line[128];
        fb_str(&b, "tensor ");
        fb_str(&b, t->name);
        snprintf(line, sizeof line, " %s [", dfl_dtype_name(t->dtype));
        fb_str(&b, line);
        for (int d = 0; d < t->ndim; d++) {
            snprintf(line, sizeof line, "%s%lld", d ? "," : "", (long long)t->shape[d]);
            fb_str(&b, line);
        }
        fb_str(&b, "]\n");
    }
    if (b.oom) {
        free(b.p);
        return dfl_fail(e, DFL_ENOMEM, "fingerprint: out of memory");
    }
    /* XXH3-128 in its canonical (big-endian) form, as xxh128sum prints it */
    XXH128_canonical_t cano;
    XXH128_canonicalFromHash(&cano, XXH3_128bits(b.p, b.n));
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", cano.digest[i]);
    free(b.p);
    return DFL_OK;
}

int dfl_hf_fingerprint(const char *dir, char out[33], dfl_err *e)
{
    dfl_hf_config c;
    json_t *cfg = NULL;
    int rc = dfl_hf_config_load(dir, &c, &cfg, e);
    if (rc)
        return rc;
    dfl_st_model *m = NULL;
    rc = dfl_st_model_open(&m, dir, e);
    if (!rc)
        rc = dfl_hf_fingerprint_of(cfg, m, out, e);
    dfl_st_model_close(m);
    json_decref(cfg);
    return rc;
}

int dfl_hf_auto_layers(int64_t n_layers, int k, int32_t *out, int *n, dfl_err *e)
{
    *n = 0;
    if (n_layers < 1)
        return dfl_fail(e, DFL_EDATA, "auto layers: the model has no layers");
    if (k < 1)
        return dfl_fail(e, DFL_EUSAGE, "auto layers: K = %d must be at least 1", k);
    int64_t kk = k;
    if (kk > n_layers - 3)
        kk = n_layers - 3;
    if (kk < 1)
        kk = 1;
    if (kk == 1) {
        out[0] = (int32_t)(n_layers / 2);
        *n = 1;
        return DFL_OK;
    }
    int64_t den = kk - 1, span = n_layers - 4;
    for (int64_t i = 0; i < kk; i++) {
        int64_t num = den + i * span; /* 1 + i*span/den = num/den, num >= 0 */
        int64_t q = num / den, r = num % den;
        if (2 * r > den || (2 * r == den && (q & 1)))
            q++;
        out[i] = (int32_t)q;
    }
    for (int64_t i = 0; i < kk; i++)
        if (out[i] < 0 || out[i] >= n_layers || (i && out[i] <= out[i - 1]))
            return dfl_fail(e, DFL_EDATA, "auto layers: internal error for N = %lld, K = %d",
                            (long long)n_layers, k);
    *n = (int)kk;
    return DFL_OK;
}
