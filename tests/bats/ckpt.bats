#!/usr/bin/env bats
# ckpt.bats: dfl-ckpt from the command line: listing every input kind (told by content), the
# NaN/Inf scan (planted values found with their count and first index, files and streams, any
# thread count, pread or mapping), statistics, --verify, --diff, --to-safetensors, the oracle
# files, and every bad input of the corpora rejected with exit 2 and a message naming the file.
bats_require_minimum_version 1.5.0
load helper

TORCH="$FIXTURES/torch"

setup() {
    cd "$BATS_TEST_TMPDIR"
}

gen() {
    "$DFL_TOOLS/ckpt-gen" "$@"
}

# pyj EXPR FILE: a Python expression over the JSON document j read from FILE.
PY=$(command -v /usr/bin/python3 || command -v python3)
pyj() {
    "$PY" -c 'import json, sys; j = json.load(open(sys.argv[2])); print(eval(sys.argv[1]))' "$1" "$2"
}

# rejects TEXT... -- CMD...: CMD exits 2 with every TEXT in its output (a loop-friendly check: it
# says which command failed, and returns non-zero).
rejects() {
    local texts=() out rc t
    while [ "$1" != -- ]; do
        texts+=("$1")
        shift
    done
    shift
    out=$("$@" 2>&1) && rc=0 || rc=$?
    for t in "${texts[@]}"; do
        if [ "$rc" -ne 2 ] || [[ "$out" != *"$t"* ]]; then
            echo "expected exit 2 and '$t' from: $*" >&2
            echo "got exit $rc: $out" >&2
            return 1
        fi
    done
}

# --- generic behaviour

@test "--help prints the usage on stdout" {
    assert_help dfl-ckpt "Usage: dfl-ckpt" --check-nan
}

@test "--version" {
    assert_version dfl-ckpt
}

@test "no path is a usage error" {
    run -1 dfl-ckpt --check-nan
    assert_output --partial "no PATH"
}

@test "two modes are a usage error" {
    run -1 dfl-ckpt --check-nan --stats "$TORCH/tensor.pt"
    assert_output --partial "exclusive"
}

@test "--diff needs exactly two paths" {
    run -1 dfl-ckpt --diff "$TORCH/tensor.pt"
    assert_output --partial "exactly two"
}

@test "a bad --threads value is a usage error" {
    run -1 dfl-ckpt -j lots "$TORCH/tensor.pt"
    assert_output --partial "--threads"
}

# --- listing

@test "lists a safetensors file: name, dtype, shape, bytes" {
    gen st a.safetensors f32 3 10
    run -0 --separate-stderr dfl-ckpt a.safetensors
    assert_line --index 0 "# name	dtype	shape	bytes"
    assert_line --index 1 "t0	f32	[10]	40"
    assert_line --index 3 "t2	f32	[10]	40"
    [ "${#lines[@]}" -eq 4 ]
}

@test "lists a torch file with the names, dtypes and shapes of its .expect" {
    run -0 --separate-stderr dfl-ckpt "$TORCH/state_dict.pt"
    got=$(printf '%s\n' "${lines[@]:1}" | awk -F'\t' '{ print $1, $2, $3 }')
    want=$(awk '{ s = $3 == "-" ? "[]" : "[" $3 "]"; print $1, $2, s }' "$TORCH/state_dict.expect")
    [ "$got" = "$want" ]
}

@test "lists a nested torch checkpoint with joined names" {
    run -0 --separate-stderr dfl-ckpt "$TORCH/checkpoint.pt"
    assert_line "model.w	f32	[2,2]	16"
    assert_line "optimizer.state.0.exp_avg	f32	[2,2]	16"
    assert_line "pair.0	i64	[1]	8"
}

@test "the kind is told by content, not by the file name" {
    gen st a.safetensors bf16 1 4
    cp a.safetensors model.bin
    cp "$TORCH/tensor.pt" weights.safetensors.data
    run -0 dfl-ckpt --json model.bin weights.safetensors.data
    echo "$output" > out.json
    [ "$(pyj 'j["inputs"][0]["kind"]' out.json)" = safetensors ]
    [ "$(pyj 'j["inputs"][1]["kind"]' out.json)" = torch ]
}

@test "lists a checkpoint directory: both files, each under its name" {
    gen ckpt ck
    run -0 --separate-stderr dfl-ckpt ck
    assert_line "# ck/model.safetensors (safetensors)"
    assert_line "# ck/optimizer.safetensors (safetensors)"
    assert_line "fc.weight	bf16	[64,192]	24576"
    assert_line "fc.weight.exp_avg	f32	[64,192]	49152"
}

@test "a directory holding pytorch_model.bin is read as that torch file" {
    mkdir hf
    cp "$TORCH/state_dict.pt" hf/pytorch_model.bin
    run -0 --separate-stderr dfl-ckpt hf
    assert_line "embed.weight	bf16	[4,3]	24"
}

@test "--json listing" {
    run -0 --separate-stderr dfl-ckpt --json "$TORCH/checkpoint.pt"
    echo "$output" > out.json
    [ "$(pyj 'len(j["inputs"][0]["tensors"])' out.json)" -eq 7 ]
    [ "$(pyj 'j["inputs"][0]["tensors"][0]' out.json)" = "{'bytes': 16, 'dtype': 'f32', 'name': 'model.w', 'shape': [2, 2]}" ]
}

@test "lists a stream frame by frame" {
    gen stream s.dfl 3 bf16
    run -0 --separate-stderr dfl-ckpt s.dfl
    assert_line --index 0 "# offset	seq	type	flags	stored	raw	S	T	K	H	dtype"
    assert_line --index 1 --regexp "^0	0	header	"
    assert_line --index 2 --regexp "^[0-9]+	1	hidden	-	6400	6400	2	16	3	64	bf16$"
    assert_line --index 4 --regexp "^[0-9]+	3	hidden	-	6400	6400	2	16	3	64	bf16$"
    assert_line --regexp "	end	"
}

@test "lists a stream from stdin" {
    gen tokens t.dfl 2
    run -0 --separate-stderr dfl-ckpt - < t.dfl
    assert_line --index 2 --regexp "	1	tokens	-	[0-9]+	[0-9]+	2	16	0	0	-$"
}

# --- --check-nan

@test "--check-nan: all finite is exit 0 with nothing on stdout" {
    gen st a.safetensors bf16 4 100000
    run -0 --separate-stderr dfl-ckpt --check-nan a.safetensors
    [ -z "$output" ]
    [[ "$stderr" == *"all 4 floating tensors finite"* ]]
}

@test "--check-nan finds planted NaN/Inf at the first, last and middle positions (bf16)" {
    gen st a.safetensors bf16 3 300001 t0:0:nan t1:300000:inf t2:150000:-inf t2:150001:nan
    run -2 --separate-stderr dfl-ckpt --check-nan a.safetensors
    assert_line "a.safetensors: t0: 1 non-finite (1 NaN, 0 +Inf, 0 -Inf), first at flat index 0"
    assert_line "a.safetensors: t1: 1 non-finite (0 NaN, 1 +Inf, 0 -Inf), first at flat index 300000"
    assert_line "a.safetensors: t2: 2 non-finite (1 NaN, 0 +Inf, 1 -Inf), first at flat index 150000"
    [ "${#lines[@]}" -eq 3 ]
}

@test "--check-nan on f32, f16 and f64 files" {
    for dt in f32 f16 f64; do
        gen st $dt.safetensors $dt 2 777 t1:776:nan
        run -2 --separate-stderr dfl-ckpt --check-nan $dt.safetensors
        assert_output "$dt.safetensors: t1: 1 non-finite (1 NaN, 0 +Inf, 0 -Inf), first at flat index 776"
    done
}

@test "--check-nan gives the same report with 1, 2 and all threads, and through the mapping" {
    gen st a.safetensors f32 2 600000 t1:599999:nan t1:262144:inf
    dfl-ckpt --check-nan -j1 a.safetensors > one.txt || true
    dfl-ckpt --check-nan -j2 a.safetensors > two.txt || true
    dfl-ckpt --check-nan -j0 a.safetensors > all.txt || true
    dfl-ckpt --check-nan --mmap a.safetensors > map.txt || true
    grep -q "t1: 2 non-finite (1 NaN, 1 +Inf, 0 -Inf), first at flat index 262144" one.txt
    cmp one.txt two.txt
    cmp one.txt all.txt
    cmp one.txt map.txt
}

@test "--check-nan on torch files names the tensor" {
    run -2 --separate-stderr dfl-ckpt --check-nan "$TORCH/state_dict.pt" "$TORCH/tensor.pt"
    assert_output "$TORCH/state_dict.pt: nan: 2 non-finite (1 NaN, 1 +Inf, 0 -Inf), first at flat index 2"
}

@test "--check-nan on a checkpoint directory scans the optimizer too" {
    gen ckpt ck fc.weight.exp_avg_sq:12287:inf
    run -2 --separate-stderr dfl-ckpt --check-nan ck
    assert_output "ck/optimizer.safetensors: fc.weight.exp_avg_sq: 1 non-finite (0 NaN, 1 +Inf, 0 -Inf), first at flat index 12287"
}

@test "--check-nan on a stream names the batch, the layer, the token and the dimension" {
    gen stream s.dfl 4 bf16 batch2.layer9:70:nan batch3.layer17:0:-inf
    run -2 --separate-stderr dfl-ckpt --check-nan s.dfl
    assert_line --index 0 --regexp "^s.dfl: batch2.layer9: 1 non-finite \(1 NaN, 0 \+Inf, 0 -Inf\), first at flat index 70 \(token 1, dim 6; frame at offset [0-9]+\)$"
    assert_line --index 1 --regexp "^s.dfl: batch3.layer17: 1 non-finite \(0 NaN, 0 \+Inf, 1 -Inf\), first at flat index 0 \(token 0, dim 0;"
}

@test "--check-nan reads a stream from stdin" {
    gen stream s.dfl 2 f32 batch1.layer1:3:inf
    run -2 --separate-stderr dfl-ckpt --check-nan - < s.dfl
    assert_output --regexp "^\(stdin\): batch1.layer1: 1 non-finite"
}

@test "--check-nan --json" {
    gen st a.safetensors bf16 2 10 t1:4:nan
    run -2 --separate-stderr dfl-ckpt --check-nan --json a.safetensors
    echo "$output" > out.json
    [ "$(pyj 'j["finite"]' out.json)" = False ]
    [ "$(pyj 'j["inputs"][0]["tensors"][1]["first"]' out.json)" = 4 ]
    [ "$(pyj 'j["inputs"][0]["tensors"][0]["first"]' out.json)" = None ]
}

@test "--check-nan skips integer tensors" {
    run -0 --separate-stderr dfl-ckpt --check-nan "$TORCH/tensor.pt"
    [ -z "$output" ]
}

# --- --stats

@test "--stats: min, max, mean, std, absmax, non-finite count" {
    run -0 --separate-stderr dfl-ckpt --stats "$TORCH/checkpoint.pt"
    assert_line --index 0 "# name	dtype	numel	min	max	mean	std	absmax	nonfinite"
    assert_line "model.w	f32	4	1	4	2.5	1.11803399	4	0"
    assert_line "ema.1	f16	3	1	2	1.5	0.5	2	1"
    assert_line "pair.0	i64	1	5	5	5	0	5	0"
}

@test "--stats does not depend on the thread count" {
    gen st a.safetensors bf16 2 700000 t0:5:nan
    dfl-ckpt --stats -j1 a.safetensors > one.txt
    dfl-ckpt --stats -j2 a.safetensors > two.txt
    cmp one.txt two.txt
}

@test "--stats of a stream names every field of every batch" {
    gen stream s.dfl 2 bf16
    run -0 --separate-stderr dfl-ckpt --stats s.dfl
    assert_line --regexp "^batch0.seq_lens	u32	2	5	11	8	3	11	0$"
    assert_line --regexp "^batch1.layer17	bf16	1216	"
    [ "${#lines[@]}" -eq 13 ]
}

# --- --verify

@test "--verify accepts good inputs of every kind" {
    gen st a.safetensors f16 2 50
    gen ckpt ck
    gen stream s.dfl 2 bf16
    run -0 --separate-stderr dfl-ckpt --verify a.safetensors ck s.dfl "$TORCH/checkpoint.pt"
    [ -z "$output" ]
    [[ "$stderr" == *"s.dfl: OK (dfl-stream, 5 frames, 2 batches, 35 tokens, checksums verified)"* ]]
    [[ "$stderr" == *"ck/optimizer.safetensors: OK"* ]]
}

@test "--verify --json" {
    run -2 --separate-stderr dfl-ckpt --verify --json "$TORCH/tensor.pt" "$BAD/torch/os_system.pt"
    echo "$output" > out.json
    [ "$(pyj 'j["ok"]' out.json)" = False ]
    [ "$(pyj 'j["inputs"][0]["ok"]' out.json)" = True ]
    [[ "$(pyj 'j["inputs"][1]["error"]' out.json)" == *"refusing the global os.system"* ]]
}

@test "every file of the ckpt corpus is rejected with exit 2 and a message naming it" {
    while IFS=$'\t' read -r f text; do
        [[ "$f" == \#* ]] && continue
        rejects "$f" "$text" -- dfl-ckpt --verify "$BAD/ckpt/$f"
        rejects "$text" -- dfl-ckpt --check-nan "$BAD/ckpt/$f"
    done < "$BAD/ckpt/EXPECT"
}

@test "every file of the torch corpus is rejected with exit 2 and its message, verified or listed" {
    while IFS=$'\t' read -r f code text; do
        [[ "$f" == \#* ]] && continue
        rejects "$BAD/torch/$f: " "$text" -- dfl-ckpt --verify "$BAD/torch/$f"
        if [ "$f" != bad_crc.pt ]; then   # a listing reads no tensor data, so no CRC
            rejects "$text" -- dfl-ckpt "$BAD/torch/$f"
        fi
    done < "$BAD/torch/EXPECT"
}

@test "every bad safetensors file and directory is rejected with exit 2" {
    for f in "$BAD"/safetensors/*; do
        case "$f" in *MANIFEST|*.py) continue ;; esac
        rejects "error: $f" -- dfl-ckpt --check-nan "$f"
    done
}

@test "every bad stream is rejected with exit 2" {
    [ -d "$BAD/frame" ] || skip "no stream corpus (tests/bad/frame)"
    for f in "$BAD"/frame/*.dfl; do
        rejects "error: $f" -- dfl-ckpt --verify "$f"
    done
}

@test "a missing path is exit 2, naming it" {
    run -2 dfl-ckpt --check-nan does-not-exist.safetensors
    assert_output --partial "does-not-exist.safetensors: cannot open"
}

@test "every path is processed: a bad one does not hide a NaN in the next" {
    gen st a.safetensors bf16 1 10 t0:3:nan
    run -2 --separate-stderr dfl-ckpt --check-nan "$BAD/ckpt/text.txt" a.safetensors
    assert_output "a.safetensors: t0: 1 non-finite (1 NaN, 0 +Inf, 0 -Inf), first at flat index 3"
    [[ "$stderr" == *"text.txt: not a checkpoint"* ]]
}

# --- --diff

@test "--diff of identical checkpoints is exit 0" {
    gen ckpt a
    gen ckpt b
    run -0 --separate-stderr dfl-ckpt --diff a b
    assert_line --index 0 "# name	max_abs	max_rel	differing	note"
    assert_line "fc.weight	0	0	0	"
    [[ "$stderr" == *"are identical (20 tensors)"* ]]
}

@test "--diff reports the differing tensor and exits 1" {
    gen ckpt a
    gen ckpt b norm.weight:3:0.5
    run -1 --separate-stderr dfl-ckpt --diff a b
    assert_line --regexp "^norm.weight	[0-9.e-]+	[0-9.e-]+	1	$"
    assert_line "fc.weight	0	0	0	"
}

@test "--diff: a NaN against a number is an infinite difference" {
    gen st a.safetensors f32 1 100
    gen st b.safetensors f32 1 100 t0:50:nan
    run -1 --separate-stderr dfl-ckpt --diff a.safetensors b.safetensors
    assert_line "t0	inf	inf	1	"
}

@test "--diff notes tensors in one only, and a changed trainer_state.json" {
    gen ckpt a
    gen ckpt b
    rm b/optimizer.safetensors
    echo '{"step": 999}' > b/trainer_state.json
    run -1 --separate-stderr dfl-ckpt --diff a b
    assert_line "optimizer.safetensors:fc.weight.master	-	-	-	only in A"
    assert_line "trainer_state.json	-	-	-	differs"
}

@test "--diff of a torch file against itself, as JSON" {
    run -0 --separate-stderr dfl-ckpt --diff --json "$TORCH/state_dict.pt" "$TORCH/state_dict.pt"
    echo "$output" > out.json
    [ "$(pyj 'j["identical"]' out.json)" = True ]
    [ "$(pyj 'len(j["diff"][0]["tensors"])' out.json)" -eq 17 ]
}

@test "--diff of an invalid input is exit 2" {
    gen st a.safetensors f32 1 10
    run -2 dfl-ckpt --diff a.safetensors "$BAD/ckpt/truncated.safetensors"
    assert_output --partial "truncated.safetensors"
}

# --- --to-safetensors

@test "--to-safetensors writes batch<N>.<field> tensors" {
    gen stream s.dfl 2 bf16
    run -0 dfl-ckpt --to-safetensors out.safetensors s.dfl
    run -0 --separate-stderr dfl-ckpt out.safetensors
    assert_line "batch0.input_ids	i32	[16]	64"
    assert_line "batch0.seq_lens	u32	[2]	8"
    assert_line "batch0.loss_mask	u8	[16]	16"
    assert_line "batch0.layer9	bf16	[16,64]	2048"
    assert_line "batch1.layer17	bf16	[19,64]	2432"
    [ "${#lines[@]}" -eq 13 ]
}

@test "--to-safetensors keeps every value: stats of the file equal those of the stream" {
    gen stream s.dfl 3 f32 batch1.layer9:5:nan
    dfl-ckpt --to-safetensors out.safetensors s.dfl
    dfl-ckpt --stats s.dfl | sed 1d | sort > a.txt
    dfl-ckpt --stats out.safetensors | sed 1d | sort > b.txt
    cmp a.txt b.txt
}

@test "--to-safetensors records the stream header as metadata" {
    gen stream s.dfl 1 bf16
    dfl-ckpt --to-safetensors out.safetensors s.dfl
    n=$(od -An -t u8 -N 8 out.safetensors | tr -d ' ')
    head -c $((8 + n)) out.safetensors | tail -c "$n" > header.json
    [ "$(pyj 'j["__metadata__"]["dfl.layers"]' header.json)" = "1,9,17" ]
    [ "$(pyj 'j["__metadata__"]["dfl.n_batches"]' header.json)" = 1 ]
}

@test "--to-safetensors of something that is not a stream is refused" {
    run -1 dfl-ckpt --to-safetensors out.safetensors "$TORCH/tensor.pt"
    assert_output --partial "converts a .dfl stream"
    [ ! -e out.safetensors ]
}

@test "--to-safetensors of a corrupt stream leaves no file behind" {
    run -2 dfl-ckpt --to-safetensors out.safetensors "$BAD/ckpt/bad-checksum.dfl"
    assert_output --partial "checksum"
    run ls -A
    assert_output ""
}

@test "--to-safetensors into a FIFO writes into it, never renames over it" {
    gen stream s.dfl 2 bf16
    dfl-ckpt --to-safetensors want.safetensors s.dfl
    mkfifo out.fifo
    timeout 60 cat out.fifo > got.safetensors &
    run -0 dfl-ckpt --to-safetensors out.fifo s.dfl
    wait
    [ -p out.fifo ]
    cmp want.safetensors got.safetensors
    run ls -A
    assert_output "$(printf '%s\n' got.safetensors out.fifo s.dfl want.safetensors)"
}

@test "--to-safetensors into a character device writes into it: /dev/null stays /dev/null" {
    gen stream s.dfl 1 bf16
    ln -s /dev/null nul
    run -0 dfl-ckpt --to-safetensors nul s.dfl
    [ -L nul ]
    [ "$(readlink nul)" = /dev/null ]
    [ -c /dev/null ]
    [ -z "$(ls -A | grep -v '^nul$' | grep -v '^s.dfl$')" ]
    run -0 dfl-ckpt --to-safetensors /dev/null s.dfl
    [ -c /dev/null ]
}

@test "--to-safetensors through a symbolic link replaces the file it points to, not the link" {
    gen stream s.dfl 2 bf16
    dfl-ckpt --to-safetensors want.safetensors s.dfl
    mkdir d
    echo old > d/real.safetensors
    ln -s d/real.safetensors link.safetensors
    run -0 dfl-ckpt --to-safetensors link.safetensors s.dfl
    [ -L link.safetensors ]
    [ "$(readlink link.safetensors)" = d/real.safetensors ]
    cmp want.safetensors d/real.safetensors
    [ "$(ls -A d)" = real.safetensors ]
}

@test "--to-safetensors refuses a link to nothing and a directory, exit 1, touching neither" {
    gen stream s.dfl 1 bf16
    ln -s nowhere/x.safetensors dangling
    run -1 dfl-ckpt --to-safetensors dangling s.dfl
    assert_output --partial "dangling: a symbolic link to nothing: refusing to write through it"
    [ -L dangling ]
    [ ! -e nowhere ]
    mkdir dir
    run -1 dfl-ckpt --to-safetensors dir s.dfl
    assert_output --partial "dir: is a directory"
    [ -d dir ]
    [ -z "$(ls -A dir)" ]
}

# --- the oracle files

@test "oracle: the Qwen3 model directory lists and scans clean" {
    require_oracle
    run -0 --separate-stderr dfl-ckpt "$DFL_ORACLE/qwen3-tiny-a"
    assert_line "model.embed_tokens.weight	bf16	[2048,256]	1048576"
    [ "${#lines[@]}" -eq 70 ]
    run -0 --separate-stderr dfl-ckpt --check-nan "$DFL_ORACLE/qwen3-tiny-a" "$DFL_ORACLE/qwen3-tiny-a/ref.safetensors"
    [ -z "$output" ]
}

@test "oracle: the DFlash golden file verifies and scans clean" {
    require_oracle
    run -0 --separate-stderr dfl-ckpt --verify "$DFL_ORACLE/dflash-tiny/golden.safetensors"
    run -0 --separate-stderr dfl-ckpt --check-nan -j2 "$DFL_ORACLE/dflash-tiny/golden.safetensors"
    [ -z "$output" ]
}

@test "real torch files (when committed) list and verify" {
    compgen -G "$TORCH/real/*.pt" > /dev/null || compgen -G "$TORCH/real/*.bin" > /dev/null ||
        skip "no real torch files in tests/fixtures/torch/real"
    for f in "$TORCH"/real/*.pt "$TORCH"/real/*.bin; do
        [ -e "$f" ] || continue
        run -0 dfl-ckpt --verify "$f"
        run -0 --separate-stderr dfl-ckpt "$f"
        stem=${f%.*}
        if [ -f "$stem.expect" ]; then
            got=$(printf '%s\n' "${lines[@]:1}" | awk -F'\t' '{ print $1, $2 }')
            want=$(awk '{ print $1, $2 }' "$stem.expect")
            [ "$got" = "$want" ]
        fi
    done
}

@test "real torch files: the planted NaN and Inf of state_dict.pt are found" {
    [ -f "$TORCH/real/state_dict.pt" ] || skip "no real torch files in tests/fixtures/torch/real"
    run -2 --separate-stderr dfl-ckpt --check-nan "$TORCH/real/state_dict.pt" "$TORCH/real/state_dict_p4.pt"
    assert_line "$TORCH/real/state_dict.pt: nan: 2 non-finite (1 NaN, 1 +Inf, 0 -Inf), first at flat index 3"
    assert_line "$TORCH/real/state_dict_p4.pt: nan: 2 non-finite (1 NaN, 1 +Inf, 0 -Inf), first at flat index 3"
    [ "${#lines[@]}" -eq 2 ]
}

@test "a sharded model directory: every shard is scanned, each tensor from its own file" {
    mkdir m
    gen st m/model-00001-of-00002.safetensors f32 2 1000
    gen stream s.dfl 1 bf16 batch0.layer9:17:inf
    dfl-ckpt --to-safetensors m/model-00002-of-00002.safetensors s.dfl
    {
        echo '{"metadata": {}, "weight_map": {'
        echo '"t0": "model-00001-of-00002.safetensors", "t1": "model-00001-of-00002.safetensors",'
        for f in input_ids seq_lens loss_mask layer1 layer9; do
            echo "\"batch0.$f\": \"model-00002-of-00002.safetensors\","
        done
        echo '"batch0.layer17": "model-00002-of-00002.safetensors"}}'
    } > m/model.safetensors.index.json
    run -2 --separate-stderr dfl-ckpt --check-nan m
    assert_output "m: batch0.layer9: 1 non-finite (0 NaN, 1 +Inf, 0 -Inf), first at flat index 17"
    run -0 --separate-stderr dfl-ckpt m
    [ "${#lines[@]}" -eq 9 ]
}
