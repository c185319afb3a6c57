/* test-families.c: the target families beyond the dense default-rope models, on the CPU:
 * RoPE scaling (rope_type linear, llama3, yarn: the inverse frequencies against values computed
 * here from the formulas, the config fields, refusals by name), Qwen3-MoE (config fields,
 * routing and grouping, the MoE MLP against a per-token loop) and Qwen3.5-MoE (config fields of
 * the text model and the multimodal wrapper, the shared expert and its gate against the loop),
 * and the forward of all three against the transformers oracles llama31-tiny-a, qwen3moe-tiny-a
 * and qwen35moe-tiny-a: every layer, the final norm, the last logits and (MoE) the router logits
 * within 1e-4 relative error per row, each sequence alone and all packed into one batch. */
#include <stdint.h>
#include <sys/stat.h>

#include "backend.h"
#include "hfmodel.h"
#include "json.h"
#include "moe.h"
#include "rope.h"
#include "safetensors.h"
#include "target.h"
#include "util.h"
#include "t.h"
#include "oracle-ref.h"

/* ---- helpers ---- */

/* The largest over rows of |a - b| / |b| (Euclidean norms of rows of n); NaN sticks. */
static double row_rel_err(const float *a, const float *b, int64_t rows, int64_t n)
{
    return t_rows_err(a, n, b, n, rows, n, 1e-30);
}

static int cfg_of(const char *json, dfl_hf_config *c, char *msg, size_t n)
{
    dfl_err e = {0};
    json_t *v = NULL;
    int rc = dfl_json_parse(json, strlen(json), &v, "test", &e);
    if (!rc)
        rc = dfl_hf_config_parse(v, "m/config.json", c, &e);
    snprintf(msg, n, "%s", e.msg);
    json_decref(v);
    return rc;
}

/* A config that must be refused: extra members, a word of the message, the code. */
typedef struct bad_cfg {
    const char *extra, *word;
    int code;
} bad_cfg;

/* Each case appended to "{<head>, " must fail with its code and a message naming the file. */
static void check_bad_cfgs(const char *head, const bad_cfg *bad, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char text[1024], m[1024];
        dfl_hf_config c;
        snprintf(text, sizeof text, "{%s, %s}", head, bad[i].extra);
        int rc = cfg_of(text, &c, m, sizeof m);
        T_CHECK(rc == bad[i].code && strstr(m, bad[i].word) && strstr(m, "m/config.json"),
                "%s case %zu: rc %d '%s'", head, i, rc, m);
    }
}

#define DENSE "\"hidden_size\": 64, \"num_hidden_layers\": 4, \"num_attention_heads\": 4, " \
              "\"intermediate_size\": 128, \"vocab_size\": 256"

/* ---- RoPE scaling ---- */

/* The inverse frequencies from the formulas, in double: llama3 by wavelength band (kept below
 * orig / high, divided by factor above orig / low, blended linearly in 1 / wavelength between),
 * yarn as a ramp over dimensions between the interpolated and extrapolated frequencies. */
static double want_inv(int i, int d, double theta, const dfl_rope_scaling *s)
{
    double f = pow(theta, -2.0 * i / d);
    if (s->kind == DFL_ROPE_LINEAR)
        return f / s->factor;
    if (s->kind == DFL_ROPE_LLAMA3) {
        double wl = 2 * M_PI / f, n = s->original_max_pos;
        if (wl < n / s->high_freq_factor)
            return f;
        if (wl > n / s->low_freq_factor)
            return f / s->factor;
        double a = (n / wl - s->low_freq_factor) / (s->high_freq_factor - s->low_freq_factor);
        return a * f + (1 - a) * f / s->factor;
    }
    if (s->kind == DFL_ROPE_YARN) {
        /* dimension pair j turns n f_j / (2 pi) times over n positions */
        double lo = floor(d * log(s->original_max_pos / (2 * M_PI * s->beta_fast)) / (2 * log(theta)));
        double hi = ceil(d * log(s->original_max_pos / (2 * M_PI * s->beta_slow)) / (2 * log(theta)));
        lo = lo < 0 ? 0 : lo;
        hi = hi > d - 1 ? d - 1 : hi;
        double ramp = (i - lo) / (hi - lo);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        return ramp * f / s->factor + (1 - ramp) * f;
    }
    return f;
}

static void check_inv(int d, double theta, const dfl_rope_scaling *s, const char *what)
{
    float got[512], def[512], r16[512];
    dfl_rope_inv_freq_scaled(got, d, (float)theta, s, DFL_F32);
    dfl_rope_inv_freq_scaled(def, d, (float)theta, NULL, DFL_F32);
    dfl_rope_inv_freq_scaled(r16, d, (float)theta, s, DFL_BF16);
    double worst = 0;
    bool rounded = true;
    for (int i = 0; i < d / 2; i++) {
        double w = want_inv(i, d, theta, s), err = fabs(got[i] - w) / w;
        worst = err <= worst ? worst : err;
        rounded &= r16[i] == dfl_bf16_to_f32(dfl_f32_to_bf16(got[i]));
    }
    T_CHECK(worst <= 2e-6, "%s: d %d theta %g: worst relative error %.3g", what, d, theta, worst);
    T_CHECK(rounded, "%s: bf16 rounding of the scaled frequencies", what);
    /* default is 1 / theta^(2i/d) */
    for (int i = 0; i < d / 2; i++)
        T_NEAR(def[i], pow(theta, -2.0 * i / d), 2e-6 * pow(theta, -2.0 * i / d), "default");
}

static void test_rope_inv_freq(void)
{
    dfl_rope_scaling s = {.kind = DFL_ROPE_LLAMA3, .factor = 8, .low_freq_factor = 1,
                          .high_freq_factor = 4, .original_max_pos = 128, .attention_factor = 1};
    check_inv(32, 5e5, &s, "llama3 (the oracle's)");
    /* the three bands are all there: first kept, last divided, some in between */
    float got[16], def[16];
    dfl_rope_inv_freq_scaled(got, 32, 5e5f, &s, DFL_F32);
    dfl_rope_inv_freq_scaled(def, 32, 5e5f, NULL, DFL_F32);
    int kept = 0, divided = 0, blended = 0;
    for (int i = 0; i < 16; i++) {
        if (got[i] == def[i])
            kept++;
        else if (got[i] == def[i] / 8.0f)
            divided++;
        else if (got[i] < def[i] && got[i] > def[i] / 8.0f)
            blended++;
    }
    T_CHECK(kept >= 1 && divided >= 1 && blended >= 1 && kept + divided + blended == 16,
            "bands: %d kept, %d divided, %d blended", kept, divided, blended);
    dfl_rope_scaling l31 = {.kind = DFL_ROPE_LLAMA3, .factor = 8, .low_freq_factor = 1,
                            .high_freq_factor = 4, .original_max_pos = 8192, .attention_factor = 1};
    check_inv(128, 5e5, &l31, "llama3 (Llama-3.1-8B's)");
    dfl_rope_scaling lin = {.kind = DFL_ROPE_LINEAR, .factor = 2.5, .attention_factor = 1};
    check_inv(64, 1e4, &lin, "linear");
    dfl_rope_scaling yarn = {.kind = DFL_ROPE_YARN, .factor = 4, .original_max_pos = 32768,
                             .beta_fast = 32, .beta_slow = 1, .truncate = true,
                             .attention_factor = 1.1386};
    check_inv(128, 1e6, &yarn, "yarn (Qwen3's suggested)");
    yarn.original_max_pos = 4096;
    yarn.factor = 16;
    check_inv(64, 1e4, &yarn, "yarn 16x");
    T_CHECK(dfl_rope_scaling_eq(NULL, &(dfl_rope_scaling){.kind = DFL_ROPE_DEFAULT}) &&
                !dfl_rope_scaling_eq(&yarn, &lin) && dfl_rope_scaling_eq(&yarn, &yarn),
            "scaling equality");
}

static void test_rope_config(void)
{
    dfl_hf_config c;
    char m[1024];
    T_CHECK(cfg_of("{\"model_type\": \"llama\", " DENSE ", \"rope_parameters\": {\"rope_type\": "
                   "\"llama3\", \"rope_theta\": 5e5, \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                   "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}}",
                   &c, m, sizeof m) == 0, "%s", m);
    T_CHECK(c.rope.kind == DFL_ROPE_LLAMA3 && c.rope.factor == 8 && c.rope.low_freq_factor == 1 &&
                c.rope.high_freq_factor == 4 && c.rope.original_max_pos == 8192 &&
                c.rope.attention_factor == 1 && c.rope_theta == 5e5, "llama3 fields");
    /* the Llama-3.1 checkpoint spelling: rope_scaling with rope_theta at the top level */
    T_CHECK(cfg_of("{\"model_type\": \"llama\", " DENSE ", \"rope_theta\": 5e5, \"rope_scaling\": "
                   "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                   "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}}",
                   &c, m, sizeof m) == 0 && c.rope.kind == DFL_ROPE_LLAMA3, "rope_scaling: %s", m);
    T_CHECK(cfg_of("{\"model_type\": \"llama\", " DENSE ", \"rope_scaling\": {\"type\": \"linear\", "
                   "\"factor\": 2.0}}", &c, m, sizeof m) == 0 && c.rope.kind == DFL_ROPE_LINEAR &&
                c.rope.factor == 2, "linear (old spelling 'type'): %s", m);
    T_CHECK(cfg_of("{\"model_type\": \"qwen3\", " DENSE ", \"rope_scaling\": {\"rope_type\": \"yarn\", "
                   "\"factor\": 4.0, \"original_max_position_embeddings\": 32768}}", &c, m,
                   sizeof m) == 0 && c.rope.kind == DFL_ROPE_YARN, "yarn: %s", m);
    T_NEAR(c.rope.attention_factor, 0.1 * log(4.0) + 1, 1e-12, "yarn attention factor");
    T_CHECK(c.rope.beta_fast == 32 && c.rope.beta_slow == 1 && c.rope.truncate &&
                c.rope.original_max_pos == 32768, "yarn defaults");
    T_CHECK(cfg_of("{\"model_type\": \"qwen3\", " DENSE ", \"max_position_embeddings\": 131072, "
                   "\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                   "\"attention_factor\": 1.5, \"beta_fast\": 16, \"truncate\": false}}", &c, m,
                   sizeof m) == 0, "yarn with fields: %s", m);
    T_CHECK(c.rope.attention_factor == 1.5 && c.rope.beta_fast == 16 && !c.rope.truncate &&
                c.rope.original_max_pos == 131072, "yarn fields, original from max_position_embeddings");
    T_CHECK(cfg_of("{\"model_type\": \"qwen3\", " DENSE ", \"rope_scaling\": {\"rope_type\": \"yarn\", "
                   "\"factor\": 4.0, \"original_max_position_embeddings\": 4096, \"mscale\": 2, "
                   "\"mscale_all_dim\": 1}}", &c, m, sizeof m) == 0, "%s", m);
    T_NEAR(c.rope.attention_factor, (0.2 * log(4.0) + 1) / (0.1 * log(4.0) + 1), 1e-12, "mscale");
    bad_cfg bad[] = {
        {"\"rope_parameters\": {\"rope_type\": \"dynamic\", \"factor\": 2.0}",
         "rope_parameters.rope_type is 'dynamic'", DFL_EUNSUP},
        {"\"rope_scaling\": {\"type\": \"longrope\", \"factor\": 2.0}", "rope_scaling.type is 'longrope'",
         DFL_EUNSUP},
        {"\"rope_parameters\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"high_freq_factor\": 4.0, "
         "\"original_max_position_embeddings\": 8192}", "rope_parameters.low_freq_factor is missing",
         DFL_EDATA},
        {"\"rope_parameters\": {\"rope_type\": \"llama3\", \"low_freq_factor\": 1.0, "
         "\"high_freq_factor\": 4.0}", "rope_parameters.factor is missing", DFL_EDATA},
        {"\"rope_parameters\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4.0, "
         "\"high_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192}", "high_freq_factor",
         DFL_EDATA},
        {"\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}",
         "rope_scaling.original_max_position_embeddings is missing", DFL_EDATA},
        {"\"rope_scaling\": {\"rope_type\": \"linear\"}", "rope_scaling.factor is missing", DFL_EDATA},
        {"\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": \"2\"}", "rope_scaling.factor must",
         DFL_EDATA},
        {"\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2}, \"rope_parameters\": "
         "{\"rope_type\": \"linear\", \"factor\": 3}", "disagree", DFL_EDATA},
    };
    check_bad_cfgs("\"model_type\": \"llama\", " DENSE, bad, DFL_ARRAY_LEN(bad));
    /* qwen3_5's partial RoPE takes the default frequencies only: scaling is refused, not ignored */
    T_CHECK(cfg_of("{\"model_type\": \"qwen3_5_text\", " DENSE ", \"rope_parameters\": "
                   "{\"rope_type\": \"linear\", \"factor\": 2.0, \"partial_rotary_factor\": 0.25}}",
                   &c, m, sizeof m) == DFL_EUNSUP && strstr(m, "partial rotary"),
            "qwen3_5 with rope scaling: %s", m);
}

/* ---- Qwen3-MoE ---- */

#define MOE "\"model_type\": \"qwen3_moe\", " DENSE

static void test_moe_config(void)
{
    dfl_hf_config c;
    char m[1024];
    T_CHECK(cfg_of("{" MOE ", \"num_experts\": 8, \"num_experts_per_tok\": 2, "
                   "\"moe_intermediate_size\": 32, \"norm_topk_prob\": true, "
                   "\"decoder_sparse_step\": 2, \"mlp_only_layers\": [3]}", &c, m, sizeof m) == 0,
            "%s", m);
    T_CHECK(c.arch == DFL_HF_QWEN3_MOE && c.qk_norm && c.n_experts == 8 && c.top_k == 2 &&
                c.moe_intermediate == 32 && c.norm_topk_prob && c.sparse_step == 2, "fields");
    /* sparse where (l + 1) % step == 0 and not in mlp_only_layers: layer 1 only */
    T_CHECK(!dfl_hf_layer_is_moe(&c, 0) && dfl_hf_layer_is_moe(&c, 1) && !dfl_hf_layer_is_moe(&c, 2) &&
                !dfl_hf_layer_is_moe(&c, 3), "sparse layers");
    T_CHECK(cfg_of("{" MOE ", \"num_local_experts\": 4, \"num_experts_per_tok\": 1, "
                   "\"moe_intermediate_size\": 32}", &c, m, sizeof m) == 0 && c.n_experts == 4 &&
                !c.norm_topk_prob && c.sparse_step == 1 && dfl_hf_layer_is_moe(&c, 3),
            "num_local_experts, defaults: %s", m);
    bad_cfg bad[] = {
        {"\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 32", "num_experts is missing", DFL_EDATA},
        {"\"num_experts\": 8, \"moe_intermediate_size\": 32", "num_experts_per_tok is missing", DFL_EDATA},
        {"\"num_experts\": 8, \"num_experts_per_tok\": 2", "moe_intermediate_size is missing", DFL_EDATA},
        {"\"num_experts\": 8, \"num_experts_per_tok\": 9, \"moe_intermediate_size\": 32",
         "num_experts_per_tok", DFL_EDATA},
        {"\"num_experts\": 8, \"num_local_experts\": 4, \"num_experts_per_tok\": 2, "
         "\"moe_intermediate_size\": 32", "disagree", DFL_EDATA},
        {"\"num_experts\": 8, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 32, "
         "\"mlp_only_layers\": [4]", "mlp_only_layers[0]", DFL_EDATA},
        {"\"num_experts\": 8, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 32, "
         "\"decoder_sparse_step\": 0", "decoder_sparse_step", DFL_EDATA},
        {"\"num_experts\": 8, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 32, "
         "\"shared_expert_intermediate_size\": 64", "shared_expert_intermediate_size", DFL_EUNSUP},
    };
    check_bad_cfgs(MOE, bad, DFL_ARRAY_LEN(bad));
    /* MoE keys on a dense model type stay refused */
    T_CHECK(cfg_of("{\"model_type\": \"qwen3\", " DENSE ", \"num_experts\": 8}", &c, m, sizeof m) ==
                DFL_EUNSUP && strstr(m, "num_experts is set"), "dense qwen3 with experts: %s", m);
}

/* ---- Qwen3.5-MoE ---- */

#define MOE35 "\"hidden_size\": 64, \"num_hidden_layers\": 4, \"num_attention_heads\": 4, "      \
              "\"vocab_size\": 256, \"head_dim\": 32, \"linear_num_key_heads\": 2, "             \
              "\"linear_key_head_dim\": 16, \"linear_num_value_heads\": 4, "                       \
              "\"linear_value_head_dim\": 16, \"linear_conv_kernel_dim\": 4, "                     \
              "\"num_experts\": 8, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 32"

static void test_moe35_config(void)
{
    dfl_hf_config c;
    char m[1024];
    /* every layer sparse, the top k always renormalised, transformers' deleted keys not read */
    T_CHECK(cfg_of("{\"model_type\": \"qwen3_5_moe_text\", " MOE35 ", "
                   "\"shared_expert_intermediate_size\": 48, \"norm_topk_prob\": false, "
                   "\"decoder_sparse_step\": 2, \"mlp_only_layers\": [1]}", &c, m, sizeof m) == 0,
            "%s", m);
    T_CHECK(c.arch == DFL_HF_QWEN35 && c.norm_1p && c.n_linear == 3 && c.n_experts == 8 &&
                c.top_k == 2 && c.moe_intermediate == 32 && c.shared_intermediate == 48 &&
                c.norm_topk_prob && c.intermediate_size == 0 &&
                strcmp(c.model_type, "qwen3_5_moe_text") == 0, "fields");
    bool all = true;
    for (int l = 0; l < 4; l++)
        all &= dfl_hf_layer_is_moe(&c, l);
    T_CHECK(all, "every layer sparse");
    /* the published layout: Qwen3_5MoeForConditionalGeneration with text_config */
    T_CHECK(cfg_of("{\"model_type\": \"qwen3_5_moe\", \"dtype\": \"bfloat16\", \"text_config\": "
                   "{\"model_type\": \"qwen3_5_moe_text\", " MOE35 ", "
                   "\"shared_expert_intermediate_size\": 48}}", &c, m, sizeof m) == 0,
            "wrapper: %s", m);
    T_CHECK(c.arch == DFL_HF_QWEN35 && c.shared_intermediate == 48 && c.n_experts == 8 &&
                c.dtype == DFL_BF16 && strcmp(c.model_type, "qwen3_5_moe") == 0, "wrapper fields");
    bad_cfg bad[] = {
        {"\"norm_topk_prob\": true", "shared_expert_intermediate_size is missing", DFL_EDATA},
        {"\"shared_expert_intermediate_size\": 0", "shared_expert_intermediate_size", DFL_EDATA},
        {"\"shared_expert_intermediate_size\": 48, \"rope_parameters\": {\"rope_type\": "
         "\"linear\", \"factor\": 2.0}", "rope_type 'linear'", DFL_EUNSUP},
        {"\"shared_expert_intermediate_size\": 48, \"hidden_act\": \"gelu\"", "hidden_act 'gelu'",
         DFL_EUNSUP},
        {"\"shared_expert_intermediate_size\": 48, \"layer_types\": [\"linear_attention\", "
         "\"sliding_attention\", \"linear_attention\", \"full_attention\"]",
         "layer_types[1] is 'sliding_attention'", DFL_EUNSUP},
    };
    check_bad_cfgs("\"model_type\": \"qwen3_5_moe_text\", " MOE35, bad, DFL_ARRAY_LEN(bad));
    /* a wrapper must hold its own text model, and experts need the MoE model types */
    T_CHECK(cfg_of("{\"model_type\": \"qwen3_5_moe\", \"text_config\": {\"model_type\": "
                   "\"qwen3_5_text\", " MOE35 "}}", &c, m, sizeof m) == DFL_EUNSUP &&
                strstr(m, "text_config.model_type is 'qwen3_5_text'") && strstr(m, "qwen3_5_moe_text"),
            "qwen3_5_moe wrapping qwen3_5_text: %s", m);
    T_CHECK(cfg_of("{\"model_type\": \"qwen3_5_moe\"}", &c, m, sizeof m) == DFL_EDATA &&
                strstr(m, "model_type 'qwen3_5_moe' needs a text_config"), "no text_config: %s", m);
    T_CHECK(cfg_of("{\"model_type\": \"qwen3_5_text\", " MOE35 ", \"intermediate_size\": 64}", &c,
                   m, sizeof m) == DFL_EUNSUP && strstr(m, "num_experts is set"),
            "dense qwen3_5_text with experts: %s", m);
    /* the shared expert stays refused where transformers has none */
    T_CHECK(cfg_of("{" MOE ", \"num_experts\": 8, \"num_experts_per_tok\": 2, "
                   "\"moe_intermediate_size\": 32, \"shared_expert_intermediate_size\": 64}", &c, m,
                   sizeof m) == DFL_EUNSUP && strstr(m, "shared experts are not supported in "
                   "model_type 'qwen3_moe'"), "qwen3_moe with a shared expert: %s", m);
}

/* Routing and grouping on known logits. */
static void test_moe_route(void)
{
    dfl_err e = {0};
    dfl_be *be = NULL;
    T_CHECK(dfl_be_open(&be, "cpu", DFL_DT_INVALID, &e) == 0, "%s", e.msg);
    if (!be)
        return;
    enum { T = 4, E = 5, K = 2 };
    float logits[T * E] = {
        1, 3, 2, 0, -1,      /* experts 1, 2 */
        0, 0, 5, 0, 4,       /* 2, 4 */
        2, 2, 2, 1, 1,       /* tie: 0, 1 */
        -3, -2, -1, 7, -1,   /* 3, then the tie 2|4 -> 2 */
    };
    int32_t idx[T * K], counts[E], offsets[E + 1], slot[T * K];
    float w[T * K];
    int64_t cap = dfl_moe_cap(T, E, K);
    int32_t *rows = malloc((size_t)cap * sizeof *rows);
    dfl_moe_route r = {.logits = logits, .T = T, .E = E, .k = K, .norm_topk = false, .idx = idx,
                       .weight = w, .counts = counts, .offsets = offsets, .rows = rows,
                       .slot = slot, .cap = cap};
    T_CHECK(be->ops->moe_route(be, &r) == 0, "route");
    int32_t want_idx[T * K] = {1, 2, 2, 4, 0, 1, 3, 2};
    T_CHECK(memcmp(idx, want_idx, sizeof idx) == 0, "top-2: %d %d | %d %d | %d %d | %d %d", idx[0],
            idx[1], idx[2], idx[3], idx[4], idx[5], idx[6], idx[7]);
    /* softmax weights of token 0 */
    double s0 = exp(1) + exp(3) + exp(2) + exp(0) + exp(-1);
    T_NEAR(w[0], exp(3) / s0, 1e-6, "weight 0");
    T_NEAR(w[1], exp(2) / s0, 1e-6, "weight 1");
    int32_t want_counts[E] = {1, 2, 3, 1, 1};
    T_CHECK(memcmp(counts, want_counts, sizeof counts) == 0, "counts");
    for (int x = 0; x <= E; x++)
        T_EQ_INT(offsets[x], x * DFL_MOE_PAD, "padded offsets");
    /* expert 2 holds tokens 0, 1, 3 in order, then padding */
    T_CHECK(rows[2 * DFL_MOE_PAD] == 0 && rows[2 * DFL_MOE_PAD + 1] == 1 &&
                rows[2 * DFL_MOE_PAD + 2] == 3 && rows[2 * DFL_MOE_PAD + 3] == -1, "rows of expert 2");
    bool slots = true;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < K; j++) {
            int g = slot[t * K + j];
            slots &= rows[g] == t && g >= offsets[idx[t * K + j]] && g < offsets[idx[t * K + j] + 1];
        }
    T_CHECK(slots, "slot[t, j] is a row of token t in its expert's segment");
    r.norm_topk = true;
    T_CHECK(be->ops->moe_route(be, &r) == 0, "route");
    T_NEAR(w[0] + w[1], 1.0, 1e-6, "normalised");
    T_NEAR(w[0], exp(3) / (exp(3) + exp(2)), 1e-6, "normalised weight");
    free(rows);
    dfl_be_close(be);
}

static void fill_rand(float *v, int64_t n, uint64_t seed, float scale)
{
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = scale * ((float)(seed >> 40) / 16777216.0f * 2.0f - 1.0f);
    }
}

/* moe_matmul's fused forms on the CPU (rows: A's token rows through the route's rows; swiglu:
 * silu(gate) * up of the product's two halves) against moe_gather, the plain moe_matmul and
 * swiglu; padding rows untouched; an odd N with swiglu refused. */
static void test_moe_matmul_fused(void)
{
    dfl_err e = {0};
    dfl_be *be = NULL;
    T_CHECK(dfl_be_open(&be, "cpu", DFL_DT_INVALID, &e) == 0, "%s", e.msg);
    if (!be)
        return;
    enum { T = 29, E = 5, K = 3, H = 12, N = 14 };
    float logits[T * E], x[T * H], W[E * N * H];
    fill_rand(logits, T * E, 11, 2.0f);
    fill_rand(x, T * H, 12, 1.0f);
    fill_rand(W, E * N * H, 13, 0.5f);
    logits[4] = 50; /* token 0 to expert 4, as the others: expert 4 ... */
    for (int t = 0; t < T; t++)
        logits[t * E + 3] = -50; /* ... and none to expert 3: an empty expert */
    int32_t idx[T * K], counts[E], offsets[E + 1], slot[T * K];
    float w[T * K];
    int64_t cap = dfl_moe_cap(T, E, K);
    int32_t *rows = malloc((size_t)cap * sizeof *rows);
    float *xg = malloc(sizeof(float) * cap * H), *C = malloc(sizeof(float) * cap * N);
    float *act = malloc(sizeof(float) * cap * N / 2), *f = malloc(sizeof(float) * cap * N);
    dfl_moe_route r = {.logits = logits, .T = T, .E = E, .k = K, .norm_topk = true, .idx = idx,
                       .weight = w, .counts = counts, .offsets = offsets, .rows = rows,
                       .slot = slot, .cap = cap};
    T_CHECK(be->ops->moe_route(be, &r) == 0, "route");
    T_CHECK(counts[3] == 0, "expert 3 empty");
    T_CHECK(be->ops->moe_gather(be, xg, x, rows, offsets, E, cap, H) == 0, "gather");
    dfl_moe_mm m = {.A = xg, .W = W, .C = C, .counts = counts, .offsets = offsets, .E = E, .N = N,
                    .K = H, .cap = cap};
    T_CHECK(be->ops->moe_matmul(be, &m) == 0, "plain");
    for (int64_t g = 0; g < offsets[E]; g++)
        C[g * N] = rows[g] < 0 ? NAN : C[g * N]; /* padding rows: NaN, as never written */
    T_CHECK(be->ops->swiglu(be, act, C, offsets[E], N / 2) == 0, "swiglu");
    for (int form = 0; form < 3; form++) { /* rows; swiglu; both */
        int64_t Nc = form ? N / 2 : N;
        for (int64_t i = 0; i < cap * N; i++)
            f[i] = NAN;
        dfl_moe_mm mf = m;
        mf.A = form == 1 ? (const void *)xg : (const void *)x;
        mf.rows = form == 1 ? NULL : rows;
        mf.swiglu = form > 0;
        mf.C = f;
        T_CHECK(be->ops->moe_matmul(be, &mf) == 0, "fused form %d", form);
        const float *want = form ? act : C;
        double worst = 0;
        int64_t untouched = 0;
        for (int64_t g = 0; g < offsets[E]; g++)
            for (int64_t n = 0; n < Nc; n++) {
                float got = f[g * Nc + n], exp_v = want[g * Nc + n];
                double d = fabs(got - exp_v) / (fabs(exp_v) + 1e-3);
                if (rows[g] < 0)
                    untouched += isnan(got);
                else if (!(d <= worst))   /* NaN-propagating: fmax would drop a NaN */
                    worst = isnan(d) ? INFINITY : d;
            }
        int64_t pad = 0;
        for (int x_ = 0; x_ < E; x_++)
            pad += offsets[x_ + 1] - offsets[x_] - counts[x_];
        T_CHECK(worst <= 1e-6, "form %d: %.3g from gather + matmul + swiglu", form, worst);
        T_CHECK(untouched == pad * Nc, "form %d: padding rows untouched", form);
    }
    dfl_moe_mm odd = m;
    odd.N = N - 1;
    odd.swiglu = true;
    T_CHECK(be->ops->moe_matmul(be, &odd) == DFL_EUNSUP, "swiglu with an odd N refused");
    free(rows);
    free(xg);
    free(C);
    free(act);
    free(f);
    dfl_be_close(be);
}

/* SwiGLU MLP of one token in double: y[H] += scale * down (silu(gate x) * up x), with gate|up
 * [2 I, H] and down [H, I]. */
static void swiglu_ref(const float *gu, const float *dn, const float *x, int64_t H, int64_t I,
                       double scale, double *y)
{
    double a[64];
    for (int64_t i = 0; i < I; i++) {
        double gg = 0, uu = 0;
        for (int64_t q = 0; q < H; q++) {
            gg += (double)gu[i * H + q] * x[q];
            uu += (double)gu[(I + i) * H + q] * x[q];
        }
        a[i] = gg / (1 + exp(-gg)) * uu;
    }
    for (int64_t q = 0; q < H; q++) {
        double s = 0;
        for (int64_t i = 0; i < I; i++)
            s += (double)dn[q * I + i] * a[i];
        y[q] += scale * s;
    }
}

/* dfl_moe_forward against a loop over tokens and their experts in double; Is > 0: with a shared
 * expert of that width (qwen3_5_moe: top k renormalised, + sigmoid(gate x) shared(x)). */
static void moe_loop_case(int64_t Is)
{
    dfl_err e = {0};
    dfl_be *be = NULL;
    T_CHECK(dfl_be_open(&be, "cpu", DFL_DT_INVALID, &e) == 0, "%s", e.msg);
    if (!be)
        return;
    dfl_hf_config c = {.hidden_size = 24, .n_experts = 6, .top_k = 3, .moe_intermediate = 10,
                       .norm_topk_prob = Is > 0, .sparse_step = 1, .shared_intermediate = Is};
    enum { T = 37 };
    int64_t H = c.hidden_size, E = c.n_experts, Im = c.moe_intermediate, k = c.top_k;
    float *sgu = malloc(sizeof(float) * (2 * Is * H + 1)), *sdn = malloc(sizeof(float) * (H * Is + 1));
    float *sg = malloc(sizeof(float) * H);
    fill_rand(sgu, 2 * Is * H, 5, 0.3f);
    fill_rand(sdn, H * Is, 6, 0.3f);
    fill_rand(sg, H, 7, 0.5f);
    float *x = malloc(sizeof(float) * T * H), *out = malloc(sizeof(float) * T * H);
    float *wr = malloc(sizeof(float) * E * H), *wgu = malloc(sizeof(float) * E * 2 * Im * H);
    float *wd = malloc(sizeof(float) * E * H * Im), *ro = malloc(sizeof(float) * T * E);
    fill_rand(x, T * H, 1, 1.0f);
    fill_rand(wr, E * H, 2, 0.5f);
    fill_rand(wgu, E * 2 * Im * H, 3, 0.3f);
    fill_rand(wd, E * H * Im, 4, 0.3f);
    void *block = malloc(dfl_moe_ws_bytes(&c, be, T));
    dfl_moe_ws m;
    dfl_moe_ws_carve(&c, be, T, block, &m);
    dfl_moe_weights w = {.router = wr, .wgu = wgu, .wdown = wd, .sgu = Is ? sgu : NULL,
                         .sdown = Is ? sdn : NULL, .sgate = Is ? sg : NULL};
    for (int acc = 0; acc < 2; acc++) {
        for (int64_t i = 0; i < T * H; i++)
            out[i] = acc ? 0.25f : 1e30f;
        T_CHECK(dfl_moe_forward(be, &c, &m, &w, x, T, out, acc, ro) == 0, "forward");
        double worst = 0;
        for (int t = 0; t < T; t++) {
            double z[16], p[16], sum = 0, y[64] = {0}, top = 0;
            for (int x_ = 0; x_ < E; x_++) {
                z[x_] = 0;
                for (int i = 0; i < H; i++)
                    z[x_] += (double)x[t * H + i] * wr[x_ * H + i];
                worst = t_worst(worst, fabs(z[x_] - ro[t * E + x_]));
            }
            double mx = z[0];
            for (int x_ = 1; x_ < E; x_++)
                mx = fmax(mx, z[x_]);
            for (int x_ = 0; x_ < E; x_++)
                sum += (p[x_] = exp(z[x_] - mx));
            bool used[16] = {0};
            int pick[16];
            for (int j = 0; j < k; j++) {
                int b = -1;
                for (int x_ = 0; x_ < E; x_++)
                    if (!used[x_] && (b < 0 || z[x_] > z[b]))
                        b = x_;
                used[b] = true;
                pick[j] = b;
                top += p[b] / sum;
            }
            for (int j = 0; j < k; j++)
                swiglu_ref(wgu + (int64_t)pick[j] * 2 * Im * H, wd + (int64_t)pick[j] * H * Im,
                           x + t * H, H, Im, p[pick[j]] / sum / (Is ? top : 1.0), y);
            if (Is) {
                double gl = 0;
                for (int q = 0; q < H; q++)
                    gl += (double)sg[q] * x[t * H + q];
                swiglu_ref(sgu, sdn, x + t * H, H, Is, 1 / (1 + exp(-gl)), y);
            }
            for (int q = 0; q < H; q++)
                worst = t_worst(worst, fabs(out[t * H + q] - (y[q] + (acc ? 0.25 : 0))));
        }
        T_CHECK(worst <= 1e-5, "shared %lld, accumulate %d: worst abs error %.3g", (long long)Is,
                acc, worst);
    }
    free(sgu);
    free(sdn);
    free(sg);
    free(block);
    free(x);
    free(out);
    free(wr);
    free(wgu);
    free(wd);
    free(ro);
    dfl_be_close(be);
}

/* ---- the oracles ---- */

typedef struct oracle {
    dfl_st_file *ref;
    dfl_st_model *model;
    int n_seqs;
    const int32_t *ids[16];
    int64_t len[16], total;
} oracle;

static const float *ref_get(const oracle *o, int s, const char *what, int k)
{
    char name[64];
    if (k >= 0)
        snprintf(name, sizeof name, "seq%d.%s%d", s, what, k);
    else
        snprintf(name, sizeof name, "seq%d.%s", s, what);
    const dfl_st_tensor *t = dfl_st_find(o->ref, name);
    return t && t->dtype == DFL_F32 ? t->data : NULL;
}

/* The final norm and the last logits of one sequence from its last layer's output, on the host
 * (transformers' RMSNorm: x / sqrt(mean(x^2) + eps) * w; logits = norm lm_head^T), against the
 * reference. */
static void check_head(const oracle *o, const dfl_hf_config *c, int s, const float *last,
                       const char *dir)
{
    int64_t H = c->hidden_size, V = c->vocab_size, L = o->len[s], n;
    float *nw = tensor_f32(o->model, "model.norm.weight", &n);
    float *lm = tensor_f32(o->model, c->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight", &n);
    const float *rn = ref_get(o, s, "norm", -1), *rl = ref_get(o, s, "logits_last8", -1);
    int64_t nl = L < 8 ? L : 8;
    float *norm = calloc((size_t)(L * H), sizeof(float)), *lg = calloc((size_t)(nl * V), sizeof(float));
    T_CHECK(nw && lm && rn && rl, "%s: norm weight, lm head, seq%d.norm and logits_last8", dir, s);
    if (!nw || !lm || !rn || !rl || !norm || !lg) {
        free(nw);
        free(lm);
        free(norm);
        free(lg);
        return;
    }
    for (int64_t r = 0; r < L; r++) {
        double ss = 0;
        for (int64_t i = 0; i < H; i++)
            ss += (double)last[r * H + i] * last[r * H + i];
        double rs = 1 / sqrt(ss / H + c->rms_norm_eps);
        for (int64_t i = 0; i < H; i++)
            norm[r * H + i] = (float)(last[r * H + i] * rs) * (c->norm_1p ? 1.0f + nw[i] : nw[i]);
    }
    double en = row_rel_err(norm, rn, L, H);
    t_logits_last(lg, norm, L, nl, H, lm, V);
    double el = row_rel_err(lg, rl, nl, V);
    if (getenv("DFL_TEST_VERBOSE"))
        fprintf(stderr, "  %s seq%d: norm %.3g, logits %.3g\n", dir, s, en, el);
    T_CHECK(en <= 1e-4, "%s seq%d final norm: max row rel err %.3g", dir, s, en);
    T_CHECK(el <= 1e-4, "%s seq%d last logits: max row rel err %.3g", dir, s, el);
    free(norm);
    free(lg);
    free(nw);
    free(lm);
}

/* Tokens whose top-k expert set from our router logits differs from the reference's. */
static int expert_set_diffs(const float *got, const float *want, int64_t T, int E, int k)
{
    int diff = 0;
    for (int64_t t = 0; t < T; t++) {
        uint64_t a = 0, b = 0;
        for (int j = 0; j < k; j++) {
            int ba = -1, bb = -1;
            for (int x = 0; x < E; x++) {
                if (!(a >> x & 1) && (ba < 0 || got[t * E + x] > got[t * E + ba]))
                    ba = x;
                if (!(b >> x & 1) && (bb < 0 || want[t * E + x] > want[t * E + bb]))
                    bb = x;
            }
            a |= 1ull << ba;
            b |= 1ull << bb;
        }
        diff += a != b;
    }
    return diff;
}

/* The CPU forward of the model in dir against its ref.safetensors (name says which model). */
static void forward_vs_oracle_dir(const char *dir, const char *name)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/ref.safetensors", dir);
    dfl_err e = {0};
    oracle o = {0};
    dfl_be *be = NULL;
    dfl_target *t = NULL;
    dfl_target_ws *ws = NULL;
    if (dfl_st_open(&o.ref, p, &e) || dfl_st_model_open(&o.model, dir, &e) ||
        dfl_be_open(&be, "cpu", DFL_DT_INVALID, &e) || dfl_target_open(&t, be, dir, 0, &e)) {
        T_CHECK(0, "%s: %s", dir, e.msg);
        goto out;
    }
    for (int s = 0; s < 16; s++) {
        char n[64];
        snprintf(n, sizeof n, "seq%d.input_ids", s);
        const dfl_st_tensor *ti = dfl_st_find(o.ref, n);
        if (!ti)
            break;
        o.ids[s] = ti->data;
        o.len[s] = ti->shape[0];
        o.total += o.len[s];
        o.n_seqs = s + 1;
    }
    const dfl_hf_config *c = &t->cfg;
    int64_t H = c->hidden_size, E = c->n_experts;
    int K = (int)c->n_layers;
    T_CHECK(o.n_seqs >= 5 && ref_get(&o, 0, "layer", K - 1) && !ref_get(&o, 0, "layer", K),
            "%s: five sequences, every layer", dir);
    T_CHECK(dfl_target_ws_new(t, o.total, o.n_seqs, &ws, &e) == 0, "%s", e.msg);
    if (!ws)
        goto out;
    int32_t layers[64];
    float *caps[64], *router[64] = {0};
    for (int k = 0; k < K; k++) {
        layers[k] = k;
        caps[k] = malloc(sizeof(float) * o.total * H);
        if (dfl_hf_layer_is_moe(c, k))
            router[k] = malloc(sizeof(float) * o.total * E);
    }
    t->router_out = E ? router : NULL;
    int sparse = 0, diffs = 0;
    uint32_t lens[16];
    uint8_t *mask = calloc((size_t)o.total, 1);
    int32_t *ids = malloc(sizeof(int32_t) * o.total);
    double worst = 0;
    /* each sequence alone */
    for (int s = 0; s < o.n_seqs; s++) {
        lens[0] = (uint32_t)o.len[s];
        dfl_batch b = {.index = (uint64_t)s, .n_tokens = (uint64_t)o.len[s], .n_seqs = 1,
                       .seq_lens = lens, .input_ids = o.ids[s], .loss_mask = mask};
        if (dfl_target_forward(t, ws, &b, K, layers, DFL_F32, (void *const *)caps, &e)) {
            T_CHECK(0, "seq %d: %s", s, e.msg);
            continue;
        }
        for (int k = 0; k < K; k++) {
            double err = row_rel_err(caps[k], ref_get(&o, s, "layer", k), o.len[s], H);
            worst = err <= worst ? worst : err;
            T_CHECK(err <= 1e-4, "%s seq%d layer%d alone: max row rel err %.3g", name, s, k, err);
            if (router[k]) {
                const float *rr = ref_get(&o, s, "router", k);
                T_CHECK(rr, "%s: seq%d.router%d in the reference", name, s, k);
                if (!rr)
                    continue;
                double er = row_rel_err(router[k], rr, o.len[s], E);
                T_CHECK(er <= 1e-4, "%s seq%d router%d: max row rel err %.3g", name, s, k, er);
                diffs += expert_set_diffs(router[k], rr, o.len[s], (int)E, (int)c->top_k);
                sparse += (int)o.len[s];
            }
        }
        check_head(&o, c, s, caps[K - 1], name);
    }
    if (E)
        fprintf(stderr, "  %s: %d of %d (token, sparse layer) expert sets differ from the "
                "reference on the CPU\n", name, diffs, sparse);
    T_CHECK(!E || sparse > 0, "%s: sparse layers seen", name);
    T_CHECK(diffs == 0, "%s: %d tokens chose another expert set", name, diffs);
    if (getenv("DFL_TEST_VERBOSE"))
        fprintf(stderr, "  %s: worst layer row error alone %.3g\n", name, worst);
    /* all packed, in reverse order */
    int64_t off[16], row = 0;
    for (int j = 0; j < o.n_seqs; j++) {
        int s = o.n_seqs - 1 - j;
        lens[j] = (uint32_t)o.len[s];
        off[s] = row;
        memcpy(ids + row, o.ids[s], sizeof(int32_t) * o.len[s]);
        row += o.len[s];
    }
    dfl_batch b = {.n_tokens = (uint64_t)o.total, .n_seqs = (uint32_t)o.n_seqs, .seq_lens = lens,
                   .input_ids = ids, .loss_mask = mask};
    if (dfl_target_forward(t, ws, &b, K, layers, DFL_F32, (void *const *)caps, &e) == 0) {
        for (int s = 0; s < o.n_seqs; s++)
            for (int k = 0; k < K; k++) {
                double err = row_rel_err(caps[k] + off[s] * H, ref_get(&o, s, "layer", k), o.len[s], H);
                T_CHECK(err <= 1e-4, "%s seq%d layer%d packed: max row rel err %.3g", name, s, k, err);
                if (router[k]) {
                    err = row_rel_err(router[k] + off[s] * E, ref_get(&o, s, "router", k), o.len[s], E);
                    T_CHECK(err <= 1e-4, "%s seq%d router%d packed: %.3g", name, s, k, err);
                }
            }
        for (int s = 0; s < o.n_seqs; s++)
            check_head(&o, c, s, caps[K - 1] + off[s] * H, name);
    } else {
        T_CHECK(0, "packed: %s", e.msg);
    }
    t->router_out = NULL;
    for (int k = 0; k < K; k++) {
        free(caps[k]);
        free(router[k]);
    }
    free(mask);
    free(ids);
out:
    dfl_target_ws_free(t, ws);
    dfl_target_close(t);
    dfl_be_close(be);
    dfl_st_model_close(o.model);
    dfl_st_close(o.ref);
}

static void test_moe_forward_loop(void)
{
    moe_loop_case(0);
    moe_loop_case(14); /* with a shared expert */
}

static void forward_vs_oracle(const char *name)
{
    const char *od = t_oracle();
    if (!od) {
        t_case_skipped_ = 1;
        fprintf(stderr, "  skip: no oracle directory (set DFL_ORACLE)\n");
        return;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", od, name);
    forward_vs_oracle_dir(dir, name);
}

static void test_llama31_oracle(void)
{
    forward_vs_oracle("llama31-tiny-a");
}

static void test_qwen3moe_oracle(void)
{
    forward_vs_oracle("qwen3moe-tiny-a");
}

static void test_qwen35moe_oracle(void)
{
    forward_vs_oracle("qwen35moe-tiny-a");
}

/* Copies file a to b (small files). */
static bool copy_file(const char *a, const char *b)
{
    FILE *in = fopen(a, "rb"), *out = in ? fopen(b, "wb") : NULL;
    char buf[65536];
    size_t n;
    bool ok = in && out;
    while (ok && (n = fread(buf, 1, sizeof buf, in)) > 0)
        ok = fwrite(buf, 1, n, out) == n;
    if (in)
        fclose(in);
    if (out && fclose(out))
        ok = false;
    return ok;
}

/* qwen35moe-tiny-a with its experts stacked as the published Qwen3.5-MoE checkpoints store them
 * (mlp.experts.gate_up_proj [E, 2 Im, H], mlp.experts.down_proj [E, H, Im]): the same oracle. */
static void test_qwen35moe_stacked(void)
{
    const char *od = t_oracle();
    if (!od) {
        t_case_skipped_ = 1;
        fprintf(stderr, "  skip: no oracle directory (set DFL_ORACLE)\n");
        return;
    }
    char src[4096], dir[4200], a[4400], b[4400];
    snprintf(src, sizeof src, "%s/qwen35moe-tiny-a", od);
    snprintf(dir, sizeof dir, "%s/qwen35moe-stacked", t_tmpdir());
    dfl_err e = {0};
    dfl_st_model *m = NULL;
    json_t *cfg = NULL;
    T_CHECK(mkdir(dir, 0755) == 0 && dfl_st_model_open(&m, src, &e) == 0, "%s: %s", dir, e.msg);
    snprintf(a, sizeof a, "%s/config.json", src);
    T_CHECK(m && dfl_json_load_file(a, &cfg, &e) == 0, "%s", e.msg);
    if (!m || !cfg) {
        dfl_st_model_close(m);
        return;
    }
    int64_t H = json_integer_value(json_object_get(cfg, "hidden_size"));
    int64_t E = json_integer_value(json_object_get(cfg, "num_experts"));
    int64_t Im = json_integer_value(json_object_get(cfg, "moe_intermediate_size"));
    int64_t L = json_integer_value(json_object_get(cfg, "num_hidden_layers"));
    json_decref(cfg);
    dfl_st_writer *w = dfl_st_writer_new();
    uint16_t *stacks[2 * 64] = {0};
    int ns = 0, moved = 0, rc = 0;
    for (size_t i = 0; i < m->n && !rc; i++) /* everything but the per-expert tensors */
        if (!strstr(m->t[i]->name, ".mlp.experts."))
            rc = dfl_st_writer_add(w, m->t[i]->name, m->t[i]->dtype, m->t[i]->ndim, m->t[i]->shape,
                                   m->t[i]->data, &e);
    for (int64_t l = 0; l < L && l < 64 && !rc; l++) {
        uint16_t *gu = malloc((size_t)(E * 2 * Im * H) * 2), *dn = malloc((size_t)(E * H * Im) * 2);
        stacks[ns++] = gu;
        stacks[ns++] = dn;
        for (int64_t x = 0; x < E; x++) {
            const char *part[3] = {"gate_proj", "up_proj", "down_proj"};
            for (int j = 0; j < 3; j++) {
                char n[128];
                snprintf(n, sizeof n, "model.layers.%lld.mlp.experts.%lld.%s.weight", (long long)l,
                         (long long)x, part[j]);
                const dfl_st_tensor *t = dfl_st_model_find(m, n);
                if (!t || t->dtype != DFL_BF16 || (int64_t)t->numel != Im * H) {
                    rc = DFL_EDATA;
                    break;
                }
                memcpy(j < 2 ? gu + (x * 2 + j) * Im * H : dn + x * H * Im, t->data, (size_t)(Im * H) * 2);
                moved++;
            }
        }
        char n[128];
        int64_t sgu[3] = {E, 2 * Im, H}, sdn[3] = {E, H, Im};
        snprintf(n, sizeof n, "model.layers.%lld.mlp.experts.gate_up_proj", (long long)l);
        if (!rc)
            rc = dfl_st_writer_add(w, n, DFL_BF16, 3, sgu, gu, &e);
        snprintf(n, sizeof n, "model.layers.%lld.mlp.experts.down_proj", (long long)l);
        if (!rc)
            rc = dfl_st_writer_add(w, n, DFL_BF16, 3, sdn, dn, &e);
    }
    snprintf(a, sizeof a, "%s/model.safetensors", dir);
    if (!rc)
        rc = dfl_st_write(w, a, &e);
    T_CHECK(rc == 0 && moved == (int)(L * E * 3), "stacking the experts: %s (%d moved)", e.msg, moved);
    dfl_st_writer_free(w);
    for (int i = 0; i < ns; i++)
        free(stacks[i]);
    dfl_st_model_close(m);
    const char *files[] = {"config.json", "ref.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(a, sizeof a, "%s/%s", src, files[i]);
        snprintf(b, sizeof b, "%s/%s", dir, files[i]);
        T_CHECK(copy_file(a, b), "copying %s", a);
    }
    if (!rc)
        forward_vs_oracle_dir(dir, "qwen35moe-tiny-a stacked");
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    T_RUN(test_rope_inv_freq);
    T_RUN(test_rope_config);
    T_RUN(test_moe_config);
    T_RUN(test_moe35_config);
    T_RUN(test_moe_route);
    T_RUN(test_moe_matmul_fused);
    T_RUN(test_moe_forward_loop);
    T_RUN(test_llama31_oracle);
    T_RUN(test_qwen3moe_oracle);
    T_RUN(test_qwen35moe_oracle);
    T_RUN(test_qwen35moe_stacked);
    return t_done();
}
