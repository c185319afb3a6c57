#!/usr/bin/env bash
# make.sh BUILD: regenerates the corpus of inputs dfl-eval must reject (tests/bats/eval.bats checks
# each one against EXPECT: input | exit status | words of the message). Streams are written by
# draftdata for the fixture target tests/fixtures/draft/target, checkpoints by ckpt-gen drafter
# for tests/fixtures/draft/config.json (layers 1,2). Deterministic.
set -euo pipefail
B=$(cd "${1:-build}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
tgt="$here/../../fixtures/draft/target"
cfg="$here/../../fixtures/draft/config.json"
dd_() { "$B/tools/draftdata" "$tgt" "$@" --batches 2 --seqs 2 --len 16; }
cd "$here"
rm -rf ./*.dfl ./ckpt-*
# streams (evaluated with a good checkpoint)
dd_ fingerprint.dfl --fingerprint 00000000000000000000000000000000
dd_ layers.dfl --layers 1,3
dd_ hidden.dfl --hidden 16
dd_ truncated.dfl --cut 64
"$B/tools/draftdata" "$tgt" no-response.dfl --batches 2 --seqs 2 --ids 5,6,7,8,9,10 --mask 000000
# checkpoints (evaluated on a good stream)
"$B/tools/ckpt-gen" drafter ckpt-nan "$cfg" layers.0.mlp.up_proj.weight:17:nan
"$B/tools/ckpt-gen" drafter ckpt-truncated "$cfg"
size=$(stat -c %s ckpt-truncated/model.safetensors)
truncate -s $((size - 100)) ckpt-truncated/model.safetensors
"$B/tools/ckpt-gen" drafter ckpt-layers "$cfg"
sed 's/"num_hidden_layers": 1/"num_hidden_layers": 2/' "$cfg" > ckpt-layers/config.json
"$B/tools/ckpt-gen" drafter ckpt-target-layers "$cfg"
sed 's/"target_layer_ids": \[1, 2\]/"target_layer_ids": [1, 3]/' "$cfg" > ckpt-target-layers/config.json
"$B/tools/ckpt-gen" drafter ckpt-json "$cfg"
printf '{"block_size": 8, ' > ckpt-json/config.json
"$B/tools/ckpt-gen" drafter ckpt-other-target "$cfg"
sed 's/"num_target_layers": 4/"num_target_layers": 36/' "$cfg" > ckpt-other-target/config.json
mkdir -p ckpt-empty
echo "no model.safetensors: dfl-eval refuses this directory" > ckpt-empty/README
