/* mktarget: writes a small random target model (qwen3, qwen3_moe, llama, qwen2, or the hybrid
 * qwen3_5 / qwen3_5_moe in its multimodal layout or qwen3_5_text / qwen3_5_moe_text in the
 * text-only one) in the Hugging Face layout
 * (config.json plus model.safetensors, or shards with model.safetensors.index.json), for tests
 * and the demo. Deterministic: the same options give the same bytes; each tensor's values depend
 * only on the seed and its name. Options to break a model on purpose (--omit, --wrong-shape) make
 * the bad-model corpus. --no-layers writes the config of all layers but only the embedding, final
 * norm and LM head: what a drafter reads of its target (bench/draft: 2.5 GB instead of 16). */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "cli.h"
#include "dtype.h"
#include "json.h"
#include "log.h"
#include "safetensors.h"
#include "util.h"

typedef struct opts {
    const char *type, *out, *rope_spelling;
    int64_t hidden, layers, heads, kv_heads, head_dim, inter, vocab, shards;
    int64_t lin_k_heads, lin_v_heads, lin_k_dim, lin_v_dim, conv, interval; /* qwen3_5 */
    int64_t experts, top_k, moe_inter; /* qwen3_moe, qwen3_5_moe */
    int64_t shared_inter;              /* qwen3_5_moe: the shared expert's width */
    double llama3[4];                  /* --rope-llama3: factor, low, high, original (0: none) */
    uint64_t seed;
    double theta, eps;
    bool tied, attn_bias, mlp_bias, no_layers;
    dfl_dtype dtype;
    const char *omit[16];
    int n_omit;
    const char *wrong[16];
    int n_wrong;
} opts;

typedef struct tensor {
    char name[128];
    int ndim;
    int64_t shape[3];
    void *data;
} tensor;

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform values with mean `mean` and standard deviation `std`. Value i is the (i+1)-th output of
 * splitmix64 from the name's seed, computed from i alone, so that large tensors fill in parallel
 * with the same values. */
static void fill(float *v, size_t n, const char *name, uint64_t seed, float mean, float std)
{
    const uint64_t s0 = XXH3_64bits_withSeed(name, strlen(name), seed);
    const float a = std * sqrtf(3.0f);
#pragma omp parallel for schedule(static) if (n > ((size_t)1 << 20))
    for (size_t i = 0; i < n; i++) {
        uint64_t s = s0 + (uint64_t)i * 0x9e3779b97f4a7c15ull;
        double u = (double)(splitmix(&s) >> 11) * 0x1p-53; /* [0, 1) */
        v[i] = mean + a * (float)(2.0 * u - 1.0);
    }
}

/* dfl_convert in parallel pieces. */
static void convert_par(void *dst, dfl_dtype dt, const float *src, size_t n)
{
    const size_t piece = (size_t)1 << 20;
    size_t pieces = (n + piece - 1) / piece;
#pragma omp parallel for schedule(static) if (pieces > 1)
    for (size_t p = 0; p < pieces; p++) {
        size_t off = p * piece, m = n - off < piece ? n - off : piece;
        dfl_convert((char *)dst + off * dfl_dtype_size(dt), dt, src + off, DFL_F32, m);
    }
}

static bool listed(const char *const *l, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (strcmp(l[i], name) == 0)
            return true;
    return false;
}

static int add(tensor *ts, int *nt, const opts *o, const char *name, int ndim, int64_t d0,
               int64_t d1, float mean, float std, dfl_err *e)
{
    if (listed(o->omit, o->n_omit, name))
        return DFL_OK;
    tensor *t = &ts[(*nt)++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    t->shape[0] = d0 + (listed(o->wrong, o->n_wrong, name) ? 1 : 0);
    t->shape[1] = ndim == 3 ? 1 : d1;
    t->shape[2] = d1;     /* ndim 3: [d0, 1, d1] (a depthwise conv1d weight) */
    size_t n = (size_t)t->shape[0] * (size_t)(ndim >= 2 ? d1 : 1);
    float *f = malloc(n * sizeof *f);
    t->data = malloc(n * dfl_dtype_size(o->dtype) + 1);
    if (!f || !t->data) {
        free(f);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    fill(f, n, name, o->seed, mean, std);
    convert_par(t->data, o->dtype, f, n);
    free(f);
    return DFL_OK;
}

static bool is_full(const opts *o, int64_t l) { return (l + 1) % o->interval == 0; }

/* qwen3_5_text: the hybrid fields, then (qwen3_5) wrapped as the published multimodal config. */
static int write_config_qwen35(const opts *o, json_t *c, dfl_err *e)
{
    bool moe = strstr(o->type, "_moe") != NULL;
    json_object_set_new(c, "model_type", json_string(moe ? "qwen3_5_moe_text" : "qwen3_5_text"));
    if (moe) { /* as transformers' Qwen3_5MoeTextConfig: no intermediate_size, every layer sparse */
        json_object_del(c, "intermediate_size");
        json_object_set_new(c, "num_experts", json_integer(o->experts));
        json_object_set_new(c, "num_experts_per_tok", json_integer(o->top_k));
        json_object_set_new(c, "moe_intermediate_size", json_integer(o->moe_inter));
        json_object_set_new(c, "shared_expert_intermediate_size", json_integer(o->shared_inter));
    }
    json_object_del(c, "architectures");
    json_object_set_new(c, "attention_bias", json_false());
    json_object_set_new(c, "partial_rotary_factor", json_real(0.25));
    json_object_set_new(c, "rope_parameters", json_pack("{s:s,s:f,s:f,s:[i,i,i],s:b}", "rope_type",
                                                        "default", "rope_theta", o->theta,
                                                        "partial_rotary_factor", 0.25,
                                                        "mrope_section", 11, 11, 10,
                                                        "mrope_interleaved", 1));
    json_object_set_new(c, "linear_num_key_heads", json_integer(o->lin_k_heads));
    json_object_set_new(c, "linear_num_value_heads", json_integer(o->lin_v_heads));
    json_object_set_new(c, "linear_key_head_dim", json_integer(o->lin_k_dim));
    json_object_set_new(c, "linear_value_head_dim", json_integer(o->lin_v_dim));
    json_object_set_new(c, "linear_conv_kernel_dim", json_integer(o->conv));
    if (o->interval != 4) {
        json_object_set_new(c, "full_attention_interval", json_integer(o->interval));
    } else {
        json_t *lt = json_array();
        for (int64_t l = 0; l < o->layers; l++)
            json_array_append_new(lt, json_string(is_full(o, l) ? "full_attention" : "linear_attention"));
        json_object_set_new(c, "layer_types", lt);
    }
    if (strcmp(o->type, "qwen3_5") == 0 || strcmp(o->type, "qwen3_5_moe") == 0) {
        json_t *w = json_pack("{s:[s],s:s,s:O,s:b,s:{s:s,s:i},s:s}", "architectures",
                              moe ? "Qwen3_5MoeForConditionalGeneration"
                                  : "Qwen3_5ForConditionalGeneration", "model_type", o->type,
                              "text_config", c, "tie_word_embeddings", o->tied, "vision_config",
                              "model_type", "qwen3_5_vision", "depth", 1, "dtype",
                              json_string_value(json_object_get(c, "torch_dtype")));
        json_object_del(json_object_get(w, "text_config"), "torch_dtype");
        json_decref(c);
        c = w;
    }
    char *path = dfl_path_join(o->out, "config.json");
    int rc = path && c ? dfl_json_write_file(path, c, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
    free(path);
    json_decref(c);
    return rc;
}

static int write_config(const opts *o, dfl_err *e)
{
    const char *arch = strcmp(o->type, "qwen3") == 0 ? "Qwen3ForCausalLM"
                       : strcmp(o->type, "qwen3_moe") == 0 ? "Qwen3MoeForCausalLM"
                       : strcmp(o->type, "llama") == 0 ? "LlamaForCausalLM" : "Qwen2ForCausalLM";
    json_t *c = json_pack("{s:[s],s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:b,s:s,s:s,s:I}",
                          "architectures", arch, "model_type", o->type,
                          "hidden_size", (json_int_t)o->hidden,
                          "num_hidden_layers", (json_int_t)o->layers,
                          "num_attention_heads", (json_int_t)o->heads,
                          "num_key_value_heads", (json_int_t)o->kv_heads,
                          "head_dim", (json_int_t)o->head_dim,
                          "intermediate_size", (json_int_t)o->inter,
                          "vocab_size", (json_int_t)o->vocab, "rms_norm_eps", o->eps,
                          "tie_word_embeddings", o->tied, "hidden_act", "silu",
                          "torch_dtype", o->dtype == DFL_BF16 ? "bfloat16"
                                         : o->dtype == DFL_F16 ? "float16" : "float32",
                          "max_position_embeddings", (json_int_t)4096);
    if (!c)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    if (strncmp(o->type, "qwen3_5", 7) == 0)
        return write_config_qwen35(o, c, e);
    if (strcmp(o->type, "qwen2") != 0)
        json_object_set_new(c, "attention_bias", json_boolean(o->attn_bias));
    if (strcmp(o->type, "llama") == 0)
        json_object_set_new(c, "mlp_bias", json_boolean(o->mlp_bias));
    if (strcmp(o->type, "qwen3_moe") == 0) {
        json_object_set_new(c, "num_experts", json_integer(o->experts));
        json_object_set_new(c, "num_experts_per_tok", json_integer(o->top_k));
        json_object_set_new(c, "moe_intermediate_size", json_integer(o->moe_inter));
        json_object_set_new(c, "norm_topk_prob", json_true());
        json_object_set_new(c, "decoder_sparse_step", json_integer(1));
        json_object_set_new(c, "mlp_only_layers", json_array());
    }
    if (strcmp(o->type, "qwen2") == 0) {
        json_object_set_new(c, "use_sliding_window", json_false());
        json_object_set_new(c, "sliding_window", json_integer(4096));
    }
    if (strcmp(o->rope_spelling, "params") == 0)
        json_object_set_new(c, "rope_parameters", json_pack("{s:s,s:f}", "rope_type", "default",
                                                            "rope_theta", o->theta));
    else
        json_object_set_new(c, "rope_theta", json_real(o->theta));
    if (o->llama3[0] > 0) { /* as Llama-3.1's published config.json spells it */
        json_object_del(c, "rope_parameters");
        json_object_set_new(c, "rope_theta", json_real(o->theta));
        json_object_set_new(c, "rope_scaling",
                            json_pack("{s:s,s:f,s:f,s:f,s:f}", "rope_type", "llama3", "factor",
                                      o->llama3[0], "low_freq_factor", o->llama3[1],
                                      "high_freq_factor", o->llama3[2],
                                      "original_max_position_embeddings", o->llama3[3]));
    }
    char *path = dfl_path_join(o->out, "config.json");
    int rc = path ? dfl_json_write_file(path, c, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
    free(path);
    json_decref(c);
    return rc;
}

static int write_weights(const opts *o, tensor *ts, int nt, dfl_err *e)
{
    int rc = DFL_OK;
    int64_t shards = o->shards < nt ? o->shards : (nt ? nt : 1);
    json_t *map = json_object();
    uint64_t total = 0;
    for (int64_t s = 0; s < shards && !rc; s++) {
        int lo = (int)(nt * s / shards), hi = (int)(nt * (s + 1) / shards);
        char fname[64];
        if (o->shards > 1)
            snprintf(fname, sizeof fname, "model-%05lld-of-%05lld.safetensors", (long long)s + 1,
                     (long long)shards);
        else
            snprintf(fname, sizeof fname, "model.safetensors");
        dfl_st_writer *w = dfl_st_writer_new();
        if (!w)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        rc = dfl_st_writer_meta(w, "format", "pt", e);
        for (int i = lo; i < hi && !rc; i++) {
            rc = dfl_st_writer_add(w, ts[i].name, o->dtype, ts[i].ndim, ts[i].shape, ts[i].data, e);
            json_object_set_new(map, ts[i].name, json_string(fname));
            total += (uint64_t)ts[i].shape[0] * (uint64_t)(ts[i].ndim >= 2 ? ts[i].shape[ts[i].ndim - 1] : 1) *
                     dfl_dtype_size(o->dtype);
        }
        char *path = dfl_path_join(o->out, fname);
        if (!rc)
            rc = path ? dfl_st_write(w, path, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
        free(path);
        dfl_st_writer_free(w);
    }
    if (!rc && o->shards > 1) {
        json_t *idx = json_pack("{s:{s:I},s:o}", "metadata", "total_size", (json_int_t)total,
                                "weight_map", map);
        map = NULL;
        char *path = dfl_path_join(o->out, "model.safetensors.index.json");
        rc = path && idx ? dfl_json_write_file(path, idx, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
        free(path);
        json_decref(idx);
    }
    json_decref(map);
    return rc;
}

static void usage(void)
{
    printf("Usage: %s -o DIR [OPTION]...\n"
           "Write a small random target model in the Hugging Face layout.\n"
           "  --type qwen3|qwen3_moe|llama|qwen2|qwen3_5|qwen3_5_text|qwen3_5_moe|qwen3_5_moe_text\n"
           "                             model_type (default qwen3); qwen3_5, qwen3_5_moe:\n"
           "                             the multimodal layout (text_config, model.language_model.*,\n"
           "                             a model.visual.* and an mtp.* tensor), *_text: text-only\n"
           "  --lin-k-heads N --lin-v-heads N --lin-k-dim N --lin-v-dim N --conv N\n"
           "                             qwen3_5 linear attention (default 2, 4, 16, 16, 4)\n"
           "  --interval N               qwen3_5: every Nth layer full attention (default 4: written\n"
           "                             as layer_types; otherwise as full_attention_interval)\n"
           "  --experts N --top-k N --moe-intermediate N\n"
           "                             qwen3_moe, qwen3_5_moe: experts (default 4), per token (2),\n"
           "                             width (32)\n"
           "  --shared-intermediate N    qwen3_5_moe: the shared expert's width (default 48)\n"
           "  --rope-llama3 F,LOW,HIGH,ORIG\n"
           "                             rope_scaling rope_type llama3 with factor F, low_freq_factor,\n"
           "                             high_freq_factor, original_max_position_embeddings (and\n"
           "                             rope_theta at the top level; Llama 3.1: 8,1,4,8192)\n"
           "  --hidden N --layers N --heads N --kv-heads N --head-dim N --intermediate N --vocab N\n"
           "                             sizes (default 64, 4, 4, 2, hidden/heads, 128, 256)\n"
           "  --tied                     tie_word_embeddings (no lm_head.weight)\n"
           "  --dtype bf16|f16|f32       weight dtype (default bf16)\n"
           "  --seed N                   random seed (default 1)\n"
           "  --shards N                 split the weights over N files with an index (default 1)\n"
           "  --theta X  --eps X         rope theta (default 1e6), rms_norm_eps (default 1e-6)\n"
           "  --rope-spelling top|params rope_theta at the top level or in rope_parameters\n"
           "                             (default: params for qwen3, top otherwise)\n"
           "  --attention-bias           attention_bias true (llama, qwen3; qwen2 always has q/k/v biases)\n"
           "  --mlp-bias                 mlp_bias true (llama)\n"
           "  --omit NAME                leave tensor NAME out (repeatable)\n"
           "  --wrong-shape NAME         write tensor NAME with one row too many (repeatable)\n"
           "  --no-layers                no layer tensors (config.json still says --layers): only\n"
           "                             the embedding, final norm and LM head, for a drafter\n",
           dfl_progname);
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    opts o = {.type = "qwen3", .hidden = 64, .layers = 4, .heads = 4, .kv_heads = 2, .inter = 128,
              .vocab = 256, .shards = 1, .seed = 1, .theta = 1e6, .eps = 1e-6, .dtype = DFL_BF16,
              .lin_k_heads = 2, .lin_v_heads = 4, .lin_k_dim = 16, .lin_v_dim = 16, .conv = 4,
              .interval = 4, .experts = 4, .top_k = 2, .moe_inter = 32, .shared_inter = 48};
    static const struct option lo[] = {
        {"type", 1, 0, 't'}, {"hidden", 1, 0, 'H'}, {"layers", 1, 0, 'L'}, {"heads", 1, 0, 'A'},
        {"kv-heads", 1, 0, 'K'}, {"head-dim", 1, 0, 'D'}, {"intermediate", 1, 0, 'I'},
        {"vocab", 1, 0, 'V'}, {"tied", 0, 0, 'T'}, {"dtype", 1, 0, 'y'}, {"seed", 1, 0, 's'},
        {"shards", 1, 0, 'S'}, {"theta", 1, 0, 'r'}, {"eps", 1, 0, 'e'},
        {"rope-spelling", 1, 0, 'R'}, {"attention-bias", 0, 0, 'b'}, {"mlp-bias", 0, 0, 'M'},
        {"omit", 1, 0, 'x'}, {"wrong-shape", 1, 0, 'w'}, {"output", 1, 0, 'o'},
        {"no-layers", 0, 0, 'N'}, {"lin-k-heads", 1, 0, 1000}, {"lin-v-heads", 1, 0, 1001},
        {"lin-k-dim", 1, 0, 1002}, {"lin-v-dim", 1, 0, 1003}, {"conv", 1, 0, 1004},
        {"interval", 1, 0, 1005},
        {"no-layers", 0, 0, 'N'}, {"experts", 1, 0, 'E'}, {"top-k", 1, 0, 'k'},
        {"moe-intermediate", 1, 0, 'm'}, {"shared-intermediate", 1, 0, 1006},
        {"rope-llama3", 1, 0, 1007},
        {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    dfl_err e = {0};
    int c;
    int64_t v;
    while ((c = getopt_long(argc, argv, "o:", lo, NULL)) != -1) {
        int64_t *dst = NULL;
        switch (c) {
        case 't': o.type = optarg; break;
        case 'H': dst = &o.hidden; break;
        case 'L': dst = &o.layers; break;
        case 'A': dst = &o.heads; break;
        case 'K': dst = &o.kv_heads; break;
        case 'D': dst = &o.head_dim; break;
        case 'I': dst = &o.inter; break;
        case 'V': dst = &o.vocab; break;
        case 'S': dst = &o.shards; break;
        case 'E': dst = &o.experts; break;
        case 'k': dst = &o.top_k; break;
        case 'm': dst = &o.moe_inter; break;
        case 'T': o.tied = true; break;
        case 'y': o.dtype = dfl_dtype_from_name(optarg); break;
        case 's':
            if (dfl_parse_i64(optarg, 0, INT64_MAX, &v, "--seed", &e))
                return dfl_cli_report(&e);
            o.seed = (uint64_t)v;
            break;
        case 'r':
            if (dfl_parse_double(optarg, &o.theta, "--theta", &e))
                return dfl_cli_report(&e);
            break;
        case 'e':
            if (dfl_parse_double(optarg, &o.eps, "--eps", &e))
                return dfl_cli_report(&e);
            break;
        case 'R': o.rope_spelling = optarg; break;
        case 'b': o.attn_bias = true; break;
        case 'M': o.mlp_bias = true; break;
        case 'N': o.no_layers = true; break;
        case 1000: dst = &o.lin_k_heads; break;
        case 1001: dst = &o.lin_v_heads; break;
        case 1002: dst = &o.lin_k_dim; break;
        case 1003: dst = &o.lin_v_dim; break;
        case 1004: dst = &o.conv; break;
        case 1005: dst = &o.interval; break;
        case 1006: dst = &o.shared_inter; break;
        case 1007: {
            char tail;
            double *r = o.llama3;
            if (sscanf(optarg, "%lf,%lf,%lf,%lf%c", &r[0], &r[1], &r[2], &r[3], &tail) != 4 ||
                !(r[0] > 0 && r[1] > 0 && r[2] > r[1] && r[3] >= 1))
                return dfl_cli_usage_error("--rope-llama3: '%s' is not FACTOR,LOW,HIGH,ORIGINAL "
                                           "(positive, HIGH > LOW)", optarg);
            break;
        }
        case 'x':
            if (o.n_omit < 16)
                o.omit[o.n_omit++] = optarg;
            break;
        case 'w':
            if (o.n_wrong < 16)
                o.wrong[o.n_wrong++] = optarg;
            break;
        case 'o': o.out = optarg; break;
        case 'h': usage(); return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
        if (dst && dfl_parse_i64(optarg, 1, 1 << 20, dst, "size", &e))
            return dfl_cli_report(&e);
    }
    if (!o.out)
        return dfl_cli_usage_error("-o DIR is required");
    bool moe35 = strcmp(o.type, "qwen3_5_moe") == 0 || strcmp(o.type, "qwen3_5_moe_text") == 0;
    bool moe = strcmp(o.type, "qwen3_moe") == 0 || moe35;
    if (strcmp(o.type, "qwen3") && strcmp(o.type, "llama") && strcmp(o.type, "qwen2") && !moe &&
        strcmp(o.type, "qwen3_5") && strcmp(o.type, "qwen3_5_text"))
        return dfl_cli_usage_error("--type: '%s' is not qwen3, qwen3_moe, llama, qwen2, qwen3_5, "
                                   "qwen3_5_text, qwen3_5_moe or qwen3_5_moe_text", o.type);
    if (moe && o.top_k > o.experts)
        return dfl_cli_usage_error("--top-k: more than --experts");
    bool hybrid = strncmp(o.type, "qwen3_5", 7) == 0;
    bool wrapped = strcmp(o.type, "qwen3_5") == 0 || strcmp(o.type, "qwen3_5_moe") == 0;
    if (o.dtype != DFL_BF16 && o.dtype != DFL_F16 && o.dtype != DFL_F32)
        return dfl_cli_usage_error("--dtype: bf16, f16 or f32");
    if (!o.head_dim)
        o.head_dim = o.hidden / o.heads;
    if (!o.rope_spelling)
        o.rope_spelling = strcmp(o.type, "qwen3") == 0 || moe ? "params" : "top";
    bool qwen3 = strcmp(o.type, "qwen3") == 0 || (moe && !moe35), qwen2 = strcmp(o.type, "qwen2") == 0;
    bool llama = strcmp(o.type, "llama") == 0;
    bool qkv_bias = qwen2 || o.attn_bias, o_bias = !qwen2 && o.attn_bias, mlp_bias = llama && o.mlp_bias;
    int64_t H = o.hidden, d = o.head_dim, nq = o.heads * d, nkv = o.kv_heads * d, I = o.inter;

    int cap = (int)(o.layers * (24 + (moe ? 3 * o.experts + 1 : 0)) + 8);
    tensor *ts = calloc((size_t)cap, sizeof *ts);
    int nt = 0, rc = 0;
    if (!ts)
        return dfl_cli_report(&(dfl_err){DFL_ENOMEM, "out of memory"});
    char name[128];
#define ADD(nd, a, b, mean, std, ...)                                                    \
    do {                                                                                 \
        snprintf(name, sizeof name, __VA_ARGS__);                                        \
        if (!rc)                                                                         \
            rc = add(ts, &nt, &o, name, nd, a, b, mean, std, &e);                        \
    } while (0)
    /* qwen3_5's norms are zero-centred (weights around 0: out = rmsnorm(x) (1 + w)) */
    const char *mp = wrapped ? "model.language_model" : "model";
    float nmean = hybrid ? 0.0f : 1.0f;
    ADD(2, o.vocab, H, 0.0f, 1.0f, "%s.embed_tokens.weight", mp);
    ADD(1, H, 0, nmean, 0.1f, "%s.norm.weight", mp);
    if (!o.tied)
        ADD(2, o.vocab, H, 0.0f, 0.05f, "lm_head.weight");
    if (wrapped) { /* present in the published checkpoints; dfl-target must not read them */
        ADD(2, 8, 8, 0.0f, 0.05f, "model.visual.patch_embed.proj.weight");
        ADD(2, H, 2 * H, 0.0f, 0.05f, "mtp.fc.weight");
    }
    int64_t kd = o.lin_k_heads * o.lin_k_dim, vd = o.lin_v_heads * o.lin_v_dim;
    for (int64_t l = 0; l < (o.no_layers ? 0 : o.layers); l++) {
        char p[64];
        snprintf(p, sizeof p, "%s.layers", mp);
        long long L = (long long)l;
        ADD(1, H, 0, nmean, 0.1f, "%s.%lld.input_layernorm.weight", p, L);
        ADD(1, H, 0, nmean, 0.1f, "%s.%lld.post_attention_layernorm.weight", p, L);
        if (hybrid && !is_full(&o, l)) {
            ADD(2, 2 * kd + vd, H, 0.0f, 0.05f, "%s.%lld.linear_attn.in_proj_qkv.weight", p, L);
            ADD(2, vd, H, 0.0f, 0.05f, "%s.%lld.linear_attn.in_proj_z.weight", p, L);
            ADD(2, o.lin_v_heads, H, 0.0f, 0.05f, "%s.%lld.linear_attn.in_proj_b.weight", p, L);
            ADD(2, o.lin_v_heads, H, 0.0f, 0.05f, "%s.%lld.linear_attn.in_proj_a.weight", p, L);
            ADD(3, 2 * kd + vd, o.conv, 0.0f, 0.3f, "%s.%lld.linear_attn.conv1d.weight", p, L);
            ADD(1, o.lin_v_heads, 0, 0.5f, 0.5f, "%s.%lld.linear_attn.A_log", p, L);
            ADD(1, o.lin_v_heads, 0, 0.0f, 0.5f, "%s.%lld.linear_attn.dt_bias", p, L);
            ADD(1, o.lin_v_dim, 0, 1.0f, 0.1f, "%s.%lld.linear_attn.norm.weight", p, L);
            ADD(2, H, vd, 0.0f, 0.05f, "%s.%lld.linear_attn.out_proj.weight", p, L);
            goto mlp;
        }
        ADD(2, hybrid ? 2 * nq : nq, H, 0.0f, 0.05f, "%s.%lld.self_attn.q_proj.weight", p, L);
        ADD(2, nkv, H, 0.0f, 0.05f, "%s.%lld.self_attn.k_proj.weight", p, L);
        ADD(2, nkv, H, 0.0f, 0.05f, "%s.%lld.self_attn.v_proj.weight", p, L);
        ADD(2, H, nq, 0.0f, 0.05f, "%s.%lld.self_attn.o_proj.weight", p, L);
        if (qkv_bias) {
            ADD(1, nq, 0, 0.0f, 0.1f, "%s.%lld.self_attn.q_proj.bias", p, L);
            ADD(1, nkv, 0, 0.0f, 0.1f, "%s.%lld.self_attn.k_proj.bias", p, L);
            ADD(1, nkv, 0, 0.0f, 0.1f, "%s.%lld.self_attn.v_proj.bias", p, L);
        }
        if (o_bias)
            ADD(1, H, 0, 0.0f, 0.1f, "%s.%lld.self_attn.o_proj.bias", p, L);
        if (qwen3 || hybrid) {
            ADD(1, d, 0, nmean, 0.1f, "%s.%lld.self_attn.q_norm.weight", p, L);
            ADD(1, d, 0, nmean, 0.1f, "%s.%lld.self_attn.k_norm.weight", p, L);
        }
    mlp:
        if (moe) {
            int64_t Im = o.moe_inter;
            ADD(2, o.experts, H, 0.0f, 0.2f, "%s.%lld.mlp.gate.weight", p, L);
            for (int64_t x = 0; x < o.experts; x++) {
                ADD(2, Im, H, 0.0f, 0.05f, "%s.%lld.mlp.experts.%lld.gate_proj.weight", p, L, (long long)x);
                ADD(2, Im, H, 0.0f, 0.05f, "%s.%lld.mlp.experts.%lld.up_proj.weight", p, L, (long long)x);
                ADD(2, H, Im, 0.0f, 0.05f, "%s.%lld.mlp.experts.%lld.down_proj.weight", p, L, (long long)x);
            }
            if (moe35) {
                int64_t Is = o.shared_inter;
                ADD(2, Is, H, 0.0f, 0.05f, "%s.%lld.mlp.shared_expert.gate_proj.weight", p, L);
                ADD(2, Is, H, 0.0f, 0.05f, "%s.%lld.mlp.shared_expert.up_proj.weight", p, L);
                ADD(2, H, Is, 0.0f, 0.05f, "%s.%lld.mlp.shared_expert.down_proj.weight", p, L);
                ADD(2, 1, H, 0.0f, 0.2f, "%s.%lld.mlp.shared_expert_gate.weight", p, L);
            }
        } else {
            ADD(2, I, H, 0.0f, 0.05f, "%s.%lld.mlp.gate_proj.weight", p, L);
            ADD(2, I, H, 0.0f, 0.05f, "%s.%lld.mlp.up_proj.weight", p, L);
            ADD(2, H, I, 0.0f, 0.05f, "%s.%lld.mlp.down_proj.weight", p, L);
        }
        if (mlp_bias) {
            ADD(1, I, 0, 0.0f, 0.1f, "%s.%lld.mlp.gate_proj.bias", p, L);
            ADD(1, I, 0, 0.0f, 0.1f, "%s.%lld.mlp.up_proj.bias", p, L);
            ADD(1, H, 0, 0.0f, 0.1f, "%s.%lld.mlp.down_proj.bias", p, L);
        }
    }
#undef ADD
    if (!rc)
        rc = dfl_mkdir_p(o.out, 0755, &e);
    if (!rc)
        rc = write_config(&o, &e);
    if (!rc)
        rc = write_weights(&o, ts, nt, &e);
    for (int i = 0; i < nt; i++)
        free(ts[i].data);
    free(ts);
    return rc ? dfl_cli_report(&e) : 0;
}
