#!/usr/bin/env bats
# The built-in example (examples/demo, what `make demo` runs), with fewer samples and so fewer
# steps: the whole pipeline runs, and prints tau at the start and at the end, the offline tau of
# the final checkpoint on held-out samples (dfl-eval), the checkpoint (finite, in the public
# DFlash layout) and the curves.
load helper
bats_require_minimum_version 1.5.0

setup() {
    for p in dfl-bucket dfl-target dfl-draft dfl-ckpt dfl-eval; do
        command -v "$p" >/dev/null || skip "$p not built"
    done
    [ -x "$DFL_TOOLS/demodata" ] && [ -x "$DFL_TOOLS/mktarget" ] || skip "tools not built"
    command -v gnuplot >/dev/null || skip "gnuplot not installed"
    export OMP_WAIT_POLICY=passive
    T="$BATS_TEST_TMPDIR"
}

@test "examples/demo runs the whole job and reports tau, the checkpoint and the plot" {
    run --separate-stderr "$REPO/examples/demo" --samples 300 --dir "$T/demo" "$(dirname "$DFL_BIN")"
    [ "$status" -eq 0 ]
    [[ "$output" == *"tau at the start: "* ]]
    [[ "$output" == *"tau at the end: "* ]]
    # the offline tau, and what each tau means
    [[ "$output" == *"it is not what a server accepts"* ]]
    [[ "$output" == *"greedy speculative decoding"* ]]
    off=$(grep -o 'offline tau: *[0-9.]*' <<<"$output" | awk '{print $3}')
    awk -v a="$off" 'BEGIN { exit !(a >= 1 && a <= 8) }'
    # it is dfl-eval's record of the final checkpoint, made by dfl-train --eval
    [[ "$stderr" == *'$ dfl-train '*' --eval heldout.dfl '* ]]
    step=$(grep -o 'step-[0-9]*' "$T/demo/ckpt.txt" | cut -d- -f2)
    rec=$(grep "^{\"step\":$((10#$step)),\"kind\":\"eval\"," "$T/demo/run/metrics.jsonl" | grep -o '"eval_tau":[0-9.]*' | cut -d: -f2)
    [ "$(printf '%.2f' "$rec")" = "$off" ]
    # the commands are shown as a user would type them
    [[ "$stderr" == *'$ dfl-bucket --shards 2 '* ]]
    [[ "$stderr" == *'$ dfl-train --model target --out run --device cpu '* ]]
    [[ "$stderr" == *'$ dfl-ckpt --check-nan '* ]]
    ckpt=$(grep -o 'checkpoint: *[^ ]*' <<<"$output" | awk '{print $2}')
    [ "$ckpt" = "$(cat "$T/demo/ckpt.txt")" ]
    [ -f "$ckpt/model.safetensors" ] && [ -f "$ckpt/config.json" ]
    grep -q '"block_size": 8' "$ckpt/config.json"
    dfl-ckpt -q --check-nan "$ckpt"
    [ "$(head -c 8 "$T/demo/run/metrics.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]
    [[ "$output" == *"curves:           $T/demo/run/metrics.png"* ]]
    # the first logged window is near chance (tau ~ 1)
    first=$(grep -o 'tau at the start: [0-9.]*' <<<"$output" | awk '{print $5}')
    awk -v a="$first" 'BEGIN { exit !(a >= 1 && a < 1.5) }'
    # nothing written outside the work directory, nothing left running
    [ ! -e "$REPO/examples/run" ]
    while read -r name pid; do
        ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$T/demo"
    done <"$T/demo/run/pids"
}

@test "examples/demo refuses a build directory without the programs" {
    mkdir -p "$T/b/bin"
    run -1 "$REPO/examples/demo" --dir "$T/demo" "$T/b"
    [[ "$output" == *"is missing (run make)"* ]]
    [ ! -e "$T/demo" ]
}
