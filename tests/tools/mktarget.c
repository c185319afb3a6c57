/* mktarget: writes a small random target model (qwen3, llama, qwen2, or qwen3_5: a Qwen3.5/3.6
 * hybrid in the published layout, Qwen3_5ForConditionalGeneration with text_config, weights
 * under model.language_model.*, lm_head.weight, a model.visual.* and an mtp.* tensor that loaders
 * skip; 3 Gated DeltaNet layers then 1 gated full-attention layer, repeated) in the Hugging Face layout
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
    t->shape[1] = d1;
    t->shape[2] = 4;   /* ndim 3: the conv1d weight [channels, 1, 4] (d1 = 1) */
    size_t n = (size_t)t->shape[0] * (size_t)(ndim >= 2 ? d1 : 1) * (size_t)(ndim == 3 ? 4 : 1);
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

/* The fields every family's (text) config has: model_type and the sizes. */
static json_t *sizes_config(const opts *o, const char *model_type)
{
    return json_pack("{s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:b,s:s}", "model_type", model_type,
                     "hidden_size", (json_int_t)o->hidden, "num_hidden_layers", (json_int_t)o->layers,
                     "num_attention_heads", (json_int_t)o->heads,
                     "num_key_value_heads", (json_int_t)o->kv_heads,
                     "head_dim", (json_int_t)o->head_dim, "intermediate_size", (json_int_t)o->inter,
                     "vocab_size", (json_int_t)o->vocab, "rms_norm_eps", o->eps,
                     "tie_word_embeddings", o->tied, "hidden_act", "silu");
}

/* Qwen3.5 sizes of the tiny hybrid (QWEN35.md): linear-attention heads of head_dim, 2 key and
 * 4 value heads, conv kernel 4; every 4th layer is full attention. */
#define Q35_LK 2
#define Q35_LV 4
static json_t *qwen35_config(const opts *o)
{
    json_t *lt = json_array();
    for (int64_t l = 0; l < o->layers; l++)
        json_array_append_new(lt, json_string((l + 1) % 4 == 0 ? "full_attention" : "linear_attention"));
    json_t *tc = sizes_config(o, "qwen3_5_text");
    json_t *more = json_pack("{s:o,s:I,s:I,s:I,s:I,s:I,s:f,s:I,s:b,s:b}",
                           "layer_types", lt, "linear_conv_kernel_dim", (json_int_t)4,
                           "linear_key_head_dim", (json_int_t)o->head_dim,
                           "linear_value_head_dim", (json_int_t)o->head_dim,
                           "linear_num_key_heads", (json_int_t)Q35_LK,
                           "linear_num_value_heads", (json_int_t)Q35_LV,
                           "partial_rotary_factor", 0.25,
                           "max_position_embeddings", (json_int_t)8192,
                           "attention_bias", false, "attn_output_gate", true);
    if (!tc || !more || json_object_update(tc, more)) {
        json_decref(tc);
        json_decref(more);
        return NULL;
    }
    json_decref(more);
    json_object_set_new(tc, "rope_parameters",
                        json_pack("{s:s,s:f,s:f,s:[i,i,i],s:b}", "rope_type", "default",
                                  "rope_theta", o->theta, "partial_rotary_factor", 0.25,
                                  "mrope_section", 1, 1, 0, "mrope_interleaved", true));
    return json_pack("{s:[s],s:s,s:s,s:b,s:o,s:{s:s,s:i,s:i},s:i,s:i}",
                     "architectures", "Qwen3_5ForConditionalGeneration", "model_type", "qwen3_5",
                     "dtype", o->dtype == DFL_BF16 ? "bfloat16" : o->dtype == DFL_F16 ? "float16" : "float32",
                     "tie_word_embeddings", o->tied, "text_config", tc,
                     "vision_config", "model_type", "qwen3_5", "hidden_size", 16, "depth", 1,
                     "image_token_id", 248056, "video_token_id", 248057);
}

/* Writes c (taken) to OUT/config.json. */
static int write_json(const opts *o, json_t *c, dfl_err *e)
{
    char *path = dfl_path_join(o->out, "config.json");
    int rc = c && path ? dfl_json_write_file(path, c, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
    free(path);
    json_decref(c);
    return rc;
}

static int write_config(const opts *o, dfl_err *e)
{
    if (strcmp(o->type, "qwen3_5") == 0)
        return write_json(o, qwen35_config(o), e);
    const char *arch = strcmp(o->type, "qwen3") == 0 ? "Qwen3ForCausalLM"
                       : strcmp(o->type, "llama") == 0 ? "LlamaForCausalLM" : "Qwen2ForCausalLM";
    json_t *c = sizes_config(o, o->type);
    if (!c)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    json_object_set_new(c, "architectures", json_pack("[s]", arch));
    json_object_set_new(c, "torch_dtype", json_string(o->dtype == DFL_BF16 ? "bfloat16"
                                                      : o->dtype == DFL_F16 ? "float16" : "float32"));
    json_object_set_new(c, "max_position_embeddings", json_integer(4096));
    if (strcmp(o->type, "qwen2") != 0)
        json_object_set_new(c, "attention_bias", json_boolean(o->attn_bias));
    if (strcmp(o->type, "llama") == 0)
        json_object_set_new(c, "mlp_bias", json_boolean(o->mlp_bias));
    if (strcmp(o->type, "qwen2") == 0) {
        json_object_set_new(c, "use_sliding_window", json_false());
        json_object_set_new(c, "sliding_window", json_integer(4096));
    }
    if (strcmp(o->rope_spelling, "params") == 0)
        json_object_set_new(c, "rope_parameters", json_pack("{s:s,s:f}", "rope_type", "default",
                                                            "rope_theta", o->theta));
    else
        json_object_set_new(c, "rope_theta", json_real(o->theta));
    return write_json(o, c, e);
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
            total += (uint64_t)ts[i].shape[0] * (uint64_t)(ts[i].ndim >= 2 ? ts[i].shape[1] : 1) *
                     (uint64_t)(ts[i].ndim == 3 ? ts[i].shape[2] : 1) * dfl_dtype_size(o->dtype);
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

/* The published Qwen3.5 tensors (QWEN35.md section 1): norms are zero-centred (1 + w: mean 0)
 * except the Gated DeltaNet output norm (w: mean 1). */
static int qwen35_tensors(tensor *ts, int *nt, const opts *o, dfl_err *e)
{
    const int64_t H = o->hidden, d = o->head_dim, nq = o->heads * d, nkv = o->kv_heads * d, I = o->inter;
    const int64_t kd = Q35_LK * d, vd = Q35_LV * d;
    char name[160];
    int rc = 0;
#define ADDQ(nd, a, b, mean, std, ...)                                                   \
    do {                                                                                 \
        snprintf(name, sizeof name, __VA_ARGS__);                                        \
        if (!rc)                                                                         \
            rc = add(ts, nt, o, name, nd, a, b, mean, std, e);                           \
    } while (0)
    const char *p = "model.language_model";
    ADDQ(2, o->vocab, H, 0.0f, 1.0f, "%s.embed_tokens.weight", p);
    ADDQ(1, H, 0, 0.0f, 0.1f, "%s.norm.weight", p);
    if (!o->tied)
        ADDQ(2, o->vocab, H, 0.0f, 0.05f, "lm_head.weight");
    ADDQ(2, 16, 12, 0.0f, 0.05f, "model.visual.patch_embed.proj.weight");
    ADDQ(2, H, 2 * H, 0.0f, 0.05f, "mtp.fc.weight");
    for (int64_t l = 0; l < (o->no_layers ? 0 : o->layers); l++) {
        long long L = (long long)l;
        ADDQ(1, H, 0, 0.0f, 0.1f, "%s.layers.%lld.input_layernorm.weight", p, L);
        ADDQ(1, H, 0, 0.0f, 0.1f, "%s.layers.%lld.post_attention_layernorm.weight", p, L);
        if ((l + 1) % 4 == 0) {
            ADDQ(2, 2 * nq, H, 0.0f, 0.05f, "%s.layers.%lld.self_attn.q_proj.weight", p, L);
            ADDQ(2, nkv, H, 0.0f, 0.05f, "%s.layers.%lld.self_attn.k_proj.weight", p, L);
            ADDQ(2, nkv, H, 0.0f, 0.05f, "%s.layers.%lld.self_attn.v_proj.weight", p, L);
            ADDQ(2, H, nq, 0.0f, 0.05f, "%s.layers.%lld.self_attn.o_proj.weight", p, L);
            ADDQ(1, d, 0, 0.0f, 0.1f, "%s.layers.%lld.self_attn.q_norm.weight", p, L);
            ADDQ(1, d, 0, 0.0f, 0.1f, "%s.layers.%lld.self_attn.k_norm.weight", p, L);
        } else {
            ADDQ(2, 2 * kd + vd, H, 0.0f, 0.05f, "%s.layers.%lld.linear_attn.in_proj_qkv.weight", p, L);
            ADDQ(2, vd, H, 0.0f, 0.05f, "%s.layers.%lld.linear_attn.in_proj_z.weight", p, L);
            ADDQ(2, Q35_LV, H, 0.0f, 0.05f, "%s.layers.%lld.linear_attn.in_proj_b.weight", p, L);
            ADDQ(2, Q35_LV, H, 0.0f, 0.05f, "%s.layers.%lld.linear_attn.in_proj_a.weight", p, L);
            ADDQ(2, H, vd, 0.0f, 0.05f, "%s.layers.%lld.linear_attn.out_proj.weight", p, L);
            ADDQ(3, 2 * kd + vd, 1, 0.0f, 0.2f, "%s.layers.%lld.linear_attn.conv1d.weight", p, L);
            ADDQ(1, Q35_LV, 0, 0.5f, 0.3f, "%s.layers.%lld.linear_attn.A_log", p, L);
            ADDQ(1, Q35_LV, 0, 1.0f, 0.2f, "%s.layers.%lld.linear_attn.dt_bias", p, L);
            ADDQ(1, d, 0, 1.0f, 0.1f, "%s.layers.%lld.linear_attn.norm.weight", p, L);
        }
        ADDQ(2, I, H, 0.0f, 0.05f, "%s.layers.%lld.mlp.gate_proj.weight", p, L);
        ADDQ(2, I, H, 0.0f, 0.05f, "%s.layers.%lld.mlp.up_proj.weight", p, L);
        ADDQ(2, H, I, 0.0f, 0.05f, "%s.layers.%lld.mlp.down_proj.weight", p, L);
    }
#undef ADDQ
    return rc;
}

static void usage(void)
{
    printf("Usage: %s -o DIR [OPTION]...\n"
           "Write a small random target model in the Hugging Face layout.\n"
           "  --type qwen3|llama|qwen2|qwen3_5  model_type (default qwen3; qwen3_5: the published\n"
           "                             Qwen3.5/3.6 layout, hybrid layers, text_config)\n"
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
              .vocab = 256, .shards = 1, .seed = 1, .theta = 1e6, .eps = 1e-6, .dtype = DFL_BF16};
    static const struct option lo[] = {
        {"type", 1, 0, 't'}, {"hidden", 1, 0, 'H'}, {"layers", 1, 0, 'L'}, {"heads", 1, 0, 'A'},
        {"kv-heads", 1, 0, 'K'}, {"head-dim", 1, 0, 'D'}, {"intermediate", 1, 0, 'I'},
        {"vocab", 1, 0, 'V'}, {"tied", 0, 0, 'T'}, {"dtype", 1, 0, 'y'}, {"seed", 1, 0, 's'},
        {"shards", 1, 0, 'S'}, {"theta", 1, 0, 'r'}, {"eps", 1, 0, 'e'},
        {"rope-spelling", 1, 0, 'R'}, {"attention-bias", 0, 0, 'b'}, {"mlp-bias", 0, 0, 'M'},
        {"omit", 1, 0, 'x'}, {"wrong-shape", 1, 0, 'w'}, {"output", 1, 0, 'o'},
        {"no-layers", 0, 0, 'N'},
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
    if (strcmp(o.type, "qwen3") && strcmp(o.type, "llama") && strcmp(o.type, "qwen2") &&
        strcmp(o.type, "qwen3_5"))
        return dfl_cli_usage_error("--type: '%s' is not qwen3, llama, qwen2 or qwen3_5", o.type);
    if (o.dtype != DFL_BF16 && o.dtype != DFL_F16 && o.dtype != DFL_F32)
        return dfl_cli_usage_error("--dtype: bf16, f16 or f32");
    if (!o.head_dim)
        o.head_dim = o.hidden / o.heads;
    if (!o.rope_spelling)
        o.rope_spelling = strcmp(o.type, "qwen3") == 0 ? "params" : "top";
    bool qwen3 = strcmp(o.type, "qwen3") == 0, qwen2 = strcmp(o.type, "qwen2") == 0;
    bool llama = strcmp(o.type, "llama") == 0;
    bool qkv_bias = qwen2 || o.attn_bias, o_bias = !qwen2 && o.attn_bias, mlp_bias = llama && o.mlp_bias;
    int64_t H = o.hidden, d = o.head_dim, nq = o.heads * d, nkv = o.kv_heads * d, I = o.inter;

    int cap = (int)(o.layers * 20 + 4);
    tensor *ts = calloc((size_t)cap, sizeof *ts);
    int nt = 0, rc = 0;
    if (!ts)
        return dfl_cli_report(&(dfl_err){DFL_ENOMEM, "out of memory"});
    char name[128];
    if (strcmp(o.type, "qwen3_5") == 0) {
        rc = qwen35_tensors(ts, &nt, &o, &e);
        goto write;
    }
#define ADD(nd, a, b, mean, std, ...)                                                    \
    do {                                                                                 \
        snprintf(name, sizeof name, __VA_ARGS__);                                        \
        if (!rc)                                                                         \
            rc = add(ts, &nt, &o, name, nd, a, b, mean, std, &e);                        \
    } while (0)
    ADD(2, o.vocab, H, 0.0f, 1.0f, "model.embed_tokens.weight");
    ADD(1, H, 0, 1.0f, 0.1f, "model.norm.weight");
    if (!o.tied)
        ADD(2, o.vocab, H, 0.0f, 0.05f, "lm_head.weight");
    for (int64_t l = 0; l < (o.no_layers ? 0 : o.layers); l++) {
        const char *p = "model.layers";
        long long L = (long long)l;
        ADD(1, H, 0, 1.0f, 0.1f, "%s.%lld.input_layernorm.weight", p, L);
        ADD(1, H, 0, 1.0f, 0.1f, "%s.%lld.post_attention_layernorm.weight", p, L);
        ADD(2, nq, H, 0.0f, 0.05f, "%s.%lld.self_attn.q_proj.weight", p, L);
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
        if (qwen3) {
            ADD(1, d, 0, 1.0f, 0.1f, "%s.%lld.self_attn.q_norm.weight", p, L);
            ADD(1, d, 0, 1.0f, 0.1f, "%s.%lld.self_attn.k_norm.weight", p, L);
        }
        ADD(2, I, H, 0.0f, 0.05f, "%s.%lld.mlp.gate_proj.weight", p, L);
        ADD(2, I, H, 0.0f, 0.05f, "%s.%lld.mlp.up_proj.weight", p, L);
        ADD(2, H, I, 0.0f, 0.05f, "%s.%lld.mlp.down_proj.weight", p, L);
        if (mlp_bias) {
            ADD(1, I, 0, 0.0f, 0.1f, "%s.%lld.mlp.gate_proj.bias", p, L);
            ADD(1, I, 0, 0.0f, 0.1f, "%s.%lld.mlp.up_proj.bias", p, L);
            ADD(1, H, 0, 0.0f, 0.1f, "%s.%lld.mlp.down_proj.bias", p, L);
        }
    }
#undef ADD
write:
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
