#!/usr/bin/env bats
# Issue 18, the Qwen3.6 recipe: sliding-window drafter layers (--layer-types, --sliding-window),
# the checkpoint in the layout serving engines load (checked by an independent reader written
# here, not lib/), resume of old and new configs, drafters of Qwen3.5/3.6 targets (text_config,
# model.language_model.*), and dfl-train end to end with such a target.
load helper
bats_require_minimum_version 1.5.0

setup() {
    TGT="$FIXTURES/draft/target"
    export OMP_WAIT_POLICY=passive
    command -v draftdata >/dev/null || PATH="$DFL_TOOLS:$PATH"
    T="$BATS_TEST_TMPDIR"
    # a 2-layer drafter, the first layer sliding with a window of 5 positions
    A=(--target "$TGT" --mask-token-id 63 --block-size 8 --num-anchors 16
       --layer-types sliding:1,full:1 --sliding-window 5)
}

data() { # data TARGET OUT [draftdata options]
    local tgt=$1 out=$2
    shift 2
    draftdata "$tgt" "$out" --batches 6 --seqs 3 --len 24 "$@"
}

losses() { grep -o '"loss":[^,]*' "$1"; }

# check_layout CKPT LAYER_TYPES WINDOW NUM_TARGET_LAYERS: config.json and model.safetensors as the
# published DFlash drafters have them, read with python3's json and struct (not lib/)
check_layout() {
    python3 - "$@" <<'PY'
import json, struct, sys
ck, types, window, ntl = sys.argv[1], sys.argv[2].split(','), int(sys.argv[3]), int(sys.argv[4])
c = json.load(open(ck + '/config.json'))
required = {'architectures', 'auto_map', 'model_type', 'block_size', 'dflash_config',
            'num_target_layers', 'layer_types', 'use_sliding_window', 'sliding_window',
            'max_window_layers', 'rope_parameters', 'rope_theta', 'dtype', 'hidden_size',
            'intermediate_size', 'num_attention_heads', 'num_key_value_heads', 'head_dim',
            'num_hidden_layers', 'rms_norm_eps', 'vocab_size', 'tie_word_embeddings'}
optional = {'attention_bias', 'attention_dropout', 'bos_token_id', 'eos_token_id', 'hidden_act',
            'initializer_range', 'max_position_embeddings', 'rope_scaling', 'use_cache'}
missing, extra = required - set(c), set(c) - required - optional
assert not missing, 'config.json lacks %s' % sorted(missing)
assert not extra, 'config.json has unknown keys %s' % sorted(extra)
assert c['architectures'] == ['DFlashDraftModel'], c['architectures']
assert c['auto_map'] == {'AutoModel': 'dflash.DFlashDraftModel'}, c['auto_map']
assert c['model_type'] == 'qwen3' and c['dtype'] == 'bfloat16'
assert c['tie_word_embeddings'] is False
dc = c['dflash_config']
assert {'mask_token_id', 'target_layer_ids'} <= set(dc) <= {'mask_token_id', 'target_layer_ids', 'loss_decay_gamma'}, dc
assert isinstance(dc['mask_token_id'], int) and all(isinstance(x, int) for x in dc['target_layer_ids'])
assert c['num_target_layers'] == ntl, c['num_target_layers']
L = c['num_hidden_layers']
want = ['sliding_attention' if t == 'sliding' else 'full_attention' for t in types]
assert c['layer_types'] == want, (c['layer_types'], want)
assert len(c['layer_types']) == L
if 'sliding' in types:
    assert c['use_sliding_window'] is True and c['sliding_window'] == window, (c['use_sliding_window'], c['sliding_window'])
else:
    assert c['use_sliding_window'] is False and c['sliding_window'] is None
assert c['rope_parameters']['rope_theta'] == c['rope_theta'] and c['rope_parameters']['rope_type'] == 'default'
f = open(ck + '/model.safetensors', 'rb')
n = struct.unpack('<Q', f.read(8))[0]
h = json.loads(f.read(n))
h.pop('__metadata__', None)
names = {'fc.weight', 'hidden_norm.weight', 'norm.weight'}
for l in range(L):
    for t in ['input_layernorm', 'post_attention_layernorm', 'self_attn.q_proj', 'self_attn.k_proj',
              'self_attn.v_proj', 'self_attn.o_proj', 'self_attn.q_norm', 'self_attn.k_norm',
              'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj']:
        names.add('layers.%d.%s.weight' % (l, t))
assert set(h) == names, 'tensors: missing %s, extra %s' % (sorted(names - set(h)), sorted(set(h) - names))
H, k = c['hidden_size'], len(dc['target_layer_ids'])
assert h['fc.weight']['shape'] == [H, k * H], h['fc.weight']['shape']
nq = c['num_attention_heads'] * c['head_dim']
assert h['layers.0.self_attn.q_proj.weight']['shape'] == [nq, H]
assert h['layers.0.mlp.gate_proj.weight']['shape'] == [c['intermediate_size'], H]
assert all(t['dtype'] == 'BF16' for t in h.values())
print('layout ok: %d tensors, layer_types %s' % (len(h), c['layer_types']))
PY
}

@test "--layer-types and --sliding-window: config.json and tensors in the published layout" {
    data "$TGT" "$T/a.dfl"
    run --separate-stderr dfl-draft "${A[@]}" --out "$T/r" "$T/a.dfl"
    [ "$status" -eq 0 ]
    run check_layout "$T/r/latest" sliding,full 5 4
    echo "$output"
    [ "$status" -eq 0 ]
    # the full-attention drafter of the same run: layer_types all full, no window
    dfl-draft --target "$TGT" --mask-token-id 63 --block-size 8 --draft-layers 2 -q --out "$T/f" "$T/a.dfl"
    run check_layout "$T/f/latest" full,full 0 4
    echo "$output"
    [ "$status" -eq 0 ]
    # the window changes the training: the two runs differ
    ! cmp -s "$T/r/latest/optimizer.safetensors" "$T/f/latest/optimizer.safetensors"
}

@test "the layer list's length gives the drafter's layers; the long spellings are accepted" {
    data "$TGT" "$T/a.dfl"
    dfl-draft --target "$TGT" --mask-token-id 63 --block-size 8 -q --out "$T/r" \
        --layer-types sliding_attention:2,full_attention --sliding-window 3 "$T/a.dfl"
    run check_layout "$T/r/latest" sliding,sliding,full 3 4
    echo "$output"
    [ "$status" -eq 0 ]
}

@test "--layer-types and --sliding-window: bad values are usage errors naming the option" {
    data "$TGT" "$T/a.dfl"
    B=(--target "$TGT" --mask-token-id 63 --out "$T/r")
    run -1 dfl-draft "${B[@]}" --layer-types sliding:1,local:1 --sliding-window 4 "$T/a.dfl"
    [[ "$output" == *"--layer-types: 'local:1' is not a layer type"* ]]
    run -1 dfl-draft "${B[@]}" --layer-types sliding:1,full:1 "$T/a.dfl"
    [[ "$output" == *"--sliding-window is required"* ]]
    run -1 dfl-draft "${B[@]}" --draft-layers 2 --sliding-window 4 "$T/a.dfl"
    [[ "$output" == *"no drafter layer is sliding"* ]]
    run -1 dfl-draft "${B[@]}" --draft-layers 3 --layer-types sliding:1,full:1 --sliding-window 4 "$T/a.dfl"
    [[ "$output" == *"names 2 layers, the drafter has 3"* ]]
    run -1 dfl-draft "${B[@]}" --layer-types sliding:0 --sliding-window 4 "$T/a.dfl"
    [[ "$output" == *"bad count"* ]]
    run -1 dfl-draft "${B[@]}" --layer-types full --sliding-window 0 "$T/a.dfl"
    [[ "$output" == *"--sliding-window"* ]]
    [ ! -e "$T/r/latest" ]
}

@test "resume of a sliding-window drafter: N steps, stop, N steps equals 2N steps, bit for bit" {
    data "$TGT" "$T/a.dfl" --batches 10
    B=(--epochs 2 --log-every 1 --save-every 7 --seed 9)
    dfl-draft "${A[@]}" "${B[@]}" -q --out "$T/straight" "$T/a.dfl"
    dfl-draft "${A[@]}" "${B[@]}" -q --out "$T/split" --stop-at 9 "$T/a.dfl"
    # the layer types and the window come from the checkpoint's config.json
    dfl-draft --target "$TGT" --mask-token-id 63 --num-anchors 16 "${B[@]}" -q --out "$T/split" \
        --resume "$T/split/latest" "$T/a.dfl"
    cmp "$T/straight/step-0000020/optimizer.safetensors" "$T/split/step-0000020/optimizer.safetensors"
    cmp "$T/straight/step-0000020/model.safetensors" "$T/split/step-0000020/model.safetensors"
    diff <(losses "$T/straight/metrics.jsonl") <(losses "$T/split/metrics.jsonl")
    # other layer types or another window than the checkpoint's are refused
    run -2 dfl-draft --target "$TGT" --mask-token-id 63 "${B[@]}" --layer-types full:2 --out "$T/split" \
        --resume "$T/split/step-0000009" "$T/a.dfl"
    [[ "$output" == *"the checkpoint's drafter differs from this run's (sliding layer (layer_types) 1 vs 0)"* ]]
    run -2 dfl-draft "${A[@]}" "${B[@]}" --sliding-window 6 --out "$T/split" --resume "$T/split/step-0000009" "$T/a.dfl"
    [[ "$output" == *"(sliding_window 5 vs 6)"* ]]
}

@test "a checkpoint whose config.json predates layer_types (all full attention) resumes exactly" {
    data "$TGT" "$T/a.dfl" --batches 10
    F=(--target "$TGT" --mask-token-id 63 --block-size 8 --num-anchors 16 --draft-layers 1
       --epochs 2 --log-every 1 --save-every 7 --seed 9)
    dfl-draft "${F[@]}" -q --out "$T/straight" "$T/a.dfl"
    dfl-draft "${F[@]}" -q --out "$T/split" --stop-at 9 "$T/a.dfl"
    # the config.json dfl-draft wrote before issue 18
    python3 - "$T/split/step-0000009/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
for k in ('auto_map', 'rope_parameters'):
    c.pop(k)
c['layer_types'] = ['full_attention'] * c['num_hidden_layers']
c['sliding_window'] = None
c['use_sliding_window'] = False
json.dump(c, open(sys.argv[1], 'w'), indent=2)
PY
    dfl-draft "${F[@]}" -q --out "$T/split" --resume "$T/split/step-0000009" "$T/a.dfl"
    cmp "$T/straight/step-0000020/optimizer.safetensors" "$T/split/step-0000020/optimizer.safetensors"
}

# ---- Qwen3.5 / Qwen3.6 targets ------------------------------------------------------------

@test "a Qwen3.5-layout target: dfl-draft takes its text_config, embedding and LM head" {
    mktarget --type qwen3_5 -o "$T/q35" --hidden 32 --layers 8 --heads 4 --kv-heads 2 --head-dim 8 \
        --intermediate 64 --vocab 64
    # the published layout: text_config, model.language_model.*, lm_head, visual and mtp tensors
    grep -q '"Qwen3_5ForConditionalGeneration"' "$T/q35/config.json"
    grep -q '"text_config"' "$T/q35/config.json"
    hdr=$(head -c 20000 "$T/q35/model.safetensors")
    for t in model.language_model.embed_tokens.weight lm_head.weight model.visual.patch_embed.proj.weight \
        mtp.fc.weight model.language_model.layers.0.linear_attn.in_proj_qkv.weight \
        model.language_model.layers.3.self_attn.q_proj.weight; do
        [[ "$hdr" == *"\"$t\""* ]]
    done
    data "$T/q35" "$T/a.dfl" --batches 20 --seqs 4 --len 40
    run --separate-stderr dfl-draft --target "$T/q35" --mask-token-id 63 --block-size 8 --num-anchors 16 \
        --layer-types sliding:1,full:1 --sliding-window 6 --heads 8 --kv-heads 4 --head-dim 8 \
        --epochs 10 --lr 1e-2 --log-every 20 --save-every 0 --out "$T/r" "$T/a.dfl"
    echo "$stderr"
    [ "$status" -eq 0 ]
    run check_layout "$T/r/latest" sliding,full 6 8
    echo "$output"
    [ "$status" -eq 0 ]
    grep -q '"num_attention_heads": 8' "$T/r/latest/config.json"
    # learns: chance is tau ~ 1.02; threshold 3
    first=$(head -1 "$T/r/metrics.jsonl" | grep -o '"tau":[0-9.]*' | cut -d: -f2)
    last=$(tail -1 "$T/r/metrics.jsonl" | grep -o '"tau":[0-9.]*' | cut -d: -f2)
    echo "tau $first -> $last"
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(a < 1.5 && b > 3.0) }'
    dfl-ckpt -q --check-nan "$T/r/latest"
}

@test "a tied Qwen3.5-layout target (no lm_head.weight) uses its embedding as the LM head" {
    mktarget --type qwen3_5 --tied -o "$T/q35" --hidden 32 --layers 4 --heads 4 --kv-heads 2 \
        --head-dim 8 --intermediate 64 --vocab 64
    ! grep -q '"lm_head.weight"' <(head -c 20000 "$T/q35/model.safetensors")
    data "$T/q35" "$T/a.dfl"
    run -0 dfl-draft --target "$T/q35" --mask-token-id 63 --block-size 8 --draft-layers 1 -q \
        --out "$T/r" "$T/a.dfl"
    # a stream of another target is refused: the fingerprint covers the Qwen3.5 config
    data "$TGT" "$T/b.dfl"
    run -2 dfl-draft --target "$T/q35" --mask-token-id 63 --block-size 8 --draft-layers 1 -q \
        --out "$T/r2" "$T/b.dfl"
    [[ "$output" == *"made from another target"* ]]
}

@test "a text_config of another family is refused (status 2) with a message naming it" {
    mkdir "$T/x"
    echo '{"model_type": "llava", "text_config": {"model_type": "mistral", "hidden_size": 32}}' > "$T/x/config.json"
    data "$TGT" "$T/a.dfl"
    run -2 dfl-draft --target "$T/x" --mask-token-id 63 --out "$T/r" "$T/a.dfl"
    [[ "$output" == *"text_config.model_type 'mistral' is not supported"* ]]
}

@test "dfl-train with a Qwen3.5-layout target on the CPU: a sliding-window drafter learns, checks clean, resumes exactly" {
    command -v dfl-bucket >/dev/null && command -v demodata >/dev/null || skip "dfl-bucket or demodata not built"
    PATH="$DFL_BIN:$REPO/pipelines:$PATH"
    export DFL_BIN
    mktarget --type qwen3_5 -o "$T/q35" --hidden 32 --layers 8 --heads 4 --kv-heads 2 --head-dim 8 \
        --intermediate 64 --vocab 64
    if ! dfl-target --model "$T/q35" --info >/dev/null 2>"$T/info.err"; then
        skip "dfl-target refuses the qwen3_5 model ($(head -c 160 "$T/info.err" | tr '\n' ' ')): Qwen3.5 support in dfl-target comes from its own branch"
    fi
    # the learnable synthetic chat language of the demo (tau ~ 7 of 8 when learnt, ~ 1 when not)
    demodata -n 240 --vocab 64 --min-len 8 --max-len 40 -o "$T/d.jsonl"
    dfl-bucket -q --shards 2 --max-tokens 256 --buckets auto:2 --vocab-size 64 -o "$T/sh" "$T/d.jsonl"
    D=(--mask-token-id 63 --block-size 8 --num-anchors 16 --layer-types sliding:1,full:1
       --sliding-window 6 --lr 1e-2 --log-every 1 --save-every 10 --seed 3)
    run --separate-stderr dfl-train -q --model "$T/q35" --out "$T/r" --layers 1,5 --passes 4 "$T/sh" -- "${D[@]}"
    echo "$stderr"
    [ "$status" -eq 0 ]
    first=$(head -1 "$T/r/metrics.jsonl" | grep -o '"tau":[0-9.]*' | cut -d: -f2)
    last=$(tail -1 "$T/r/metrics.jsonl" | grep -o '"tau":[0-9.]*' | cut -d: -f2)
    echo "tau $first -> $last"
    # chance is tau ~ 1; with the Qwen3.5 dfl-target branch merged, 4.42 (threshold 3)
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(a < 1.5 && b > 3.0) }'
    dfl-ckpt -q --check-nan "$T/r/latest"
    run check_layout "$T/r/latest" sliding,full 6 8
    [ "$status" -eq 0 ]
    # resume is exact on the target's own hidden states (dfl-train --resume restarts the targets
    # at the start of their shards, so its data order differs by design: dfl-draft on a file)
    dfl-target --model "$T/q35" --layers 1,5 "$T/sh/shard-00000.dfl" > "$T/hs.dfl"
    B=("${D[@]}" --target "$T/q35" --epochs 2)
    dfl-draft "${B[@]}" -q --out "$T/straight" "$T/hs.dfl" >/dev/null
    dfl-draft "${B[@]}" -q --out "$T/split" --stop-at 7 "$T/hs.dfl" >/dev/null
    dfl-draft "${B[@]}" -q --out "$T/split" --resume "$T/split/latest" "$T/hs.dfl" >/dev/null
    last=$(basename "$(readlink "$T/straight/latest")")
    [ "$(basename "$(readlink "$T/split/latest")")" = "$last" ]
    cmp "$T/straight/$last/optimizer.safetensors" "$T/split/$last/optimizer.safetensors"
    diff <(losses "$T/straight/metrics.jsonl") <(losses "$T/split/metrics.jsonl")
}
