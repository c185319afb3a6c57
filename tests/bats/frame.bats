#!/usr/bin/env bats
# frame.bats: the .dfl readers agree on every path (dfl-frame(5)): a file read through its INDEX
# (dfl-draft's replay), the same bytes through a pipe, and dfl-ckpt --verify refuse each defect of
# tests/bad/frame/*-indexed.dfl with exit 2 and the same message; an empty input is truncated,
# with one message, on every path; the HEADER is read as strictly as the page says.
bats_require_minimum_version 1.5.0
load helper

setup() {
    cd "$BATS_TEST_TMPDIR"
    TGT="$FIXTURES/draft/target"
    export OMP_WAIT_POLICY=passive
    # the small drafter of draft.bats
    A=(--target "$TGT" --mask-token-id 63 --draft-layers 1 --block-size 8 --num-anchors 16)
}

# paths FILE: runs FILE through dfl-draft by file (replay through the INDEX), dfl-draft through a
# pipe, and dfl-ckpt --verify; sets s_file s_pipe s_verify (exit statuses) and m_file m_pipe
# m_verify (the last line of stderr of each).
paths() {
    local f=$1 n
    n=$(basename "$f" .dfl)
    s_file=0 s_pipe=0 s_verify=0
    dfl-draft "${A[@]}" --out "r-$n" "$f" > /dev/null 2> err-file || s_file=$?
    cat "$f" | dfl-draft "${A[@]}" --out "p-$n" --total-steps 8 - > /dev/null 2> err-pipe || s_pipe=$?
    dfl-ckpt --verify "$f" 2> err-verify || s_verify=$?
    m_file=$(tail -n 1 err-file) m_pipe=$(tail -n 1 err-pipe) m_verify=$(tail -n 1 err-verify)
}

@test "the base of the indexed defects trains by file and through a pipe, and verifies" {
    paths "$FIXTURES/frame/hidden-draft.dfl"
    [ "$s_file" -eq 0 ]
    [ "$s_pipe" -eq 0 ]
    [ "$s_verify" -eq 0 ]
    [[ "$m_file" == *"done: 4 steps"* ]]
}

# indexed NAME TEXT: the defect of NAME-indexed.dfl is refused on all three paths with exit 2 and
# the same message, which holds TEXT (a file with an INDEX trained with exit 0 before).
indexed() {
    local f="$BAD/frame/$1-indexed.dfl"
    [ -f "$f" ]
    paths "$f"
    echo "file: $s_file: $m_file"
    echo "pipe: $s_pipe: $m_pipe"
    echo "verify: $s_verify: $m_verify"
    [ "$s_file" -eq 2 ]
    [ "$s_pipe" -eq 2 ]
    [ "$s_verify" -eq 2 ]
    [[ "$m_file" == *"$f: frame "*"$2"* ]]
    [[ "$m_pipe" == *"stdin: frame "*"$2"* ]]
    [[ "$m_verify" == *"$f: frame "*"$2"* ]]
    # the same message but for the name of the input
    [ "${m_file#*"$f"}" = "${m_pipe#*stdin}" ]
    [ "${m_verify#*"$f"}" = "${m_pipe#*stdin}" ]
    [ -z "$(ls "r-$1-indexed" 2> /dev/null | grep step-)" ]   # no checkpoint
}

@test "by its INDEX as through a pipe: an unknown must-understand frame type" {
    indexed unsup-frame-type "unsupported frame type 1000"
}

@test "by its INDEX as through a pipe: a batch index out of order" {
    indexed batch-index "batch index 7, expected 1"
}

@test "by its INDEX as through a pipe: a second HEADER" {
    indexed header-twice "a second HEADER frame"
}

@test "by its INDEX as through a pipe: a NOTE that is not JSON" {
    indexed note-not-json "NOTE: invalid JSON"
}

@test "by its INDEX as through a pipe: a gap in the frame numbers" {
    indexed seq-gap "frame number 3, expected 2"
}

@test "an empty input is truncated, with one message, by file, through a pipe and under --verify" {
    local want="truncated: empty input (no bytes at all)"
    : > empty
    for f in "$BAD/frame/trunc-empty.dfl" empty; do
        run -2 dfl-ckpt --verify "$f"
        assert_output "dfl-ckpt: error: $f: $want"
        run -2 dfl-ckpt "$f"
        assert_output "dfl-ckpt: error: $f: $want"
    done
    run -2 bash -c "cat empty | dfl-ckpt --verify -"
    assert_output "dfl-ckpt: error: stdin: $want"
    run -2 dfl-draft "${A[@]}" --out r empty
    assert_output --partial "error: empty: $want"
    run -2 bash -c "dfl-draft ${A[*]} --out r --total-steps 4 - < empty"
    assert_output --partial "error: stdin: $want"
}

@test "the HEADER: integers are integer tokens, null is not absence (every path)" {
    local f
    for c in "vocab-real:\"vocab_size\" must be an integer" "vocab-exponent:\"vocab_size\" must be an integer" \
             "hidden-size-real:\"hidden_size\" must be an integer" "vocab-null:\"vocab_size\" is null" \
             "fingerprint-null:\"fingerprint\" is null" "meta-null:\"meta\" is null"; do
        f="$BAD/frame/header-${c%%:*}.dfl"
        run -2 dfl-ckpt --verify "$f"
        assert_output --partial "dfl-ckpt: error: $f: frame 0 at offset 0: HEADER: ${c#*:}"
        run -2 bash -c "dfl-ckpt --verify - < '$f'"
        assert_output --partial "stdin: frame 0 at offset 0: HEADER: ${c#*:}"
    done
}

# header_json FILE: the HEADER payload of a stream (its stored_len bytes after the 64-byte header)
header_json() {
    local n
    n=$(od -An -t u8 -j 8 -N 8 "$1" | tr -d ' ')
    tail -c +65 "$1" | head -c "$n"
}

@test "dfl-bucket(1): the header's vocab_size is left out without --vocab-size (not 0), given with it" {
    printf '{"input_ids":[1,2,3,4],"loss_mask":[0,1,1,1]}\n{"input_ids":[5,6,7]}\n' > a.jsonl
    dfl-bucket -q -o plain a.jsonl
    dfl-bucket -q --vocab-size 100 -o vocab a.jsonl
    PY=$(command -v /usr/bin/python3 || command -v python3)
    header_json plain/shard-00000.dfl > plain.json
    header_json vocab/shard-00000.dfl > vocab.json
    [ "$("$PY" -c 'import json, sys; print("vocab_size" in json.load(open(sys.argv[1])))' plain.json)" = False ]
    [ "$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' vocab.json)" = 100 ]
    grep -q '(the key is left out when it is not given' "$REPO/man/dfl-bucket.1"
}
