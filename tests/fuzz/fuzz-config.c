/* fuzz-config.c: libFuzzer harness for config.json (lib/formats/hfmodel.c over lib/base/json.c).
 *
 * The input is a config.json. It is parsed with dfl_json_parse (bounds: size, nesting, NUL
 * bytes, duplicate keys) and, when it is an object, with dfl_hf_config_parse; it is also loaded
 * from a file the way dfl-target does (dfl_hf_config_load), which must agree. A parsed JSON
 * value must survive dfl_json_dump and a second parse unchanged. An accepted config must hold
 * what the parser promises (sizes in range, heads dividing, head_dim even), its default layer
 * choice must be valid for every K, and its fingerprint with a small fixed model must be
 * computable and the same twice. */
#include <math.h>
#include <stdbool.h>
#include <sys/stat.h>

#include "fuzz.h"
#include "hfmodel.h"
#include "json.h"
#include "safetensors.h"

static dfl_st_model *model;
static char cfg_dir[512];

static void setup(void)
{
    const char *top = fz_scratch_dir();
    snprintf(cfg_dir, sizeof cfg_dir, "%s/model", top);
    if (mkdir(cfg_dir, 0755) != 0)
        fz_die("mkdir %s: %s", cfg_dir, strerror(errno));
    char path[1024];
    snprintf(path, sizeof path, "%s/weights.safetensors", top);
    dfl_st_writer *w = dfl_st_writer_new();
    dfl_err e;
    static const uint8_t zeros[64];
    int64_t s1[1] = {4}, s2[2] = {2, 4};
    if (dfl_st_writer_add(w, "model.norm.weight", DFL_BF16, 1, s1, zeros, &e) ||
        dfl_st_writer_add(w, "model.embed_tokens.weight", DFL_F32, 2, s2, zeros, &e) || dfl_st_write(w, path, &e))
        fz_die("%s", e.msg);
    dfl_st_writer_free(w);
    if (dfl_st_model_open(&model, path, &e))
        fz_die("%s", e.msg);
}

static void check_config(const dfl_hf_config *c)
{
    FZ_ASSERT(c->arch == DFL_HF_QWEN3 || c->arch == DFL_HF_LLAMA || c->arch == DFL_HF_QWEN2 ||
                  c->arch == DFL_HF_QWEN35 || c->arch == DFL_HF_QWEN3_MOE, "arch %d", c->arch);
    /* hybrid models: layer kinds, partial RoPE and linear-attention sizes the kernels take */
    FZ_ASSERT(c->rot_dim >= 2 && c->rot_dim <= c->head_dim && c->rot_dim % 2 == 0, "rot_dim %lld",
              (long long)c->rot_dim);
    int64_t linear = 0;
    for (int64_t i = 0; i < c->n_layers; i++) {
        FZ_ASSERT(c->layer_kind[i] == (c->arch == DFL_HF_QWEN35 ? c->layer_kind[i] : DFL_LAYER_ATTN),
                  "dense layer %lld of kind %d", (long long)i, c->layer_kind[i]);
        FZ_ASSERT(c->layer_kind[i] <= DFL_LAYER_GDN, "layer %lld: kind %d", (long long)i, c->layer_kind[i]);
        linear += c->layer_kind[i] == DFL_LAYER_GDN;
    }
    FZ_ASSERT(linear == c->n_linear, "%lld linear layers counted, %lld recorded", (long long)linear,
              (long long)c->n_linear);
    if (c->n_linear)
        FZ_ASSERT(c->lin_k_heads >= 1 && c->lin_v_heads % c->lin_k_heads == 0 && c->lin_k_dim >= 1 &&
                      c->lin_v_dim >= 1 && c->lin_conv >= 1 && c->lin_conv <= 8,
                  "linear sizes %lld/%lld heads of %lld/%lld, conv %lld", (long long)c->lin_k_heads,
                  (long long)c->lin_v_heads, (long long)c->lin_k_dim, (long long)c->lin_v_dim,
                  (long long)c->lin_conv);
    /* experts: qwen3_moe, and qwen3_5_moe (hybrid: every layer sparse, a shared expert each) */
    if (c->arch == DFL_HF_QWEN3_MOE || (c->arch == DFL_HF_QWEN35 && c->n_experts))
        FZ_ASSERT(c->n_experts >= 1 && c->top_k >= 1 && c->top_k <= c->n_experts &&
                      c->moe_intermediate >= 1 && c->sparse_step >= 1, "experts %lld, top %lld",
                  (long long)c->n_experts, (long long)c->top_k);
    else
        FZ_ASSERT(c->n_experts == 0 && !dfl_hf_layer_is_moe(c, 0), "experts in a dense model");
    if (c->arch == DFL_HF_QWEN35 && c->n_experts)
        FZ_ASSERT(c->shared_intermediate >= 1 && c->sparse_step == 1 && c->norm_topk_prob &&
                      dfl_hf_layer_is_moe(c, c->n_layers - 1),
                  "hybrid experts: shared %lld, sparse step %lld", (long long)c->shared_intermediate,
                  (long long)c->sparse_step);
    else
        FZ_ASSERT(c->shared_intermediate == 0, "a shared expert outside qwen3_5_moe");
    /* the rope scaling gives finite positive frequencies */
    float inv[512];
    dfl_rope_inv_freq_scaled(inv, (int)c->head_dim, (float)c->rope_theta, &c->rope, DFL_F32);
    for (int i = 0; i < c->head_dim / 2; i++)
        FZ_ASSERT(isfinite(inv[i]) && inv[i] >= 0, "rope %s: inv_freq[%d] = %g",
                  dfl_rope_kind_name(c->rope.kind), i, inv[i]);
    FZ_ASSERT(c->rope.attention_factor > 0 && c->rope.attention_factor < 1e3, "attention factor %g",
              c->rope.attention_factor);
    /* a dense MLP's width: every model but qwen3_5_moe, whose layers are all sparse (its
     * intermediate_size may be absent: transformers deletes it) */
    bool all_sparse = c->arch == DFL_HF_QWEN35 && c->n_experts;
    FZ_ASSERT(c->hidden_size >= 1 && c->n_layers >= 1 && c->n_heads >= 1 && c->n_kv_heads >= 1 &&
                  (c->intermediate_size >= 1 || all_sparse) && c->vocab_size >= 1 && c->vocab_size <= INT32_MAX,
              "a size out of range");
    FZ_ASSERT(c->n_heads % c->n_kv_heads == 0, "heads %lld, kv heads %lld", (long long)c->n_heads,
              (long long)c->n_kv_heads);
    FZ_ASSERT(c->head_dim >= 2 && c->head_dim <= 1024 && c->head_dim % 2 == 0, "head_dim %lld", (long long)c->head_dim);
    FZ_ASSERT(c->rms_norm_eps > 0 && c->rms_norm_eps < 1, "eps %g", c->rms_norm_eps);
    FZ_ASSERT(c->rope_theta > 1 && c->rope_theta < 1e30, "theta %g", c->rope_theta);
    for (int k = 1; k <= 8; k++) {
        int32_t layers[8];
        int n;
        dfl_err e;
        int rc = dfl_hf_auto_layers(c->n_layers, k, layers, &n, &e);
        FZ_ASSERT(rc == DFL_OK, "auto layers for N = %lld, K = %d: %s", (long long)c->n_layers, k, e.msg);
        FZ_ASSERT(n >= 1 && n <= k, "auto layers: %d of %d", n, k);
        for (int i = 0; i < n; i++)
            FZ_ASSERT(layers[i] >= 0 && layers[i] < c->n_layers && (i == 0 || layers[i] > layers[i - 1]),
                      "auto layers for N = %lld, K = %d: layer %d", (long long)c->n_layers, k, layers[i]);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!model)
        setup();
    json_t *v;
    dfl_err e;
    int rc = dfl_json_parse((const char *)data, size, &v, "config.json", &e);
    fz_check_err(rc, &e, "dfl_json_parse");
    dfl_hf_config c;
    int prc = rc;
    if (rc == DFL_OK) {
        /* the canonical dump parses back to the same value */
        char *s = dfl_json_dump(v, (int)(size & 3));
        FZ_ASSERT(s != NULL, "dump");
        json_t *w;
        int rc2 = dfl_json_parse(s, strlen(s), &w, "dump", &e);
        FZ_ASSERT(rc2 == DFL_OK && json_equal(v, w), "the dump does not parse back to the same value: %s", s);
        json_decref(w);
        free(s);
        prc = dfl_hf_config_parse(v, "config.json", &c, &e);
        fz_check_err(prc, &e, "dfl_hf_config_parse");
        if (prc == DFL_OK) {
            check_config(&c);
            char fp1[33], fp2[33];
            FZ_ASSERT(dfl_hf_fingerprint_of(v, model, fp1, &e) == DFL_OK, "fingerprint: %s", e.msg);
            FZ_ASSERT(dfl_hf_fingerprint_of(v, model, fp2, &e) == DFL_OK && strcmp(fp1, fp2) == 0, "fingerprint twice");
        } else {
            FZ_ASSERT(prc == DFL_EDATA || prc == DFL_EUNSUP, "code %s: %s", dfl_code_name(prc), e.msg);
            FZ_ASSERT(strncmp(e.msg, "config.json", 11) == 0, "the message does not name the file: %s", e.msg);
        }
        json_decref(v);
    } else {
        FZ_ASSERT(rc == DFL_EDATA, "code %s: %s", dfl_code_name(rc), e.msg);
    }
    /* through a file, as programs load it: the same outcome */
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", cfg_dir);
    fz_write_file(path, data, size);
    dfl_hf_config c2;
    json_t *j = NULL;
    int lrc = dfl_hf_config_load(cfg_dir, &c2, &j, &e);
    fz_check_err(lrc, &e, "dfl_hf_config_load");
    FZ_ASSERT(lrc == prc, "in memory %s, from the file %s", dfl_code_name(prc), dfl_code_name(lrc));
    if (lrc == DFL_OK) {
        FZ_ASSERT(memcmp(&c, &c2, sizeof c) == 0, "the file gives another config");
        json_decref(j);
    } else {
        FZ_ASSERT(j == NULL, "json returned on failure");
        FZ_ASSERT(strstr(e.msg, path) != NULL, "the message does not name the file: %s", e.msg);
    }
    return 0;
}
