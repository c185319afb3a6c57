/* test-target.c: the target model on the CPU: config.json parsing (both rope spellings, every
 * unsupported feature refused by name), the default layer choice, the fingerprint, tensor-table
 * checks of bad models, and the forward against the transformers oracles (qwen3 from the shared
 * oracle, llama and qwen2 from tests/fixtures/target when present): through the library, and
 * through the real dfl-target program fed with token streams, every layer within 1e-4 relative
 * error per row, each sequence alone and all packed into one batch. */
#include <errno.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "frame.h"
#include "hfmodel.h"
#include "json.h"
#include "safetensors.h"
#include "target.h"
#include "util.h"
#include "t.h"
#include "oracle-ref.h"

static char self_dir[4096]; /* directory of this test binary (build/tests) */

/* ---- helpers ---- */

static json_t *parse(const char *text)
{
    dfl_err e;
    json_t *v = NULL;
    if (dfl_json_parse(text, strlen(text), &v, "test", &e))
        fprintf(stderr, "  bad test JSON: %s\n", e.msg);
    return v;
}

#define BASE_CFG                                                                                   \
    "\"hidden_size\": 64, \"num_hidden_layers\": 4, \"num_attention_heads\": 4, "                \
    "\"intermediate_size\": 128, \"vocab_size\": 256"

/* Parses "{ <json> }" and returns the code; msg receives the message. */
static int parse_cfg(const char *text, dfl_hf_config *c, char *msg, size_t n)
{
    json_t *v = parse(text);
    dfl_err e = {0};
    int rc = v ? dfl_hf_config_parse(v, "config.json", c, &e) : -1;
    snprintf(msg, n, "%s", e.msg);
    json_decref(v);
    return rc;
}

/* Path of a program: $VAR/name, else ../SUB/name beside this binary. */
static void prog_path(char *out, size_t n, const char *var, const char *sub, const char *name)
{
    const char *d = getenv(var);
    if (d && *d)
        snprintf(out, n, "%s/%s", d, name);
    else
        snprintf(out, n, "%s/../%s/%s", self_dir, sub, name);
}

static int run_cmd(const char *cmd)
{
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static bool exists(const char *p)
{
    struct stat s;
    return stat(p, &s) == 0;
}

/* ---- config ---- */

static void test_config_oracle(void)
{
    const char *o = t_oracle();
    if (!o)
        T_SKIP("no oracle");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/qwen3-tiny-a", o);
    dfl_hf_config c;
    dfl_err e = {0};
    T_CHECK(dfl_hf_config_load(dir, &c, NULL, &e) == 0, "%s", e.msg);
    T_CHECK(c.arch == DFL_HF_QWEN3 && strcmp(c.model_type, "qwen3") == 0, "arch");
    T_EQ_INT(c.hidden_size, 256, "hidden");
    T_EQ_INT(c.n_layers, 6, "layers");
    T_EQ_INT(c.n_heads, 8, "heads");
    T_EQ_INT(c.n_kv_heads, 4, "kv heads");
    T_EQ_INT(c.head_dim, 32, "head_dim");
    T_EQ_INT(c.intermediate_size, 768, "I");
    T_EQ_INT(c.vocab_size, 2048, "V");
    T_NEAR(c.rope_theta, 1e6, 0, "theta from rope_parameters");
    T_NEAR(c.rms_norm_eps, 1e-6, 0, "eps");
    T_CHECK(c.qk_norm && !c.qkv_bias && !c.o_bias && !c.mlp_bias && !c.tie_word_embeddings, "flags");
}

#define Q35_CFG                                                                                    \
    "\"model_type\": \"qwen3_5_text\", " BASE_CFG ", \"head_dim\": 32, "                         \
    "\"linear_num_key_heads\": 2, \"linear_num_value_heads\": 4, \"linear_key_head_dim\": 16, "   \
    "\"linear_value_head_dim\": 16, \"linear_conv_kernel_dim\": 4"

static void test_config_qwen35(void)
{
    dfl_hf_config c;
    char m[1024];
    const char *o = t_oracle();
    if (o) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/qwen35-tiny-a", o);
        dfl_err e = {0};
        T_CHECK(dfl_hf_config_load(dir, &c, NULL, &e) == 0, "%s", e.msg);
        T_CHECK(c.arch == DFL_HF_QWEN35 && strcmp(c.model_type, "qwen3_5") == 0, "arch");
        T_EQ_INT(c.n_layers, 8, "layers");
        T_EQ_INT(c.n_linear, 6, "linear layers");
        for (int i = 0; i < 8; i++)
            T_EQ_INT(c.layer_kind[i], i % 4 == 3 ? DFL_LAYER_GATED_ATTN : DFL_LAYER_GDN, "kind");
        T_EQ_INT(c.rot_dim, 16, "64 * 0.25 rotary dims");
        T_EQ_INT(c.lin_k_heads, 2, "key heads");
        T_EQ_INT(c.lin_v_heads, 4, "value heads");
        T_EQ_INT(c.lin_k_dim, 32, "dk");
        T_EQ_INT(c.lin_v_dim, 32, "dv");
        T_EQ_INT(c.lin_conv, 4, "conv");
        T_NEAR(c.rope_theta, 1e7, 0, "theta");
        T_CHECK(c.dtype == DFL_BF16, "dtype from the top level");
        T_CHECK(c.norm_1p && c.qk_norm && !c.tie_word_embeddings, "flags");
    }
    /* text-only, layer kinds from full_attention_interval (default 4) */
    T_CHECK(parse_cfg("{" Q35_CFG "}", &c, m, sizeof m) == 0, "%s", m);
    T_CHECK(c.layer_kind[0] == DFL_LAYER_GDN && c.layer_kind[3] == DFL_LAYER_GATED_ATTN &&
                c.n_linear == 3, "default interval 4");
    T_EQ_INT(c.rot_dim, 8, "default partial_rotary_factor 0.25");
    T_CHECK(parse_cfg("{" Q35_CFG ", \"full_attention_interval\": 2, \"partial_rotary_factor\": 0.5}",
                      &c, m, sizeof m) == 0, "%s", m);
    T_CHECK(c.layer_kind[0] == DFL_LAYER_GDN && c.layer_kind[1] == DFL_LAYER_GATED_ATTN &&
                c.layer_kind[2] == DFL_LAYER_GDN && c.n_linear == 2, "interval 2");
    T_EQ_INT(c.rot_dim, 16, "partial 0.5");
    /* the published wrapper */
    T_CHECK(parse_cfg("{\"model_type\": \"qwen3_5\", \"torch_dtype\": \"float32\", \"text_config\": {"
                      Q35_CFG "}}", &c, m, sizeof m) == 0 && c.dtype == DFL_F32, "wrapper: %s", m);
    struct {
        const char *text;
        const char *word;
        int code;
    } bad[] = {
        {"{" Q35_CFG ", \"layer_types\": [\"linear_attention\", \"sliding_attention\", "
         "\"linear_attention\", \"full_attention\"]}", "layer_types[1] is 'sliding_attention'",
         DFL_EUNSUP},
        {"{" Q35_CFG ", \"layer_types\": [\"linear_attention\"]}", "layer_types has 1 entries",
         DFL_EDATA},
        {"{" Q35_CFG ", \"partial_rotary_factor\": 0.01}", "partial_rotary_factor", DFL_EUNSUP},
        {"{" Q35_CFG ", \"attention_bias\": true}", "attention_bias", DFL_EUNSUP},
        {"{\"model_type\": \"qwen3_5\"}", "text_config", DFL_EDATA},
        {"{\"model_type\": \"qwen3_5\", \"text_config\": {\"model_type\": \"qwen3_5_moe_text\"}}",
         "text_config.model_type is 'qwen3_5_moe_text'", DFL_EUNSUP},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(bad); i++) {
        int rc = parse_cfg(bad[i].text, &c, m, sizeof m);
        T_CHECK(rc == bad[i].code && strstr(m, bad[i].word), "bad case %zu: rc %d '%s'", i, rc, m);
    }
    /* sizes the kernels do not take, at the top level and inside text_config */
    struct {
        const char *key;
        int value;
        const char *word;
    } sizes[] = {
        {"linear_num_value_heads", 3, "linear_num_value_heads = 3 is not a multiple"},
        {"linear_conv_kernel_dim", 9, "linear_conv_kernel_dim = 9 is not supported"},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(sizes); i++) {
        for (int wrap = 0; wrap < 2; wrap++) {
            json_t *tc = parse("{" Q35_CFG "}");
            json_object_set_new(tc, sizes[i].key, json_integer(sizes[i].value));
            json_t *top = wrap ? json_pack("{s:s,s:O}", "model_type", "qwen3_5", "text_config", tc)
                               : json_incref(tc);
            dfl_err e = {0};
            int rc = dfl_hf_config_parse(top, "config.json", &c, &e);
            T_CHECK(rc == DFL_EUNSUP && strstr(e.msg, sizes[i].word) &&
                        (!wrap || strstr(e.msg, "config.json: text_config: ")),
                    "%s (wrapped %d): %s", sizes[i].key, wrap, e.msg);
            json_decref(top);
            json_decref(tc);
        }
    }
    /* a missing linear-attention size is named */
    json_t *v = parse("{" Q35_CFG "}");
    json_object_del(v, "linear_key_head_dim");
    dfl_err e = {0};
    T_CHECK(dfl_hf_config_parse(v, "config.json", &c, &e) == DFL_EDATA &&
                strstr(e.msg, "linear_key_head_dim"), "missing: %s", e.msg);
    json_decref(v);
}

static void test_config_spellings(void)
{
    dfl_hf_config c;
    char m[1024];
    T_CHECK(parse_cfg("{\"model_type\": \"llama\", " BASE_CFG ", \"rope_theta\": 500000.0}", &c, m,
                      sizeof m) == 0, "%s", m);
    T_NEAR(c.rope_theta, 5e5, 0, "top-level rope_theta");
    T_EQ_INT(c.n_kv_heads, 4, "kv heads default to heads");
    T_EQ_INT(c.head_dim, 16, "head_dim defaults to hidden / heads");
    T_CHECK(!c.qk_norm && !c.qkv_bias, "llama: no qk norm, no bias");
    T_CHECK(parse_cfg("{\"model_type\": \"llama\", " BASE_CFG "}", &c, m, sizeof m) == 0, "%s", m);
    T_NEAR(c.rope_theta, 10000, 0, "default theta");
    T_CHECK(parse_cfg("{\"model_type\": \"qwen3\", " BASE_CFG ", \"rope_theta\": 7.0, "
                      "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 7.0}}",
                      &c, m, sizeof m) == 0 && c.rope_theta == 7.0, "both spellings agreeing: %s", m);
    T_CHECK(parse_cfg("{\"model_type\": \"qwen3\", " BASE_CFG ", \"rope_theta\": 7.0, "
                      "\"rope_parameters\": {\"rope_theta\": 8.0}}", &c, m, sizeof m) == DFL_EDATA &&
                strstr(m, "disagree"), "both spellings disagreeing: %s", m);
    T_CHECK(parse_cfg("{\"model_type\": \"qwen2\", " BASE_CFG ", \"sliding_window\": 4096, "
                      "\"use_sliding_window\": false, \"rope_scaling\": null}", &c, m, sizeof m) == 0,
            "qwen2 with an unused sliding window: %s", m);
    T_CHECK(c.qkv_bias && !c.o_bias && !c.qk_norm, "qwen2: q/k/v biases, no o bias");
    T_CHECK(parse_cfg("{\"model_type\": \"llama\", " BASE_CFG ", \"attention_bias\": true, "
                      "\"mlp_bias\": true, \"num_key_value_heads\": 2, \"head_dim\": 32, "
                      "\"tie_word_embeddings\": true, \"rope_scaling\": {\"rope_type\": \"default\"}}",
                      &c, m, sizeof m) == 0, "%s", m);
    T_CHECK(c.qkv_bias && c.o_bias && c.mlp_bias && c.tie_word_embeddings, "llama biases, tied");
    T_EQ_INT(c.head_dim, 32, "explicit head_dim");
    T_EQ_INT(c.n_kv_heads, 2, "kv heads");
    T_CHECK(c.dtype == DFL_DT_INVALID, "no dtype key");
    T_CHECK(parse_cfg("{\"model_type\": \"qwen3\", " BASE_CFG ", \"torch_dtype\": \"float16\"}", &c, m,
                      sizeof m) == 0 && c.dtype == DFL_F16, "torch_dtype: %s", m);
    T_CHECK(parse_cfg("{\"model_type\": \"qwen3\", " BASE_CFG ", \"dtype\": \"bfloat16\", "
                      "\"torch_dtype\": \"float32\"}", &c, m, sizeof m) == 0 && c.dtype == DFL_BF16,
            "dtype wins over torch_dtype: %s", m);
    T_CHECK(parse_cfg("{\"model_type\": \"qwen3\", " BASE_CFG ", \"dtype\": \"float8_e4m3fn\"}", &c,
                      m, sizeof m) == DFL_EUNSUP && strstr(m, "dtype 'float8_e4m3fn'"), "fp8: %s", m);
    T_CHECK(parse_cfg("{\"model_type\": \"qwen3\", " BASE_CFG ", \"attention_bias\": true, "
                      "\"layer_types\": [\"full_attention\"]}", &c, m, sizeof m) == 0 &&
                c.qkv_bias && c.o_bias && c.qk_norm, "qwen3 attention_bias: %s", m);
}

static void test_config_unsupported(void)
{
    struct {
        const char *extra, *type, *word;
        int code;
    } cases[] = {
        {"", "mistral", "model_type 'mistral'", DFL_EUNSUP},
        {", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}", "qwen3",
         "rope_scaling.original_max_position_embeddings is missing", DFL_EDATA},
        {", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}", "llama",
         "rope_scaling.type is 'dynamic'", DFL_EUNSUP},
        {", \"rope_scaling\": {\"factor\": 2.0}", "llama", "rope_scaling", DFL_EUNSUP},
        {", \"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 5e5}", "llama",
         "rope_parameters.factor is missing", DFL_EDATA},
        {", \"rope_parameters\": {\"full_attention\": {\"rope_type\": \"default\"}}", "qwen3",
         "rope_parameters.full_attention", DFL_EUNSUP},
        {", \"sliding_window\": 4096, \"use_sliding_window\": true", "qwen2", "sliding_window", DFL_EUNSUP},
        {", \"layer_types\": [\"full_attention\", \"sliding_attention\"]", "qwen3", "layer_types[1]", DFL_EUNSUP},
        {", \"num_experts\": 8", "qwen3", "num_experts", DFL_EUNSUP},
        {", \"num_local_experts\": 8", "llama", "num_local_experts", DFL_EUNSUP},
        {", \"hidden_act\": \"gelu\"", "llama", "hidden_act 'gelu'", DFL_EUNSUP},
        {", \"quantization_config\": {\"quant_method\": \"fp8\"}", "qwen3", "quantization_config", DFL_EUNSUP},
        {", \"partial_rotary_factor\": 0.5", "llama", "partial_rotary_factor", DFL_EUNSUP},
        {", \"num_key_value_heads\": 3", "llama", "num_key_value_heads", DFL_EDATA},
        {", \"head_dim\": 15", "llama", "head_dim", DFL_EUNSUP},
        {", \"rms_norm_eps\": -1", "llama", "rms_norm_eps", DFL_EDATA},
        {", \"rope_theta\": \"big\"", "llama", "rope_theta", DFL_EDATA},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(cases); i++) {
        char text[1024], m[1024];
        snprintf(text, sizeof text, "{\"model_type\": \"%s\", " BASE_CFG "%s}", cases[i].type,
                 cases[i].extra);
        dfl_hf_config c;
        int rc = parse_cfg(text, &c, m, sizeof m);
        T_CHECK(rc == cases[i].code && strstr(m, cases[i].word), "case %zu: rc %d, message '%s'", i,
                rc, m);
    }
    /* missing required keys */
    const char *req[] = {"hidden_size", "num_hidden_layers", "num_attention_heads",
                         "intermediate_size", "vocab_size"};
    for (size_t i = 0; i < DFL_ARRAY_LEN(req); i++) {
        json_t *v = parse("{\"model_type\": \"qwen3\", " BASE_CFG "}");
        json_object_del(v, req[i]);
        dfl_hf_config c;
        dfl_err e = {0};
        int rc = dfl_hf_config_parse(v, "config.json", &c, &e);
        T_CHECK(rc == DFL_EDATA && strstr(e.msg, req[i]), "missing %s: %s", req[i], e.msg);
        json_decref(v);
    }
}

/* ---- layers ---- */

static void check_layers(int64_t N, int K, const int32_t *want, int nwant)
{
    int32_t got[64];
    int n = -1;
    dfl_err e;
    T_CHECK(dfl_hf_auto_layers(N, K, got, &n, &e) == 0, "N %lld K %d: %s", (long long)N, K, e.msg);
    bool same = n == nwant;
    for (int i = 0; same && i < n; i++)
        same = got[i] == want[i];
    T_CHECK(same, "N %lld K %d: got %d layers starting %d", (long long)N, K, n, n > 0 ? got[0] : -1);
}

static void test_auto_layers(void)
{
    check_layers(36, 5, (int32_t[]){1, 9, 17, 25, 33}, 5);
    check_layers(28, 5, (int32_t[]){1, 7, 13, 19, 25}, 5);
    check_layers(32, 5, (int32_t[]){1, 8, 15, 22, 29}, 5);
    check_layers(9, 3, (int32_t[]){1, 4, 6}, 3);   /* 3.5 -> 4 (half to even) */
    check_layers(11, 3, (int32_t[]){1, 4, 8}, 3);  /* 4.5 -> 4 (half to even) */
    check_layers(13, 5, (int32_t[]){1, 3, 6, 8, 10}, 5); /* 3.25, 5.5 -> 6, 7.75 */
    check_layers(36, 1, (int32_t[]){18}, 1);       /* SpecForge: N // 2 */
    check_layers(6, 5, (int32_t[]){1, 2, 3}, 3);   /* small: K' = N - 3 */
    check_layers(5, 5, (int32_t[]){1, 2}, 2);
    check_layers(4, 5, (int32_t[]){2}, 1);
    check_layers(3, 5, (int32_t[]){1}, 1);
    check_layers(1, 5, (int32_t[]){0}, 1);
    /* every N, K: valid, distinct, ascending, and round-half-even of the exact value */
    for (int64_t N = 1; N <= 80; N++) {
        for (int K = 1; K <= 12; K++) {
            int32_t got[64];
            int n;
            dfl_err e;
            if (dfl_hf_auto_layers(N, K, got, &n, &e)) {
                T_CHECK(0, "N %lld K %d: %s", (long long)N, K, e.msg);
                continue;
            }
            int kk = K < N - 3 ? K : (int)(N - 3);
            kk = kk < 1 ? 1 : kk;
            T_EQ_INT(n, kk, "count");
            for (int i = 0; i < n; i++) {
                T_CHECK(got[i] >= 0 && got[i] < N && (i == 0 || got[i] > got[i - 1]),
                        "N %lld K %d: layer %d = %d", (long long)N, K, i, got[i]);
                if (n > 1) {
                    double x = 1.0 + (double)i * (double)(N - 4) / (double)(n - 1);
                    T_EQ_INT(got[i], (int32_t)nearbyint(x), "round half even");
                }
            }
        }
    }
    int32_t l[64];
    int n;
    dfl_err e;
    T_CHECK(dfl_target_parse_layers("auto", 36, l, &n, &e) == 0 && n == 5 && l[4] == 33, "auto");
    T_CHECK(dfl_target_parse_layers("auto:3", 36, l, &n, &e) == 0 && n == 3 && l[1] == 17, "auto:3");
    T_CHECK(dfl_target_parse_layers("0,2,5", 6, l, &n, &e) == 0 && n == 3 && l[2] == 5, "list");
    T_CHECK(dfl_target_parse_layers("0,6", 6, l, &n, &e) == DFL_EUSAGE && strstr(e.msg, "layer 6"),
            "out of range: %s", e.msg);
    T_CHECK(dfl_target_parse_layers("2,1", 6, l, &n, &e) == DFL_EUSAGE && strstr(e.msg, "ascending"),
            "order: %s", e.msg);
    T_CHECK(dfl_target_parse_layers("1,1", 6, l, &n, &e) == DFL_EUSAGE, "duplicate");
    T_CHECK(dfl_target_parse_layers("auto:0", 6, l, &n, &e) == DFL_EUSAGE, "auto:0");
    T_CHECK(dfl_target_parse_layers("auto:x", 6, l, &n, &e) == DFL_EUSAGE, "auto:x");
    T_CHECK(dfl_target_parse_layers("", 6, l, &n, &e) == DFL_EUSAGE, "empty");
}

/* ---- models made here ---- */

static char mktarget_bin[4096];

/* Writes a model with build/tools/mktarget; returns false (after a failed check) if it fails. */
static bool mkmodel(const char *dir, const char *args)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && '%s' -o '%s' %s", dir, mktarget_bin, dir, args);
    int rc = run_cmd(cmd);
    T_CHECK(rc == 0, "mktarget %s: exit %d", args, rc);
    return rc == 0;
}

static void test_fingerprint(void)
{
    if (!exists(mktarget_bin))
        T_SKIP("no %s", mktarget_bin);
    char a[4096], b[4096], path[8192];
    snprintf(a, sizeof a, "%s/fp-a", t_tmpdir());
    snprintf(b, sizeof b, "%s/fp-b", t_tmpdir());
    if (!mkmodel(a, "--layers 2") || !mkmodel(b, "--layers 2"))
        return;
    char fa[33], fb[33];
    dfl_err e = {0};
    T_CHECK(dfl_hf_fingerprint(a, fa, &e) == 0, "%s", e.msg);
    T_CHECK(strlen(fa) == 32 && strspn(fa, "0123456789abcdef") == 32, "hex: %s", fa);
    T_CHECK(dfl_hf_fingerprint(b, fb, &e) == 0 && strcmp(fa, fb) == 0, "same model, same print");
    /* The same config with keys in another order and other whitespace: same fingerprint. */
    snprintf(path, sizeof path, "%s/config.json", b);
    json_t *cfg = NULL;
    T_CHECK(dfl_json_load_file(path, &cfg, &e) == 0, "%s", e.msg);
    char *s = json_dumps(cfg, JSON_INDENT(7) | JSON_PRESERVE_ORDER);
    /* reverse the key order */
    json_t *rev = json_object();
    const char *keys[64];
    int nk = 0;
    const char *k;
    json_t *v;
    json_object_foreach(cfg, k, v) if (nk < 64) keys[nk++] = k;
    for (int i = nk - 1; i >= 0; i--)
        json_object_set(rev, keys[i], json_object_get(cfg, keys[i]));
    char *r = json_dumps(rev, JSON_INDENT(3) | JSON_PRESERVE_ORDER);
    T_CHECK(r && dfl_write_file_atomic(path, r, strlen(r), &e) == 0, "rewrite");
    T_CHECK(dfl_hf_fingerprint(b, fb, &e) == 0 && strcmp(fa, fb) == 0, "key order: %s vs %s", fa, fb);
    free(s);
    free(r);
    json_decref(rev);
    /* A changed config value changes it. */
    json_object_set_new(cfg, "rms_norm_eps", json_real(1e-5));
    T_CHECK(dfl_json_write_file(path, cfg, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_hf_fingerprint(b, fb, &e) == 0 && strcmp(fa, fb) != 0, "config change");
    json_decref(cfg);
    /* So do the tensor table's dtypes and shapes. */
    if (!mkmodel(b, "--layers 2 --dtype f32"))
        return;
    T_CHECK(dfl_hf_fingerprint(b, fb, &e) == 0 && strcmp(fa, fb) != 0, "dtype change");
    if (!mkmodel(b, "--layers 2 --wrong-shape lm_head.weight"))
        return;
    T_CHECK(dfl_hf_fingerprint(b, fb, &e) == 0 && strcmp(fa, fb) != 0, "shape change");
    /* Not the values: another seed gives the same print. */
    if (!mkmodel(b, "--layers 2 --seed 7"))
        return;
    T_CHECK(dfl_hf_fingerprint(b, fb, &e) == 0 && strcmp(fa, fb) == 0, "values are not hashed");
}

static void test_bad_models(void)
{
    if (!exists(mktarget_bin))
        T_SKIP("no %s", mktarget_bin);
    dfl_be *be = NULL;
    dfl_err e = {0};
    T_CHECK(dfl_be_open(&be, "cpu", DFL_DT_INVALID, &e) == 0, "%s", e.msg);
    struct {
        const char *args, *word;
        int code;
    } cases[] = {
        {"--omit model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight", DFL_EDATA},
        {"--wrong-shape model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         DFL_EMISMATCH},
        {"--omit model.layers.0.self_attn.q_norm.weight", "q_norm", DFL_EDATA},
        {"--type qwen2 --omit model.layers.1.self_attn.v_proj.bias", "v_proj.bias", DFL_EDATA},
        {"--omit model.embed_tokens.weight", "embed_tokens", DFL_EDATA},
        {"--omit model.norm.weight", "model.norm.weight", DFL_EDATA},
    };
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/bad", t_tmpdir());
    for (size_t i = 0; i < DFL_ARRAY_LEN(cases); i++) {
        char args[512];
        snprintf(args, sizeof args, "--layers 2 %s", cases[i].args);
        if (!mkmodel(dir, args))
            continue;
        dfl_target *t = NULL;
        int rc = dfl_target_open(&t, be, dir, 0, &e);
        T_CHECK(rc == cases[i].code && strstr(e.msg, cases[i].word), "%s: rc %d: %s", cases[i].args,
                rc, e.msg);
        T_CHECK(!t, "no model on failure");
        dfl_target_close(t);
    }
    /* hybrid models: missing or misshapen linear-attention tensors */
    struct {
        const char *args, *word;
        int code;
    } hy[] = {
        {"--type qwen3_5 --omit model.language_model.layers.0.linear_attn.A_log",
         "model.language_model.layers.0.linear_attn.A_log", DFL_EDATA},
        {"--type qwen3_5_text --omit model.layers.1.linear_attn.conv1d.weight",
         "model.layers.1.linear_attn.conv1d.weight", DFL_EDATA},
        {"--type qwen3_5_text --wrong-shape model.layers.3.self_attn.q_proj.weight",
         "model.layers.3.self_attn.q_proj.weight", DFL_EMISMATCH},
        {"--type qwen3_5 --omit model.language_model.layers.2.linear_attn.in_proj_z.weight",
         "in_proj_z", DFL_EDATA},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(hy); i++) {
        char args[512];
        snprintf(args, sizeof args, "--layers 4 %s", hy[i].args);
        if (!mkmodel(dir, args))
            continue;
        dfl_target *t = NULL;
        int rc = dfl_target_open(&t, be, dir, 0, &e);
        T_CHECK(rc == hy[i].code && strstr(e.msg, hy[i].word), "%s: rc %d: %s", hy[i].args, rc, e.msg);
        T_CHECK(!t, "no model on failure");
        dfl_target_close(t);
    }
    /* tied embeddings need no lm_head; a sharded model loads */
    if (mkmodel(dir, "--layers 2 --tied --shards 3")) {
        dfl_target *t = NULL;
        T_CHECK(dfl_target_open(&t, be, dir, 0, &e) == 0, "tied, sharded: %s", e.msg);
        dfl_target_close(t);
    }
    dfl_be_close(be);
}

/* ---- forward ---- */

/* Per-row relative error ||a - b|| / ||b|| over rows of H; the maximum (NaN if any is NaN). */
static double max_row_err(const float *a, const float *b, int64_t rows, int64_t H)
{
    return t_rows_err(a, H, b, H, rows, H, 1e-30);
}

/* The final norm (the model's RMSNorm, on the backend's op) and the logits of the last 8 rows
 * (lm_head, or the embedding when tied) of sequence s from its last layer's output x, against
 * seq{s}.norm and seq{s}.logits_last8 when the reference has them. */
static void final_vs_ref(dfl_target *t, const char *dir, const ref *r, int s, const float *x)
{
    char name[128];
    snprintf(name, sizeof name, "seq%d.norm", s);
    const dfl_st_tensor *rn = dfl_st_find(r->f, name);
    snprintf(name, sizeof name, "seq%d.logits_last8", s);
    const dfl_st_tensor *rl = dfl_st_find(r->f, name);
    if (!rn || !rl)
        return;
    dfl_err e = {0};
    dfl_st_model *m = NULL;
    if (dfl_st_model_open(&m, dir, &e)) {
        T_CHECK(0, "%s", e.msg);
        return;
    }
    const dfl_hf_config *c = &t->cfg;
    int64_t H = c->hidden_size, V = c->vocab_size, L = r->len[s], nw = 0, nl = 0;
    snprintf(name, sizeof name, "%snorm.weight", t->prefix);
    float *w = tensor_f32(m, name, &nw);
    snprintf(name, sizeof name, "%sembed_tokens.weight", t->prefix);
    float *lm = tensor_f32(m, c->tie_word_embeddings ? name : "lm_head.weight", &nl);
    float *y = malloc((size_t)(L * H) * sizeof *y);
    T_CHECK(w && lm && nw == H && nl == V * H, "%s: final norm and LM head", dir);
    if (w && lm && nw == H && nl == V * H) {
        dfl_be *be = t->be;
        int rc = c->norm_1p ? be->ops->rmsnorm_1p(be, y, x, w, L, H, (float)c->rms_norm_eps)
                            : be->ops->rmsnorm(be, y, NULL, x, w, L, H, (float)c->rms_norm_eps);
        T_CHECK(rc == 0, "final norm");
        double err = max_row_err(y, rn->data, L, H);
        T_CHECK(err <= 1e-4, "%s seq%d final norm: max row rel err %.3g", dir, s, err);
        int64_t n8 = rl->shape[0];
        float *lg = malloc((size_t)(n8 * V) * sizeof *lg);
        t_logits_last(lg, y, L, n8, H, lm, V);
        double el = max_row_err(lg, rl->data, n8, V);
        if (getenv("DFL_TEST_VERBOSE"))
            fprintf(stderr, "  %s seq%d norm: %.3g logits: %.3g\n", dir, s, err, el);
        T_CHECK(el <= 1e-4, "%s seq%d logits of the last %lld: max row rel err %.3g", dir, s,
                (long long)n8, el);
        free(lg);
    }
    free(y);
    free(w);
    free(lm);
    dfl_st_model_close(m);
}

/* The library forward on the CPU against a reference directory: each sequence alone, then all
 * packed into one batch (in reverse order, so that packing offsets differ). fuse: the residual
 * adds in the GEMMs' epilogues (beta = 1), as the CUDA backend runs them. */
static void forward_vs_ref_ex(const char *dir, bool fuse)
{
    dfl_err e = {0};
    ref r;
    if (!ref_load(&r, dir))
        return;
    dfl_be *be = NULL;
    dfl_target *t = NULL;
    dfl_target_ws *ws = NULL;
    T_CHECK(dfl_be_open(&be, "cpu", DFL_DT_INVALID, &e) == 0, "%s", e.msg);
    if (dfl_target_open(&t, be, dir, 0, &e)) {
        T_CHECK(0, "%s: %s", dir, e.msg);
        goto out;
    }
    t->fuse_residual = fuse;
    int64_t H = t->cfg.hidden_size, total = 0;
    int K = r.n_layers;
    T_EQ_INT(K, t->cfg.n_layers, "reference has every layer");
    for (int s = 0; s < r.n_seqs; s++)
        total += r.len[s];
    T_CHECK(dfl_target_ws_new(t, total, r.n_seqs, &ws, &e) == 0, "%s", e.msg);
    int32_t layers[64];
    float *caps[64];
    for (int k = 0; k < K; k++) {
        layers[k] = k;
        caps[k] = malloc((size_t)(total * H) * sizeof(float));
    }
    int32_t *ids = malloc((size_t)total * 4);
    uint32_t lens[16];
    uint8_t *mask = calloc((size_t)total, 1);
    /* alone */
    for (int s = 0; s < r.n_seqs; s++) {
        dfl_batch b = {.index = (uint64_t)s, .n_tokens = (uint64_t)r.len[s], .n_seqs = 1,
                       .seq_lens = lens, .input_ids = r.ids[s], .loss_mask = mask};
        lens[0] = (uint32_t)r.len[s];
        if (dfl_target_forward(t, ws, &b, K, layers, DFL_F32, (void *const *)caps, &e)) {
            T_CHECK(0, "seq %d: %s", s, e.msg);
            continue;
        }
        for (int k = 0; k < K; k++) {
            double err = max_row_err(caps[k], ref_layer(&r, s, k), r.len[s], H);
            if (getenv("DFL_TEST_VERBOSE"))
                fprintf(stderr, "  %s seq%d layer%d: %.3g\n", dir, s, k, err);
            T_CHECK(err <= 1e-4, "%s seq%d layer%d alone: max row rel err %.3g", dir, s, k, err);
        }
        if (K == t->cfg.n_layers)
            final_vs_ref(t, dir, &r, s, caps[K - 1]);
    }
    /* packed, reversed */
    int64_t off[16], row = 0;
    for (int j = 0; j < r.n_seqs; j++) {
        int s = r.n_seqs - 1 - j;
        lens[j] = (uint32_t)r.len[s];
        off[s] = row;
        memcpy(ids + row, r.ids[s], (size_t)r.len[s] * 4);
        row += r.len[s];
    }
    dfl_batch b = {.index = 0, .n_tokens = (uint64_t)total, .n_seqs = (uint32_t)r.n_seqs,
                   .seq_lens = lens, .input_ids = ids, .loss_mask = mask};
    if (dfl_target_forward(t, ws, &b, K, layers, DFL_F32, (void *const *)caps, &e) == 0) {
        for (int s = 0; s < r.n_seqs; s++)
            for (int k = 0; k < K; k++) {
                double err = max_row_err(caps[k] + off[s] * H, ref_layer(&r, s, k), r.len[s], H);
                T_CHECK(err <= 1e-4, "%s seq%d layer%d packed: max row rel err %.3g", dir, s, k, err);
            }
    } else {
        T_CHECK(0, "packed: %s", e.msg);
    }
    /* bf16 capture: within bf16 rounding of the f32 one */
    float *c32 = malloc((size_t)(total * H) * sizeof(float));
    uint16_t *c16 = malloc((size_t)(total * H) * 2);
    memcpy(c32, caps[K - 1], (size_t)(total * H) * sizeof(float));
    void *one[1] = {c16};
    int32_t last[1] = {K - 1};
    T_CHECK(dfl_target_forward(t, ws, &b, 1, last, DFL_BF16, one, &e) == 0, "%s", e.msg);
    bool same = true;
    for (int64_t i = 0; i < total * H; i++)
        same &= c16[i] == dfl_f32_to_bf16(c32[i]);
    T_CHECK(same, "bf16 capture is the f32 result rounded");
    free(c32);
    free(c16);
    /* a token out of range is refused, naming batch, sequence and position */
    ids[r.len[r.n_seqs - 1] + 2] = (int32_t)t->cfg.vocab_size;
    b.index = 7;
    int rc = dfl_target_forward(t, ws, &b, K, layers, DFL_F32, (void *const *)caps, &e);
    T_CHECK(rc == DFL_EDATA && strstr(e.msg, "batch 7, sequence 1, position 2") &&
                strstr(e.msg, "vocab_size"), "out of range: %d %s", rc, e.msg);
    ids[0] = -1;
    rc = dfl_target_forward(t, ws, &b, K, layers, DFL_F32, (void *const *)caps, &e);
    T_CHECK(rc == DFL_EDATA && strstr(e.msg, "sequence 0, position 0"), "negative: %s", e.msg);
    /* a batch larger than the buffers is refused */
    b.n_tokens = (uint64_t)total + 1;
    lens[0]++;
    rc = dfl_target_forward(t, ws, &b, K, layers, DFL_F32, (void *const *)caps, &e);
    T_CHECK(rc == DFL_EUSAGE, "too large: %s", e.msg);
    for (int k = 0; k < K; k++)
        free(caps[k]);
    free(ids);
    free(mask);
out:
    dfl_target_ws_free(t, ws);
    dfl_target_close(t);
    dfl_be_close(be);
    dfl_st_close(r.f);
}

static void forward_vs_ref(const char *dir) { forward_vs_ref_ex(dir, false); }

/* dfl_target_check_vocab: the batch checks shared with the frame reader and writer
 * (batch_check.h), each failure naming the batch, the sequence and the position within it,
 * across empty sequences; negative ids are out of range too. */
static void test_check_vocab(void)
{
    uint32_t lens[4] = {3, 0, 2, 1};
    int32_t ids[6] = {0, 1, 2, 3, 4, 5};
    dfl_batch b = {.index = 7, .n_tokens = 6, .n_seqs = 4, .seq_lens = lens, .input_ids = ids};
    dfl_err e = {0};
    T_CHECK(dfl_target_check_vocab(6, &b, &e) == DFL_OK, "%s", e.msg);
    struct { int at; int32_t id; const char *msg; } cases[] = {
        {0, 6, "batch 7, sequence 0, position 0: token id 6 is out of range for the model's vocab_size 6"},
        {2, -1, "batch 7, sequence 0, position 2: token id -1 is out of range"},
        {4, 9, "batch 7, sequence 2, position 1: token id 9 is out of range"},
        {5, 100, "batch 7, sequence 3, position 0: token id 100 is out of range"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int32_t keep = ids[cases[i].at];
        ids[cases[i].at] = cases[i].id;
        e = (dfl_err){0};
        int rc = dfl_target_check_vocab(6, &b, &e);
        T_CHECK(rc == DFL_EDATA && strstr(e.msg, cases[i].msg), "case %zu: %d %s", i, rc, e.msg);
        ids[cases[i].at] = keep;
    }
    lens[3] = 2;   /* lengths add up to 7, not 6 tokens */
    e = (dfl_err){0};
    T_CHECK(dfl_target_check_vocab(6, &b, &e) == DFL_EDATA &&
            strstr(e.msg, "batch 7: sequence lengths add up to 7, not 6 tokens"), "%s", e.msg);
}

static void test_forward_qwen3_oracle(void)
{
    const char *o = t_oracle();
    if (!o)
        T_SKIP("no oracle");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/qwen3-tiny-a", o);
    forward_vs_ref(dir);
}

static void test_forward_qwen35_oracle(void)
{
    const char *o = t_oracle();
    if (!o)
        T_SKIP("no oracle");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/qwen35-tiny-a", o);
    forward_vs_ref(dir);
    forward_vs_ref_ex(dir, true); /* the layer sequence CUDA runs */
}

static const char *fixture(const char *name)
{
    static char dir[4096];
    const char *src = getenv("DFL_SRCDIR");
    if (src && *src)
        snprintf(dir, sizeof dir, "%s/tests/fixtures/target/%s", src, name);
    else
        snprintf(dir, sizeof dir, "%s/../../tests/fixtures/target/%s", self_dir, name);
    char p[4200];
    snprintf(p, sizeof p, "%s/ref.safetensors", dir);
    return exists(p) ? dir : NULL;
}

static void test_forward_llama_fixture(void)
{
    const char *d = fixture("llama-tiny");
    if (!d)
        T_SKIP("no tests/fixtures/target/llama-tiny (made by tests/oracle-gen/make_ref.py)");
    forward_vs_ref(d);
}

static void test_forward_qwen2_fixture(void)
{
    const char *d = fixture("qwen2-tiny");
    if (!d)
        T_SKIP("no tests/fixtures/target/qwen2-tiny (made by tests/oracle-gen/make_ref.py)");
    forward_vs_ref(d);
}

/* Packing is exact bookkeeping: on a generated model with every optional piece (biases, GQA,
 * several dtypes), a packed batch equals each sequence run alone, and capturing fewer layers
 * (stopping early) gives the same values. */
static void packed_equals_alone(const char *args)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/pk", t_tmpdir());
    if (!mkmodel(dir, args))
        return;
    dfl_err e = {0};
    dfl_be *be = NULL;
    dfl_target *t = NULL;
    dfl_target_ws *ws = NULL;
    T_CHECK(dfl_be_open(&be, "cpu", DFL_DT_INVALID, &e) == 0, "%s", e.msg);
    if (dfl_target_open(&t, be, dir, 0, &e)) {
        T_CHECK(0, "%s: %s", args, e.msg);
        dfl_be_close(be);
        return;
    }
    int64_t H = t->cfg.hidden_size, V = t->cfg.vocab_size;
    uint32_t lens[] = {5, 1, 0, 17, 3};
    int S = 5, T = 26, K = (int)t->cfg.n_layers;
    int32_t ids[26];
    uint8_t mask[26] = {0};
    for (int i = 0; i < T; i++)
        ids[i] = (int32_t)((i * 37 + 11) % V);
    T_CHECK(dfl_target_ws_new(t, T, S, &ws, &e) == 0, "%s", e.msg);
    int32_t layers[64];
    float *packed[64], *alone[64];
    for (int k = 0; k < K; k++) {
        layers[k] = k;
        packed[k] = malloc((size_t)(T * H) * 4);
        alone[k] = malloc((size_t)(T * H) * 4);
    }
    dfl_batch b = {.n_tokens = (uint64_t)T, .n_seqs = (uint32_t)S, .seq_lens = lens,
                   .input_ids = ids, .loss_mask = mask};
    T_CHECK(dfl_target_forward(t, ws, &b, K, layers, DFL_F32, (void *const *)packed, &e) == 0,
            "%s", e.msg);
    int64_t row = 0;
    for (int s = 0; s < S; s++) {
        dfl_batch one = {.n_tokens = lens[s], .n_seqs = 1, .seq_lens = &lens[s],
                         .input_ids = ids + row, .loss_mask = mask};
        float *dst[64];
        for (int k = 0; k < K; k++)
            dst[k] = alone[k] + row * H;
        T_CHECK(dfl_target_forward(t, ws, &one, K, layers, DFL_F32, (void *const *)dst, &e) == 0,
                "%s", e.msg);
        row += lens[s];
    }
    for (int k = 0; k < K; k++) {
        double err = max_row_err(packed[k], alone[k], T, H);
        T_CHECK(err <= 1e-6, "%s: layer %d packed vs alone: %.3g", args, k, err);
    }
    /* stop early: capture only layer 1 */
    int32_t l1[1] = {1};
    float *c1 = malloc((size_t)(T * H) * 4);
    void *one_cap[1] = {c1};
    T_CHECK(dfl_target_forward(t, ws, &b, 1, l1, DFL_F32, one_cap, &e) == 0, "%s", e.msg);
    T_CHECK(memcmp(c1, packed[1], (size_t)(T * H) * 4) == 0, "%s: layer 1 alone equals", args);
    /* all finite, and layers differ from each other */
    bool finite = true;
    for (int k = 0; k < K; k++)
        for (int64_t i = 0; i < T * H; i++)
            finite &= isfinite(packed[k][i]);
    T_CHECK(finite, "%s: finite", args);
    T_CHECK(memcmp(packed[0], packed[1], (size_t)(T * H) * 4) != 0, "layers differ");
    free(c1);
    for (int k = 0; k < K; k++) {
        free(packed[k]);
        free(alone[k]);
    }
    dfl_target_ws_free(t, ws);
    dfl_target_close(t);
    dfl_be_close(be);
}

static void test_packed_generated(void)
{
    if (!exists(mktarget_bin))
        T_SKIP("no %s", mktarget_bin);
    packed_equals_alone("--type qwen3 --layers 3 --heads 4 --kv-heads 2 --attention-bias");
    packed_equals_alone("--type llama --layers 3 --heads 4 --kv-heads 1 --attention-bias --mlp-bias --dtype f16");
    packed_equals_alone("--type qwen2 --layers 3 --heads 8 --kv-heads 2 --dtype f32 --tied");
    /* hybrid: the conv window and the delta rule's state restart with each sequence */
    packed_equals_alone("--type qwen3_5 --layers 4 --shards 3");
    packed_equals_alone("--type qwen3_5_text --layers 3 --interval 3 --lin-k-heads 1 --lin-v-heads 3 "
                        "--lin-k-dim 8 --lin-v-dim 24 --conv 2 --dtype f32 --tied");
}

/* ---- the program ---- */

static char target_bin[4096], mktokens_bin[4096];

/* Runs dfl-target on the oracle with a token stream made by mktokens; compares every layer. */
static void program_vs_ref(const char *dir, bool pack)
{
    dfl_err e = {0};
    ref r;
    if (!ref_load(&r, dir))
        return;
    char tok[4096], out[4096], cmd[16384], layers[512] = "";
    snprintf(tok, sizeof tok, "%s/tokens-%d.dfl", t_tmpdir(), pack);
    snprintf(out, sizeof out, "%s/hidden-%d.dfl", t_tmpdir(), pack);
    for (int k = 0; k < r.n_layers; k++)
        snprintf(layers + strlen(layers), sizeof layers - strlen(layers), "%s%d", k ? "," : "", k);
    snprintf(cmd, sizeof cmd, "'%s' --from-ref '%s/ref.safetensors' %s -o '%s' && "
             "'%s' -q --device cpu --dtype f32 --layers %s --model '%s' -o '%s' '%s'",
             mktokens_bin, dir, pack ? "--pack" : "", tok, target_bin, layers, dir, out, tok);
    int rc = run_cmd(cmd);
    T_CHECK(rc == 0, "%s: exit %d", cmd, rc);
    dfl_reader *rd = NULL;
    if (rc || dfl_reader_open(&rd, out, NULL, &e)) {
        T_CHECK(0, "%s: %s", out, e.msg);
        dfl_st_close(r.f);
        return;
    }
    const dfl_stream_info *info = dfl_reader_info(rd);
    T_CHECK(info->kind == DFL_KIND_HIDDEN && info->dtype == DFL_F32 && info->n_layers == r.n_layers,
            "stream header");
    char fp[33];
    T_CHECK(dfl_hf_fingerprint(dir, fp, &e) == 0 && strcmp(fp, info->fingerprint) == 0,
            "fingerprint in the header: '%s' vs '%s'", info->fingerprint, fp);
    int s = 0, batches = 0;
    for (;;) {
        dfl_batch b;
        memset(&b, 0, sizeof b);
        bool eos = false;
        if (dfl_reader_next(rd, &b, &eos, &e)) {
            T_CHECK(0, "%s", e.msg);
            break;
        }
        if (eos)
            break;
        batches++;
        int64_t row = 0;
        for (uint32_t j = 0; j < b.n_seqs; j++, s++) {
            T_CHECK(s < r.n_seqs && b.seq_lens[j] == r.len[s], "sequence %d length", s);
            if (s >= r.n_seqs || b.seq_lens[j] != r.len[s])
                break;
            T_CHECK(memcmp(b.input_ids + row, r.ids[s], (size_t)r.len[s] * 4) == 0, "ids carried");
            for (int k = 0; k < r.n_layers; k++) {
                double err = max_row_err((const float *)b.layers[k] + row * b.hidden,
                                         ref_layer(&r, s, k), r.len[s], b.hidden);
                T_CHECK(err <= 1e-4, "%s seq%d layer%d (%s): max row rel err %.3g", dir, s, k,
                        pack ? "packed" : "alone", err);
            }
            row += r.len[s];
        }
        dfl_batch_free(&b);
    }
    T_EQ_INT(s, r.n_seqs, "every sequence came back");
    T_EQ_INT(batches, pack ? 1 : r.n_seqs, "one output batch per input batch");
    dfl_reader_close(rd);
    dfl_st_close(r.f);
}

/* program_vs_ref on the oracle's directory name, one stream a sequence and packed. */
static void program_oracle(const char *name)
{
    const char *o = t_oracle();
    if (!o)
        T_SKIP("no oracle");
    if (!exists(target_bin) || !exists(mktokens_bin))
        T_SKIP("no %s or %s", target_bin, mktokens_bin);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", o, name);
    program_vs_ref(dir, false);
    program_vs_ref(dir, true);
}

static void test_program_qwen3_oracle(void) { program_oracle("qwen3-tiny-a"); }

static void test_program_qwen35_oracle(void) { program_oracle("qwen35-tiny-a"); }

static void test_program_fixtures(void)
{
    const char *names[] = {"llama-tiny", "qwen2-tiny"};
    int ran = 0;
    for (size_t i = 0; i < DFL_ARRAY_LEN(names); i++) {
        const char *d = fixture(names[i]);
        if (!d || !exists(target_bin) || !exists(mktokens_bin))
            continue;
        program_vs_ref(d, false);
        program_vs_ref(d, true);
        ran++;
    }
    if (!ran)
        T_SKIP("no llama/qwen2 fixtures under tests/fixtures/target");
}

/* The program on the other families' oracles (Llama 3.1 rope scaling, Qwen3-MoE). */
static void test_program_families(void)
{
    const char *names[] = {"llama31-tiny-a", "qwen3moe-tiny-a"};
    for (size_t i = 0; i < DFL_ARRAY_LEN(names); i++)
        program_oracle(names[i]);
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    char *slash = strrchr(argv[0], '/');
    if (slash)
        snprintf(self_dir, sizeof self_dir, "%.*s", (int)(slash - argv[0]), argv[0]);
    else
        snprintf(self_dir, sizeof self_dir, ".");
    prog_path(mktarget_bin, sizeof mktarget_bin, "DFL_TOOLS", "tools", "mktarget");
    prog_path(mktokens_bin, sizeof mktokens_bin, "DFL_TOOLS", "tools", "mktokens");
    prog_path(target_bin, sizeof target_bin, "DFL_BIN", "bin", "dfl-target");
    T_RUN(test_config_oracle);
    T_RUN(test_config_spellings);
    T_RUN(test_config_unsupported);
    T_RUN(test_config_qwen35);
    T_RUN(test_auto_layers);
    T_RUN(test_fingerprint);
    T_RUN(test_bad_models);
    T_RUN(test_check_vocab);
    T_RUN(test_forward_qwen3_oracle);
    T_RUN(test_forward_qwen35_oracle);
    T_RUN(test_forward_llama_fixture);
    T_RUN(test_forward_qwen2_fixture);
    T_RUN(test_packed_generated);
    T_RUN(test_program_qwen3_oracle);
    T_RUN(test_program_qwen35_oracle);
    T_RUN(test_program_fixtures);
    T_RUN(test_program_families);
    return t_done();
}
