#!/usr/bin/env bats
# faults.bats: fault injection on the CPU. Producers killed mid-frame, consumers that die,
# signals and crashes while checkpoints are written, full disks, flipped bits, non-finite values
# and dumps without an END frame: every program must fail cleanly (the right status, a message
# naming the place) or go on, and never lose a checkpoint or leave one that looks complete but
# is not. Processes are started in the background with their PIDs kept and signalled by PID;
# every wait is bounded (a hang fails the test), and BATS_TEST_TIMEOUT is the backstop.
# Programs: dfl-draft, dfl-target, dfl-bucket, dfl-ckpt. Tools: stall (a producer that stops
# and waits to be killed), poison (plants a NaN or Inf), draftdata, mktokens, hsdump; the test
# hook DFL_TEST_FAULT of lib/formats/draft_ckpt.c.
load helper
bats_require_minimum_version 1.5.0
PATH="$DFL_TOOLS:$PATH"
BATS_TEST_TIMEOUT=${BATS_TEST_TIMEOUT:-300}

setup_file() {
    export OMP_WAIT_POLICY=passive
    export D="$BATS_FILE_TMPDIR" TGT="$FIXTURES/draft/target"
    local dd=(--seqs 3 --len 24)
    draftdata "$TGT" "$D/a.dfl" --batches 8 "${dd[@]}"                   # indexed file (replay)
    draftdata "$TGT" "$D/s.dfl" --batches 12 "${dd[@]}" --no-index      # the bytes of a pipe
    draftdata "$TGT" "$D/s2.dfl" --batches 12 "${dd[@]}" --no-index --seed 7
    # token streams for dfl-target: 12 batches of 4 x 50 tokens, and 40 of 4 x 200
    local nb len
    for nb in 12 40; do
        len=$((nb == 12 ? 50 : 200))
        awk -v nb="$nb" -v len="$len" 'BEGIN { srand(nb); for (b = 0; b < nb; b++) { if (b) print "--";
                for (s = 0; s < 4; s++) { t = int(rand() * 63); line = "";
                    for (i = 0; i < len; i++) { line = line (i ? " " : "") t; t = (5 * t + 3) % 63 }
                    print line } } }' | mktokens --vocab 64 -o "$D/tok$nb.dfl"
    done
    # one batch of 100 sequences x 60 tokens: 3 MB of f32 hidden states for 4 layers, more than
    # a pipe holds
    awk 'BEGIN { for (s = 0; s < 100; s++) { t = s % 63; line = "";
            for (i = 0; i < 60; i++) { line = line (i ? " " : "") t; t = (5 * t + 3) % 63 }
            print line } }' | mktokens --vocab 64 -o "$D/tokbig.dfl"
    # the reference: 16 steps (2 epochs of a.dfl), a checkpoint every 2
    dfl-draft --target "$TGT" --mask-token-id 63 --draft-layers 1 --block-size 8 --num-anchors 16 \
        --epochs 2 --save-every 2 --log-every 1 --seed 5 -q --out "$D/straight" "$D/a.dfl" >/dev/null
}

setup() {
    T="$BATS_TEST_TMPDIR"
    A=(--target "$TGT" --mask-token-id 63 --draft-layers 1 --block-size 8 --num-anchors 16)
    B=(--epochs 2 --save-every 2 --log-every 1 --seed 5)   # as the reference run
    TO=(timeout -k 5 120)   # a foreground command that hangs fails its test
    PIDS=()
}

teardown() {
    local p
    for p in "${PIDS[@]}"; do
        kill -KILL "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
}

# bg IN OUT ERR CMD...: starts CMD in the background (fd 3 closed, for bats), its PID in $pid
bg() {
    local in=$1 out=$2 err=$3
    shift 3
    "$@" <"$in" >"$out" 2>"$err" 3>&- &
    pid=$!
    PIDS+=("$pid")
}

# pstate PID: the state letter of a process (R, S, T stopped, Z exited), or "gone"
pstate() {
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || { echo gone; return; }
    s=${s##*) }
    echo "${s%% *}"
}

# finish PID SECS: waits at most SECS seconds for background process PID to end and puts its exit
# status in $st; one still running then is killed and the test fails
finish() {
    local end=$((SECONDS + $2)) s
    while s=$(pstate "$1"); [ "$s" != Z ] && [ "$s" != gone ]; do
        if [ "$SECONDS" -ge "$end" ]; then
            kill -KILL "$1" 2>/dev/null
            echo "process $1 did not end within $2 s (a hang)"
            return 1
        fi
        sleep 0.05
    done
    st=0
    wait "$1" || st=$?
}

# wait_for SECS CMD...: runs CMD every 0.05 s until it succeeds; fails after SECS seconds
wait_for() {
    local end=$((SECONDS + $1))
    shift
    until "$@"; do
        [ "$SECONDS" -lt "$end" ] || { echo "timed out waiting for: $*"; return 1; }
        sleep 0.05
    done
}

stopped() { [ "$(pstate "$1")" = T ]; }
has_line() { [ -f "$2" ] && grep -q -- "$1" "$2"; }

frame_offset() { # FILE N: the offset of frame N (0 is HEADER) of a stream
    hsdump --frames "$1" | awk -v n="$2" 'NR == n + 1 { print $1; exit }'
}
end_of_batches() { # FILE: the offset of the first frame after the batches (INDEX or END)
    hsdump --frames "$1" | awk '$2 == "INDEX" || $2 == "END" { print $1; exit }'
}
step_of() { local s; s=$(readlink "$1/latest"); echo $((10#${s#step-})); }
losses() { grep -o '"loss":[^,]*' "$1"; }

# check_ckpts RUN: latest names a checkpoint, and every directory that looks like a checkpoint is
# one: its four files, dfl-ckpt --verify clean, trainer_state.json at its step
check_ckpts() {
    local d f n dirs=()
    [ -d "$1/$(readlink "$1/latest")" ]
    for d in "$1"/step-*; do
        [ -d "$d" ] || continue
        dirs+=("$d")
        n=$((10#${d##*step-}))
        for f in model.safetensors config.json optimizer.safetensors trainer_state.json; do
            [ -s "$d/$f" ] || { echo "$d: no $f"; return 1; }
        done
        grep -q "\"step\": $n," "$d/trainer_state.json" || { echo "$d: not step $n"; return 1; }
    done
    dfl-ckpt -q --verify "${dirs[@]}" || { echo "dfl-ckpt --verify: ${dirs[*]}"; return 1; }
}
no_temporaries() { ! ls -A "$1" | grep -q '^\.'; }

same_as_straight() { # RUN: its step 16 is the reference's, bit for bit, with the same losses
    cmp "$D/straight/step-0000016/model.safetensors" "$1/step-0000016/model.safetensors"
    cmp "$D/straight/step-0000016/optimizer.safetensors" "$1/step-0000016/optimizer.safetensors"
    diff <(losses "$D/straight/metrics.jsonl") <(losses "$1/metrics.jsonl")
}

# ---- the producer dies --------------------------------------------------------------------------

@test "a producer killed mid-frame: the consumer names the cut frame and exits 2; its last checkpoint resumes" {
    local off
    off=$(frame_offset "$D/s.dfl" 8)
    mkfifo "$T/p"
    bg /dev/null "$T/p" "$T/stall.err" stall "$D/s.dfl" $((off + 1000)) --ready "$T/ready"
    local spid=$pid
    bg /dev/null "$T/out" "$T/err" dfl-draft "${A[@]}" --out "$T/r" --total-steps 100 --save-every 2 \
        --min-ready 1 --pool-size 1 "$T/p"
    local dpid=$pid
    wait_for 60 test -e "$T/ready"   # frames 1..7 and 1000 bytes of frame 8 are in the pipe
    kill -KILL "$spid"
    finish "$dpid" 60
    cat "$T/err"
    [ "$st" -eq 2 ]
    grep -q "truncated inside frame 8 (HIDDEN) at offset $off: 1000 of its [0-9]* bytes present" "$T/err"
    [ ! -s "$T/out" ]
    # 7 complete batches arrived; the checkpoints are those of steps 2, 4, 6 written before the cut
    local n
    n=$(step_of "$T/r")
    [ "$n" -ge 2 ]
    [ "$n" -le 6 ]
    check_ckpts "$T/r"
    no_temporaries "$T/r"
    run -0 "${TO[@]}" dfl-draft "${A[@]}" --out "$T/r" --resume "$T/r" --total-steps 100 \
        --save-every 2 --stop-at $((n + 2)) "$D/s2.dfl"
    [[ "$output" == *"resuming from $T/r/latest at step $n"* ]]
    [ "$(step_of "$T/r")" -eq $((n + 2)) ]
    check_ckpts "$T/r"
}

@test "dfl-target killed while it streams to dfl-draft: the cut stream stops the run with 2; the last checkpoint resumes" {
    mkfifo "$T/tok" "$T/hs"
    # every batch of tok12, then nothing: dfl-target waits for more input until it is killed
    bg /dev/null "$T/tok" "$T/stall.err" stall "$D/tok12.dfl" "$(end_of_batches "$D/tok12.dfl")"
    bg /dev/null "$T/hs" "$T/target.err" dfl-target --model "$TGT" --layers 1,2 "$T/tok"
    local tpid=$pid
    bg /dev/null "$T/out" "$T/err" dfl-draft "${A[@]}" --out "$T/r" --total-steps 100 --save-every 2 \
        --min-ready 1 --pool-size 1 "$T/hs"
    local dpid=$pid
    wait_for 120 test -L "$T/r/latest"
    kill -KILL "$tpid"
    finish "$dpid" 60
    cat "$T/err"
    [ "$st" -eq 2 ]
    grep -q "truncated" "$T/err"
    check_ckpts "$T/r"
    no_temporaries "$T/r"
    local n
    n=$(step_of "$T/r")
    run -0 "${TO[@]}" dfl-draft "${A[@]}" --out "$T/r" --resume "$T/r" --total-steps 100 \
        --stop-at $((n + 1)) "$D/a.dfl"
    [ "$(step_of "$T/r")" -eq $((n + 1)) ]
}

# ---- the consumer dies --------------------------------------------------------------------------

@test "the consumer dies: dfl-target exits 1 promptly, saying the consumer went away" {
    mkfifo "$T/hs"
    # 40 batches of 16 MB in all (f32, 4 layers): far more than the pipe and dfl-draft's pool hold,
    # so dfl-target is still writing when its consumer is killed
    bg /dev/null "$T/hs" "$T/target.err" dfl-target --model "$TGT" --layers 0,1,2,3 --dtype f32 \
        "$D/tok40.dfl"
    local tpid=$pid
    bg /dev/null /dev/null "$T/err" dfl-draft "${A[@]}" --out "$T/r" --total-steps 1000 --log-every 1 \
        --min-ready 1 --pool-size 1 "$T/hs"
    local dpid=$pid
    wait_for 120 test -s "$T/r/metrics.jsonl"
    kill -KILL "$dpid"
    finish "$tpid" 15
    cat "$T/target.err"
    [ "$st" -eq 1 ]
    grep -q "error: stdout: the consumer went away (broken pipe) after [0-9]* batches" "$T/target.err"
}

# sigterm_stalled TOKENS: dfl-target writes into a pipe whose reader holds it open but does not
# read; SIGTERM must end it promptly (status 1, the stream cut), not wait for the reader
sigterm_stalled() {
    mkfifo "$T/hs"
    bg "$T/hs" /dev/null /dev/null sleep 600   # holds the pipe open, never reads
    bg /dev/null "$T/hs" "$T/target.err" dfl-target -v --model "$TGT" --layers 0,1,2,3 --dtype f32 "$1"
    local tpid=$pid
    wait_for 60 has_line "buffers for" "$T/target.err"
    sleep 2   # the pipe fills up; dfl-target blocks on it
    kill -TERM "$tpid"
    finish "$tpid" 15
    cat "$T/target.err"
    [ "$st" -eq 1 ]
    grep -q "error: stopped by signal 15 (Terminated) after [0-9]* batches: the output stream was cut without an end frame" "$T/target.err"
}

@test "SIGTERM while the consumer stalls mid-stream: dfl-target stops promptly with 1" {
    sigterm_stalled "$D/tok40.dfl"   # 16 MB: the output queue fills up behind the blocked write
}

@test "SIGTERM while the last batch waits for a stalled consumer: dfl-target stops promptly with 1" {
    sigterm_stalled "$D/tokbig.dfl"   # one batch, 3 MB: the input has ended, the write is pending
}

# ---- signals and crashes while checkpointing ----------------------------------------------------

@test "SIGTERM while a checkpoint is being written: it is completed, the run exits 1, and resuming ends as an uninterrupted run" {
    bg /dev/null "$T/out" "$T/err" env DFL_TEST_FAULT=ckpt-after-model@4:stop \
        dfl-draft "${A[@]}" "${B[@]}" --out "$T/r" "$D/a.dfl"
    local dpid=$pid
    wait_for 60 stopped "$dpid"   # stopped by the hook, half-way through the checkpoint of step 4
    [ -f "$T/r/.step-0000004.tmp/model.safetensors" ]
    kill -TERM "$dpid"
    kill -CONT "$dpid"
    finish "$dpid" 60
    cat "$T/err"
    [ "$st" -eq 1 ]
    grep -q "stopped by a signal at step 4" "$T/err"
    [ "$(cat "$T/out")" = "$(cd "$T/r" && pwd -P)/step-0000004" ]
    [ "$(readlink "$T/r/latest")" = step-0000004 ]
    check_ckpts "$T/r"
    no_temporaries "$T/r"
    run -0 "${TO[@]}" dfl-draft "${A[@]}" "${B[@]}" --out "$T/r" --resume "$T/r" "$D/a.dfl"
    same_as_straight "$T/r"
}

@test "SIGTERM while the producer stalls: dfl-draft checkpoints the steps it made and exits 1 promptly" {
    mkfifo "$T/p"
    bg /dev/null "$T/p" "$T/stall.err" stall "$D/s.dfl" "$(frame_offset "$D/s.dfl" 6)"   # 5 batches
    bg /dev/null "$T/out" "$T/err" dfl-draft "${A[@]}" --out "$T/r" --total-steps 100 --save-every 0 \
        --log-every 1 --min-ready 1 --pool-size 1 "$T/p"
    local dpid=$pid
    wait_for 60 has_line '"step":5,' "$T/r/metrics.jsonl"
    kill -TERM "$dpid"
    finish "$dpid" 15
    cat "$T/err"
    [ "$st" -eq 1 ]
    grep -q "stopped by a signal at step 5" "$T/err"
    [ "$(readlink "$T/r/latest")" = step-0000005 ]
    [ "$(cat "$T/out")" = "$(cd "$T/r" && pwd -P)/step-0000005" ]
    check_ckpts "$T/r"
}

@test "SIGTERM while an --on-save command hangs: dfl-draft says what it waits for; a second SIGTERM ends it at once" {
    mkfifo "$T/p"
    bg /dev/null "$T/p" "$T/stall.err" stall "$D/s.dfl" "$(frame_offset "$D/s.dfl" 6)"   # 5 batches
    bg /dev/null "$T/out" "$T/err" dfl-draft "${A[@]}" --out "$T/r" --total-steps 100 --save-every 2 \
        --log-every 1 --min-ready 1 --pool-size 1 --on-save 'exec sleep 60 #' "$T/p"
    local dpid=$pid
    wait_for 60 has_line '"step":5,' "$T/r/metrics.jsonl"
    kill -TERM "$dpid"
    wait_for 30 has_line "waiting for 3 --on-save commands to end (pid " "$T/err"   # steps 2, 4, 5
    local hooks
    hooks=$(grep -o "to end (pid [0-9, ]*)" "$T/err" | grep -o "[0-9]*")
    PIDS+=($hooks)
    [ "$(readlink "$T/r/latest")" = step-0000005 ]
    sleep 1
    [ "$(pstate "$dpid")" != Z ]   # still waiting for the hooks, as it said
    kill -TERM "$dpid"
    finish "$dpid" 10
    [ "$st" -eq 143 ]
    check_ckpts "$T/r"
}

# killed_at POINT: SIGKILL (the test hook) at POINT of writing the checkpoint of step 4. Nothing
# that looks like a checkpoint is half-written; latest is step 2; --resume refuses a leftover
# temporary; resuming from the run picks step 2, clears the leftovers, and ends as an
# uninterrupted run would.
killed_at() {
    run -137 "${TO[@]}" env DFL_TEST_FAULT="$1@4" dfl-draft "${A[@]}" "${B[@]}" --out "$T/r" "$D/a.dfl"
    [[ "$output" == *"DFL_TEST_FAULT: dying at $1 of the checkpoint of step 4"* ]]
    [ "$(readlink "$T/r/latest")" = step-0000002 ]
    check_ckpts "$T/r"
    if [ "$1" = ckpt-before-latest ]; then
        cmp "$D/straight/step-0000004/optimizer.safetensors" "$T/r/step-0000004/optimizer.safetensors"
    else
        [ ! -e "$T/r/step-0000004" ]
        [ -d "$T/r/.step-0000004.tmp" ]
        if [ -f "$T/r/.step-0000004.tmp/trainer_state.json" ]; then
            run -2 dfl-draft "${A[@]}" "${B[@]}" --out "$T/r" --resume "$T/r/.step-0000004.tmp/" "$D/a.dfl"
            [[ "$output" == *"an incomplete (temporary) checkpoint left by an interrupted save"* ]]
        fi
    fi
    run -0 "${TO[@]}" dfl-draft "${A[@]}" "${B[@]}" --out "$T/r" --resume "$T/r" "$D/a.dfl"
    [[ "$output" == *"resuming from $T/r/latest at step 2"* ]]
    same_as_straight "$T/r"
    check_ckpts "$T/r"
    no_temporaries "$T/r"
}

@test "SIGKILL as a checkpoint's directory is created: resume picks the previous one" {
    killed_at ckpt-begin
}

@test "SIGKILL after a checkpoint's model.safetensors: resume picks the previous one" {
    killed_at ckpt-after-model
}

@test "SIGKILL before a complete checkpoint is renamed into place: resume picks the previous one" {
    killed_at ckpt-before-rename
}

@test "SIGKILL after the rename, before latest: resume picks the previous one" {
    killed_at ckpt-before-latest
}

@test "SIGKILL while --keep removes an old checkpoint: no incomplete checkpoint is left" {
    run -137 "${TO[@]}" env DFL_TEST_FAULT=ckpt-prune@4 dfl-draft "${A[@]}" "${B[@]}" --keep 2 \
        --out "$T/r" "$D/a.dfl"
    # step 8 was written, then step 4 was being removed
    [ "$(readlink "$T/r/latest")" = step-0000008 ]
    [ ! -e "$T/r/step-0000004" ]
    check_ckpts "$T/r"
    run -0 "${TO[@]}" dfl-draft "${A[@]}" "${B[@]}" --keep 2 --out "$T/r" --resume "$T/r" "$D/a.dfl"
    [[ "$output" == *".step-0000004.old: removed what an interrupted checkpoint left"* ]]
    same_as_straight "$T/r"
    no_temporaries "$T/r"
    [ "$(ls -d "$T"/r/step-* | wc -l)" -eq 2 ]
}

@test "SIGKILL at random moments of a run that checkpoints every step: every checkpoint that looks complete is" {
    local i lines res=()
    more_lines() { [ "$(cat "$T/r/metrics.jsonl" 2>/dev/null | wc -l)" -gt "$lines" ]; }
    for i in 1 2 3; do
        lines=$(cat "$T/r/metrics.jsonl" 2>/dev/null | wc -l)
        bg /dev/null /dev/null "$T/err$i" dfl-draft "${A[@]}" --epochs 50 --save-every 1 --keep 3 \
            --log-every 1 --seed 5 --out "$T/r" "${res[@]}" "$D/a.dfl"
        wait_for 60 more_lines   # it has made a step (and so a checkpoint)
        sleep "0.$((RANDOM % 9 + 1))"
        kill -KILL "$pid"
        finish "$pid" 10
        check_ckpts "$T/r"
        res=(--resume "$T/r")   # the next one resumes from what this one left
    done
    local n
    n=$(step_of "$T/r")
    run -0 "${TO[@]}" dfl-draft "${A[@]}" --epochs 50 --save-every 1 --keep 3 --seed 5 --out "$T/r" \
        --resume "$T/r" --stop-at $((n + 1)) "$D/a.dfl"
    check_ckpts "$T/r"
    no_temporaries "$T/r"
}

@test "a step directory left by a killed run is replaced, not reused, when a resumed run reaches that step" {
    # a stream run killed after step 4's checkpoint was renamed, before latest named it
    run -137 "${TO[@]}" env DFL_TEST_FAULT=ckpt-before-latest@4 dfl-draft "${A[@]}" --out "$T/r" \
        --save-every 2 --total-steps 8 "$D/s.dfl"
    cp -r "$T/r" "$T/clean"
    rm -r "$T/clean/step-0000004"
    # both resume from step 2 on other data; the orphan must not change what the run saves
    for d in r clean; do
        run -0 "${TO[@]}" dfl-draft "${A[@]}" --out "$T/$d" --resume "$T/$d" --save-every 2 \
            --total-steps 8 --stop-at 4 "$D/s2.dfl"
    done
    [ "$(readlink "$T/r/latest")" = step-0000004 ]
    cmp "$T/clean/step-0000004/optimizer.safetensors" "$T/r/step-0000004/optimizer.safetensors"
    cmp "$T/clean/step-0000004/trainer_state.json" "$T/r/step-0000004/trainer_state.json"
    no_temporaries "$T/r"
}

# ---- full disks -----------------------------------------------------------------------------------

@test "disk full while writing a checkpoint (file-size limit): a clear error, the previous checkpoint intact" {
    run -0 "${TO[@]}" dfl-draft "${A[@]}" "${B[@]}" --stop-at 8 --out "$T/r" "$D/a.dfl"
    cp -r "$T/r/step-0000008" "$T/before"
    local lim file
    # 16 KiB: model.safetensors (24 kB) does not fit; 64 KiB: optimizer.safetensors (141 kB)
    for lim in 16 64; do
        file=$([ "$lim" = 16 ] && echo model || echo optimizer)
        run -1 "${TO[@]}" bash -c 'ulimit -f "$1"; trap "" XFSZ; shift; exec "$@"' - "$lim" \
            dfl-draft "${A[@]}" "${B[@]}" --out "$T/r" --resume "$T/r" "$D/a.dfl"
        [[ "$output" == *"error: checkpoint of step 10 not written (the last one, step 8, is intact): $T/r/.step-0000010.tmp/$file.safetensors: write failed: File too large"* ]]
        [ "$(readlink "$T/r/latest")" = step-0000008 ]
        diff -r "$T/before" "$T/r/step-0000008"
        [ "$(ls -d "$T"/r/step-* | wc -l)" -eq 4 ]
        no_temporaries "$T/r"
    done
    run -0 "${TO[@]}" dfl-draft "${A[@]}" "${B[@]}" --out "$T/r" --resume "$T/r" "$D/a.dfl"
    same_as_straight "$T/r"
}

@test "disk full while writing metrics.jsonl: a warning says from which step lines are lost" {
    # 1 KiB: metrics.jsonl fills up at the fourth line; the checkpoint at the end fails too
    run -1 "${TO[@]}" bash -c 'ulimit -f 1; trap "" XFSZ; exec "$@"' - \
        dfl-draft "${A[@]}" --log-every 1 --save-every 0 --out "$T/r" "$D/a.dfl"
    [[ "$output" =~ "warning: $T/r/metrics.jsonl: write failed: File too large: metrics lines from step "[0-9]+" on are lost" ]]
    [[ "$output" == *"error: checkpoint of step 8 not written: "* ]]
    # whole lines only: no partial JSON line was left behind
    [ "$(tail -c 1 "$T/r/metrics.jsonl" | od -An -c | tr -d ' ')" = '\n' ]
    [ "$(grep -cv '^{.*}$' "$T/r/metrics.jsonl")" -eq 0 ]
    [ "$(wc -l <"$T/r/metrics.jsonl")" -ge 2 ]
    [ ! -e "$T/r/latest" ]
    no_temporaries "$T/r"
}

@test "disk full while writing a dump (file-size limit): a clear error, the previous dump intact, no temporary" {
    dfl-target -q --model "$TGT" --layers 1,2 -o "$T/hs.dfl" "$D/tok12.dfl"
    cp "$T/hs.dfl" "$T/before.dfl"
    run -1 "${TO[@]}" bash -c 'ulimit -f 32; trap "" XFSZ; exec "$@"' - \
        dfl-target -q --model "$TGT" --layers 0,1,2,3 --dtype f32 -o "$T/hs.dfl" "$D/tok12.dfl"
    [[ "$output" == *"error: $T/hs.dfl: write failed: File too large"* ]]
    cmp "$T/hs.dfl" "$T/before.dfl"
    no_temporaries "$T"
}

@test "a full device (ENOSPC) under a dump: dfl-target exits 1 with a clear error" {
    [ -w /dev/full ] || skip "no /dev/full"
    run -1 "${TO[@]}" dfl-target -q --model "$TGT" --layers 1,2 -o /dev/full "$D/tok12.dfl"
    [[ "$output" == *"error: /dev/full: write failed: No space left on device"* ]]
}

# dataset N FILE: N JSON Lines samples of 5 to 300 tokens below 64
dataset() {
    awk -v n="$1" 'BEGIN { srand(5); for (i = 0; i < n; i++) { k = 5 + int(rand() * 296); line = "";
            for (j = 0; j < k; j++) line = line (j ? "," : "") int(rand() * 64);
            print "{\"input_ids\": [" line "]}" } }' >"$2"
}

@test "dfl-bucket killed while it reads: no manifest nor shard is left; a rerun names the leftover, --force replaces it" {
    dataset 3000 "$T/d.jsonl"
    mkfifo "$T/p"
    bg /dev/null "$T/p" "$T/stall.err" stall "$T/d.jsonl" 500000   # part of the data, then nothing
    bg /dev/null /dev/null "$T/bucket.err" dfl-bucket -o "$T/out" "$T/p"
    local bpid=$pid
    tmpdir() { compgen -G "$T/out/.dfl-bucket.tmp.*" >/dev/null; }
    wait_for 60 tmpdir
    kill -KILL "$bpid"
    finish "$bpid" 10
    [ "$st" -eq 137 ]
    [ -z "$(find "$T/out" -name 'manifest.json' -o -name 'shard-*')" ]
    run -1 "${TO[@]}" dfl-bucket -o "$T/out" "$T/d.jsonl"
    [[ "$output" == *"the output directory is not empty (it holds '.dfl-bucket.tmp."*"use --force"* ]]
    run -0 "${TO[@]}" dfl-bucket -q -o "$T/out" --force "$T/d.jsonl"
    [ "$(ls -A "$T/out")" = "$(printf 'manifest.json\nshard-00000.dfl')" ]
    run -0 hsdump "$T/out/shard-00000.dfl"
}

@test "disk full while dfl-bucket writes its shards (file-size limit): a clear error, nothing left" {
    dataset 3000 "$T/d.jsonl"
    run -1 "${TO[@]}" bash -c 'ulimit -f 256; trap "" XFSZ; exec "$@"' - dfl-bucket -o "$T/out" "$T/d.jsonl"
    [[ "$output" == *"shard-00000.dfl: write failed: File too large"* ]]
    [ ! -e "$T/out" ]
}

# ---- flipped bits -------------------------------------------------------------------------------

@test "a flipped bit in a dump: dfl-draft (file and pipe) and dfl-ckpt --verify name its frame and offset" {
    hsdump --frames "$D/a.dfl" >"$T/frames"
    # frame header, payload, trailer, of HEADER, batch, INDEX and END frames
    local frame off next pos k=0
    for spec in "0 100" "1 20" "3 700" "5 -3" "7 70" "8 10"; do
        read -r frame pos <<<"$spec"
        off=$(awk -v n="$frame" 'NR == n + 1 { print $1 }' "$T/frames")
        next=$(awk -v n="$frame" 'NR == n + 2 { print $1 }' "$T/frames")
        [ "$pos" -lt 0 ] && pos=$((next - off + pos))
        pos=$((off + pos))
        cp "$D/a.dfl" "$T/f.dfl"
        local byte
        byte=$(od -An -tu1 -j "$pos" -N1 "$T/f.dfl" | tr -d ' ')
        printf "\\$(printf %03o $((byte ^ 8)))" | dd of="$T/f.dfl" bs=1 seek="$pos" conv=notrunc status=none
        run -1 cmp -s "$D/a.dfl" "$T/f.dfl"
        local want="f.dfl: frame $frame at offset $off: "
        k=$((k + 1))
        run -2 "${TO[@]}" dfl-draft "${A[@]}" --out "$T/r$k" "$T/f.dfl"
        [[ "$output" == *"$want"* ]] || { echo "byte $pos, file: $output"; return 1; }
        [ -z "$(ls "$T/r$k" | grep step-)" ]
        run -2 "${TO[@]}" bash -c 'cat "$1" | "${@:2}"' - "$T/f.dfl" dfl-draft "${A[@]}" \
            --out "$T/p$k" --total-steps 20 -
        [[ "$output" == *"stdin: frame $frame at offset $off: "* ]] || { echo "byte $pos, pipe: $output"; return 1; }
        run -2 "${TO[@]}" dfl-ckpt --verify "$T/f.dfl"
        [[ "$output" == *"$want"* ]] || { echo "byte $pos, dfl-ckpt: $output"; return 1; }
    done
}

# ---- non-finite values --------------------------------------------------------------------------

@test "NaN, +Inf or -Inf planted in one hidden state: that step is skipped and counted, the weights stay finite" {
    local v
    for v in nan inf -inf; do
        poison "$D/a.dfl" "$T/$v.dfl" --batch 3 --layer 1 --token 0 --dim 7 --value "$v"
        run --separate-stderr "${TO[@]}" dfl-draft "${A[@]}" --log-every 1 --out "$T/r$v" "$T/$v.dfl"
        [ "$status" -eq 0 ]
        [ "$(grep -c "non-finite loss: skipped" <<<"$stderr")" -eq 1 ]
        [ "$(grep -c '"loss":null' "$T/r$v/metrics.jsonl")" -eq 1 ]
        tail -1 "$T/r$v/metrics.jsonl" | grep -q '"skipped_steps":1,'
        grep -q '"skipped_steps": 1,' "$T/r$v/latest/trainer_state.json"
        grep -q '"adam_step": 7,' "$T/r$v/latest/trainer_state.json"
        run -0 dfl-ckpt --check-nan "$T/r$v/latest"
    done
}

@test "a checkpoint holding a NaN or an Inf: --resume refuses it and dfl-ckpt --check-nan reports it, both with 2" {
    run -0 "${TO[@]}" dfl-draft "${A[@]}" --out "$T/r" "$D/a.dfl"
    local file elem size bytes kind hl name
    # +Inf as element 3 of a bf16 tensor, NaN as element 2 of an f32 one
    for spec in "model.safetensors 3 2 \200\177 +Inf" "optimizer.safetensors 2 4 \000\000\300\177 NaN"; do
        read -r file elem size bytes kind <<<"$spec"
        rm -rf "$T/c"
        cp -r "$T/r/step-0000008" "$T/c"
        hl=$(od -An -tu8 -N8 "$T/c/$file" | tr -d ' ')
        # the tensor whose data comes first
        name=$(head -c $((8 + hl)) "$T/c/$file" | grep -ao '"[^"]*":{"data_offsets":\[0,' | cut -d'"' -f2)
        printf "$bytes" | dd of="$T/c/$file" bs=1 seek=$((8 + hl + elem * size)) conv=notrunc status=none
        run -2 "${TO[@]}" dfl-draft "${A[@]}" --out "$T/r" --resume "$T/c" "$D/a.dfl"
        [[ "$output" == *"$T/c/$file: tensor '$name' element $elem is not finite: refusing to resume from it"* ]]
        run -2 dfl-ckpt --check-nan "$T/c"
        [[ "$output" == *"$T/c/$file: $name: 1 non-finite"* ]]
        [[ "$output" == *"1 $kind"* ]]
    done
    [ "$(readlink "$T/r/latest")" = step-0000008 ]
}

# ---- dumps without an END frame ----------------------------------------------------------------

@test "a dump left by a killed dfl-target is refused; --allow-truncated trains on its complete batches and says how many" {
    mkfifo "$T/tok"
    bg /dev/null "$T/tok" "$T/stall.err" stall "$D/tok12.dfl" "$(end_of_batches "$D/tok12.dfl")"
    mkdir "$T/d"
    bg /dev/null /dev/null "$T/target.err" dfl-target -q --model "$TGT" --layers 1,2 -o "$T/d/hs.dfl" "$T/tok"
    local tpid=$pid tmp
    full() { tmp=$(ls -A "$T/d" | head -1); [ -n "$tmp" ] && [ "$(hsdump --frames "$T/d/$tmp" 2>/dev/null | grep -c HIDDEN)" -eq 12 ]; }
    wait_for 120 full
    kill -KILL "$tpid"
    finish "$tpid" 10
    [ "$st" -eq 137 ]
    [ ! -e "$T/d/hs.dfl" ]   # nothing that looks like a finished dump
    [[ "$tmp" == .hs.dfl.tmp.* ]]
    run -2 "${TO[@]}" dfl-draft "${A[@]}" --out "$T/r1" "$T/d/$tmp"
    [[ "$output" == *"$T/d/$tmp: truncated: no END frame"*"(--allow-truncated trains on the complete batches of a cut input)"* ]]
    [ ! -e "$T/r1/latest" ]
    run --separate-stderr "${TO[@]}" dfl-draft "${A[@]}" --log-every 1 --allow-truncated --out "$T/r2" "$T/d/$tmp"
    [ "$status" -eq 0 ]
    [[ "$stderr" == *"warning: $T/d/$tmp: cut short (no END frame) after 12 complete batches: training on those (--allow-truncated)"* ]]
    [ "$(readlink "$T/r2/latest")" = step-0000012 ]
    [ "$(wc -l <"$T/r2/metrics.jsonl")" -eq 12 ]
}

@test "a dump cut mid-frame: refused, or with --allow-truncated trained on the complete frames, from a file or a pipe" {
    local off
    off=$(frame_offset "$D/s.dfl" 6)
    head -c $((off + 1000)) "$D/s.dfl" >"$T/cut.dfl"   # 5 complete batches, then part of the 6th
    run -2 "${TO[@]}" dfl-draft "${A[@]}" --out "$T/r0" "$T/cut.dfl"
    [[ "$output" == *"cut.dfl: truncated inside frame 6 (HIDDEN) at offset $off: 1000 of its"*"(--allow-truncated trains on the complete batches of a cut input)"* ]]
    run --separate-stderr "${TO[@]}" dfl-draft "${A[@]}" --allow-truncated --out "$T/r1" "$T/cut.dfl"
    [ "$status" -eq 0 ]
    [[ "$stderr" == *"cut.dfl: cut short (no END frame) after 5 complete batches: training on those"* ]]
    [ "$(readlink "$T/r1/latest")" = step-0000005 ]
    run --separate-stderr "${TO[@]}" bash -c 'cat "$1" | "${@:2}"' - "$T/cut.dfl" dfl-draft "${A[@]}" \
        --allow-truncated --total-steps 100 --out "$T/r2" -
    [ "$status" -eq 0 ]
    [[ "$stderr" == *"stdin: cut short (no END frame) after 5 complete batches: training on those"* ]]
    [ "$(readlink "$T/r2/latest")" = step-0000005 ]
}

@test "the man page documents --allow-truncated and is clean" {
    grep -q 'allow\\-truncated' "$REPO/man/dfl-draft.1"
    run mandoc -Tlint -Wwarning "$REPO/man/dfl-draft.1"
    assert_success
    assert_output ""
}
