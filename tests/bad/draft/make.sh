#!/usr/bin/env bash
# make.sh BUILD: regenerates the corpus of inputs dfl-draft must reject (tests/bats/draft.bats
# checks each one against EXPECT: file | exit status | words of the message). The streams are
# written by draftdata for the fixture target tests/fixtures/draft/target (layers 1,2 unless the
# defect is the layers). Deterministic.
set -euo pipefail
B=$(cd "${1:-build}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
tgt="$here/../../fixtures/draft/target"
dd_() { "$B/tools/draftdata" "$tgt" "$1" --batches 2 --seqs 2 --len 16 "${@:2}"; }   # later options win
cd "$here"
rm -f ./*.dfl ./*.json
dd_ fingerprint.dfl --fingerprint 00000000000000000000000000000000
dd_ layers.dfl --layers 1,3
dd_ hidden.dfl --hidden 16
dd_ truncated.dfl --cut 64
dd_ no-end-pipe.dfl --no-index --cut 200
dd_ bitflip.dfl
dd_ no-anchor-one-token.dfl --len 1        # every sequence one token: no anchor anywhere
dd_ no-anchor-mask10.dfl --len 2 --mask 10  # loss mask [1, 0]: no two scored tokens in a row
size=$(stat -c %s bitflip.dfl)
printf '\252' | dd of=bitflip.dfl bs=1 seek=$((size / 2)) conv=notrunc status=none
sed 's/"mask_token_id": 63/"mask_token_id": 64/' ../../fixtures/draft/config.json > config-mask.json
sed 's/"target_layer_ids": \[1, 2\]/"target_layer_ids": [1, 9]/' ../../fixtures/draft/config.json > config-layers.json
sed 's/"hidden_size": 32/"hidden_size": 48/' ../../fixtures/draft/config.json > config-hidden.json
printf '{"block_size": 8, ' > config-json.json
# layer_types / sliding_window (issue 18)
lt() { sed "s/\"num_hidden_layers\": 1,/\"num_hidden_layers\": 1,\n  $1/" ../../fixtures/draft/config.json; }
lt '"layer_types": ["local_attention"],' > config-layer-type.json
lt '"layer_types": ["sliding_attention"],' > config-no-window.json
lt '"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4,' > config-layer-count.json
lt '"layer_types": ["sliding_attention"], "sliding_window": 0,' > config-window.json
lt '"layer_types": ["sliding_attention"], "sliding_window": 4, "use_sliding_window": false,' > config-window-off.json
