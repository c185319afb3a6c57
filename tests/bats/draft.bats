#!/usr/bin/env bats
# dfl-draft: options, training on files and pipes, checkpoints, resume, NaN skipping, bad inputs.
# Streams come from the draftdata tool (predictable token sequences for the fixture target).
load helper
bats_require_minimum_version 1.5.0

setup() {
    TGT="$FIXTURES/draft/target"
    CFG="$FIXTURES/draft/config.json"
    export OMP_WAIT_POLICY=passive   # small ops on a shared machine: no spinning threads
    command -v draftdata >/dev/null || PATH="$DFL_TOOLS:$PATH"
    T="$BATS_TEST_TMPDIR"
    # a small drafter: 1 layer, block 8, 16 anchors per sequence
    A=(--target "$TGT" --mask-token-id 63 --draft-layers 1 --block-size 8 --num-anchors 16)
}

# a background dfl-draft a failed test leaves must not keep bats waiting
teardown() {
    [ -z "${BGPID:-}" ] || kill -KILL "$BGPID" 2>/dev/null || true
}

data() { # data OUT [draftdata options]: a stream for the fixture target
    local out=$1
    shift
    draftdata "$TGT" "$out" --batches 6 --seqs 3 --len 24 "$@"
}

losses() { grep -o '"loss":[^,]*' "$1"; }

@test "--help prints the options on stdout and exits 0" {
    assert_help dfl-draft "--target DIR" "--resume PATH"
}

@test "--version" {
    assert_version dfl-draft
}

@test "usage errors exit 1" {
    data "$T/a.dfl"
    run -1 dfl-draft --out "$T/r" "$T/a.dfl"
    [[ "$output" == *"--target"* ]]
    run -1 dfl-draft --target "$TGT" "$T/a.dfl"
    [[ "$output" == *"--out"* ]]
    run -1 dfl-draft "${A[@]}" --out "$T/r"
    [[ "$output" == *"no input"* ]]
    run -1 dfl-draft "${A[@]}" --out "$T/r" --lr fast "$T/a.dfl"
    [[ "$output" == *"--lr"* ]]
    run -1 dfl-draft "${A[@]}" --out "$T/r" --betas 0.9 "$T/a.dfl"
    run -1 dfl-draft "${A[@]}" --out "$T/r" --save-dtype f16 "$T/a.dfl"
    run -1 dfl-draft "${A[@]}" --out "$T/r" --min-ready 9 --pool-size 2 "$T/a.dfl"
    run -1 dfl-draft "${A[@]}" --out "$T/r" --bogus "$T/a.dfl"
}

@test "the mask token is required without a config" {
    data "$T/a.dfl"
    run -1 dfl-draft --target "$TGT" --out "$T/r" "$T/a.dfl"
    [[ "$output" == *"--mask-token-id"* ]]
}

@test "trains on a file: checkpoint in the public layout, path on stdout" {
    data "$T/a.dfl"
    run --separate-stderr dfl-draft "${A[@]}" --out "$T/r" --log-every 2 "$T/a.dfl"
    [ "$status" -eq 0 ]
    [ "$output" = "$(cd "$T/r" && pwd -P)/step-0000006" ]
    for f in model.safetensors config.json optimizer.safetensors trainer_state.json; do
        [ -s "$T/r/latest/$f" ]
    done
    [ "$(readlink "$T/r/latest")" = step-0000006 ]
    grep -q '"DFlashDraftModel"' "$T/r/latest/config.json"
    grep -q '"mask_token_id": 63' "$T/r/latest/config.json"
    grep -q '"block_size": 8' "$T/r/latest/config.json"
    tr -d ' \n' < "$T/r/latest/config.json" | grep -q '"target_layer_ids":\[1,2\]'
    # model.safetensors: the 3 + 11 drafter names, bf16, no prefix
    hdr=$(head -c 8000 "$T/r/latest/model.safetensors")
    [[ "$hdr" == *'"layers.0.self_attn.q_proj.weight":{"data_offsets":'*'],"dtype":"BF16","shape":[32,32]}'* ]]
    [ "$(grep -o '"[a-z_.0-9]*weight":' <<< "$hdr" | wc -l)" -eq 14 ]
    [ "$(grep -o '"dtype":"BF16"' <<< "$hdr" | wc -l)" -eq 14 ]
    ! ls -a "$T/r" | grep -q tmp
}

@test "metrics.jsonl has one line per --log-every steps with every field" {
    data "$T/a.dfl"
    run dfl-draft "${A[@]}" --out "$T/r" --log-every 2 "$T/a.dfl"
    [ "$status" -eq 0 ]
    [ "$(wc -l < "$T/r/metrics.jsonl")" -eq 3 ]
    for k in step loss accuracy acc_per_slot tau lr grad_norm tokens_per_s wait_s skipped_steps; do
        grep -q "\"$k\":" "$T/r/metrics.jsonl"
    done
    tail -1 "$T/r/metrics.jsonl" | grep -q '"step":6'
    # 7 slots per block of 8 (slot 0 is never scored)
    tail -1 "$T/r/metrics.jsonl" | grep -oq '"acc_per_slot":\[[^],]*\(,[^],]*\)\{6\}\]'
}

@test "learns: tau rises well above 1 on predictable continuations" {
    data "$T/a.dfl" --batches 20 --seqs 4 --len 40
    run dfl-draft "${A[@]}" --out "$T/r" --epochs 10 --lr 1e-2 --log-every 20 --save-every 0 "$T/a.dfl"
    [ "$status" -eq 0 ]
    first=$(head -1 "$T/r/metrics.jsonl" | grep -o '"tau":[0-9.]*' | cut -d: -f2)
    last=$(tail -1 "$T/r/metrics.jsonl" | grep -o '"tau":[0-9.]*' | cut -d: -f2)
    # chance is tau ~ 1.02 (slot 1 right 1 time in 63); 200 steps reach about 6 (threshold 3)
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(a < 1.5 && b > 3.0) }'
}

@test "bf16 and f32 streams, f32 weights" {
    data "$T/a.dfl" --dtype f32
    run dfl-draft "${A[@]}" --out "$T/r" --save-dtype f32 "$T/a.dfl"
    [ "$status" -eq 0 ]
    hdr=$(head -c 8000 "$T/r/latest/model.safetensors")
    [[ "$hdr" == *'"fc.weight":{"data_offsets":[0,8192],"dtype":"F32"'* ]]
}

@test "fan-in from two pipes" {
    mkfifo "$T/p1" "$T/p2"
    data "$T/p1" --seed 2 &
    data "$T/p2" --seed 3 &
    run dfl-draft "${A[@]}" --out "$T/r" --total-steps 50 --log-every 1 "$T/p1" "$T/p2"
    [ "$status" -eq 0 ]
    wait
    # 6 + 6 batches arrived; the inputs ended before the 50 steps
    [ "$(wc -l < "$T/r/metrics.jsonl")" -eq 12 ]
}

@test "stdin" {
    data - --seed 4 | dfl-draft "${A[@]}" --out "$T/r" --total-steps 6 -
    [ -d "$T/r/step-0000006" ]
}

@test "a pipe needs --total-steps and cannot be replayed" {
    run -1 bash -c "draftdata '$TGT' - --batches 2 | dfl-draft ${A[*]} --out '$T/r' -"
    [[ "$output" == *"--total-steps"* ]]
    run -1 bash -c "draftdata '$TGT' - --batches 2 | dfl-draft ${A[*]} --out '$T/r' --epochs 2 --total-steps 4 -"
    [[ "$output" == *"--epochs"* ]]
}

@test "replay is deterministic: same seed, same weights" {
    data "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/r1" --epochs 2 --seed 5 "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/r2" --epochs 2 --seed 5 "$T/a.dfl"
    cmp "$T/r1/latest/optimizer.safetensors" "$T/r2/latest/optimizer.safetensors"
    dfl-draft "${A[@]}" --out "$T/r3" --epochs 2 --seed 6 "$T/a.dfl"
    ! cmp -s "$T/r1/latest/optimizer.safetensors" "$T/r3/latest/optimizer.safetensors"
}

@test "resume: N steps, stop, N steps equals 2N steps, bit for bit" {
    data "$T/a.dfl" --batches 10
    B=(--epochs 3 --log-every 1 --save-every 7 --pool-size 4 --min-ready 2 --seed 9)
    dfl-draft "${A[@]}" "${B[@]}" --out "$T/straight" "$T/a.dfl"
    dfl-draft "${A[@]}" "${B[@]}" --out "$T/split" --stop-at 15 "$T/a.dfl"
    [ "$(readlink "$T/split/latest")" = step-0000015 ]
    dfl-draft "${A[@]}" "${B[@]}" --out "$T/split" --resume "$T/split/latest" "$T/a.dfl"
    [ "$(readlink "$T/split/latest")" = step-0000030 ]
    cmp "$T/straight/step-0000030/model.safetensors" "$T/split/step-0000030/model.safetensors"
    cmp "$T/straight/step-0000030/optimizer.safetensors" "$T/split/step-0000030/optimizer.safetensors"
    diff <(losses "$T/straight/metrics.jsonl") <(losses "$T/split/metrics.jsonl")
    [ "$(wc -l < "$T/split/metrics.jsonl")" -eq 30 ]
}

@test "resume from a run directory means its latest; from an intermediate step too" {
    data "$T/a.dfl" --batches 10
    B=(--epochs 2 --log-every 1 --save-every 5 --seed 9)
    dfl-draft "${A[@]}" "${B[@]}" --out "$T/straight" "$T/a.dfl"
    cp -r "$T/straight" "$T/copy"
    dfl-draft "${A[@]}" "${B[@]}" --out "$T/copy" --resume "$T/copy/step-0000010" "$T/a.dfl"
    cmp "$T/straight/step-0000020/optimizer.safetensors" "$T/copy/step-0000020/optimizer.safetensors"
    diff <(losses "$T/straight/metrics.jsonl") <(losses "$T/copy/metrics.jsonl")
    run -0 dfl-draft "${A[@]}" "${B[@]}" --out "$T/copy" --resume "$T/copy" "$T/a.dfl"
}

@test "--keep and --on-save" {
    data "$T/a.dfl"
    run dfl-draft "${A[@]}" --out "$T/r" --epochs 2 --save-every 3 --keep 2 \
        --on-save "echo saved >> '$T/hook.log'; echo" "$T/a.dfl"
    [ "$status" -eq 0 ]
    [ "$(ls -d "$T"/r/step-* | wc -l)" -eq 2 ]
    [ -d "$T/r/step-0000012" ] && [ -d "$T/r/step-0000009" ]
    [ "$(grep -c saved "$T/hook.log")" -eq 4 ]
    run dfl-draft "${A[@]}" --out "$T/r2" --on-save "printf '%s\n' >> '$T/paths'" "$T/a.dfl"
    [ "$(cat "$T/paths")" = "$T/r2/step-0000006" ]
}

@test "a non-finite loss skips the step and is counted" {
    data "$T/nan.dfl" --nan-batch 2
    run --separate-stderr dfl-draft "${A[@]}" --out "$T/r" --log-every 1 "$T/nan.dfl"
    [ "$status" -eq 0 ]
    [[ "$stderr" == *"non-finite loss: skipped"* ]]
    tail -1 "$T/r/metrics.jsonl" | grep -q '"skipped_steps":1'
    grep -q '"adam_step": 5' "$T/r/latest/trainer_state.json"
    grep -q '"step": 6' "$T/r/latest/trainer_state.json"
}

@test "--max-bad-steps non-finite steps in a row stop the run with 2; the last good checkpoint stays" {
    # a stream (arrival order, pool of 1): 4 good batches, then only non-finite ones
    run -2 bash -c "draftdata '$TGT' - --batches 12 --seqs 2 --len 16 --nan-from 4 |
        dfl-draft ${A[*]} --out '$T/r' --total-steps 20 --save-every 2 --pool-size 1 --min-ready 1 \
        --max-bad-steps 3 -"
    [[ "$output" == *"3 non-finite steps in a row"* ]]
    # steps 5 and 6 changed nothing: the checkpoint of step 6 is good (and says so)
    [[ "$output" == *"the last good checkpoint is step 6"* ]]
    [ "$(readlink "$T/r/latest")" = step-0000006 ]
    [ "$(ls -d "$T"/r/step-* | wc -l)" -eq 3 ]
    grep -q '"skipped_steps": 2' "$T/r/latest/trainer_state.json"
    grep -q '"adam_step": 4' "$T/r/latest/trainer_state.json"
    cmp "$T/r/step-0000004/model.safetensors" "$T/r/step-0000006/model.safetensors"
    ! ls -a "$T/r" | grep -q tmp
}

@test "--resume refuses a checkpoint holding a NaN" {
    data "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/r" "$T/a.dfl"
    f="$T/r/latest/optimizer.safetensors"
    hl=$(od -An -tu8 -N8 "$f" | tr -d ' ')
    printf '\000\000\300\177' | dd of="$f" bs=1 seek=$((8 + hl)) conv=notrunc status=none
    run -2 dfl-draft "${A[@]}" --out "$T/r" --resume "$T/r/latest" "$T/a.dfl"
    [[ "$output" == *"not finite"* ]]
}

# setf32 FILE TENSOR VALUE: element 0 of TENSOR in the safetensors FILE becomes the f32 VALUE
setf32() {
    python3 - "$@" <<'PY'
import json, struct, sys
f, name, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
b = bytearray(open(f, 'rb').read())
n = struct.unpack('<Q', b[:8])[0]
o = 8 + n + json.loads(b[8:8 + n])[name]['data_offsets'][0]
b[o:o + 4] = struct.pack('<f', value)
open(f, 'wb').write(b)
PY
}

@test "a weight finite in f32 but beyond bf16 (3.4e38 -> Inf) is never published; f32 saves keep it" {
    command -v python3 >/dev/null || skip "no python3"
    data "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/r" "$T/a.dfl"
    setf32 "$T/r/step-0000006/optimizer.safetensors" master.layers.0.self_attn.k_norm.weight 3.4e38
    cp -r "$T/r" "$T/f32"
    cp -r "$T/r/step-0000006" "$T/before"
    run -2 dfl-draft "${A[@]}" --out "$T/r" --resume "$T/r" --epochs 2 "$T/a.dfl"
    [[ "$output" == *"model weight 'layers.0.self_attn.k_norm.weight' element 0 is 3.4e+38, which is inf in BF16"* ]]
    [[ "$output" == *"checkpoint not written"* ]]
    [ "$(readlink "$T/r/latest")" = step-0000006 ]
    [ "$(ls -d "$T"/r/step-* | wc -l)" -eq 1 ]
    diff -r "$T/before" "$T/r/step-0000006"
    ! ls -a "$T/r" | grep -q tmp
    # in f32 the same value is finite: saved, and dfl-ckpt finds nothing to object to
    run -0 dfl-draft "${A[@]}" --out "$T/f32" --resume "$T/f32" --epochs 2 --save-dtype f32 "$T/a.dfl"
    [ "$(readlink "$T/f32/latest")" = step-0000012 ]
    run -0 dfl-ckpt --check-nan "$T/f32/latest"
}

@test "input without a valid anchor anywhere: exit 2 naming the inputs, no checkpoint" {
    draftdata "$TGT" "$T/one.dfl" --batches 3 --seqs 2 --len 1
    draftdata "$TGT" "$T/m10.dfl" --batches 3 --seqs 2 --len 2 --mask 10
    run -2 --separate-stderr dfl-draft "${A[@]}" --out "$T/r" "$T/one.dfl" "$T/m10.dfl"
    [[ "$stderr" == *"$T/one.dfl, $T/m10.dfl: no valid anchor in any of the 6 batches read"* ]]
    [ -z "$output" ]
    ! ls "$T/r" | grep -q step-
    # through a pipe too (the schedule is known, the input is not)
    run -2 --separate-stderr bash -c "draftdata '$TGT' - --batches 3 --seqs 2 --len 2 --mask 10 |
        dfl-draft ${A[*]} --out '$T/p' --total-steps 5 -"
    [[ "$stderr" == *"-: no valid anchor in any of the 3 batches read"* ]]
    ! ls "$T/p" | grep -q step-
    # one good batch among them is enough: the others are skipped
    data "$T/good.dfl" --batches 1
    run -0 dfl-draft "${A[@]}" --out "$T/g" "$T/one.dfl" "$T/good.dfl"
    [ "$(readlink "$T/g/latest")" = step-0000001 ]
}

@test "--resume refuses a trainer_state.json whose step is not the directory's" {
    data "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/r" --save-every 4 --epochs 2 "$T/a.dfl"
    for s in 100 4611686018427387904; do
        sed -i "s/\"step\": [0-9]*,/\"step\": $s,/" "$T/r/step-0000004/trainer_state.json"
        run -2 dfl-draft "${A[@]}" --out "$T/r" --epochs 2 --resume "$T/r/step-0000004" "$T/a.dfl"
        [[ "$output" == *"trainer_state.json says step $s, but the checkpoint is step-0000004"* ]]
    done
    [ ! -e "$T/r/step-0000100" ]
    [ "$(readlink "$T/r/latest")" = step-0000012 ]
    # through latest (a link): the name it points to counts
    sed -i 's/"step": 12,/"step": 8,/; s/"adam_step": 12,/"adam_step": 8,/' "$T/r/step-0000012/trainer_state.json"
    run -2 dfl-draft "${A[@]}" --out "$T/r" --epochs 2 --resume "$T/r/latest" "$T/a.dfl"
    [[ "$output" == *"says step 8, but the checkpoint is step-0000012"* ]]
    run -0 dfl-draft "${A[@]}" --out "$T/r" --epochs 2 --resume "$T/r/step-0000008" "$T/a.dfl"
}

@test "--out is locked for the run: a second dfl-draft in the directory fails at once, naming it and the PID" {
    mkfifo "$T/p"
    dfl-draft "${A[@]}" --out "$T/r" --total-steps 6 "$T/p" > "$T/out1" 2> "$T/err1" 3>&- &
    pid=$! BGPID=$!
    for i in $(seq 100); do [ -s "$T/r/dfl-draft.lock" ] && break; sleep 0.05; done
    data "$T/a.dfl"
    SECONDS=0
    run -1 --separate-stderr dfl-draft "${A[@]}" --out "$T/r" "$T/a.dfl"
    [ "$SECONDS" -lt 5 ]
    [[ "$stderr" == *"$T/r: the run directory is in use by process $pid"* ]]
    [ -z "$output" ]
    ! ls "$T/r" | grep -q step-
    data "$T/p"   # the first run goes on and ends normally
    wait "$pid"
    [ "$(readlink "$T/r/latest")" = step-0000006 ]
    # the lock ends with the process: a later run (a resume) takes it
    run -0 dfl-draft "${A[@]}" --out "$T/r" --resume "$T/r" --total-steps 12 "$T/a.dfl"
    [ "$(readlink "$T/r/latest")" = step-0000012 ]
}

@test "a truncated stream stops the run with 2 and leaves the last checkpoint intact" {
    data "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/r" --total-steps 100 "$T/a.dfl"
    cp -r "$T/r/step-0000006" "$T/before"
    run -2 bash -c "draftdata '$TGT' - --batches 20 --seqs 3 --len 24 | head -c 30000 |
        dfl-draft ${A[*]} --out '$T/r' --resume '$T/r' --total-steps 100 -"
    [[ "$output" == *"truncated"* ]]
    [ "$(readlink "$T/r/latest")" = step-0000006 ]
    diff -r "$T/before" "$T/r/step-0000006"
    [ "$(ls -d "$T"/r/step-* | wc -l)" -eq 1 ]
    ! ls -a "$T/r" | grep -q tmp
}

@test "SIGTERM writes a checkpoint and exits 1" {
    mkfifo "$T/p"
    draftdata "$TGT" "$T/p" --batches 500 --seqs 2 --len 16 --delay-ms 20 &
    dfl-draft "${A[@]}" --out "$T/r" --total-steps 500 --min-ready 1 --save-every 0 "$T/p" \
        > "$T/out" 2> "$T/err" &
    pid=$!
    for i in $(seq 50); do [ -s "$T/r/metrics.jsonl" ] && break; sleep 0.1; done
    kill -TERM "$pid"
    st=0
    wait "$pid" || st=$?
    [ "$st" -eq 1 ]
    grep -q "stopped by a signal" "$T/err"
    step=$(readlink "$T/r/latest")
    [ -f "$T/r/$step/optimizer.safetensors" ]
    [ "$(cat "$T/out")" = "$(cd "$T/r" && pwd -P)/$step" ]
}

@test "bad inputs are rejected with the exact status and a message naming the problem" {
    data "$T/good.dfl" --batches 2
    while IFS='|' read -r name code words; do
        [[ -z "$name" || "$name" == \#* ]] && continue
        if [[ "$name" == *.json ]]; then
            run dfl-draft --target "$TGT" --out "$T/r-$name" --config "$BAD/draft/$name" "$T/good.dfl"
        else
            run dfl-draft --target "$TGT" --out "$T/r-$name" --config "$CFG" "$BAD/draft/$name"
        fi
        echo "$name: status $status: $output"
        [ "$status" -eq "$code" ]
        [[ "$output" == *"$words"* ]]
        ! ls "$T/r-$name" 2>/dev/null | grep -q step-
    done < "$BAD/draft/EXPECT"
}

@test "a stream whose layers differ from the first stream's is refused" {
    data "$T/a.dfl"
    data "$T/b.dfl" --layers 2,3
    run -2 dfl-draft "${A[@]}" --out "$T/r" "$T/a.dfl" "$T/b.dfl"
    [[ "$output" == *"b.dfl: captured target layers 2,3, the drafter's target layer ids are 1,2"* ]]
}

@test "--config gives the drafter; its config.json is written back" {
    data "$T/a.dfl"
    run dfl-draft --target "$TGT" --out "$T/r" --config "$CFG" -q "$T/a.dfl"
    [ "$status" -eq 0 ]
    grep -q '"num_hidden_layers": 1' "$T/r/latest/config.json"
    grep -q '"num_target_layers": 4' "$T/r/latest/config.json"
}

@test "with dfl-target: a drafter learns from the target's own hidden states" {
    command -v dfl-target >/dev/null || skip "dfl-target not built"
    [ -x "$DFL_TOOLS/mktokens" ] || skip "mktokens not built"
    # 8 batches of 3 predictable sequences, the first two tokens of each unscored
    awk 'BEGIN { srand(3); for (b = 0; b < 8; b++) { if (b) print "--";
            for (s = 0; s < 3; s++) { t = int(rand() * 63); line = "";
                for (i = 0; i < 24; i++) { line = line (i ? " " : "") (i < 2 ? "!" : "") t; t = (5 * t + 3) % 63 }
                print line } } }' | "$DFL_TOOLS/mktokens" --vocab 64 -o "$T/tok.dfl"
    dfl-target --model "$TGT" --layers 1,2 "$T/tok.dfl" > "$T/hs.dfl"
    run dfl-draft "${A[@]}" --out "$T/r" --epochs 20 --lr 1e-2 --log-every 20 --save-every 0 "$T/hs.dfl"
    [ "$status" -eq 0 ]
    last=$(tail -1 "$T/r/metrics.jsonl" | grep -o '"tau":[0-9.]*' | cut -d: -f2)
    # chance is tau ~ 1.02; 160 steps reach about 4.5 (threshold 3)
    awk -v b="$last" 'BEGIN { exit !(b > 3.0) }'
}

@test "--profile: the step's time by kind and the GEMMs by weight shape at the end; --tune; the same checkpoint as without" {
    data "$T/a.dfl"
    # (--tune: nothing to choose on the CPU; accepted, the same checkpoint)
    run --separate-stderr dfl-draft "${A[@]}" --out "$T/r" --log-every 3 --profile --tune "$T/a.dfl"
    assert_success
    line=$(grep "profile: the CPU step's" <<<"$stderr")
    # every kind the step has, with the GEMMs' and the LM head's rates
    for k in 'GEMMs forward [0-9.]+ ms \([0-9.]+%, [0-9.]+ [GT]FLOP/s\)' 'GEMMs backward [0-9.]+ ms \([0-9.]+%, [0-9.]+ [GT]FLOP/s\)' \
             'attention forward [0-9.]+ ms \([0-9.]+%, [0-9.]+ [GT]FLOP/s\)' 'attention backward [0-9.]+ ms' \
             'LM head \+ cross-entropy [0-9.]+ ms \([0-9.]+%, [0-9.]+ [GT]FLOP/s\)' 'norms, RoPE, SwiGLU, copies [0-9.]+ ms' \
             'gradient zeroing \+ optimizer [0-9.]+ ms' 'per step over 6 steps'; do
        grep -Eq "$k" <<<"$line" || { echo "no '$k' in: $line"; false; }
    done
    [[ "$line" != *incomplete* ]]
    # the GEMMs by shape (1 layer of hidden 32, 4 heads of 16 / 2 kv: q 64x32, k and v 32x32,
    # o 32x64, gate_up 128x32, down 32x64; fc 32x32): forward, input and weight gradients; their
    # times add up to the two GEMM kinds' (to the rounding)
    shapes=$(grep "profile: the GEMMs by weight shape" <<<"$stderr")
    for s in "fwd 128x32 " "dx 128x32 " "dW 128x32 " "fwd 32x64 " "dW 32x32 "; do
        [[ "$shapes" == *"$s"* ]] || { echo "no '$s' in: $shapes"; false; }
    done
    want=$(sed -E 's/.*GEMMs forward ([0-9.]+) ms.*GEMMs backward ([0-9.]+) ms.*/\1 \2/' <<<"$line" | awk '{ print $1 + $2 }')
    grep -oE '[0-9.]+ ms \(' <<<"${shapes#*per step: }" | awk -v want="$want" '{ s += $1; n++ }
        END { if (n < 8 || s < want - 0.0005 * n || s > want + 0.0005 * n) { print n " shapes, " s " ms, want " want; exit 1 } }'
    dfl-draft "${A[@]}" --out "$T/q" --log-every 3 "$T/a.dfl" 2>/dev/null
    cmp "$T/r/latest/optimizer.safetensors" "$T/q/latest/optimizer.safetensors"
}

@test "--noise-std perturbs the features, the same way for the same seed" {
    data "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/n1" --noise-std 0.5 "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/n2" --noise-std 0.5 "$T/a.dfl"
    dfl-draft "${A[@]}" --out "$T/n0" "$T/a.dfl"
    cmp "$T/n1/latest/optimizer.safetensors" "$T/n2/latest/optimizer.safetensors"
    ! cmp -s "$T/n1/latest/optimizer.safetensors" "$T/n0/latest/optimizer.safetensors"
    run -1 dfl-draft "${A[@]}" --out "$T/n3" --noise-std -1 "$T/a.dfl"
}

@test "--profile: one line per log window on stderr (input wait, host prep, host syncs); stdout unchanged" {
    data "$T/a.dfl"
    run --separate-stderr dfl-draft "${A[@]}" --out "$T/r" --log-every 2 --profile "$T/a.dfl"
    [ "$status" -eq 0 ]
    [ "$output" = "$(cd "$T/r" && pwd -P)/step-0000006" ]
    [ "$(grep -c '^dfl-draft: profile: steps ' <<<"$stderr")" -eq 3 ]
    grep -q 'profile: steps 1-2: input wait [0-9.]* ms, host prep [0-9.]* ms, GPU step n/a per step; host syncs 0' <<<"$stderr"
    grep -q 'host syncs' <<<"$stderr"
}

@test "--no-pipeline reads each step before the next: the same checkpoint and metrics as the default" {
    data "$T/a.dfl"
    run -0 dfl-draft "${A[@]}" --out "$T/p" --log-every 1 "$T/a.dfl"
    run -0 dfl-draft "${A[@]}" --out "$T/n" --log-every 1 --no-pipeline "$T/a.dfl"
    run -0 dfl-ckpt --diff "$T/p/latest" "$T/n/latest"
    assert_output --partial "identical"
    [ "$(losses "$T/p/metrics.jsonl")" = "$(losses "$T/n/metrics.jsonl")" ]
}

@test "--max-tokens and --max-blocks: bad values are usage errors; on the CPU a larger batch grows the workspace" {
    data "$T/a.dfl"
    run -1 dfl-draft "${A[@]}" --out "$T/r" --max-blocks 0 "$T/a.dfl"
    assert_output --partial "--max-blocks"
    [ ! -e "$T/r" ]
    run -1 dfl-draft "${A[@]}" --out "$T/r" --max-blocks x "$T/a.dfl"
    assert_output --partial "--max-blocks"
    run -0 dfl-draft "${A[@]}" --out "$T/r" --total-steps 6 --max-tokens 8 --max-blocks 2 - < "$T/a.dfl"
    [ "$(readlink "$T/r/latest")" = step-0000006 ]
}
