#!/usr/bin/env bats
# dfl-draft data parallel on the CPU: two ranks (two processes, RANK/WORLD_SIZE, a rendezvous
# file) each on its own stream against one rank on both streams' batches merged (draftdata
# --also-seed); checkpoints and metrics from rank 0 only; resume on two ranks; failures (a rank
# killed, a rank alone, a checkpoint of another world size, bad launcher variables).
# Anchors are deterministic: --num-anchors 32 is more than the valid positions of a sequence of
# at most 24 tokens, so every valid position is an anchor whatever each rank's generator.
load helper
bats_require_minimum_version 1.5.0

setup() {
    TGT="$FIXTURES/draft/target"
    export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1
    command -v draftdata >/dev/null || PATH="$DFL_TOOLS:$PATH"
    T="$BATS_TEST_TMPDIR"
    unset RANK WORLD_SIZE LOCAL_RANK SLURM_PROCID SLURM_NTASKS SLURM_LOCALID
    A=(--target "$TGT" --mask-token-id 63 --draft-layers 1 --block-size 8 --num-anchors 32
       --pool-size 1 --min-ready 1 --log-every 1 --save-dtype f32 --dist-timeout 30)
    draftdata "$TGT" "$T/s0.dfl" --batches 4 --seqs 2 --len 24 --seed 1
    draftdata "$TGT" "$T/s1.dfl" --batches 4 --seqs 2 --len 24 --seed 2
}

# two NAME [dfl-draft args]: ranks 0 and 1 with the same command line; stdout and stderr in
# $T/NAME.{out,err}{0,1}; fails unless both exit 0
two() {
    local n=$1 rc0=0 rc1=0
    shift
    RANK=1 WORLD_SIZE=2 dfl-draft "$@" >"$T/$n.out1" 2>"$T/$n.err1" &
    local p1=$!
    RANK=0 WORLD_SIZE=2 dfl-draft "$@" >"$T/$n.out0" 2>"$T/$n.err0" || rc0=$?
    wait "$p1" || rc1=$?
    if [ "$rc0" -ne 0 ] || [ "$rc1" -ne 0 ]; then
        cat "$T/$n.err0" "$T/$n.err1" >&2
        return 1
    fi
}

losses() { grep -o '"loss":[^,]*' "$1" | cut -d: -f2; }

# same_weights A B [TOL]: every tensor of two checkpoints within TOL (absolute; default 1e-6: the
# weights are about 0.02, and each step moves an element by up to lr = 6e-4)
same_weights() {
    run dfl-ckpt --diff "$1/model.safetensors" "$2/model.safetensors"
    [ "$status" -le 1 ]
    awk -v tol="${3:-1e-6}" 'NR > 1 && /^[a-z]/ && !($2 <= tol) { print "differs: " $0; bad = 1 } END { exit bad }' <<< "$output"
}

@test "two ranks on their own streams train as one rank on the merged batches" {
    draftdata "$TGT" "$T/m.dfl" --batches 4 --seqs 2 --len 24 --seed 1 --also-seed 2
    two dp "${A[@]}" --out "$T/r2" --rendezvous "$T/rdv" "$T/s{rank}.dfl"
    dfl-draft "${A[@]}" --out "$T/r1" "$T/m.dfl" > /dev/null 2> "$T/one.err"
    [ "$(losses "$T/r2/metrics.jsonl" | wc -l)" -eq 4 ]   # rank 0 alone wrote the metrics
    paste <(losses "$T/r1/metrics.jsonl") <(losses "$T/r2/metrics.jsonl") |
        awk '{ d = $1 - $2; if (d < 0) d = -d; if (!(d <= 1e-6 * $1)) { print "loss " $0; bad = 1 } } END { exit bad }'
    # 1e-5: a batch lost or counted twice moves many elements by ~1e-4. Not tighter: two ranks
    # add the same gradients in another order than one, and AdamW divides each element by its
    # own magnitude (+1e-8), so an element whose gradient cancels to near 1e-8 carries its sum's
    # rounding into the update (seen: 1.4e-6 in o_proj)
    same_weights "$T/r1/latest" "$T/r2/latest" 1e-5
    # each rank saw its own stream; the checkpoint holds both ranks' positions
    grep -q 'rank 0 of 2' "$T/dp.err0"
    grep -q 'rank 1 of 2' "$T/dp.err1"
    tr -d ' \n' < "$T/r2/latest/trainer_state.json" | grep -q '"world_size":2'
    tr -d ' \n' < "$T/r2/latest/trainer_state.json" | grep -q '"path":"'"$T"'/s1.dfl"'
    [ "$(cat "$T/dp.out0")" = "$(cat "$T/dp.out1")" ]
    [ ! -e "$T/rdv" ]   # rank 0 removes the rendezvous file
}

@test "only rank 0 writes the run directory (rendezvous from DFL_RENDEZVOUS)" {
    export DFL_RENDEZVOUS="$T/rdv"
    RANK=1 WORLD_SIZE=2 dfl-draft "${A[@]}" --out "$T/elsewhere" "$T/s1.dfl" > /dev/null 2> "$T/e1" &
    p1=$!
    RANK=0 WORLD_SIZE=2 dfl-draft "${A[@]}" --out "$T/r" "$T/s0.dfl" > /dev/null 2> "$T/e0"
    wait "$p1"
    [ ! -e "$T/elsewhere" ]
    [ -s "$T/r/latest/model.safetensors" ]
}

@test "two ranks resume from the same checkpoint and continue as if never stopped" {
    two full "${A[@]}" --out "$T/full" --rendezvous "$T/rdv" "$T/s{rank}.dfl"
    two part "${A[@]}" --out "$T/part" --rendezvous "$T/rdv" --stop-at 2 "$T/s{rank}.dfl"
    [ "$(losses "$T/part/metrics.jsonl" | wc -l)" -eq 2 ]
    two resumed "${A[@]}" --out "$T/part" --rendezvous "$T/rdv" --resume "$T/part/latest" "$T/s{rank}.dfl"
    grep -q 'resuming from .* at step 2' "$T/resumed.err1"
    [ "$(readlink "$T/part/latest")" = step-0000004 ]
    # steps 3 and 4 as in the uninterrupted run: each rank restored its own input and generator
    [ "$(losses "$T/part/metrics.jsonl")" = "$(losses "$T/full/metrics.jsonl")" ]
    same_weights "$T/full/latest" "$T/part/latest"
}

@test "a checkpoint of two ranks is not resumed by one" {
    two dp "${A[@]}" --out "$T/r" --rendezvous "$T/rdv" --stop-at 2 "$T/s{rank}.dfl"
    run -1 dfl-draft "${A[@]}" --out "$T/r" --resume "$T/r/latest" "$T/s0.dfl"
    [[ "$output" == *"written by 2 ranks"* ]]
}

@test "a rank killed: the other exits non-zero at once, naming it" {
    mkfifo "$T/never"   # rank 1 joins, then blocks opening a FIFO nobody writes
    RANK=1 WORLD_SIZE=2 dfl-draft "${A[@]}" --out "$T/r" --rendezvous "$T/rdv" --total-steps 4 \
        "$T/never" > /dev/null 2> "$T/e1" &
    p1=$!
    RANK=0 WORLD_SIZE=2 dfl-draft "${A[@]}" --out "$T/r" --rendezvous "$T/rdv" "$T/s0.dfl" \
        > /dev/null 2> "$T/e0" &
    p0=$!
    for i in $(seq 100); do grep -q 'rank 0 of 2' "$T/e0" && break; sleep 0.1; done
    sleep 0.5
    kill -9 "$p1"
    start=$SECONDS
    rc=0
    wait "$p0" || rc=$?
    [ "$rc" -eq 1 ]
    [ $((SECONDS - start)) -le 5 ]
    grep -q 'rank 1 closed its connection' "$T/e0"
}

@test "a rank alone gives up after --dist-timeout with a message" {
    run -1 env RANK=1 WORLD_SIZE=2 dfl-draft "${A[@]}" --out "$T/r" --rendezvous "$T/rdv" \
        --dist-timeout 0.5 "$T/s1.dfl"
    [[ "$output" == *"rank 1 of 2: could not join rank 0 through $T/rdv within 0.5 s"* ]]
    run -1 env RANK=0 WORLD_SIZE=3 dfl-draft "${A[@]}" --out "$T/r" --rendezvous "$T/rdv" \
        --dist-timeout 0.5 "$T/s0.dfl"
    [[ "$output" == *"only 1 of 3 ranks joined"*"missing: ranks 1, 2"* ]]
    [ ! -e "$T/r" ]   # nothing written before the ranks met
}

@test "launcher variables and --rendezvous are checked" {
    run -1 env RANK=0 WORLD_SIZE=2 dfl-draft "${A[@]}" --out "$T/r" "$T/s0.dfl"
    [[ "$output" == *"needs --rendezvous"* ]]
    run -1 env RANK=2 WORLD_SIZE=2 dfl-draft "${A[@]}" --out "$T/r" --rendezvous "$T/rdv" "$T/s0.dfl"
    [[ "$output" == *"rank 2 is not below the world size 2"* ]]
    run -1 env SLURM_PROCID=x SLURM_NTASKS=2 dfl-draft "${A[@]}" --out "$T/r" --rendezvous "$T/rdv" "$T/s0.dfl"
    [[ "$output" == *"SLURM_PROCID='x'"* ]]
    run -1 env RANK=1 WORLD_SIZE=2 dfl-draft "${A[@]}" --out "$T/r" --rendezvous tcp://nohost "$T/s0.dfl"
    [[ "$output" == *"tcp://HOST:PORT"* ]]
    run -1 dfl-draft "${A[@]}" --out "$T/r" --dist-timeout soon "$T/s0.dfl"
    [[ "$output" == *"--dist-timeout"* ]]
}
