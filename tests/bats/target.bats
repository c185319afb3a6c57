#!/usr/bin/env bats
# target.bats: dfl-target on the command line: options, the stream it writes, layer choice,
# determinism, bad models and bad streams (tests/bad/target), a consumer that goes away, and
# SIGINT / SIGTERM. Models come from build/tools/mktarget, token streams from mktokens, and
# output streams are read back with hsdump.

load helper
bats_require_minimum_version 1.5.0
PATH="$DFL_TOOLS:$PATH"

setup_file() {
    export D="$BATS_FILE_TMPDIR"
    local tiny=(--hidden 32 --heads 4 --kv-heads 2 --intermediate 64 --vocab 128)
    "$DFL_TOOLS/mktarget" -o "$D/m4" "${tiny[@]}" --layers 4
    "$DFL_TOOLS/mktarget" -o "$D/m8" "${tiny[@]}" --layers 8
    "$DFL_TOOLS/mktarget" -o "$D/m36" --hidden 16 --heads 2 --kv-heads 1 --intermediate 16 --vocab 32 --layers 36
    # three batches, some loss-mask zeros
    printf '1 2 3 4 5\n!6 !7 8 9\n--\n10 11 12\n--\n13\n14 15 16 17 18 19 20\n' |
        "$DFL_TOOLS/mktokens" --vocab 128 -o "$D/tok3.dfl"
    printf '100 101 102\n' | "$DFL_TOOLS/mktokens" --vocab 128 -o "$D/tok1.dfl"
    # batches of 256 tokens (large outputs, for pipes)
    for b in 0 1 2 3; do
        seq $((b * 256)) $((b * 256 + 255)) | awk '{ printf "%s%d", (NR > 1 ? " " : ""), $1 % 128 } END { print "" }'
        echo --
    done | "$DFL_TOOLS/mktokens" --vocab 128 -o "$D/big.dfl"
}

# frame offset of the n-th TOKENS frame (1-based) of a stream
tokens_frame_offset() {
    hsdump --frames "$1" | awk -v n="$2" '$2 == "TOKENS" && ++k == n { print $1; exit }'
}

@test "--help prints usage on stdout and exits 0" {
    run --separate-stderr dfl-target --help
    assert_success
    assert_output --partial "--model DIR"
    assert_output --partial "--layers SPEC"
}

@test "--version prints the version" {
    run dfl-target --version
    assert_success
    assert_output --regexp '^dfl-target \(dfl\) [0-9]+\.[0-9]+'
}

@test "--model is required" {
    run -1 dfl-target "$D/tok3.dfl"
    assert_output --partial "--model DIR is required"
}

@test "an unknown option is a usage error" {
    run -1 dfl-target --model "$D/m4" --frobnicate
    assert_output --partial "Try 'dfl-target --help'"
}

@test "--dtype accepts only bf16 and f32" {
    run -1 dfl-target -m "$D/m4" --dtype f16 -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    assert_output --partial "--dtype: 'f16' is not bf16 or f32"
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
}

@test "--compute: bf16 or f32; the CPU computes in f32 only, and --compute f32 there changes nothing" {
    run -1 dfl-target -m "$D/m4" --compute f16 -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    assert_output --partial "--compute: 'f16' is not bf16 or f32"
    run -1 dfl-target -m "$D/m4" --compute bf16 -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    assert_output --partial "--device cpu computes in f32 only (asked for bf16)"
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
    dfl-target -q -m "$D/m4" --dtype f32 -o "$BATS_TEST_TMPDIR/a.dfl" "$D/tok3.dfl"
    run -0 --separate-stderr dfl-target -m "$D/m4" --dtype f32 --compute f32 -o "$BATS_TEST_TMPDIR/b.dfl" "$D/tok3.dfl"
    [[ "$stderr" == *"computing in f32, capturing layers"* ]]
    cmp "$BATS_TEST_TMPDIR/a.dfl" "$BATS_TEST_TMPDIR/b.dfl"
    dfl-target --help | grep -q -- "--compute TYPE"
}

@test "--max-tokens and --zstd are checked" {
    run -1 dfl-target -m "$D/m4" --max-tokens 0 --info
    assert_output --partial "--max-tokens"
    run -1 dfl-target -m "$D/m4" --zstd 25 --info
    assert_output --partial "--zstd"
}

@test "--layers: a layer past the last is refused, naming it" {
    run -1 dfl-target -m "$D/m4" --layers 1,4 -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    assert_output --partial "layer 4 does not exist (the model has 4 layers"
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
}

@test "--layers: ids must be ascending and distinct" {
    run -1 dfl-target -m "$D/m4" --layers 2,1 --info
    assert_output --partial "ascending and distinct"
    run -1 dfl-target -m "$D/m4" --layers 1,1 --info
    assert_output --partial "ascending and distinct"
    run -1 dfl-target -m "$D/m4" --layers auto:0 --info
    assert_output --partial "auto:K"
}

@test "--layers auto: 1,9,17,25,33 for 36 layers; auto:1 is N/2" {
    run --separate-stderr dfl-target -m "$D/m36" --info
    assert_success
    [ "$(echo "$output" | tr -d ' \n' | grep -o '"layers":\[[0-9,]*\]')" = '"layers":[1,9,17,25,33]' ]
    run --separate-stderr dfl-target -m "$D/m36" --layers auto:3 --info
    [ "$(echo "$output" | tr -d ' \n' | grep -o '"layers":\[[0-9,]*\]')" = '"layers":[1,17,33]' ]
    run --separate-stderr dfl-target -m "$D/m36" --layers auto:1 --info
    [ "$(echo "$output" | tr -d ' \n' | grep -o '"layers":\[[0-9,]*\]')" = '"layers":[18]' ]
}

@test "--layers auto on a small model picks fewer layers and says so" {
    run --separate-stderr dfl-target -m "$D/m8" --info
    assert_success
    [ "$(echo "$output" | tr -d ' \n' | grep -o '"layers":\[[0-9,]*\]')" = '"layers":[1,2,3,4,5]' ]
    run --separate-stderr dfl-target -m "$D/m4" --layers auto:5 --info
    [ "$(echo "$output" | tr -d ' \n' | grep -o '"layers":\[[0-9,]*\]')" = '"layers":[2]' ]
    [[ "$stderr" == *"4 layers is too few for 5 captured layers: capturing 1"* ]]
}

@test "hybrid qwen3_5: --info lists the layer kinds; auto layers may be of either kind" {
    "$DFL_TOOLS/mktarget" -o "$BATS_TEST_TMPDIR/h" --type qwen3_5 --hidden 32 --heads 4 \
        --kv-heads 2 --intermediate 64 --vocab 128 --layers 12
    run --separate-stderr dfl-target -m "$BATS_TEST_TMPDIR/h" --info
    assert_success
    flat=$(echo "$output" | tr -d ' \n')
    [[ "$flat" == *'"model_type":"qwen3_5"'* ]]
    [[ "$flat" == *'"layer_kinds":["gateddeltanet","gateddeltanet","gateddeltanet","gatedattention","gateddeltanet"'* ]]
    [[ "$flat" == *'"linear_attention":{"conv_kernel_dim":4,"key_head_dim":16,"layers":9,"num_key_heads":2,"num_value_heads":4,"value_head_dim":16}'* ]]
    [ "$(echo "$flat" | grep -o '"layers":\[[0-9,]*\]')" = '"layers":[1,3,5,7,9]' ]
    # the dense families say attention
    run --separate-stderr dfl-target -m "$D/m4" --info
    [[ "$(echo "$output" | tr -d ' \n')" == *'"layer_kinds":["attention","attention","attention","attention"]'* ]]
}

@test "hybrid qwen3_5 and qwen3_5_text models run and capture layers of either kind (stopping after the last)" {
    for type in qwen3_5 qwen3_5_text; do
        "$DFL_TOOLS/mktarget" -o "$BATS_TEST_TMPDIR/h" --type $type --hidden 32 --heads 4 \
            --kv-heads 2 --intermediate 64 --vocab 128 --layers 8 --shards 2
        run -0 dfl-target -q -m "$BATS_TEST_TMPDIR/h" --dtype f32 --layers 2,3,7 \
            -o "$BATS_TEST_TMPDIR/all.dfl" "$D/tok3.dfl"
        run -0 dfl-target -q -m "$BATS_TEST_TMPDIR/h" --dtype f32 --layers 3 \
            -o "$BATS_TEST_TMPDIR/one.dfl" "$D/tok3.dfl"
        run -0 hsdump "$BATS_TEST_TMPDIR/all.dfl"
        assert_line --partial --index 0 "layers 2,3,7"
        assert_line --index 4 "end batches 3 seqs 5 tokens 20"
        rm -rf "$BATS_TEST_TMPDIR/h"
    done
}

@test "hybrid qwen3_5: dfl-draft trains on its hidden states (embedding under model.language_model.)" {
    "$DFL_TOOLS/mktarget" -o "$BATS_TEST_TMPDIR/h" --type qwen3_5 --hidden 32 --heads 4 \
        --kv-heads 2 --intermediate 64 --vocab 128 --layers 8
    dfl-target -q -m "$BATS_TEST_TMPDIR/h" "$D/big.dfl" |
        dfl-draft -q -t "$BATS_TEST_TMPDIR/h" -o "$BATS_TEST_TMPDIR/run" --mask-token-id 127 \
            --block-size 4 --num-anchors 8 --min-ready 1 --total-steps 4 -
    [ -f "$BATS_TEST_TMPDIR/run/latest/model.safetensors" ]
    run -0 grep -c '"step"' "$BATS_TEST_TMPDIR/run/metrics.jsonl"
}

@test "qwen3_5_moe: dfl-draft trains on its hidden states given --intermediate-size (the target has none)" {
    local t="$BATS_TEST_TMPDIR"
    "$DFL_TOOLS/mktarget" -o "$t/h" --type qwen3_5_moe --hidden 32 --heads 4 --kv-heads 2 \
        --vocab 128 --layers 8 --experts 4 --moe-intermediate 16 --shared-intermediate 16
    dfl-target -q -m "$t/h" -o "$t/hs.dfl" "$D/big.dfl"
    run -1 dfl-draft -q -t "$t/h" -o "$t/run0" --mask-token-id 127 --block-size 4 \
        --num-anchors 8 --min-ready 1 --total-steps 4 "$t/hs.dfl"
    assert_output --partial "the target (model_type 'qwen3_5_moe_text') has no intermediate_size"
    assert_output --partial "--intermediate-size N"
    dfl-draft -q -t "$t/h" -o "$t/run" --mask-token-id 127 --block-size 4 --num-anchors 8 \
        --min-ready 1 --total-steps 4 --intermediate-size 64 "$t/hs.dfl"
    [ -f "$t/run/latest/model.safetensors" ]
    run -0 grep -c '"step"' "$t/run/metrics.jsonl"
}

@test "writes a hidden-state stream: header, one batch per input batch, ids and mask carried" {
    dfl-target -q -m "$D/m4" --layers 0,2 "$D/tok3.dfl" >"$BATS_TEST_TMPDIR/o.dfl"
    run hsdump "$BATS_TEST_TMPDIR/o.dfl"
    assert_success
    fp=$(dfl-target -m "$D/m4" --info | grep '"fingerprint"' | grep -o '[0-9a-f]\{32\}')
    assert_line --index 0 "kind hidden producer 'dfl-target 0.1.0' vocab 128 hidden 32 dtype bf16 fingerprint $fp layers 0,2"
    assert_line --partial --index 1 "batch 0 seqs 2 tokens 9 lens 5,4 mask 7 ids"
    assert_line --partial --index 2 "batch 1 seqs 1 tokens 3 lens 3 mask 3 ids"
    assert_line --partial --index 3 "batch 2 seqs 2 tokens 8 lens 1,7 mask 8 ids"
    assert_line --index 4 "end batches 3 seqs 5 tokens 20"
    # the token ids are those of the input, batch by batch
    diff <(hsdump "$D/tok3.dfl" | sed -n '2,4p' | awk '{ print $10 }') \
         <(sed -n '2,4p' <<<"$output" | awk '{ print $10 }')
}

@test "--dtype f32 writes f32 layers" {
    dfl-target -q -m "$D/m4" --layers 3 --dtype f32 "$D/tok1.dfl" >"$BATS_TEST_TMPDIR/o.dfl"
    run hsdump "$BATS_TEST_TMPDIR/o.dfl"
    assert_line --partial --index 0 "dtype f32"
    assert_line --partial --index 0 "layers 3"
}

@test "the same inputs give the same bytes" {
    dfl-target -q -m "$D/m4" -o "$BATS_TEST_TMPDIR/a.dfl" "$D/tok3.dfl"
    dfl-target -q -m "$D/m4" -o "$BATS_TEST_TMPDIR/b.dfl" "$D/tok3.dfl"
    cmp "$BATS_TEST_TMPDIR/a.dfl" "$BATS_TEST_TMPDIR/b.dfl"
}

@test "-o FILE gets an index frame; stdout does not; the batches are the same" {
    dfl-target -q -m "$D/m4" -o "$BATS_TEST_TMPDIR/f.dfl" "$D/tok3.dfl"
    dfl-target -q -m "$D/m4" "$D/tok3.dfl" >"$BATS_TEST_TMPDIR/s.dfl"
    hsdump --frames "$BATS_TEST_TMPDIR/f.dfl" | grep -q ' INDEX$'
    ! hsdump --frames "$BATS_TEST_TMPDIR/s.dfl" | grep -q ' INDEX$'
    diff <(hsdump "$BATS_TEST_TMPDIR/f.dfl") <(hsdump "$BATS_TEST_TMPDIR/s.dfl")
}

@test "several inputs, and - for stdin, make one stream" {
    dfl-target -q -m "$D/m4" "$D/tok3.dfl" - "$D/tok1.dfl" <"$D/tok1.dfl" >"$BATS_TEST_TMPDIR/o.dfl"
    run hsdump "$BATS_TEST_TMPDIR/o.dfl"
    assert_line --index 6 "end batches 5 seqs 7 tokens 26"
    assert_line --partial --index 4 "batch 3 seqs 1 tokens 3 lens 3"
}

@test "stdin is the default input" {
    dfl-target -q -m "$D/m4" <"$D/tok1.dfl" >"$BATS_TEST_TMPDIR/o.dfl"
    run hsdump "$BATS_TEST_TMPDIR/o.dfl"
    assert_line --index 2 "end batches 1 seqs 1 tokens 3"
}

@test "a stream without batches gives a stream without batches" {
    printf '' | "$DFL_TOOLS/mktokens" -o "$BATS_TEST_TMPDIR/empty.dfl"
    dfl-target -q -m "$D/m4" "$BATS_TEST_TMPDIR/empty.dfl" >"$BATS_TEST_TMPDIR/o.dfl"
    run hsdump "$BATS_TEST_TMPDIR/o.dfl"
    assert_line --index 1 "end batches 0 seqs 0 tokens 0"
}

@test "tied, sharded, f16 and f32 models run" {
    for args in "--tied" "--shards 3" "--dtype f16" "--dtype f32 --type llama" "--type qwen2"; do
        "$DFL_TOOLS/mktarget" -o "$BATS_TEST_TMPDIR/m" --hidden 32 --heads 4 --kv-heads 2 \
            --intermediate 64 --vocab 128 --layers 3 $args
        run -0 dfl-target -q -m "$BATS_TEST_TMPDIR/m" -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
        run -0 hsdump "$BATS_TEST_TMPDIR/o.dfl"
        rm -rf "$BATS_TEST_TMPDIR/m"
    done
}

@test "qwen3_moe and llama3-rope models run; --info names their experts and rope type" {
    local t="$BATS_TEST_TMPDIR"
    "$DFL_TOOLS/mktarget" -o "$t/moe" --type qwen3_moe --experts 8 --top-k 2 --moe-intermediate 16 \
        --hidden 32 --heads 4 --kv-heads 2 --intermediate 64 --vocab 128 --layers 3
    run -0 dfl-target -m "$t/moe" --info
    assert_output --partial '"num_experts": 8'
    assert_output --partial '"sparse_layers": 3'
    run -0 dfl-target -q -m "$t/moe" --layers 0,2 -o "$t/moe.dfl" "$D/tok3.dfl"
    run -0 hsdump "$t/moe.dfl"
    assert_line --index 4 "end batches 3 seqs 5 tokens 20"
    "$DFL_TOOLS/mktarget" -o "$t/llama" --type llama --hidden 32 --heads 4 --kv-heads 2 \
        --intermediate 64 --vocab 128 --layers 2
    dfl-target -q -m "$t/llama" --dtype f32 --layers 1 -o "$t/plain.dfl" "$D/tok3.dfl"
    sed -i '1s/^{/{"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},/' "$t/llama/config.json"
    run -0 dfl-target -m "$t/llama" --info
    assert_output --partial '"rope_type": "llama3"'
    dfl-target -q -m "$t/llama" --dtype f32 --layers 1 -o "$t/scaled.dfl" "$D/tok3.dfl"
    # the scaled frequencies change the layers (and so the stream)
    ! cmp -s "$t/plain.dfl" "$t/scaled.dfl"
}

@test "qwen3_5_moe (multimodal layout) and qwen3_5_moe_text models run; --info names the shared expert" {
    local t="$BATS_TEST_TMPDIR"
    for type in qwen3_5_moe qwen3_5_moe_text; do
        "$DFL_TOOLS/mktarget" -o "$t/$type" --type $type --experts 8 --top-k 2 --moe-intermediate 16 \
            --shared-intermediate 24 --hidden 32 --heads 4 --kv-heads 2 --vocab 128 --layers 4
        run -0 dfl-target -m "$t/$type" --info
        assert_output --partial "\"model_type\": \"$type\""
        assert_output --partial '"shared_expert_intermediate_size": 24'
        assert_output --partial '"sparse_layers": 4'
        run -0 dfl-target -q -m "$t/$type" --dtype f32 --layers 1,3 -o "$t/$type.dfl" "$D/tok3.dfl"
        run -0 hsdump "$t/$type.dfl"
        assert_line --partial --index 0 "layers 1,3"
        assert_line --index 4 "end batches 3 seqs 5 tokens 20"
    done
}

@test "a batch larger than --max-tokens grows the buffers on the CPU" {
    run --separate-stderr dfl-target -v -m "$D/m4" --max-tokens 4 -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    assert_success
    [[ "$stderr" == *"batch 0 has 9 tokens in 2 sequences: growing the buffers"* ]]
    dfl-target -q -m "$D/m4" -o "$BATS_TEST_TMPDIR/p.dfl" "$D/tok3.dfl"
    cmp "$BATS_TEST_TMPDIR/o.dfl" "$BATS_TEST_TMPDIR/p.dfl"
}

@test "progress and throughput on stderr" {
    run --separate-stderr dfl-target -m "$D/m4" -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    assert_success
    [[ "$stderr" =~ "3 batches, 5 sequences, 20 tokens in "[0-9.]+" s ("[0-9]+" tokens/s)" ]]
}

@test "an input that does not exist fails before the model is loaded" {
    run -1 dfl-target -m "$D/m4" "$BATS_TEST_TMPDIR/nope.dfl"
    assert_output --partial "nope.dfl: No such file or directory"
    refute_output --partial "weights"
}

@test "a missing tensor is exit 2, naming the tensor" {
    run -2 dfl-target -m "$BAD/target/missing-tensor" -o "$BATS_TEST_TMPDIR/o.dfl" "$BAD/target/tokens.dfl"
    assert_output --partial "no tensor 'model.layers.1.mlp.up_proj.weight'"
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
}

@test "a tensor of the wrong shape is exit 2, naming it and both shapes" {
    run -2 dfl-target -m "$BAD/target/wrong-shape" -o "$BATS_TEST_TMPDIR/o.dfl" "$BAD/target/tokens.dfl"
    assert_output --partial "'model.layers.0.self_attn.k_proj.weight' has shape [9, 16], expected [8, 16]"
}

@test "an unknown model_type is exit 2, naming it" {
    run -2 dfl-target -m "$BAD/target/unknown-model-type" --info
    assert_output --partial "model_type 'mistral' is not supported (supported: qwen3, qwen3_moe, llama, qwen2, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text)"
}

@test "a token id out of range is exit 2, naming batch, sequence and position" {
    run -2 dfl-target -m "$BAD/target/good-model" -o "$BATS_TEST_TMPDIR/o.dfl" "$BAD/target/token-out-of-range.dfl"
    assert_output --partial "token-out-of-range.dfl: batch 1, sequence 1, position 3: token id 64 is out of range for the model's vocab_size 64"
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
}

@test "every case of tests/bad/target is refused with its status and message, leaving no output" {
    local n=0
    while IFS=$'\t' read -r name code text; do
        [[ -z "$name" || "$name" == \#* ]] && continue
        out="$BATS_TEST_TMPDIR/$name.out.dfl"
        if [[ "$name" == *.dfl ]]; then
            run dfl-target -m "$BAD/target/good-model" --layers 0 -o "$out" "$BAD/target/$name"
        else
            run dfl-target -m "$BAD/target/$name" --layers 0 -o "$out" "$BAD/target/tokens.dfl"
        fi
        [ "$status" -eq "$code" ] || { echo "$name: status $status, expected $code: $output"; return 1; }
        [[ "$output" == *"$text"* ]] || { echo "$name: message lacks '$text': $output"; return 1; }
        [ ! -e "$out" ] || { echo "$name: left $out behind"; return 1; }
        n=$((n + 1))
    done <"$BAD/target/MANIFEST"
    [ "$n" -ge 15 ]
    # and nothing else beside the output names (no temporaries)
    [ -z "$(ls -A "$BATS_TEST_TMPDIR")" ]
}

@test "a consumer that goes away ends the run: exit 1, 'the consumer went away'" {
    run bash -c "dfl-target -m '$D/m4' --dtype f32 --layers 0,1,2,3 '$D/big.dfl' 2>'$BATS_TEST_TMPDIR/err' | head -c 1 >/dev/null; echo \${PIPESTATUS[0]}"
    assert_output "1"
    run cat "$BATS_TEST_TMPDIR/err"
    assert_output --partial "stdout: the consumer went away (broken pipe)"
}

# Feeds the first batch of big.dfl through a fifo, waits until its hidden states are out, sends
# the signal, then lets the rest come: the run must stop at that batch boundary.
signal_stops() { # signal, output mode (stdout|file)
    local sig=$1 mode=$2 t="$BATS_TEST_TMPDIR"
    local second
    second=$(tokens_frame_offset "$D/big.dfl" 2)
    mkfifo "$t/in"
    ( head -c "$second" "$D/big.dfl"
      while [ ! -e "$t/go" ]; do sleep 0.05; done
      tail -c +$((second + 1)) "$D/big.dfl" ) >"$t/in" &
    if [ "$mode" = file ]; then
        dfl-target -v -m "$D/m4" --dtype f32 -o "$t/out.dfl" "$t/in" 2>"$t/err" &
    else
        dfl-target -m "$D/m4" --dtype f32 "$t/in" >"$t/out.dfl" 2>"$t/err" &
    fi
    local pid=$! i
    for i in $(seq 200); do # until the first batch has been processed
        [ "$mode" = file ] && grep -q "buffers for 256 tokens" "$t/err" && break
        [ "$mode" = stdout ] && [ "$(stat -c %s "$t/out.dfl")" -gt 20000 ] && break
        sleep 0.05
    done
    sleep 0.3
    kill -"$sig" "$pid"
    touch "$t/go"
    local st=0
    wait "$pid" || st=$?
    wait || true
    echo "status $st"; cat "$t/err"
    [ "$st" -eq 1 ]
    grep -q "stopped by signal" "$t/err"
    grep -q "the output stream was cut without an end frame" "$t/err"
}

@test "SIGTERM stops at a batch boundary without an end frame (stdout)" {
    signal_stops TERM stdout
    run -2 hsdump "$BATS_TEST_TMPDIR/out.dfl"
    assert_output --partial "batch 0 seqs 1 tokens 256"
    refute_output --partial "batch 3 "
    refute_output --partial "end batches"
}

@test "SIGINT stops the run and leaves no output file" {
    signal_stops INT file
    [ ! -e "$BATS_TEST_TMPDIR/out.dfl" ]
    [ -z "$(ls -A "$BATS_TEST_TMPDIR" | grep -v '^in$\|^go$\|^err$')" ]
}

@test "--device cuda without a GPU says so and exits 1, leaving no output" {
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        skip "a GPU is present"
    fi
    run -1 dfl-target -m "$D/m4" --device cuda -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    [[ "$output" == *"no CUDA GPU found"* || "$output" == *"no CUDA support"* ]]
    [[ "$output" == *"--device cpu"* ]]
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
    run -1 dfl-target -m "$D/m4" --device cuda:1 -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
}

@test "--inflight: 1 to 64; any number of slots gives the same bytes" {
    run -1 dfl-target -m "$D/m4" --inflight 0 --info
    assert_output --partial "--inflight"
    run -1 dfl-target -m "$D/m4" --inflight 65 --info
    assert_output --partial "--inflight"
    dfl-target -q -m "$D/m4" --dtype f32 --layers 0,1,2,3 "$D/big.dfl" >"$BATS_TEST_TMPDIR/a.dfl"
    for n in 1 3 7; do
        dfl-target -q -m "$D/m4" --dtype f32 --layers 0,1,2,3 --inflight "$n" "$D/big.dfl" >"$BATS_TEST_TMPDIR/b.dfl"
        cmp "$BATS_TEST_TMPDIR/a.dfl" "$BATS_TEST_TMPDIR/b.dfl"
    done
}

@test "--file-io map and register write the same file as write" {
    run -1 dfl-target -m "$D/m4" --file-io mmap --info
    assert_output --partial "--file-io: 'mmap' is not write, map or register"
    dfl-target -q -m "$D/m4" --layers 0,3 --file-io write -o "$BATS_TEST_TMPDIR/w.dfl" "$D/big.dfl" "$D/tok3.dfl"
    for mode in map register; do
        dfl-target -q -m "$D/m4" --layers 0,3 --file-io "$mode" -o "$BATS_TEST_TMPDIR/$mode.dfl" "$D/big.dfl" "$D/tok3.dfl"
        cmp "$BATS_TEST_TMPDIR/w.dfl" "$BATS_TEST_TMPDIR/$mode.dfl"
    done
    run -0 hsdump "$BATS_TEST_TMPDIR/map.dfl"
    assert_line --index 8 "end batches 7 seqs 9 tokens 1044"
    hsdump --frames "$BATS_TEST_TMPDIR/map.dfl" | grep -q ' INDEX$'
}

@test "--file-io map with --zstd, or to a pipe, writes with write(2): same stream" {
    dfl-target -q -m "$D/m4" --zstd 3 -o "$BATS_TEST_TMPDIR/z1.dfl" "$D/tok3.dfl"
    dfl-target -q -m "$D/m4" --zstd 3 --file-io map -o "$BATS_TEST_TMPDIR/z2.dfl" "$D/tok3.dfl"
    cmp "$BATS_TEST_TMPDIR/z1.dfl" "$BATS_TEST_TMPDIR/z2.dfl"
    dfl-target -q -m "$D/m4" "$D/tok3.dfl" | cat >"$BATS_TEST_TMPDIR/p1.dfl"
    dfl-target -q -m "$D/m4" --file-io map "$D/tok3.dfl" | cat >"$BATS_TEST_TMPDIR/p2.dfl"
    cmp "$BATS_TEST_TMPDIR/p1.dfl" "$BATS_TEST_TMPDIR/p2.dfl"
}

@test "--file-io map: a bad batch midway leaves no output and no temporary" {
    mkdir "$BATS_TEST_TMPDIR/out"
    run -2 dfl-target -m "$BAD/target/good-model" --layers 0 --file-io map -o "$BATS_TEST_TMPDIR/out/o.dfl" "$BAD/target/token-out-of-range.dfl"
    assert_output --partial "batch 1, sequence 1, position 3: token id 64 is out of range"
    [ -z "$(ls -A "$BATS_TEST_TMPDIR/out")" ]
}

@test "--vmsplice through a pipe to a slow consumer gives the same bytes" {
    dfl-target -q -m "$D/m4" --dtype f32 --layers 0,1,2,3 "$D/big.dfl" | cat >"$BATS_TEST_TMPDIR/a.dfl"
    for n in 1 2 ""; do   # "": the default (4 slots with --vmsplice)
        dfl-target -q -m "$D/m4" --dtype f32 --layers 0,1,2,3 --vmsplice ${n:+--inflight "$n"} "$D/big.dfl" |
            { sleep 1; cat; } >"$BATS_TEST_TMPDIR/b.dfl"
        cmp "$BATS_TEST_TMPDIR/a.dfl" "$BATS_TEST_TMPDIR/b.dfl"
    done
}

@test "--vmsplice: 4 output slots by default into a pipe, 2 into a file (nothing is spliced there)" {
    dfl-target -v -m "$D/m4" --layers 0,1 --vmsplice "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err" | cat >/dev/null
    grep -q "output: a pipe of .* KiB, vmsplice" "$BATS_TEST_TMPDIR/err"
    grep -q "4 output slots" "$BATS_TEST_TMPDIR/err"
    dfl-target -v -m "$D/m4" --layers 0,1 --vmsplice -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err"
    grep -q "2 output slots" "$BATS_TEST_TMPDIR/err"
    dfl-target -v -m "$D/m4" --layers 0,1 --vmsplice --inflight 3 "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err" | cat >/dev/null
    grep -q "3 output slots" "$BATS_TEST_TMPDIR/err"
}

@test "--output-mode: auto (the default) splices into a pipe and a FIFO, not a file; -v says which" {
    dfl-target -v -m "$D/m4" --layers 0,1 "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err" | cat >"$BATS_TEST_TMPDIR/p.dfl"
    grep -q "output: a pipe of .* KiB, vmsplice" "$BATS_TEST_TMPDIR/err"
    grep -q "4 output slots" "$BATS_TEST_TMPDIR/err"
    dfl-target -v -m "$D/m4" --layers 0,1 --output-mode write "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err" | cat >/dev/null
    grep -q "output: a pipe of .* KiB, write" "$BATS_TEST_TMPDIR/err"
    grep -q "2 output slots" "$BATS_TEST_TMPDIR/err"
    dfl-target -v -m "$D/m4" --layers 0,1 --output-mode vmsplice "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err" | cat >/dev/null
    grep -q "output: a pipe of .* KiB, vmsplice" "$BATS_TEST_TMPDIR/err"
    # the last one wins: --vmsplice then --output-mode write writes
    dfl-target -v -m "$D/m4" --layers 0,1 --vmsplice --output-mode write "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err" | cat >/dev/null
    grep -q "output: a pipe of .* KiB, write" "$BATS_TEST_TMPDIR/err"
    dfl-target -v -m "$D/m4" --layers 0,1 -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err"
    run ! grep -q "output: a pipe" "$BATS_TEST_TMPDIR/err"
    grep -q "2 output slots" "$BATS_TEST_TMPDIR/err"
    mkfifo "$BATS_TEST_TMPDIR/fifo"
    cat "$BATS_TEST_TMPDIR/fifo" >"$BATS_TEST_TMPDIR/f.dfl" &
    dfl-target -v -m "$D/m4" --layers 0,1 -o "$BATS_TEST_TMPDIR/fifo" "$D/tok3.dfl" 2>"$BATS_TEST_TMPDIR/err"
    wait
    grep -q "output: a pipe of .* KiB, vmsplice" "$BATS_TEST_TMPDIR/err"
    cmp "$BATS_TEST_TMPDIR/p.dfl" "$BATS_TEST_TMPDIR/f.dfl"
}

@test "--output-mode: a bad mode is a usage error naming it" {
    run -1 dfl-target -m "$D/m4" --output-mode splice "$D/tok3.dfl"
    assert_output --partial "--output-mode: 'splice' is not auto, vmsplice or write"
}

# 24 batches of 256 tokens, 128 KiB a frame in f32 over 4 layers: a 64 KiB pipe is full behind
# every frame (the writer waits for the reader inside each frame), a 1 MiB one holds the 4 slots'
# frames (the forward waits for the reader before it reuses a slot). The reader starts late and
# reads 4 KiB a millisecond, slower than the forward: a slot rewritten before the reader has read
# its frame out of the pipe changes the bytes read (with the rule broken to "everything written
# is read", all six runs differ), so cmp against write(2).
@test "--output-mode auto on a pipe to a slow reader: the same bytes as write, slots reused with the pipe full or not" {
    for b in $(seq 0 23); do
        seq $((b * 256)) $((b * 256 + 255)) | awk -v b="$b" '{ printf "%s%d", (NR > 1 ? " " : ""), ($1 * 7 + b) % 128 } END { print "" }'
        echo --
    done | mktokens --vocab 128 -o "$BATS_TEST_TMPDIR/many.dfl"
    local args=(-q -m "$D/m4" --dtype f32 --layers 0,1,2,3)
    dfl-target "${args[@]}" --output-mode write "$BATS_TEST_TMPDIR/many.dfl" | cat >"$BATS_TEST_TMPDIR/a.dfl"
    [ "$(stat -c %s "$BATS_TEST_TMPDIR/a.dfl")" -gt $((24 * 128 * 1024)) ]
    for ps in 64K 1M; do
        for n in 1 2 ""; do   # "": the default, 4 slots
            dfl-target "${args[@]}" --pipe-size "$ps" ${n:+--inflight "$n"} "$BATS_TEST_TMPDIR/many.dfl" |
                { sleep 0.5; slowread --chunk 4096 --sleep-us 1000; } >"$BATS_TEST_TMPDIR/b.dfl"
            cmp "$BATS_TEST_TMPDIR/a.dfl" "$BATS_TEST_TMPDIR/b.dfl"
        done
    done
}

@test "--vmsplice: a consumer that goes away ends the run with exit 1" {
    run bash -c "dfl-target -m '$D/m4' --dtype f32 --layers 0,1,2,3 --vmsplice '$D/big.dfl' 2>'$BATS_TEST_TMPDIR/err' | head -c 1 >/dev/null; echo \${PIPESTATUS[0]}"
    assert_output "1"
    run cat "$BATS_TEST_TMPDIR/err"
    assert_output --partial "stdout: the consumer went away (broken pipe)"
}

@test "vmsplice: a consumer that goes away with spliced batches unread in the pipe ends the run with exit 1, not a hang" {
    # every frame fits in the pipe: the writer has nothing left to write and waits for the reader
    # to read the slots' pages, which it never will (POLLERR on the pipe says it has gone)
    run bash -c "timeout 30 dfl-target -m '$D/m4' --layers 0,1 '$D/tok3.dfl' 2>'$BATS_TEST_TMPDIR/err' |
        { sleep 1; head -c 100 >/dev/null; }; echo \${PIPESTATUS[0]}"
    assert_output "1"
    run cat "$BATS_TEST_TMPDIR/err"
    assert_output --partial "stdout: the consumer went away (broken pipe)"
    # and with the forward waiting for a slot (24 frames, 4 slots)
    for b in $(seq 0 23); do echo "$b 1 2 3"; echo --; done | mktokens --vocab 128 -o "$BATS_TEST_TMPDIR/t24.dfl"
    run bash -c "timeout 30 dfl-target -m '$D/m4' --layers 0,1 '$BATS_TEST_TMPDIR/t24.dfl' 2>'$BATS_TEST_TMPDIR/err' |
        { sleep 1; head -c 100 >/dev/null; }; echo \${PIPESTATUS[0]}"
    assert_output "1"
    run cat "$BATS_TEST_TMPDIR/err"
    assert_output --partial "stdout: the consumer went away (broken pipe) after 4 batches"
}

@test "--pipe-size: checked; a stdout pipe is enlarged to it (-v says so), the bytes are the same" {
    run -1 dfl-target -m "$D/m4" --pipe-size 100 --info
    assert_output --partial "--pipe-size: '100' is not a size in [4K, 1G]"
    run -1 dfl-target -m "$D/m4" --pipe-size 2G --info
    assert_output --partial "--pipe-size"
    dfl-target -q -m "$D/m4" --layers 0,1 "$D/big.dfl" | cat >"$BATS_TEST_TMPDIR/a.dfl"
    dfl-target -v -m "$D/m4" --layers 0,1 --pipe-size 128K "$D/big.dfl" 2>"$BATS_TEST_TMPDIR/err" |
        cat >"$BATS_TEST_TMPDIR/b.dfl"
    cmp "$BATS_TEST_TMPDIR/a.dfl" "$BATS_TEST_TMPDIR/b.dfl"
    grep -q "output: a pipe of 128 KiB" "$BATS_TEST_TMPDIR/err"
    # the default asks for 64M and gets at least the system's pipe-max-size (or 64M)
    dfl-target -v -m "$D/m4" --layers 0,1 "$D/big.dfl" 2>"$BATS_TEST_TMPDIR/err" | cat >/dev/null
    max=$(cat /proc/sys/fs/pipe-max-size)
    [ "$max" -le $((64 << 20)) ] || max=$((64 << 20))
    grep -q "output: a pipe of $((max >> 10)) KiB" "$BATS_TEST_TMPDIR/err" ||
        grep -q "output: a pipe of 65536 KiB" "$BATS_TEST_TMPDIR/err"
    # a file is no pipe
    dfl-target -v -m "$D/m4" --layers 0,1 -o "$BATS_TEST_TMPDIR/c.dfl" "$D/big.dfl" 2>"$BATS_TEST_TMPDIR/err"
    ! grep -q "output: a pipe" "$BATS_TEST_TMPDIR/err"
}

@test "--profile=N prints the stage times every N batches and a total" {
    run -1 dfl-target -m "$D/m4" --profile=0 --info
    assert_output --partial "--profile"
    run --separate-stderr dfl-target -m "$D/m4" --profile=2 -o "$BATS_TEST_TMPDIR/o.dfl" "$D/big.dfl"
    assert_success
    [[ "$stderr" == *"profile: batches 0-1: 512 tokens in "* ]]
    [[ "$stderr" == *"profile: batches 2-3: 512 tokens in "* ]]
    [[ "$stderr" =~ "profile: all batches: 1024 tokens in "[0-9.]+" s".*"forward busy "[0-9]+"%".*"input wait".*"output wait".*"bottleneck" ]]
    dfl-target -q -m "$D/m4" -o "$BATS_TEST_TMPDIR/p.dfl" "$D/big.dfl"
    cmp "$BATS_TEST_TMPDIR/o.dfl" "$BATS_TEST_TMPDIR/p.dfl"
}

@test "--profile: the forward's time by kind (GEMMs, attention, chunked delta rule with its TFLOP/s) on a hybrid model" {
    "$DFL_TOOLS/mktarget" -o "$BATS_TEST_TMPDIR/h" --type qwen3_5 --hidden 32 --heads 4 \
        --kv-heads 2 --intermediate 64 --vocab 256 --layers 8
    run --separate-stderr dfl-target -m "$BATS_TEST_TMPDIR/h" --layers 3,7 --profile=2 \
        -o "$BATS_TEST_TMPDIR/o.dfl" "$D/big.dfl"
    assert_success
    line=$(grep "profile: the forward's" <<<"$stderr")
    # 8 layers: 6 Gated DeltaNet (in and out projections), 2 gated attention (qkv, o), 8 MLPs
    # (gate_up, down) = 32 GEMM spans a batch, 2 attention and 6 delta-rule spans
    grep -Eq 'by kind: GEMMs [0-9.]+ s \([0-9.]+%, [0-9.]+ [GT]FLOP/s\); attention [0-9.]+ s \([0-9.]+%\); chunked delta rule [0-9.]+ s \([0-9.]+%, [0-9.]+ [GT]FLOP/s\); the rest \(norms, RoPE, conv, element-wise ops, captures\) [0-9.]+ s' <<<"$line"
    [[ "$line" != *incomplete* ]]
    # the GEMMs by weight shape: MLP gate_up 128x32 and down 32x64, the attention's and the Gated
    # DeltaNet's in and out projections; their seconds add up to the GEMMs' (to the rounding)
    shapes=$(grep "profile: the GEMMs by weight shape" <<<"$stderr")
    [[ "$shapes" == *"128x32 "* && "$shapes" == *"32x64 "* ]]
    gemm_s=$(sed -E 's/.*by kind: GEMMs ([0-9.]+) s.*/\1/' <<<"$line")
    grep -oE '[0-9.]+ s \(' <<<"${shapes#*epilogue): }" | awk -v want="$gemm_s" '{ s += $1; n++ }
        END { if (n < 5 || s < want - 0.0005 * n || s > want + 0.0005 * n) { print n " shapes, " s " s, want " want; exit 1 } }'
    # a dense model has no delta-rule part; the output is the same with and without --profile
    run --separate-stderr dfl-target -m "$D/m4" --profile=2 -o "$BATS_TEST_TMPDIR/p.dfl" "$D/big.dfl"
    line=$(grep "profile: the forward's" <<<"$stderr")
    [[ "$line" == *"GEMMs "* && "$line" == *"attention "* && "$line" != *"delta rule"* ]]
    dfl-target -q -m "$BATS_TEST_TMPDIR/h" --layers 3,7 -o "$BATS_TEST_TMPDIR/q.dfl" "$D/big.dfl"
    cmp "$BATS_TEST_TMPDIR/o.dfl" "$BATS_TEST_TMPDIR/q.dfl"
}

@test "--manifest sizes the buffers from dfl-bucket's warm-up shapes" {
    printf '{"manifest_version": 1, "warmup": [{"bucket": 0, "bound": 8, "seqs": 3, "tokens": 20, "max_len": 8},\n  {"bucket": 1, "bound": 512, "seqs": 1, "tokens": 300, "max_len": 300}]}\n' >"$BATS_TEST_TMPDIR/manifest.json"
    run --separate-stderr dfl-target -v -m "$D/m4" --manifest "$BATS_TEST_TMPDIR/manifest.json" -o "$BATS_TEST_TMPDIR/o.dfl" "$D/big.dfl"
    assert_success
    [[ "$stderr" == *"buffers for 300 tokens"* ]]
    # -v times the end of the run, from the last batch's enqueue to the END frame
    [[ "$stderr" =~ "the end, after the last batch was enqueued: the inputs closed at "[-+][0-9.]+" s".*"the end frame written at +"[0-9.]+" s" ]]
    [[ "$stderr" != *"growing the buffers"* ]]
    dfl-target -q -m "$D/m4" -o "$BATS_TEST_TMPDIR/p.dfl" "$D/big.dfl"
    cmp "$BATS_TEST_TMPDIR/o.dfl" "$BATS_TEST_TMPDIR/p.dfl"
}

@test "--manifest: not there, no warm-up shapes, or with --max-tokens, is refused" {
    run -1 dfl-target -m "$D/m4" --manifest "$BATS_TEST_TMPDIR/none.json" -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    assert_output --partial "none.json"
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
    echo '{"manifest_version": 1}' >"$BATS_TEST_TMPDIR/m.json"
    run -2 dfl-target -m "$D/m4" --manifest "$BATS_TEST_TMPDIR/m.json" -o "$BATS_TEST_TMPDIR/o.dfl" "$D/tok3.dfl"
    assert_output --partial "m.json: no \"warmup\" list of batch shapes"
    [ ! -e "$BATS_TEST_TMPDIR/o.dfl" ]
    run -1 dfl-target -m "$D/m4" --manifest "$BATS_TEST_TMPDIR/m.json" --max-tokens 10 --info
    assert_output --partial "--max-tokens and --manifest"
}

@test "--tune is accepted on the CPU and changes nothing" {
    dfl-target -q -m "$D/m4" --tune -o "$BATS_TEST_TMPDIR/a.dfl" "$D/tok3.dfl"
    dfl-target -q -m "$D/m4" -o "$BATS_TEST_TMPDIR/b.dfl" "$D/tok3.dfl"
    cmp "$BATS_TEST_TMPDIR/a.dfl" "$BATS_TEST_TMPDIR/b.dfl"
}

@test "--tune-file on the CPU: a good file is read and left as it is, an absent one is not made, the output is the same" {
    local t="$BATS_TEST_TMPDIR" h
    h=$(printf '%0128d' 0)
    printf '{"format": "dfl-tune 1", "scope": "some GPU sm_90 cuBLASLt 1", "products": {"k": "%s"}}\n' "$h" >"$t/good.json"
    cp "$t/good.json" "$t/before.json"
    dfl-target -q -m "$D/m4" --tune-file "$t/good.json" -o "$t/a.dfl" "$D/tok3.dfl"
    dfl-target -q -m "$D/m4" --tune-file "$t/absent.json" -o "$t/b.dfl" "$D/tok3.dfl"
    dfl-target -q -m "$D/m4" -o "$t/c.dfl" "$D/tok3.dfl"
    cmp "$t/good.json" "$t/before.json"
    [ ! -e "$t/absent.json" ]
    cmp "$t/a.dfl" "$t/c.dfl"
    cmp "$t/b.dfl" "$t/c.dfl"
    run -1 dfl-target -m "$D/m4" --tune-file "" --info
    assert_output --partial "--tune-file: an empty file name"
}

@test "every case of tests/bad/tune is refused with its status and message before the run, leaving no output" {
    local n=0 out="$BATS_TEST_TMPDIR/o.dfl"
    while IFS='|' read -r name code text; do
        [[ -z "$name" || "$name" == \#* ]] && continue
        run dfl-target -m "$BAD/target/good-model" --layers 0 --tune-file "$BAD/tune/$name" -o "$out" "$BAD/target/tokens.dfl"
        [ "$status" -eq "$code" ] || { echo "$name: status $status, expected $code: $output"; return 1; }
        [[ "$output" == *"--tune-file: $BAD/tune/$name"* ]] || { echo "$name: the message does not name the file: $output"; return 1; }
        [[ "$output" == *"$text"* ]] || { echo "$name: message lacks '$text': $output"; return 1; }
        [ ! -e "$out" ] || { echo "$name: left $out behind"; return 1; }
        n=$((n + 1))
    done <"$BAD/tune/EXPECT"
    [ "$n" -ge 11 ]
}

@test "SIGTERM with --file-io map leaves no output file" {
    local t="$BATS_TEST_TMPDIR" second
    second=$(tokens_frame_offset "$D/big.dfl" 2)
    mkfifo "$t/in"
    ( head -c "$second" "$D/big.dfl"
      while [ ! -e "$t/go" ]; do sleep 0.05; done
      tail -c +$((second + 1)) "$D/big.dfl" ) >"$t/in" &
    dfl-target -v -m "$D/m4" --dtype f32 --file-io map -o "$t/out.dfl" "$t/in" 2>"$t/err" &
    local pid=$! i
    for i in $(seq 200); do
        grep -q "buffers for 256 tokens" "$t/err" && break
        sleep 0.05
    done
    sleep 0.3
    kill -TERM "$pid"
    touch "$t/go"
    local st=0
    wait "$pid" || st=$?
    wait || true
    [ "$st" -eq 1 ]
    grep -q "stopped by signal" "$t/err"
    [ -z "$(ls -A "$t" | grep -v '^in$\|^go$\|^err$')" ]
}

@test "the man page is clean" {
    run mandoc -Tlint -Wwarning "$REPO/man/dfl-target.1"
    assert_success
    assert_output ""
}

@test "cuBLAS is loaded when a CUDA backend opens, not at every start (libdfl does not link it)" {
    command -v readelf >/dev/null || skip "no readelf"
    run -0 readelf -d "$DFL_BUILD/lib/libdfl.so"
    refute_output --partial "libcublas"
    # the programs still start and say what they are without a GPU
    run -0 dfl-target --version
    assert_output --partial "dfl-target"
}
