#!/usr/bin/env bats
# The pipelines (pipelines/dfl-train, dfl-dump, dfl-replay, dfl-plot) on a tiny example on the
# CPU: what they run, their outputs, and their behaviour on failures and signals (the stage is
# named with its log, nothing is left running, dfl-draft writes its checkpoint).
load helper
bats_require_minimum_version 1.5.0

setup_file() {
    local B="$BATS_FILE_TMPDIR"
    PATH="$DFL_BIN:$DFL_TOOLS:$PATH"
    command -v dfl-bucket >/dev/null && command -v demodata >/dev/null || return 0
    export OMP_WAIT_POLICY=passive
    mktarget -o "$B/tgt" --hidden 32 --layers 4 --heads 4 --kv-heads 2 --intermediate 64 --vocab 64
    # 20 small batches in 2 shards, and a larger set (300 batches) for the runs to interrupt
    demodata -n 120 --vocab 64 --min-len 8 --max-len 40 -o "$B/small.jsonl"
    dfl-bucket -q --shards 2 --max-tokens 256 --buckets auto:2 --vocab-size 64 -o "$B/sh" "$B/small.jsonl"
    demodata -n 2000 --vocab 64 --min-len 8 --max-len 40 --seed 2 -o "$B/big.jsonl"
    dfl-bucket -q --shards 2 --max-tokens 256 --buckets auto:2 --vocab-size 64 -o "$B/big" "$B/big.jsonl"
}

setup() {
    command -v dfl-bucket >/dev/null || skip "dfl-bucket not built"
    command -v demodata >/dev/null || PATH="$DFL_TOOLS:$PATH"
    PATH="$DFL_BIN:$REPO/pipelines:$PATH"   # an install of the pipelines in $DFL_BIN comes first
    export OMP_WAIT_POLICY=passive DFL_BIN
    F="$BATS_FILE_TMPDIR"
    T="$BATS_TEST_TMPDIR"
    TGT="$F/tgt"
    # a small drafter (options for dfl-draft after --)
    D=(--mask-token-id 63 --block-size 4 --draft-layers 1 --num-anchors 8 --log-every 1)
}

# no_orphans PIDFILE: no process listed in the pids file, nor any process in their process
# groups, is still alive. A process counts only if it is ours (its command line names a path of
# this test run): on a busy machine a PID is soon reused.
no_orphans() {
    local name pid f line rest pgid p
    [ -s "$1" ] || { echo "$1 is empty"; return 1; }
    while read -r name pid; do
        for f in /proc/[0-9]*/stat; do
            { read -r line <"$f"; } 2>/dev/null || continue
            rest=${line##*) }
            read -r _ _ pgid _ <<<"$rest"
            p=${f#/proc/}
            p=${p%/stat}
            [ "$p" = "$pid" ] || [ "$pgid" = "$pid" ] || continue
            if tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qF "$BATS_RUN_TMPDIR"; then
                echo "$name (PID $pid): process $p is still running: $(tr '\0' ' ' <"/proc/$p/cmdline")"
                return 1
            fi
        done
    done <"$1"
}

# wait_for FILE: waits (at most 30 s) until FILE is not empty
wait_for() {
    local i
    for i in $(seq 300); do [ -s "$1" ] && return 0; sleep 0.1; done
    echo "$1 stayed empty"
    return 1
}

# ---- dfl-train -------------------------------------------------------------------------

@test "dfl-train --help and --version" {
    run --separate-stderr dfl-train --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"--model DIR"* ]]
    [[ "$output" == *"--draft-gpus"* ]]
    [ -z "$stderr" ]
    run dfl-train --version
    [ "$status" -eq 0 ]
    [[ "$output" == "dfl-train (dfl) "* ]]
}

@test "dfl-train: usage errors exit 1 and name the problem" {
    run -1 dfl-train --out "$T/r" "$F/sh"
    [[ "$output" == *"--model"* ]]
    run -1 dfl-train --model "$TGT" "$F/sh"
    [[ "$output" == *"--out"* ]]
    run -1 dfl-train --model "$TGT" --out "$T/r"
    [[ "$output" == *"no shards"* ]]
    run -1 dfl-train --model "$TGT" --out "$T/r" --bogus "$F/sh"
    [[ "$output" == *"--bogus"* ]]
    run -1 dfl-train --model "$TGT" --out "$T/r" --workers 3 "$F/sh"
    [[ "$output" == *"3 workers but 2 shards"* ]]
    run -1 dfl-train --model "$TGT" --out "$T/r" --draft-gpus 1 "$F/sh"
    [[ "$output" == *"--device cuda"* ]]
    run -1 dfl-train --model "$T/none" --out "$T/r" "$F/sh"
    [[ "$output" == *"no config.json"* ]]
    run -1 dfl-train --model "$TGT" --out "$T/r" "$F/sh/shard-00000.dfl"
    [[ "$output" == *"--total-steps"* ]]
    run -1 dfl-train --model "$TGT" --out "$T/r" "$F/sh" -- --total-steps 5
    [[ "$output" == *"give --total-steps to dfl-train"* ]]
    [ ! -e "$T/r" ]
}

@test "dfl-train --dry-run prints one dfl-target per worker, FIFOs, and dfl-draft with the manifest's steps" {
    run --separate-stderr dfl-train --dry-run --model "$TGT" --out "$T/r" --layers 1,2 "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    batches=$(grep -A1 '"counts"' "$F/sh/manifest.json" | grep -o '[0-9]*' | head -1)
    [ "$(grep -c 'dfl-target --model' <<<"$output")" -eq 2 ]
    grep -q "dfl-target .*--layers 1,2 .*shard-00000.dfl > .*/r/fifo/hs-0 2>> .*/r/logs/target-0.log &" <<<"$output"
    grep -q "shard-00001.dfl > .*/r/fifo/hs-1 " <<<"$output"
    grep -q "dfl-draft --target .* --total-steps $batches .*--mask-token-id 63 .*fifo/hs-0 .*fifo/hs-1" <<<"$output"
    [ ! -e "$T/r" ]
}

@test "dfl-train and dfl-dump: the default worker count follows the CPUs, not OMP_NUM_THREADS" {
    ncpu=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    [ "$ncpu" -ge 2 ] || skip "needs 2 CPUs"
    run --separate-stderr env OMP_NUM_THREADS=1 dfl-train --dry-run --model "$TGT" --out "$T/r" "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    [ "$(grep -c 'dfl-target --model' <<<"$output")" -eq 2 ]
    run --separate-stderr env OMP_NUM_THREADS=1 OMP_THREAD_LIMIT=1 dfl-dump --dry-run --model "$TGT" --out "$T/hs" "$F/sh"
    [ "$status" -eq 0 ]
    [ "$(grep -c 'dfl-target --model' <<<"$output")" -eq 2 ]
    # --threads still sets the threads of each process, not the workers
    run --separate-stderr dfl-train --dry-run --threads 1 --model "$TGT" --out "$T/r" "$F/sh" -- "${D[@]}"
    [ "$(grep -c 'dfl-target --model' <<<"$output")" -eq 2 ]
}

@test "dfl-train --device cuda: one worker per target GPU, dfl-draft on the last GPU (dry run, no GPU needed)" {
    run --separate-stderr env CUDA_VISIBLE_DEVICES=0,1,2 dfl-train -n --device cuda --model "$TGT" --out "$T/r" "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    grep -q "dfl-target --model .* --device cuda:0 .*shard-00000.dfl > " <<<"$output"
    grep -q "dfl-target --model .* --device cuda:1 .*shard-00001.dfl > " <<<"$output"
    grep -q "dfl-draft --target .* --device cuda:2 " <<<"$output"
    run --separate-stderr env CUDA_VISIBLE_DEVICES=0,1,2 dfl-train -n --device cuda --target-gpus 2 --draft-gpus 0 --model "$TGT" --out "$T/r" "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    # one target GPU: one worker, reading both shards
    [ "$(grep -c "dfl-target " <<<"$output")" -eq 1 ]
    grep -q -- "--device cuda:2 .*shard-00000.dfl .*shard-00001.dfl > " <<<"$output"
    grep -q "dfl-draft --target .* --device cuda:0 " <<<"$output"
    run -1 env CUDA_VISIBLE_DEVICES= dfl-train -n --device cuda --model "$TGT" --out "$T/r" "$F/sh"
    [[ "$output" == *"no GPU found"* ]]
    run -1 dfl-train -n --device cuda --target-gpus 0 --draft-gpus x --model "$TGT" --out "$T/r" "$F/sh"
    [[ "$output" == *"--draft-gpus: 'x'"* ]]
}

@test "dfl-train: several dfl-draft GPUs run as data-parallel ranks (RANK, WORLD_SIZE, DFL_RENDEZVOUS)" {
    run -0 dfl-train -n --device cuda --target-gpus 0-1 --draft-gpus 2,3 --model "$TGT" --out "$T/r" "$F/sh" -- "${D[@]}"
    [[ "$output" == *"RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 DFL_RENDEZVOUS=$T/r/rendezvous "*"--device cuda:2"* ]]
    [[ "$output" == *"RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 DFL_RENDEZVOUS=$T/r/rendezvous "*"--device cuda:3"* ]]
}

@test "dfl-train trains on the CPU: checkpoint on stdout, a log per process, PIDs recorded, no FIFO left" {
    run --separate-stderr dfl-train --model "$TGT" --out "$T/r" --layers 1,2 "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    batches=$(grep -A1 '"counts"' "$F/sh/manifest.json" | grep -o '[0-9]*' | head -1)
    [ "$output" = "$(cd "$T/r" && pwd -P)/step-$(printf %07d "$batches")" ]
    [ -f "$output/model.safetensors" ]
    [ "$(wc -l <"$T/r/metrics.jsonl")" -eq "$batches" ]
    for l in target-0 target-1 draft-0; do grep -q "^== .*dfl-" "$T/r/logs/$l.log"; done
    grep -q "done: " "$T/r/logs/draft-0.log"
    [ "$(awk '{print $1}' "$T/r/pids" | tr '\n' ' ')" = "dfl-train target-0 target-1 draft-0 " ]
    no_orphans "$T/r/pids"
    [ ! -e "$T/r/fifo" ]
    # dfl-draft's progress is shown on stderr
    [[ "$stderr" == *"dfl-draft: step"* ]]
    if command -v dfl-ckpt >/dev/null; then dfl-ckpt -q --check-nan "$output"; fi
}

@test "dfl-train --eval: dfl-eval on each checkpoint beside the training, its tau in metrics.jsonl" {
    command -v dfl-eval >/dev/null || skip "dfl-eval not built"
    # held-out hidden states: the big set's first shard through dfl-target, once
    dfl-target -q --model "$TGT" --layers 1,2 -o "$T/held.dfl" "$F/big/shard-00000.dfl"
    run --separate-stderr dfl-train --model "$TGT" --out "$T/r" --layers 1,2 --eval "$T/held.dfl" \
        --eval-opt --block-size=3 "$F/sh" -- "${D[@]}" --save-every 4
    [ "$status" -eq 0 ]
    batches=$(grep -A1 '"counts"' "$F/sh/manifest.json" | grep -o '[0-9]*' | head -1)
    # one record per checkpoint (steps 4, 8, ... and the last), after dfl-draft's own lines
    saves=$(( batches / 4 + (batches % 4 > 0) ))
    [ "$(grep -c '"kind":"eval"' "$T/r/metrics.jsonl")" -eq "$saves" ]
    [ "$(grep -vc '"kind":"eval"' "$T/r/metrics.jsonl")" -eq "$batches" ]
    grep -q "^{\"step\":$batches,\"kind\":\"eval\",\"eval_tau\":[0-9.]*,\"eval_speedup_bound\":" "$T/r/metrics.jsonl"
    # dfl-eval's own report, with the options given
    grep -q -- "--block-size=3 $T/held.dfl --draft" "$T/r/logs/eval.log"
    grep -q "blocks of 3 (trained: 4)" "$T/r/logs/eval.log"
    [[ "$stderr" == *"offline tau "*" on the held-out streams (dfl-eval)"* ]]
    no_orphans "$T/r/pids"
    # the tau of the last checkpoint is dfl-eval's on it
    want=$(dfl-eval -q --block-size 3 --draft "$T/r/latest" --target "$TGT" "$T/held.dfl" | grep -o '"tau":[0-9.]*' | cut -d: -f2)
    grep -q "^{\"step\":$batches,\"kind\":\"eval\",\"eval_tau\":$want," "$T/r/metrics.jsonl"
    if command -v gnuplot >/dev/null; then dfl-plot -q "$T/r" >/dev/null; png "$T/r/metrics.png"; fi
}

@test "dfl-train --eval: usage errors" {
    run -1 dfl-train --model "$TGT" --out "$T/r" --eval "$T/none.dfl" "$F/sh" -- "${D[@]}"
    [[ "$output" == *"--eval $T/none.dfl: not a file"* ]]
    touch "$T/h.dfl"
    run -1 dfl-train --model "$TGT" --out "$T/r" --eval "$T/h.dfl" "$F/sh" -- "${D[@]}" --on-save true
    [[ "$output" == *"give one or the other"* ]]
    run -1 dfl-train --model "$TGT" --out "$T/r" --eval-device cpu "$F/sh" -- "${D[@]}"
    [[ "$output" == *"need --eval"* ]]
    run dfl-train --dry-run --model "$TGT" --out "$T/r" --eval "$T/h.dfl" "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    [[ "$output" == *"# after each checkpoint CKPT: "*"dfl-eval --progress 0 --target "*" --draft CKPT"* ]]
    [[ "$output" == *"--on-save "*"dfl-train"*"--eval-hook"* ]]
}

@test "dfl-train with one worker reads both shards in order" {
    run --separate-stderr dfl-train -q --workers 1 --model "$TGT" --out "$T/r" --layers 1,2 "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    grep -q "shard-00000.dfl .*shard-00001.dfl" "$T/r/logs/target-0.log"
    [ ! -e "$T/r/logs/target-1.log" ]
    batches=$(grep -A1 '"counts"' "$F/sh/manifest.json" | grep -o '[0-9]*' | head -1)
    [ "$(wc -l <"$T/r/metrics.jsonl")" -eq "$batches" ]
    [ -z "$stderr" ]
}

@test "dfl-train --passes 2 reads every shard twice and makes twice the steps" {
    run --separate-stderr dfl-train -q --passes 2 --model "$TGT" --out "$T/r" --layers 1,2 "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    batches=$(grep -A1 '"counts"' "$F/sh/manifest.json" | grep -o '[0-9]*' | head -1)
    [ "$(basename "$output")" = "step-$(printf %07d $((2 * batches)))" ]
    grep -q "shard-00000.dfl .*shard-00000.dfl" "$T/r/logs/target-0.log"
    [ "$(wc -l <"$T/r/metrics.jsonl")" -eq $((2 * batches)) ]
}

@test "dfl-train: when dfl-draft has done its steps, the targets are stopped and that is success" {
    run --separate-stderr dfl-train --model "$TGT" --out "$T/r" --layers 1,2 --total-steps 3 "$F/big" -- "${D[@]}"
    [ "$status" -eq 0 ]
    [ -d "$T/r/step-0000003" ]
    [[ "$stderr" != *"error"* ]]
    no_orphans "$T/r/pids"
}

@test "dfl-train refuses a run directory that holds a run, and --resume continues it" {
    dfl-train -q --model "$TGT" --out "$T/r" --layers 1,2 --total-steps 4 "$F/sh" -- "${D[@]}" >/dev/null
    run -1 dfl-train -q --model "$TGT" --out "$T/r" --layers 1,2 "$F/sh" -- "${D[@]}"
    [[ "$output" == *"--resume"* ]]
    run -1 dfl-train -q --resume --model "$TGT" --out "$T/r2" --layers 1,2 "$F/sh" -- "${D[@]}"
    [[ "$output" == *"latest does not exist"* ]]
    # the first run stopped at step 4 of 4; a longer schedule continues from there
    run --separate-stderr dfl-train -q --resume --model "$TGT" --out "$T/r" --layers 1,2 --total-steps 10 "$F/sh" -- "${D[@]}"
    [ "$status" -eq 0 ]
    [ "$(basename "$output")" = step-0000010 ]
    grep -q "resuming from .* at step 4" "$T/r/logs/draft-0.log"
    [ "$(wc -l <"$T/r/metrics.jsonl")" -eq 10 ]
}

@test "dfl-train: a corrupt shard stops the pipeline with status 2, naming the worker and its log" {
    mkdir "$T/sh"
    cp "$F/sh/"* "$T/sh/"
    head -c 3000 "$F/sh/shard-00001.dfl" >"$T/sh/shard-00001.dfl"
    run --separate-stderr dfl-train --model "$TGT" --out "$T/r" --layers 1,2 "$T/sh" -- "${D[@]}"
    [ "$status" -eq 2 ]
    [[ "$stderr" == *"target-1 (dfl-target on cpu) failed with exit status 2; its log $T/r/logs/target-1.log ends:"* ]]
    [[ "$stderr" == *"shard-00001.dfl: truncated"* ]]
    [[ "$stderr" != *"target-0 (dfl-target"* ]]
    no_orphans "$T/r/pids"
    [ ! -e "$T/r/fifo" ]
}

@test "dfl-train: a target that cannot run its model stops the pipeline with status 2" {
    mktarget -o "$T/m" --hidden 32 --layers 4 --heads 4 --kv-heads 2 --intermediate 64 --vocab 64 \
        --wrong-shape model.layers.1.mlp.up_proj.weight
    run --separate-stderr dfl-train --model "$T/m" --out "$T/r" --layers 1,2 "$F/sh" -- "${D[@]}"
    [ "$status" -eq 2 ]
    [[ "$stderr" == *"target-0 (dfl-target on cpu) failed with exit status 2"* ]]
    [[ "$stderr" == *"model.layers.1.mlp.up_proj.weight"* ]]
    no_orphans "$T/r/pids"
}

@test "dfl-train: dfl-draft failing at its start stops the targets waiting on their FIFOs" {
    # no --mask-token-id: dfl-draft exits 1 before it opens the FIFOs the targets write to
    start=$SECONDS
    run --separate-stderr dfl-train --model "$TGT" --out "$T/r" --layers 1,2 "$F/sh" -- --block-size 4
    [ "$status" -eq 1 ]
    [[ "$stderr" == *"draft-0 (dfl-draft on cpu) failed with exit status 1"* ]]
    [[ "$stderr" == *"--mask-token-id"* ]]
    no_orphans "$T/r/pids"
    # stopped by SIGTERM, not by the 30-second SIGKILL deadline
    [ $((SECONDS - start)) -lt 25 ]
}

stop_run() { # SIG PID FILE: once FILE exists, send SIG to PID and wait for it; its exit status in $st
    wait_for "$3"
    kill -"$1" "$2"
    st=0
    wait "$2" || st=$?
}

@test "dfl-train: SIGTERM makes dfl-draft write its checkpoint, then everything exits (status 1)" {
    dfl-train --model "$TGT" --out "$T/r" --layers 1,2 "$F/big" -- "${D[@]}" --min-ready 1 \
        >"$T/out" 2>"$T/err" &
    stop_run TERM $! "$T/r/metrics.jsonl"
    [ "$st" -eq 1 ]
    grep -q "SIGTERM: stopping" "$T/err"
    grep -q "stopped by SIGTERM: checkpoint" "$T/err"
    step=$(readlink "$T/r/latest")
    [ "$(cat "$T/out")" = "$(cd "$T/r" && pwd -P)/$step" ]
    [ -f "$T/r/$step/optimizer.safetensors" ]
    # stopped early: fewer steps than the 300-odd batches
    [ "${step#step-}" -lt 0000200 ]
    no_orphans "$T/r/pids"
    [ ! -e "$T/r/fifo" ]
}

@test "dfl-train: SIGINT (Ctrl-C) does the same" {
    # a background job of a script ignores SIGINT; restore the default as a terminal would have
    python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
        dfl-train --model "$TGT" --out "$T/r" --layers 1,2 "$F/big" -- "${D[@]}" --min-ready 1 \
        >"$T/out" 2>"$T/err" &
    stop_run INT $! "$T/r/metrics.jsonl"
    [ "$st" -eq 1 ]
    grep -q "stopped by SIGINT: checkpoint" "$T/err"
    [ -s "$T/out" ]
    no_orphans "$T/r/pids"
}

@test "dfl-train: a second signal kills everything at once" {
    dfl-train --model "$TGT" --out "$T/r" --layers 1,2 "$F/big" -- "${D[@]}" --min-ready 1 \
        >"$T/out" 2>"$T/err" &
    pid=$!
    wait_for "$T/r/metrics.jsonl"
    kill -TERM "$pid"
    sleep 0.05
    kill -TERM "$pid"
    st=0
    wait "$pid" || st=$?
    [ "$st" -ne 0 ]
    no_orphans "$T/r/pids"
}

# ---- dfl-dump and dfl-replay -------------------------------------------------------------

@test "dfl-dump and dfl-replay: --help, --version and usage errors" {
    for p in dfl-dump dfl-replay; do
        run --separate-stderr "$p" --help
        [ "$status" -eq 0 ]
        [[ "$output" == "Usage: $p "* ]]
        run "$p" --version
        [[ "$output" == "$p (dfl) "* ]]
    done
    run -1 dfl-dump --out "$T/hs" "$F/sh"
    [[ "$output" == *"--model"* ]]
    run -1 dfl-dump --model "$TGT" --out "$T/hs"
    [[ "$output" == *"no shards"* ]]
    run -1 dfl-replay --target "$TGT" "$T/hs"
    [[ "$output" == *"--out"* ]]
    run -1 dfl-replay --target "$TGT" --out "$T/r" "$T/none"
    [[ "$output" == *"no such file"* ]]
    run -1 dfl-replay --target "$TGT" --out "$T/r" --epochs 0 "$F/sh"
    [[ "$output" == *"--epochs"* ]]
    run -1 dfl-replay --target "$TGT" --out "$T/r" "$F/sh" -- --epochs 2
    [[ "$output" == *"give --epochs to dfl-replay"* ]]
}

@test "dfl-dump writes one hidden-state file per shard, prints them, and skips those already there" {
    run --separate-stderr dfl-dump --model "$TGT" --out "$T/hs" --layers 1,2 "$F/sh"
    [ "$status" -eq 0 ]
    [ "$output" = "$T/hs/shard-00000.dfl"$'\n'"$T/hs/shard-00001.dfl" ]
    # the same bytes as dfl-target writes by itself
    dfl-target -q --model "$TGT" --layers 1,2 -o "$T/one.dfl" "$F/sh/shard-00001.dfl"
    cmp "$T/one.dfl" "$T/hs/shard-00001.dfl"
    grep -q "^== .*dfl-target .*-o $T/hs/shard-00000.dfl" "$T/hs/logs/dump-0.log"
    no_orphans "$T/hs/logs/pids"
    # again: nothing to do; --force writes them again, identical
    touch -d '2000-01-01' "$T/hs/shard-00000.dfl"
    run --separate-stderr dfl-dump --model "$TGT" --out "$T/hs" --layers 1,2 "$F/sh"
    [ "$status" -eq 0 ]
    [[ "$stderr" == *"2 of 2 shards already dumped: skipped"* ]]
    [ "$(stat -c %Y "$T/hs/shard-00000.dfl")" = "$(date -d '2000-01-01' +%s)" ]
    run dfl-dump -q --force --model "$TGT" --out "$T/hs" --layers 1,2 "$F/sh"
    [ "$status" -eq 0 ]
    [ "$(stat -c %Y "$T/hs/shard-00000.dfl")" != "$(date -d '2000-01-01' +%s)" ]
    cmp "$T/one.dfl" "$T/hs/shard-00001.dfl"
}

@test "dfl-dump: a corrupt shard fails with status 2 naming the worker; no file for it, nothing left running" {
    mkdir "$T/sh"
    cp "$F/sh/"* "$T/sh/"
    head -c 3000 "$F/sh/shard-00001.dfl" >"$T/sh/shard-00001.dfl"
    run --separate-stderr dfl-dump --model "$TGT" --out "$T/hs" --layers 1,2 "$T/sh"
    [ "$status" -eq 2 ]
    [[ "$stderr" == *"dump-1 (dfl-target on cpu) failed with exit status 2; its log $T/hs/logs/dump-1.log ends:"* ]]
    [ ! -e "$T/hs/shard-00001.dfl" ]
    ! ls -a "$T/hs" | grep -q tmp
    no_orphans "$T/hs/logs/pids"
}

@test "dfl-replay trains on dumped files for several epochs" {
    dfl-dump -q --model "$TGT" --out "$T/hs" --layers 1,2 "$F/sh" >/dev/null
    run --separate-stderr dfl-replay --target "$TGT" --out "$T/r" --epochs 3 "$T/hs" -- "${D[@]}"
    [ "$status" -eq 0 ]
    batches=$(grep -A1 '"counts"' "$F/sh/manifest.json" | grep -o '[0-9]*' | head -1)
    [ "$(basename "$output")" = "step-$(printf %07d $((3 * batches)))" ]
    [ "$(wc -l <"$T/r/metrics.jsonl")" -eq $((3 * batches)) ]
    grep -q "replay" "$T/r/logs/draft-0.log"
    no_orphans "$T/r/pids"
}

@test "dfl-replay: stopped by SIGTERM and resumed, the run ends exactly as an uninterrupted one" {
    dfl-dump -q --model "$TGT" --out "$T/hs" --layers 1,2 "$F/big" >/dev/null
    R=(--epochs 1 "$T/hs" -- "${D[@]}" --save-every 0 --seed 7)
    dfl-replay -q --target "$TGT" --out "$T/a" "${R[@]}" >/dev/null
    dfl-replay --target "$TGT" --out "$T/b" "${R[@]}" >"$T/out" 2>"$T/err" &
    stop_run TERM $! "$T/b/metrics.jsonl"
    [ "$st" -eq 1 ]
    grep -q "stopped by SIGTERM: checkpoint" "$T/err"
    no_orphans "$T/b/pids"
    stopped=$(readlink "$T/b/latest")
    [ "$stopped" != "$(readlink "$T/a/latest")" ]
    run dfl-replay -q --resume --target "$TGT" --out "$T/b" "${R[@]}"
    [ "$status" -eq 0 ]
    [ "$(readlink "$T/b/latest")" = "$(readlink "$T/a/latest")" ]
    cmp "$T/a/latest/model.safetensors" "$T/b/latest/model.safetensors"
    cmp "$T/a/latest/optimizer.safetensors" "$T/b/latest/optimizer.safetensors"
}

# ---- dfl-plot ----------------------------------------------------------------------------

metrics() { # a small metrics.jsonl as dfl-draft writes it
    mkdir -p "$T/run"
    for s in 10 20 30; do
        printf '{"acc_per_slot":[0.1,0.2],"accuracy":0.%d,"grad_norm":0.5,"loss":%d.5,"lr":0.001,"skipped_steps":0,"step":%d,"tau":1.%d,"tokens":1000,"tokens_per_s":%d00.5,"wait_s":0.01}\n' \
            "$s" $((60 - s)) "$s" "$s" "$s"
    done >"$T/run/metrics.jsonl"
}

png() { # FILE: the PNG signature
    [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]
}

@test "dfl-plot writes a PNG beside metrics.jsonl and prints its path" {
    command -v gnuplot >/dev/null || skip "gnuplot not installed"
    metrics
    run --separate-stderr dfl-plot "$T/run"
    [ "$status" -eq 0 ]
    [ "$output" = "$T/run/metrics.png" ]
    png "$T/run/metrics.png"
    [ "$(stat -c %s "$T/run/metrics.png")" -gt 10000 ]
    ! ls -a "$T/run" | grep -q dfl-plot
}

@test "dfl-plot draws dfl-eval's records of dfl-train --eval beside the training tau" {
    command -v gnuplot >/dev/null || skip "gnuplot not installed"
    metrics
    printf '{"step":2,"kind":"eval","eval_tau":1.5,"eval_speedup_bound":1.4,"eval_response_tokens":100,"eval_sequences":3}\n' >>"$T/run/metrics.jsonl"
    run --separate-stderr dfl-plot -o "$T/e.png" "$T/run"
    [ "$status" -eq 0 ]
    png "$T/e.png"
    # the eval record is not a training line
    [[ "$stderr" == *": $(($(wc -l <"$T/run/metrics.jsonl") - 1)) lines of "* ]]
    # an eval record alone is no metrics
    printf '{"step":2,"kind":"eval","eval_tau":1.5}\n' >"$T/only.jsonl"
    run -2 dfl-plot -o "$T/o.png" "$T/only.jsonl"
}

@test "dfl-plot -o, --size, a metrics file given by name, and values that are null" {
    command -v gnuplot >/dev/null || skip "gnuplot not installed"
    metrics
    sed -i '2s/"loss":[^,]*/"loss":null/' "$T/run/metrics.jsonl"
    run dfl-plot -q -o "$T/x.png" --size 400x300 "$T/run/metrics.jsonl"
    [ "$status" -eq 0 ]
    png "$T/x.png"
    [ "$(od -An -tu1 -j16 -N8 "$T/x.png" | tr -s ' ')" = " 0 0 1 144 0 0 1 44" ]
}

@test "dfl-plot: an empty or bad metrics file is invalid data (status 2); a missing one status 1" {
    command -v gnuplot >/dev/null || skip "gnuplot not installed"
    mkdir "$T/run"
    : >"$T/run/metrics.jsonl"
    run -2 dfl-plot "$T/run"
    [[ "$output" == *"no metrics line"* ]]
    printf '{"step":1,"loss":2}\nnot json\n' >"$T/run/metrics.jsonl"
    run -2 dfl-plot "$T/run"
    [[ "$output" == *"metrics.jsonl:2: not a metrics line"* ]]
    [ ! -e "$T/run/metrics.png" ]
    run -1 dfl-plot "$T/none"
    [[ "$output" == *"no such file"* ]]
    run -1 dfl-plot --size 10 "$T/run"
    [[ "$output" == *"--size"* ]]
}

@test "dfl-plot says so when gnuplot is missing" {
    mkdir "$T/bin"
    for t in bash awk sed head cat mktemp dirname basename readlink rm mv chmod wc od tr; do
        ln -s "$(command -v "$t")" "$T/bin/$t"
    done
    metrics
    run -1 env PATH="$T/bin" "$(command -v dfl-plot)" "$T/run"
    [[ "$output" == *"gnuplot is not installed"* ]]
}
