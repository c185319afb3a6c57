/* hfmodel.h: Hugging Face model directories for the target: config.json parsing for the
 * decoder families we run (dense qwen3, llama, qwen2; mixture-of-experts qwen3_moe; hybrid
 * qwen3_5 / qwen3_5_text: Gated DeltaNet and gated full attention; hybrid with
 * mixture-of-experts MLPs and a shared expert: qwen3_5_moe / qwen3_5_moe_text) into one struct, with a clear error naming any
 * configuration feature we do not implement, and the model fingerprint (config + tensor table)
 * that ties a hidden-state stream to the target that produced it. */
#ifndef DFL_HFMODEL_H
#define DFL_HFMODEL_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "err.h"
#include "rope.h"
#include "safetensors.h"

typedef enum dfl_hf_arch {
    DFL_HF_QWEN3 = 1, DFL_HF_LLAMA = 2, DFL_HF_QWEN2 = 3,
    DFL_HF_QWEN35 = 4,     /* qwen3_5 (text_config) or qwen3_5_text: Qwen3.5 / Qwen3.6; also
                              qwen3_5_moe / qwen3_5_moe_text (n_experts > 0) */
    DFL_HF_QWEN3_MOE = 5,  /* qwen3 attention, mixture-of-experts MLPs */
} dfl_hf_arch;

/* What a decoder layer's token mixer is. */
typedef enum dfl_layer_kind {
    DFL_LAYER_ATTN = 0,        /* dense causal attention (qwen3, llama, qwen2) */
    DFL_LAYER_GATED_ATTN = 1,  /* qwen3_5 full_attention: q_proj gives [query | gate] per head,
                                  output * sigmoid(gate) before o_proj, partial RoPE */
    DFL_LAYER_GDN = 2          /* qwen3_5 linear_attention: Gated DeltaNet */
} dfl_layer_kind;

#define DFL_HF_MAX_LAYERS 4096 /* num_hidden_layers at most */

typedef struct dfl_hf_config {
    dfl_hf_arch arch;
    char model_type[32];         /* "qwen3", "llama", "qwen2", "qwen3_moe", "qwen3_5",
                                  * "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text" */
    int64_t hidden_size;         /* H */
    int64_t n_layers;            /* num_hidden_layers */
    int64_t n_heads;             /* num_attention_heads */
    int64_t n_kv_heads;          /* num_key_value_heads (default n_heads) */
    int64_t head_dim;            /* d (default H / n_heads) */
    int64_t intermediate_size;   /* I */
    int64_t vocab_size;          /* V */
    double rms_norm_eps;         /* default 1e-6 */
    double rope_theta;           /* rope_theta or rope_parameters.rope_theta; default 10000 */
    dfl_rope_scaling rope;       /* rope_scaling / rope_parameters: rope_type and its fields */
    dfl_dtype dtype;             /* "dtype" (transformers 5) or "torch_dtype": the dtype the
                                  * model is loaded in by default; DFL_DT_INVALID if absent */
    bool tie_word_embeddings;
    bool qk_norm;                /* per-head q/k RMSNorm (qwen3) */
    bool qkv_bias;               /* q/k/v projections have biases (qwen2; attention_bias) */
    bool o_bias;                 /* o_proj has a bias (llama/qwen3 attention_bias) */
    bool mlp_bias;               /* gate/up/down have biases (llama mlp_bias) */
    /* mixture of experts (qwen3_moe, qwen3_5_moe; 0 otherwise): a sparse layer's MLP is a router
     * mlp.gate [E, H] and E SwiGLU experts mlp.experts.N.{gate,up,down}_proj of width
     * moe_intermediate; each token takes the top_k experts of softmax(router logits).
     * qwen3_5_moe adds a shared expert: a SwiGLU MLP mlp.shared_expert.{gate,up,down}_proj of
     * width shared_intermediate, its output times sigmoid(mlp.shared_expert_gate x) (a [1, H]
     * Linear) added to the experts' sum. */
    int64_t n_experts;           /* num_experts (or num_local_experts) */
    int64_t top_k;               /* num_experts_per_tok */
    int64_t moe_intermediate;    /* moe_intermediate_size */
    int64_t sparse_step;         /* decoder_sparse_step (default 1) */
    bool norm_topk_prob;         /* renormalise the top_k probabilities to sum to 1 */
    int64_t shared_intermediate; /* shared_expert_intermediate_size (qwen3_5_moe; 0: none) */
    uint64_t mlp_only[DFL_HF_MAX_LAYERS / 64]; /* mlp_only_layers as a bit set: dense layers */

    /* qwen3_5 (all zero / false for the dense families): */
    bool norm_1p;                /* zero-centred RMSNorms: out = rmsnorm(x) * (1 + w) for the
                                  * decoder norms, the final norm and q_norm / k_norm */
    int64_t rot_dim;             /* RoPE on the first rot_dim dims of each head (head_dim *
                                  * partial_rotary_factor); head_dim for the dense families */
    int64_t lin_k_heads, lin_k_dim;   /* linear_num_key_heads, linear_key_head_dim */
    int64_t lin_v_heads, lin_v_dim;   /* linear_num_value_heads, linear_value_head_dim */
    int64_t lin_conv;                 /* linear_conv_kernel_dim */
    int64_t n_linear;                 /* layers of kind DFL_LAYER_GDN */
    uint8_t layer_kind[DFL_HF_MAX_LAYERS]; /* dfl_layer_kind of layer i < n_layers */
} dfl_hf_config;

/* "attention", "gated attention", "gated deltanet". */
const char *dfl_layer_kind_name(int kind);

/* Whether layer l has a mixture-of-experts MLP (as transformers' Qwen3MoeDecoderLayer decides:
 * not in mlp_only_layers and (l + 1) a multiple of decoder_sparse_step). */
bool dfl_hf_layer_is_moe(const dfl_hf_config *c, int64_t l);

/* Parses a config.json object. what names it in messages (the file path). A qwen3_5 config is
 * read from its text_config (what then names "FILE: text_config"); its layer kinds come from
 * layer_types or, absent, full_attention_interval (default 4). Unsupported features (rope types
 * other than default, linear, llama3 and yarn, sliding window in use, layer types other than
 * full and (qwen3_5) linear attention, MoE keys outside qwen3_moe and qwen3_5_moe, a shared expert
 * in qwen3_moe, activations other than silu,
 * quantized weights) are DFL_EUNSUP naming the key; missing or invalid values (a rope type or a
 * MoE model without its fields) are DFL_EDATA naming the key. */
int dfl_hf_config_parse(const json_t *cfg, const char *what, dfl_hf_config *c, dfl_err *e);
/* Loads DIR/config.json (*json receives the parsed object if json is non-NULL; caller frees with
 * json_decref) and parses it. */
int dfl_hf_config_load(const char *dir, dfl_hf_config *c, json_t **json, dfl_err *e);

/* What a DFlash drafter needs of its target (dfl-draft --target), whatever dfl-target supports
 * of the rest: sizes for the drafter's defaults, and the names of the frozen embedding and LM
 * head. Qwen3.5 / Qwen3.6 checkpoints (Qwen3_5ForConditionalGeneration: the text model's config
 * under text_config, weights under model.language_model.*, lm_head.weight at the top) and
 * text-only qwen3_5_text / qwen3_5_moe_text configs are read here; every other config goes
 * through dfl_hf_config_parse (the families dfl-target runs). */
typedef struct dfl_hf_drafter_target {
    char model_type[32];         /* of the text model */
    int64_t hidden_size, vocab_size, n_layers;
    int64_t n_heads, n_kv_heads, head_dim;   /* of the target's (full) attention layers */
    int64_t intermediate_size;   /* 0 when the config has none (MoE) */
    double rms_norm_eps, rope_theta;
    int64_t max_position;        /* 0: not given */
    int64_t bos_token_id, eos_token_id;      /* -1: not given */
    bool tie_word_embeddings;
    char embed_name[64];         /* e.g. model.embed_tokens.weight */
    char lm_head_name[64];       /* lm_head.weight (the embedding when tied and absent) */
} dfl_hf_drafter_target;
int dfl_hf_drafter_target_parse(const json_t *cfg, const char *what, dfl_hf_drafter_target *t,
                                dfl_err *e);
/* Loads DIR/config.json into *t, and the model's fingerprint (dfl_hf_fingerprint_of of the raw
 * config and the tensor table) into fp when fp is non-NULL. */
int dfl_hf_drafter_target_load(const char *dir, dfl_hf_drafter_target *t, char fp[33], dfl_err *e);

/* Model fingerprint: XXH3-128 (32 lowercase hex digits) over a version tag, the canonical config
 * JSON (sorted keys, compact) and the tensor table (tensors sorted by name, each with dtype and
 * shape). Tensor data is not read. */
int dfl_hf_fingerprint_of(const json_t *cfg, const dfl_st_model *m, char out[33], dfl_err *e);
/* Same, opening DIR (config.json and the safetensors weights) itself. */
int dfl_hf_fingerprint(const char *dir, char out[33], dfl_err *e);

/* Default captured layers for an N-layer target (SpecForge's rule, dfl-target(1)):
 * K' = min(K, N - 3), at least 1; K' = 1 gives N / 2 (integer division); otherwise
 * layer i = round(1 + i (N - 4) / (K' - 1)), i = 0..K'-1, rounding halves to even (exact
 * rational arithmetic, as Python's round). The result is ascending, distinct and < N.
 * out has room for K entries; *n receives K'. */
int dfl_hf_auto_layers(int64_t n_layers, int k, int32_t *out, int *n, dfl_err *e);

#endif
