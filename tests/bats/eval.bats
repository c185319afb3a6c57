#!/usr/bin/env bats
# dfl-eval: the walk of greedy speculative decoding, exactly. A checkpoint from `ckpt-gen drafter`
# proposes token 0 at every slot (its final norm is zero: every logit is 0, the argmax the first
# index), so on streams whose tokens are given (draftdata --ids/--mask) the result is known by
# hand. Then a trained drafter (the same result however the anchors are batched), the report's
# fields, --per-sequence, --block-size, and the bad inputs of tests/bad/eval.
load helper
bats_require_minimum_version 1.5.0

setup() {
    TGT="$FIXTURES/draft/target"
    CFG="$FIXTURES/draft/config.json"   # block size 8, layers 1,2, mask token 63
    export OMP_WAIT_POLICY=passive
    command -v draftdata >/dev/null || PATH="$DFL_TOOLS:$PATH"
    T="$BATS_TEST_TMPDIR"
    ckpt-gen drafter "$T/zero" "$CFG"
}

# ids PREFIX N TOKEN: PREFIX then N times TOKEN, comma-separated
ids() { local s=$1 i; for ((i = 0; i < $2; i++)); do s+=",$3"; done; echo "$s"; }
# eval_zero DRAFTDATA-ARGS...: one stream $T/s.dfl (draftdata with these arguments) through
# dfl-eval -q with the drafter that always proposes 0; the report in $output.
eval_zero() {
    draftdata "$TGT" "$T/s.dfl" "$@"
    run dfl-eval -q --draft "$T/zero" --target "$TGT" "$T/s.dfl"
}
# num KEY: a value (a number, a string or an array of numbers) of the JSON object in $output, as
# dfl-eval writes it (compact)
num() { grep -o "\"$1\":\(\[[^]]*\]\|[^,}]*\)" <<< "$output" | head -1 | cut -d: -f2-; }
# less the fields that measure time or depend on how the anchors were batched
stable() { sed 's/"seconds":[^,}]*//; s/"drafter_forwards":[0-9]*//; s/"blocks_computed":[0-9]*//'; }

@test "--help, --version, usage errors" {
    run --separate-stderr dfl-eval --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"--draft CKPT"* ]]
    [[ "$output" == *"greedy"* ]]
    [ -z "$stderr" ]
    run dfl-eval --version
    [[ "$output" == "dfl-eval (dfl) "* ]]
    draftdata "$TGT" "$T/a.dfl" --batches 1
    run -1 dfl-eval --target "$TGT" "$T/a.dfl"
    [[ "$output" == *"--draft"* ]]
    run -1 dfl-eval --draft "$T/zero" "$T/a.dfl"
    [[ "$output" == *"--target"* ]]
    run -1 dfl-eval --draft "$T/zero" --target "$TGT" --block-size 1 "$T/a.dfl"
    run -1 dfl-eval --draft "$T/zero" --target "$TGT" --block-size 9 "$T/a.dfl"
    [[ "$output" == *"trained with blocks of 8"* ]]
    run -1 dfl-eval --draft "$T/zero" --target "$TGT" --device tpu "$T/a.dfl"
    run -1 dfl-eval --draft "$T/zero" --target "$TGT" - -
    run -1 dfl-eval --draft "$T/zero" --target "$TGT" --bogus "$T/a.dfl"
}

@test "a drafter that always proposes the text's tokens: tau = the block size" {
    # prompt 7 9, then 17 zeros: the first from the prefill, 16 = 2 full blocks of 8 to decode
    draftdata "$TGT" "$T/s.dfl" --batches 2 --seqs 3 --ids "$(ids 7,9 17 0)"
    run --separate-stderr dfl-eval --draft "$T/zero" --target "$TGT" "$T/s.dfl"
    [ "$status" -eq 0 ]
    [ "$(num tau)" = 8.0 ]
    [ "$(num steps)" = 12 ]
    [ "$(num tokens)" = 96 ]
    [ "$(num histogram)" = "[0,0,0,0,0,0,0,12]" ]
    [ "$(num slot_acceptance)" = "[1.0,1.0,1.0,1.0,1.0,1.0,1.0]" ]
    # 6 sequences: 6 prefills + 12 steps for 6 * 17 tokens
    [ "$(num target_forwards)" = 18 ]
    [ "$(num response_tokens)" = 102 ]
    [ "$(num sequences)" = 6 ]
    [[ "$stderr" == *"tau:              8.000 tokens per drafting step"* ]]
    [[ "$stderr" == *"speed-up bound 5.67x"* ]]
    # the same at a smaller block: 16 tokens = 4 blocks of 4
    run dfl-eval -q --draft "$T/zero" --target "$TGT" --block-size 4 "$T/s.dfl"
    [ "$(num tau)" = 4.0 ]
    [ "$(num block_size)" = 4 ]
    [ "$(num trained_block_size)" = 8 ]
    [ "$(num histogram)" = "[0,0,0,24]" ]
    # the last step is cut at the end of the text: 16 tokens = 6 + 6 + 4 at block 6
    run dfl-eval -q --draft "$T/zero" --target "$TGT" --block-size 6 "$T/s.dfl"
    [ "$(num steps)" = 18 ]
    [ "$(num histogram)" = "[0,0,0,6,0,12]" ]
}

@test "a drafter that always misses: tau = 1" {
    eval_zero --batches 1 --seqs 2 --ids "$(ids 7,9 17 5)"
    [ "$(num tau)" = 1.0 ]
    [ "$(num steps)" = 32 ]
    [ "$(num histogram)" = "[32,0,0,0,0,0,0,0]" ]
    [ "$(num speedup_bound)" = 1.0 ]
}

@test "a hand-worked case: tau 3.5" {
    # positions 0-1 the prompt, 2-16 the response (the drafter proposes 0 everywhere):
    #   pos  2 3 4 5 6 7 8 9 10 11 12 13 14 15 16
    #   tok  5 0 0 5 0 0 0 0 0  0  0  0  5  0  5
    # anchor 2: slots 3..9 -> 0 0 5: 2 accepted, 3 tokens; anchor 5: slots 6..12 all 0: 7 accepted,
    # 8 tokens; anchor 13: 3 tokens left, slot 14 is 5: 1 token; anchor 14: 2 left, 15 = 0, 16 = 5:
    # 2 tokens; at 16 the text ends. 4 steps, 14 tokens.
    eval_zero --batches 1 --seqs 1 --ids 7,9,5,0,0,5,0,0,0,0,0,0,0,0,5,0,5
    [ "$(num tau)" = 3.5 ]
    [ "$(num steps)" = 4 ]
    [ "$(num histogram)" = "[1,1,1,0,0,0,0,1]" ]
    # slot 1 reached at 4 steps, accepted at 3 (anchors 2, 5, 14); slot 2: 4, 2; slot 3: 3 (the
    # step at 13 reaches 3 slots), 1; slots 4-7: 2, 1
    [ "$(num slot_count)" = "[4,4,3,2,2,2,2]" ]
    [ "$(num slot_acceptance)" = "[0.75,0.5,0.3333333333,0.5,0.5,0.5,0.5]" ]
    [ "$(num target_forwards)" = 5 ]
    [ "$(num response_tokens)" = 15 ]
    [ "$(num speedup_bound)" = 3.0 ]
}

@test "two turns: each response span is decoded on its own" {
    # spans 2-5 (5 0 0 0) and 8-11 (5 0 0 5); 6-7 is the user's turn: 3 tokens then 3 tokens
    eval_zero --batches 1 --seqs 1 --ids 7,9,5,0,0,0,3,3,5,0,0,5 --mask 001111001111
    [ "$(num tau)" = 3.0 ]
    [ "$(num spans)" = 2 ]
    [ "$(num histogram)" = "[0,0,2,0,0,0,0,0]" ]
    [ "$(num target_forwards)" = 4 ]
}

@test "--per-sequence: one line per sequence in stream order, then the total" {
    draftdata "$TGT" "$T/a.dfl" --batches 2 --seqs 3 --ids "$(ids 7,9 17 0)"
    draftdata "$TGT" "$T/b.dfl" --batches 1 --seqs 2 --ids "$(ids 7,9 9 5)"
    run --separate-stderr dfl-eval -q --per-sequence --draft "$T/zero" --target "$TGT" "$T/a.dfl" "$T/b.dfl"
    [ "$status" -eq 0 ]
    [ "$(wc -l <<< "$output")" -eq 9 ]
    [ "$(grep '"kind":"sequence"' <<< "$output" |
         sed 's/.*"input":"[^"]*\/\([^"]*\)","batch":\([0-9]*\),"sequence":\([0-9]*\),.*"tau":\([0-9.]*\).*/\1 \2 \3 \4/' |
         tr '\n' ' ')" = "a.dfl 0 0 8.0 a.dfl 0 1 8.0 a.dfl 0 2 8.0 a.dfl 1 0 8.0 a.dfl 1 1 8.0 a.dfl 1 2 8.0 b.dfl 0 0 1.0 b.dfl 0 1 1.0 " ]
    output=$(tail -1 <<< "$output")
    [ "$(num kind)" = '"total"' ]
    [ "$(num steps)" = $((12 + 16)) ]
}

@test "a trained drafter: the same result however anchors are batched, on stdin too" {
    draftdata "$TGT" "$T/a.dfl" --batches 20 --seqs 4 --len 40
    dfl-draft --target "$TGT" --mask-token-id 63 --draft-layers 1 --block-size 8 --num-anchors 16 \
        --out "$T/r" --epochs 4 --lr 1e-2 --save-every 0 -q "$T/a.dfl" >/dev/null
    draftdata "$TGT" "$T/h.dfl" --batches 3 --seqs 4 --len 60 --seed 9
    ref=$(dfl-eval -q --draft "$T/r" --target "$TGT" "$T/h.dfl" | stable)
    tau=$(output=$ref num tau)
    # learnt something, and decoding gets less than every slot
    awk -v t="$tau" 'BEGIN { exit !(t > 1.5 && t < 8) }'
    for mb in 1 5 64; do
        for mt in 60 100; do
            out=$(dfl-eval -q --draft "$T/r/latest" --target "$TGT" --max-blocks $mb --max-tokens $mt "$T/h.dfl" | stable)
            [ "$out" = "$ref" ]
        done
    done
    # one block a forward: only the anchors the walk visits are computed
    run dfl-eval -q --draft "$T/r" --target "$TGT" --max-blocks 1 "$T/h.dfl"
    [ "$(num blocks_computed)" = "$(num steps)" ]
    [ "$(num drafter_forwards)" = "$(num steps)" ]
    out=$(dfl-eval -q --draft "$T/r" --target "$TGT" - < "$T/h.dfl" | stable)
    [ "$out" = "$ref" ]
    # a context that does not fit
    run -1 dfl-eval -q --draft "$T/r" --target "$TGT" --max-tokens 20 "$T/h.dfl"
    [[ "$output" == *"--max-tokens 20"* ]]
}

@test "bad inputs are rejected with the documented status (tests/bad/eval)" {
    draftdata "$TGT" "$T/good.dfl" --batches 2 --seqs 2 --len 16
    n=0
    while IFS='|' read -r f st words; do
        case $f in '#'* | '') continue ;; esac
        if [[ $f == *.dfl ]]; then
            run --separate-stderr dfl-eval --draft "$T/zero" --target "$TGT" "$BAD/eval/$f"
        else
            run --separate-stderr dfl-eval --draft "$BAD/eval/$f" --target "$TGT" "$T/good.dfl"
        fi
        [ "$status" -eq "$st" ] || { echo "$f: status $status, expected $st: $stderr"; false; }
        [[ "$stderr" == *"$words"* ]] || { echo "$f: '$stderr' lacks '$words'"; false; }
        [ -z "$output" ] || { echo "$f: output on stdout: $output"; false; }
        n=$((n + 1))
    done < "$BAD/eval/EXPECT"
    [ "$n" -eq 12 ]
}
