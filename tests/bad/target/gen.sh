#!/usr/bin/env bash
# gen.sh: regenerates the known-bad corpus of dfl-target (models and token streams) and its
# MANIFEST, with the tools of a build tree: tests/bad/target/gen.sh [BUILD] (default build).
# Every case must make `dfl-target` fail with the exit status and a message containing the text
# that MANIFEST gives, and leave no output file behind (tests/bats/target.bats checks this).
#   model cases:  dfl-target -m CASE --layers 0 -o OUT tokens.dfl
#   stream cases: dfl-target -m good-model -o OUT CASE
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:-$here/../../../build}" && pwd)
mktarget="$build/tools/mktarget"
mktokens="$build/tools/mktokens"
cd "$here"
find . -mindepth 1 -maxdepth 1 ! -name gen.sh ! -name README -exec rm -rf {} +

tiny=(--hidden 16 --layers 2 --heads 2 --kv-heads 1 --intermediate 32 --vocab 64 --seed 5)

# A good model (vocab 64) for the stream cases, and a good token stream for the model cases.
"$mktarget" -o good-model "${tiny[@]}"
printf '1 2 3 4\n5 6 7\n' | "$mktokens" --vocab 64 -o tokens.dfl

# Models with broken tensor tables.
"$mktarget" -o missing-tensor "${tiny[@]}" --omit model.layers.1.mlp.up_proj.weight
"$mktarget" -o wrong-shape "${tiny[@]}" --wrong-shape model.layers.0.self_attn.k_proj.weight
"$mktarget" -o qwen2-missing-bias "${tiny[@]}" --type qwen2 --omit model.layers.0.self_attn.k_proj.bias
moe=(--type qwen3_moe --experts 4 --top-k 2 --moe-intermediate 8)
"$mktarget" -o moe-missing-expert "${tiny[@]}" "${moe[@]}" --omit model.layers.1.mlp.experts.2.down_proj.weight
"$mktarget" -o moe-missing-router "${tiny[@]}" "${moe[@]}" --omit model.layers.0.mlp.gate.weight
"$mktarget" -o moe-wrong-expert-shape "${tiny[@]}" "${moe[@]}" --wrong-shape model.layers.0.mlp.experts.3.up_proj.weight

# Configurations we refuse (config.json is checked before the weights, so none are needed).
config() { # dir, extra JSON members
    mkdir -p "$1"
    printf '{\n  "model_type": "%s",\n  "hidden_size": 32,\n  "num_hidden_layers": 2,\n  "num_attention_heads": 2,\n  "num_key_value_heads": 1,\n  "intermediate_size": 64,\n  "vocab_size": 64%s\n}\n' \
        "${3:-qwen3}" "$2" >"$1/config.json"
}
config unknown-model-type '' mistral
config rope-type-dynamic ',
  "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}'
config rope-llama3-missing-field ',
  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}' llama
config rope-yarn-no-original ',
  "rope_scaling": {"rope_type": "yarn", "factor": 4.0}'
config moe-no-experts ',
  "num_experts_per_tok": 2,
  "moe_intermediate_size": 32' qwen3_moe
config moe-no-top-k ',
  "num_experts": 8,
  "moe_intermediate_size": 32' qwen3_moe
config sliding-window ',
  "sliding_window": 4096,
  "use_sliding_window": true' qwen2
config layer-types ',
  "layer_types": ["full_attention", "sliding_attention"]'
config moe ',
  "num_experts": 8,
  "num_experts_per_tok": 2'
config hidden-act ',
  "hidden_act": "gelu_pytorch_tanh"' llama
config missing-vocab-size '' qwen3
sed -i '/"vocab_size"/d; s/"intermediate_size": 64,/"intermediate_size": 64/' missing-vocab-size/config.json
# found by fuzz-config: a real far outside int64_t where an integer is wanted
config head-dim-1e300 ',
  "head_dim": 1281e300' llama
# hybrid (qwen3_5) models: a layer kind, head ratio or conv kernel we do not run; missing
# linear-attention tensors
hybrid='"head_dim": 16,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
  "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4'
config hybrid-layer-type ",
  $hybrid,
  \"layer_types\": [\"linear_attention\", \"mamba\"]" qwen3_5_text
config hybrid-head-ratio ",
  $hybrid,
  \"layer_types\": [\"linear_attention\", \"full_attention\"]" qwen3_5_text
sed -i 's/"linear_num_value_heads": 4/"linear_num_value_heads": 3/' hybrid-head-ratio/config.json
config hybrid-conv-kernel ",
  $hybrid,
  \"layer_types\": [\"linear_attention\", \"full_attention\"]" qwen3_5_text
sed -i 's/"linear_conv_kernel_dim": 4/"linear_conv_kernel_dim": 64/' hybrid-conv-kernel/config.json
"$mktarget" -o hybrid-missing-linear "${tiny[@]}" --type qwen3_5 --head-dim 8 \
    --omit model.language_model.layers.0.linear_attn.in_proj_qkv.weight
# qwen3_5_moe: a missing shared-expert tensor, a MoE text model without its shared expert's
# width, a shared expert where transformers has none (qwen3_moe), a wrapper around the dense text
# model
"$mktarget" -o moe35-missing-shared-gate "${tiny[@]}" --type qwen3_5_moe --head-dim 8 --experts 4 \
    --moe-intermediate 8 --shared-intermediate 8 \
    --omit model.language_model.layers.1.mlp.shared_expert_gate.weight
config moe35-no-shared ",
  $hybrid,
  \"num_experts\": 4, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 8" qwen3_5_moe_text
config moe-shared-expert ',
  "num_experts": 8,
  "num_experts_per_tok": 2,
  "moe_intermediate_size": 32,
  "shared_expert_intermediate_size": 64' qwen3_moe
mkdir -p moe35-wrapper-dense && printf '{"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_text"}}\n' \
    >moe35-wrapper-dense/config.json
mkdir -p invalid-json && printf '{"model_type": "qwen3", "hidden_size": 32,\n' >invalid-json/config.json

# Token streams that the good model must refuse.
printf '1 2 3\n--\n4 5\n6 7 8 64 9\n' | "$mktokens" -o token-out-of-range.dfl
"$build/bin/dfl-target" -q -m good-model --layers 0 -o hidden-stream.dfl tokens.dfl
head -c "$(( $(stat -c %s tokens.dfl) - 64 ))" tokens.dfl >truncated.dfl

cat >MANIFEST <<'MAN'
# Written by gen.sh: case<TAB>exit status<TAB>text the message must contain. Do not edit; rerun gen.sh.
missing-tensor	2	model.layers.1.mlp.up_proj.weight
wrong-shape	2	model.layers.0.self_attn.k_proj.weight
qwen2-missing-bias	2	model.layers.0.self_attn.k_proj.bias
unknown-model-type	2	model_type 'mistral' is not supported
moe-missing-expert	2	model.layers.1.mlp.experts.2.down_proj.weight
moe-missing-router	2	model.layers.0.mlp.gate.weight
moe-wrong-expert-shape	2	model.layers.0.mlp.experts.3.up_proj.weight
rope-type-dynamic	2	rope_scaling.rope_type is 'dynamic'
rope-llama3-missing-field	2	rope_parameters.low_freq_factor is missing
rope-yarn-no-original	2	rope_scaling.original_max_position_embeddings is missing
moe-no-experts	2	num_experts is missing
moe-no-top-k	2	num_experts_per_tok is missing
sliding-window	2	sliding_window is set and use_sliding_window is true
layer-types	2	layer_types[1] is 'sliding_attention'
moe	2	num_experts is set
hidden-act	2	hidden_act 'gelu_pytorch_tanh' is not supported
missing-vocab-size	2	missing key 'vocab_size'
invalid-json	2	invalid JSON
head-dim-1e300	2	key 'head_dim' must be an integer
token-out-of-range.dfl	2	batch 1, sequence 1, position 3: token id 64 is out of range
hidden-stream.dfl	2	not a token-batch stream
truncated.dfl	2	truncated
hybrid-layer-type	2	layer_types[1] is 'mamba'
hybrid-head-ratio	2	linear_num_value_heads = 3 is not a multiple of linear_num_key_heads = 2
hybrid-conv-kernel	2	linear_conv_kernel_dim = 64 is not supported
hybrid-missing-linear	2	model.language_model.layers.0.linear_attn.in_proj_qkv.weight
moe35-missing-shared-gate	2	model.language_model.layers.1.mlp.shared_expert_gate.weight
moe35-no-shared	2	shared_expert_intermediate_size is missing (model_type 'qwen3_5_moe_text' needs it)
moe-shared-expert	2	shared_expert_intermediate_size is set: shared experts are not supported in model_type 'qwen3_moe'
moe35-wrapper-dense	2	text_config.model_type is 'qwen3_5_text': only qwen3_5_moe_text is supported
MAN
echo "tests/bad/target: $(grep -vc '^#' MANIFEST) cases"
