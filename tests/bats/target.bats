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
    assert_output --partial "model_type 'mistral' is not supported (supported: qwen3, llama, qwen2)"
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

@test "the man page is clean" {
    run mandoc -Tlint -Wwarning "$REPO/man/dfl-target.1"
    assert_success
    assert_output ""
}
