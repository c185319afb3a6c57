#!/usr/bin/env bats
# bench/draft: the drafter benchmark script, run here at --shape tiny (CPU, no peer, no ceiling),
# bench/target's options and its peer's source (it needs a GPU and torch to run), and the test-tool options it relies on (mktarget --no-layers, draftdata --exact-len and
# --table-rows). The real run (the 8B shape on a GPU) is the lead's, on the GPU machine.
load helper
bats_require_minimum_version 1.5.0

setup() {
    T="$BATS_TEST_TMPDIR"
    export OMP_WAIT_POLICY=passive
}

# run_bench NAME ARGS...: bench/NAME ARGS --out $T/res/bench-NAME.txt $DFL_BUILD, its scratch under
# $T/tmp (TMPDIR); it must exit 0. f: the results file.
run_bench() {
    local name=$1
    shift
    export TMPDIR="$T/tmp"
    mkdir -p "$TMPDIR"
    run "$REPO/bench/$name" "$@" --out "$T/res/bench-$name.txt" "$DFL_BUILD"
    echo "$output"
    [ "$status" -eq 0 ]
    f="$T/res/bench-$name.txt"
}

@test "bench/draft --help prints the usage on stdout and exits 0" {
    run --separate-stderr "$REPO/bench/draft" --help
    [ "$status" -eq 0 ]
    [[ "$output" == "# bench/draft [--quick]"* ]]
    [[ "$output" == *"drafter_flops()"* ]]
    [ -z "$stderr" ]
}

@test "bench/draft: an unknown option or shape exits 1" {
    run -1 "$REPO/bench/draft" --bogus
    [[ "$output" == *"unknown option --bogus"* ]]
    run -1 "$REPO/bench/draft" --shape 70b
    [[ "$output" == *"8b, 27b or tiny"* ]]
    run -1 "$REPO/bench/draft" --shape tiny --steps many
}

@test "bench/draft --public: a directory without SpecForge's DFlash trainer, or --shape tiny, exits 1 before any work" {
    mkdir -p "$T/sf/specforge/modeling/draft" "$T/sf/configs"
    touch "$T/sf/specforge/modeling/draft/dflash.py"
    run -1 --separate-stderr "$REPO/bench/draft" --shape 8b --public "$T/sf" --out "$T/res.txt"
    [[ "$stderr" == *"--public $T/sf: not a SpecForge checkout"*"specforge/algorithms/common/dflash_family_model.py"* ]]
    [ ! -e "$T/res.txt" ]
    run -1 "$REPO/bench/draft" --shape tiny --public "$T/sf"
    [[ "$output" == *"--public runs at --shape 8b or 27b"* ]]
    # the peer script itself: exit 2 naming what is missing
    run -2 --separate-stderr python3 "$REPO/bench/peers/specforge_step.py" --specforge "$T/sf" --shape 27b
    [[ "$stderr" == *"$T/sf: not a SpecForge checkout"*"no specforge/algorithms/common/dflash_family_model.py"* ]]
    # with every file the step runs, --check passes (without torch: it checks before importing it)
    mkdir -p "$T/sf/specforge/algorithms/common" "$T/sf/specforge/core"
    touch "$T/sf/specforge/algorithms/common/dflash_family_model.py" "$T/sf/specforge/optimizer.py" \
        "$T/sf/specforge/core/chunking.py" "$T/sf/configs/qwen3.6-27b-dflash.json"
    run -0 python3 "$REPO/bench/peers/specforge_step.py" --specforge "$T/sf" --shape 27b --check
    run -2 --separate-stderr python3 "$REPO/bench/peers/specforge_step.py" --specforge "$T/sf" --shape 8b --check
    [[ "$stderr" == *"no configs/qwen3-8b-dflash.json"* ]]
}

@test "bench/draft --shape tiny: the table with our tokens/s and TFLOP/s, logs beside it, no scratch left" {
    run_bench draft --shape tiny --steps 3 --tune --profile
    grep -q '^== results (tiny' "$f"
    # file, --tune and pipe rows: a positive tokens/s and TFLOP/s; no ceiling on the CPU: MFU n/a;
    # no GPU: no memory, power or clock samples
    grep -q '^run  .* peak GPU MiB       W/SM MHz  note$' "$f"
    for row in "ours (file)" "ours (tune)" "ours (pipe)"; do
        line=$(awk -v r="$row" 'index($0, r) == 1 && substr($0, length(r) + 1) ~ /^ +[0-9]/' "$f")
        read -r tps tfl mfu ratio mem pw _ <<< "${line#"$row"}"
        awk -v a="$tps" -v b="$tfl" 'BEGIN { exit !(a + 0 > 0 && b + 0 > 0) }'
        [ "$mfu" = n/a ] && [ "$ratio" = n/a ] && [ "$mem" = n/a ] && [ "$pw" = n/a ]
    done
    grep -q '^peer (torch) .*not run (--shape tiny)' "$f"
    grep -q '^goal: none at this shape (tokens/s [0-9]' "$f"
    # --profile: the file runs' step by kind and GEMMs by shape
    grep -q "^ours (file) profile: the CPU step's [0-9.]* ms by kind, per step over 5 steps: GEMMs forward" "$f"
    grep -q "^ours (tune) profile: the GEMMs by weight shape" "$f"
    # 2 warm-up (the default at --shape tiny) + 3 timed steps: 5 metrics lines a run
    [ "$(wc -l < "$T/res/bench-draft-logs/metrics-file.jsonl")" -eq 5 ]
    [ "$(wc -l < "$T/res/bench-draft-logs/metrics-pipe.jsonl")" -eq 5 ]
    [ -s "$T/res/bench-draft-logs/ours-file.log" ]
    # scratch removed (in /dev/shm or $TMPDIR)
    scratch=$(sed -n '1s/.*scratch //p' "$f")
    [ -n "$scratch" ] && [ ! -e "$scratch" ]
    [ -z "$(ls "$TMPDIR")" ]
}

@test "bench/draft --keep keeps the scratch; --quick skips the pipe" {
    run "$REPO/bench/draft" --shape tiny --quick --keep --out "$T/r.txt" "$DFL_BUILD"
    [ "$status" -eq 0 ]
    scratch=$(sed -n '1s/.*scratch //p' "$T/r.txt")
    [ -d "$scratch/target" ] && [ -s "$scratch/stream.dfl" ]
    rm -rf "$scratch"
    grep -q '^ours (file) ' "$T/r.txt"
    run -1 grep -q '^ours (pipe) ' "$T/r.txt"
}

@test "bench/draft: a missing program is named, exit 1" {
    run -1 "$REPO/bench/draft" --shape tiny --out "$T/r.txt" "$T/nobuild"
    [[ "$output" == *"$T/nobuild/bin/dfl-draft is missing"* ]]
}

@test "bench/draft --base: another build's run first, its row and ours over it; a missing one is named" {
    run -1 "$REPO/bench/draft" --shape tiny --quick --base "$T/nobuild" --out "$T/r.txt" "$DFL_BUILD"
    [[ "$output" == *"$T/nobuild/bin/dfl-draft is missing"* ]]
    run "$REPO/bench/draft" --shape tiny --quick --base "$DFL_BUILD" --out "$T/r.txt" "$DFL_BUILD"
    [ "$status" -eq 0 ]
    # the base row before ours, both with a positive tokens/s; the ratio line; its own logs
    [ "$(grep -n '^base (file) ' "$T/r.txt" | cut -d: -f1)" -lt "$(grep -n '^ours (file) ' "$T/r.txt" | tail -1 | cut -d: -f1)" ]
    for row in "base (file)" "ours (file)"; do
        line=$(awk -v r="$row" 'index($0, r) == 1 && substr($0, length(r) + 1) ~ /^ +[0-9]/' "$T/r.txt")
        [ -n "$line" ]
    done
    grep -Eq '^ours \(file\) / base \(file\): [0-9]+\.[0-9]{3}x$' "$T/r.txt"
    [ -s "$T/r-logs/base-file.log" ] && [ -s "$T/r-logs/metrics-base-file.jsonl" ] && [ -s "$T/r-logs/metrics-file.jsonl" ]
    # the goal line counts only ours
    grep -q '^goal: none at this shape (tokens/s [0-9]' "$T/r.txt"
}

@test "bench/draft --lmce-rows: one more run named by its rows; a value that is not a count exits 1" {
    run -1 "$REPO/bench/draft" --shape tiny --quick --lmce-rows many --out "$T/r.txt" "$DFL_BUILD"
    [[ "$output" == *"--lmce-rows takes a count of rows"* ]]
    [ ! -e "$T/r.txt" ]
    run "$REPO/bench/draft" --shape tiny --quick --lmce-rows 64 --out "$T/r.txt" "$DFL_BUILD"
    [ "$status" -eq 0 ]
    line=$(awk 'index($0, "ours (rows-64)") == 1 && substr($0, 15) ~ /^ +[0-9]/' "$T/r.txt")
    [ -n "$line" ]
    [ -s "$T/r-logs/metrics-rows-64.jsonl" ]
    run -1 grep -q '^ours (file) / base' "$T/r.txt"
}

@test "bench/draft: an option that takes a value, given none, is named; exit 1, nothing written" {
    for o in --base --lmce-rows --out --shape --warmup --steps; do
        run -1 "$REPO/bench/draft" --shape tiny --quick --out "$T/r.txt" "$o"
        [[ "$output" == *"bench/draft: $o takes a value"* ]]
        [[ "$output" != *"unbound variable"* ]]
        [ ! -e "$T/r.txt" ]
    done
}

@test "bench/target --help and an unknown option; its peer hf_target.py compiles and copies into pinned buffers" {
    run --separate-stderr "$REPO/bench/target" --help
    [ "$status" -eq 0 ]
    [[ "$output" == "# bench/target [--quick]"* ]]
    [[ "$output" == *"pinned buffers, non_blocking, double-buffered"* ]]
    [[ "$output" == *"[--quick] [--tune]"* && "$output" == *"--tune puts that row back"* ]]
    run -0 "$REPO/bench/target" --tune --shape 8b   # --tune is an option (--shape exits before any GPU work)
    [[ "$output" == *"--hidden 4096 --layers 36"* ]]
    run -0 "$REPO/bench/target" --own-gemm 1,2 --shape 8b   # --own-gemm takes its levels as the next word
    [[ "$output" == *"--hidden 4096 --layers 36"* ]]
    run --separate-stderr "$REPO/bench/target" --help
    [[ "$output" == *"--own-gemm LEVELS (e.g. 1 or 1,2) adds a run of ours per level with DFL_CUDA_GEMM_TMA=LEVEL"* ]]
    run -1 "$REPO/bench/target" --bogus
    [[ "$output" == *"unknown option --bogus"* ]]
    command -v python3 >/dev/null || skip "no python3"
    python3 -c "import ast, sys; ast.parse(open(sys.argv[1]).read())" "$REPO/bench/peers/hf_target.py"
    # no blocking copy to pageable memory is left; the copies go to pinned buffers, non_blocking
    ! grep -n 'to("cpu"' "$REPO/bench/peers/hf_target.py"
    grep -q 'pin_memory=True' "$REPO/bench/peers/hf_target.py"
    grep -q 'copy_(src, non_blocking=True)' "$REPO/bench/peers/hf_target.py"
}

@test "bench/target --shape: the 30b-a3b and llama8b shapes, shrunk, are Qwen3-MoE and Llama 3.1 models that run" {
    run -0 "$REPO/bench/target" --shape 30b-a3b
    [[ "$output" == *"--type qwen3_moe "*"--experts 128 --top-k 8 --moe-intermediate 768"* ]]
    local moe=$output
    run -0 "$REPO/bench/target" --shape llama8b
    [[ "$output" == *"--type llama "*"--theta 5e5 --rope-llama3 8,1,4,8192"* ]]
    local llama=$output
    run -1 "$REPO/bench/target" --shape 70b
    [[ "$output" == *"unknown model 70b"* ]]
    # the same options with small widths (later options win), on the CPU
    local small=(--hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --intermediate 32 --vocab 256 --layers 2)
    # shellcheck disable=SC2086
    "$DFL_TOOLS/mktarget" -o "$T/moe" $moe "${small[@]}" --moe-intermediate 8
    run -0 "$DFL_BIN/dfl-target" -m "$T/moe" --info
    [[ "$output" == *'"model_type": "qwen3_moe"'* && "$output" == *'"num_experts": 128'* ]]
    [[ "$output" == *'"num_experts_per_tok": 8'* && "$output" == *'"sparse_layers": 2'* ]]
    # shellcheck disable=SC2086
    "$DFL_TOOLS/mktarget" -o "$T/llama" $llama "${small[@]}"
    run -0 "$DFL_BIN/dfl-target" -m "$T/llama" --info
    [[ "$output" == *'"rope_type": "llama3"'* && "$output" == *'"rope_theta": 500000'* ]]
    printf '1 2 3 4 5 6 7\n8 9\n' | "$DFL_TOOLS/mktokens" --vocab 256 -o "$T/tok.dfl"
    for m in moe llama; do
        "$DFL_BIN/dfl-target" -q -m "$T/$m" --layers 1 -o "$T/$m.dfl" "$T/tok.dfl"
        run -0 "$DFL_TOOLS/hsdump" "$T/$m.dfl"
        [[ "$output" == *"end batches 1 seqs 2 tokens 9"* ]]
    done
}

# bench/target's pipe ceiling: hspump | hsdrain in both output modes. With --rewrite the pump
# refills a slot before each reuse; through a reader that starts late and reads slowly, a slot
# reused before its frame was read out of the pipe would fail hsdrain's checksums (checked by
# breaking the rule: exit 2, "checksum mismatch"). With 4 slots of 64 KiB frames in a 1 MiB pipe
# the pump waits for the reader (slot_wait_s > 0) only when it splices.
@test "hspump --output-mode vmsplice|write --rewrite | slow reader | hsdrain: every frame verifies; only vmsplice waits for the reader" {
    for mode in vmsplice write; do
        run bash -c "'$DFL_TOOLS/hspump' --batches 24 --tokens 256 --seqs 2 --layers 2 --hidden 64 --slots 4 \
            --output-mode $mode --rewrite 2>'$T/pump.json' |
            { sleep 0.3; '$DFL_TOOLS/slowread' --chunk 4096 --sleep-us 300; } | '$DFL_TOOLS/hsdrain'"
        echo "$output"
        [ "$status" -eq 0 ]
        [[ "$output" == *'"batches": 24,'* ]]
        cat "$T/pump.json"
        wait_s=$(sed -n 's/.*"slot_wait_s": \([0-9.]*\).*/\1/p' "$T/pump.json")
        if [ "$mode" = vmsplice ]; then
            grep -q '"vmsplice": true' "$T/pump.json"
            awk -v w="$wait_s" 'BEGIN { exit !(w > 0.05) }'
        else
            grep -q '"vmsplice": false' "$T/pump.json"
            awk -v w="$wait_s" 'BEGIN { exit !(w == 0) }'
        fi
    done
    run -1 "$DFL_TOOLS/hspump" --output-mode splice
    [[ "$output" == *"--output-mode: 'splice' is not auto, vmsplice or write"* ]]
}

# The reader's bounce path (dfl_reader_opts.bounce) on frames of 8 MiB through a pipe: each way
# reads every frame of a pump that refills its slots, a stream cut inside a large frame is
# reported as the old path reports it (exit 2), and bad values are refused (exit 1).
@test "hspump | hsdrain --bounce off|inline|thread|auto: every frame verifies; a cut frame is the same error" {
    local pump="'$DFL_TOOLS/hspump' --batches 6 --tokens 2048 --seqs 2 --layers 2 --hidden 1024 --slots 4"
    for b in off inline thread auto; do
        run bash -c "$pump --output-mode vmsplice --rewrite 2>/dev/null | '$DFL_TOOLS/hsdrain' --bounce $b"
        echo "$b: $output"
        [ "$status" -eq 0 ]
        [[ "$output" == *'"batches": 6,'* ]]
    done
    bash -c "$pump --output-mode write -o '$T/s.dfl'" 2>/dev/null
    local want=
    for b in off inline thread; do
        run bash -c "head -c 20000000 '$T/s.dfl' | '$DFL_TOOLS/hsdrain' --bounce $b --bounce-slots 3 --chunk-kib 300"
        echo "$b: $output"
        [ "$status" -eq 2 ]
        [[ "$output" == *"stdin: truncated inside frame 3 (HIDDEN) at offset"* ]]
        [ -z "$want" ] || [ "$output" = "$want" ]
        want=$output
    done
    run -1 "$DFL_TOOLS/hsdrain" --bounce sideways
    [[ "$output" == *"--bounce: 'sideways' is not off, inline, thread or auto"* ]]
    run -1 bash -c "'$DFL_TOOLS/hsdrain' --bounce thread --bounce-slots 1 < '$T/s.dfl'"
    [[ "$output" == *"reader options: bounce 2 (-1, 0, 1 or 2), bounce_slots 1 (2 to 64)"* ]]
}

@test "mktarget --no-layers: the config of all layers, only the embedding, norm and LM head" {
    "$DFL_TOOLS/mktarget" -o "$T/m" --layers 6 --no-layers
    grep -q '"num_hidden_layers": 6' "$T/m/config.json"
    hdr=$(head -c 2000 "$T/m/model.safetensors")
    [ "$(grep -o '"[a-z_.0-9]*weight":' <<< "$hdr" | sort | tr '\n' ' ')" = \
      '"lm_head.weight": "model.embed_tokens.weight": "model.norm.weight": ' ]
    # the same bytes as the full model's for the tensors it has
    "$DFL_TOOLS/mktarget" -o "$T/full" --layers 6
    "$DFL_TOOLS/mktarget" -o "$T/m2" --layers 6 --no-layers
    cmp "$T/m/model.safetensors" "$T/m2/model.safetensors"
    run -1 cmp -s "$T/m/model.safetensors" "$T/full/model.safetensors"
}

@test "draftdata --exact-len: every sequence has --len tokens; --table-rows changes only the features" {
    "$DFL_TOOLS/mktarget" -o "$T/m" --no-layers
    "$DFL_TOOLS/draftdata" "$T/m" "$T/a.dfl" --batches 3 --seqs 2 --len 20 --exact-len
    run -0 "$DFL_TOOLS/hsdump" "$T/a.dfl"
    [ "$(grep -c '^batch .* lens 20,20 ' <<< "$output")" -eq 3 ]
    "$DFL_TOOLS/draftdata" "$T/m" "$T/b.dfl" --batches 3 --seqs 2 --len 20 --exact-len --table-rows 4
    run -0 "$DFL_TOOLS/hsdump" "$T/b.dfl"
    b=$output
    run -0 "$DFL_TOOLS/hsdump" "$T/a.dfl"
    # the same tokens (ids hash), other features (layer hashes)
    diff <(grep -o 'ids [0-9a-f]*' <<< "$output") <(grep -o 'ids [0-9a-f]*' <<< "$b")
    run -1 diff <(grep -o 'L1 [0-9a-f]*' <<< "$output") <(grep -o 'L1 [0-9a-f]*' <<< "$b")
    # without --exact-len the lengths vary (len/2..len)
    "$DFL_TOOLS/draftdata" "$T/m" "$T/c.dfl" --batches 3 --seqs 2 --len 20
    run -0 "$DFL_TOOLS/hsdump" "$T/c.dfl"
    [ "$(grep -c '^batch .* lens 20,20 ' <<< "$output")" -lt 3 ]
    run -1 "$DFL_TOOLS/draftdata" "$T/m" "$T/d.dfl" --table-rows 0
}

@test "bench/eval --shape tiny: tokens/s of a dfl-eval run, no scratch left; bad options exit 1" {
    run --separate-stderr "$REPO/bench/eval" --help
    [ "$status" -eq 0 ]
    [[ "$output" == "# bench/eval "* ]]
    run -1 "$REPO/bench/eval" --bogus
    run -1 "$REPO/bench/eval" --shape 70b
    run -1 "$REPO/bench/eval" --shape tiny --tokens 10
    run_bench eval --shape tiny --tokens 512
    grep -q '^== results (tiny, --device cpu)' "$f"
    line=$(grep '^response tokens: ' "$f")
    [[ "$line" == "response tokens: 496 in "* ]]   # 4 batches of 2 x 64 tokens, 62 each
    tps=$(sed 's/.*: \([0-9.]*\) tokens\/s.*/\1/' <<< "$line")
    awk -v a="$tps" 'BEGIN { exit !(a + 0 > 0) }'
    grep -q '"tau":' "$T/res/bench-eval-logs/eval.json"
    [ -z "$(ls -A "$TMPDIR")" ]
}

@test "bench-ceiling: --sustained, --algos and --shapes are taken (it skips, 77, without a GPU); an unknown option or a missing value is a usage error, 2" {
    b="${DFL_TESTBIN:-$DFL_BUILD/tests}/bench-ceiling"
    run "$b" --quick --sustained 1 --shapes "64,64,64;64,64,64,acc"
    [ "$status" = 77 ] || [ "$status" = 0 ]
    run "$b" --quick --algos 0.01 --shapes "64,64,64"
    [ "$status" = 77 ] || [ "$status" = 0 ]
    run -2 "$b" --sustained
    assert_output --partial "usage: bench-ceiling"
    run -2 "$b" --algos
    assert_output --partial "[--algos S]"
    run -2 "$b" --bogus
    assert_output --partial "usage: bench-ceiling"
}

# a stand-in nvidia-smi: a one-shot query answers (or fails, FIELDS=memory), the -lms loop prints
# the lines of $SMI_LINES (memory, power, limit, SM clock, throttle reasons), then waits
fake_smi() {
    mkdir -p "$T/bin"
    cat >"$T/bin/nvidia-smi" <<'SH'
#!/bin/bash
case "$*" in *power.draw*) [ "${FIELDS:-all}" = memory ] && exit 6 ;; esac
case "$*" in *-lms*) cat "$SMI_LINES"; exec sleep 30 ;; esac
echo "1, 2, 700, 1980, 0x0"
SH
    chmod +x "$T/bin/nvidia-smi"
}

@test "bench/gpu-sampler.sh: peak memory, and power and clock over the samples at half the limit or more, 'cap' when the throttle was on in most" {
    fake_smi
    printf '%s\n' "1000, 80.0, 700.00, 1980, 0x0000000000000000" "52000, 690.0, 700.00, 1500, 0x0000000000000004" \
        "52405, 680.0, 700.00, 1600, 0x000000000000000C" "51000, 400.0, 700.00, 1700, 0x0000000000000000" \
        "900, 120.0, 700.00, 1980, 0x0000000000000001" >"$T/lines"
    run bash -c 'export PATH="$1/bin:$PATH" SMI_LINES="$1/lines"; . bench/gpu-sampler.sh; smi_init cuda
        echo "fields $smi_fields"; mem_start "$1/s.txt"; sleep 1; mem_stop
        echo "peak $(peak_mem "$1/s.txt") power $(power_of "$1/s.txt")"' _ "$T"
    [ "$status" -eq 0 ]
    [[ "$output" == *"fields memory.used,power.draw,power.limit,clocks.sm,clocks_throttle_reasons.active"* ]]
    # 690, 680 and 400 W are at half the 700 W limit or more: mean 590 W, 1600 MHz; two of three capped
    [[ "$output" == *"peak 52405 power 590/1600 cap"* ]]
    # one capped sample of three: no "cap"
    printf '%s\n' "52000, 690.0, 700.00, 1500, 0x4" "52000, 600.0, 700.00, 1800, 0x0" "52000, 500.0, 700.00, 1900, 0x1" >"$T/lines"
    run bash -c 'export PATH="$1/bin:$PATH" SMI_LINES="$1/lines"; . bench/gpu-sampler.sh; smi_init cuda
        mem_start "$1/s2.txt"; sleep 1; mem_stop; echo "power [$(power_of "$1/s2.txt")]"' _ "$T"
    [[ "$output" == *"power [597/1733]"* ]]
    # an nvidia-smi without the power fields: memory alone, no power figure; no GPU: no sampler
    printf '%s\n' "4000" "52405" >"$T/lines"
    run bash -c 'export PATH="$1/bin:$PATH" SMI_LINES="$1/lines" FIELDS=memory; . bench/gpu-sampler.sh; smi_init cuda
        echo "fields $smi_fields"; mem_start "$1/s3.txt"; sleep 1; mem_stop
        echo "peak $(peak_mem "$1/s3.txt") power [$(power_of "$1/s3.txt")]"
        smi_init cpu; mem_start "$1/s4.txt"; echo "cpu [$sampler] [$([ -e "$1/s4.txt" ] && echo file)]"' _ "$T"
    [[ "$output" == *"fields memory.used"$'\n'* ]]
    [[ "$output" == *"peak 52405 power []"* ]]
    [[ "$output" == *"cpu [] []"* ]]
    # bench-ceiling --sustained's last slice
    printf '%s\n' "sustained gemm 8192^3 bf16, slices of 163 calls: 709 656 701 TFLOP/s" \
        "sustained: 3.4 s of GEMMs: first slice 708.6, last 701.1, lowest 656.5, highest 709.0 TFLOP/s" >"$T/ceil.log"
    run bash -c '. bench/gpu-sampler.sh; echo "[$(sustained_rate "$1/ceil.log")] [$(sustained_rate /dev/null)]"' _ "$T"
    [ "$output" = "[701.1] []" ]
}
