#!/usr/bin/env bats
# bucket.bats: dfl-bucket from the command line: every option, every kind of bad input, every
# input format, determinism, shard balance, the manifest and the output directory's safety.
load helper
bats_require_minimum_version 1.5.0

BADB="$BAD/bucket"
FIX="$FIXTURES/bucket"

setup() {
    cd "$BATS_TEST_TMPDIR"
}

# gen FILE N [args...]: N synthetic samples (lengths 8..3000).
gen() {
    local f=$1 n=$2
    shift 2
    "$DFL_TOOLS/gen-bucket-jsonl" --samples "$n" --seed 3 --max-len 3000 "$@" > "$f"
}

# mj DIR EXPR: a Python expression over the manifest m of DIR.
mj() {
    python3 -c 'import json, sys; m = json.load(open(sys.argv[1] + "/manifest.json")); print(eval(sys.argv[2]))' "$1" "$2"
}

# expect FILE MAXLEN: every sample of a JSON Lines file as the shards must hold it, "ids|mask",
# computed independently with Python's json (truncated to MAXLEN, untrained samples dropped).
expect() {
    python3 -c '
import json, sys
for line in open(sys.argv[1], encoding="utf-8"):
    if not line.strip():
        continue
    o = json.loads(line)
    ids = o["input_ids"]
    if o.get("loss_mask") is not None:
        m = [int(x) for x in o["loss_mask"]]
    elif o.get("labels") is not None:
        m = [0 if x == -100 else 1 for x in o["labels"]]
    else:
        m = [1] * len(ids)
    ids, m = ids[:int(sys.argv[2])], m[:int(sys.argv[2])]
    if any(m):
        print(" ".join(map(str, ids)) + "|" + "".join(map(str, m)))' "$1" "$2" | LC_ALL=C sort
}

# dump DIR: every sequence of DIR's shards, "ids|mask", sorted.
dump() {
    "$DFL_TOOLS/bucket-dump" "$1"/shard-*.dfl | LC_ALL=C sort
}

# nothing of a run is left in (or as) DIR
assert_no_output() {
    if [ -e "$1" ]; then
        run ls -A "$1"
        assert_output ""
    fi
}

# assert_bad FILE MESSAGE: rejected with exit 2, naming FILE, line 3 and the problem; no output.
assert_bad() {
    cp "$BADB/$1" .
    run -2 dfl-bucket -o out "$1"
    assert_output --partial "dfl-bucket: error: $1:3: "
    assert_output --partial "$2"
    assert_no_output out
}

@test "--help prints the usage on stdout" {
    assert_help dfl-bucket "Usage: dfl-bucket" --buckets
}

@test "--version" {
    assert_version dfl-bucket
}

@test "no input is a usage error" {
    run -1 dfl-bucket -o out
    assert_output --partial "no input"
}

@test "no -o is a usage error" {
    run -1 dfl-bucket "$FIX/mixed.jsonl"
    assert_output --partial "-o DIR"
}

@test "bad option values are usage errors" {
    run -1 dfl-bucket --shards 0 -o out "$FIX/mixed.jsonl"
    assert_output --partial "--shards"
    run -1 dfl-bucket --buckets 1024,512 -o out "$FIX/mixed.jsonl"
    assert_output --partial "increase"
    run -1 dfl-bucket --buckets auto:0 -o out "$FIX/mixed.jsonl"
    run -1 dfl-bucket --long cut -o out "$FIX/mixed.jsonl"
    run -1 dfl-bucket --on-error ignore -o out "$FIX/mixed.jsonl"
    run -1 dfl-bucket --max-tokens 0 -o out "$FIX/mixed.jsonl"
    run -1 dfl-bucket --seed -1 -o out "$FIX/mixed.jsonl"
    run -1 dfl-bucket --buckets 512,1024 --max-len 2048 -o out "$FIX/mixed.jsonl"
    assert_output --partial "larger than the last bucket bound"
    assert_no_output out
}

@test "stdin may be named once" {
    run -1 dfl-bucket -o out - - < "$FIX/mixed.jsonl"
    assert_output --partial "more than once"
}

@test "a missing input is an error naming it" {
    run -1 dfl-bucket -o out nothere.jsonl
    assert_output --partial "nothere.jsonl: cannot open"
    assert_no_output out
}

@test "every convention of the input is read: counts in the manifest" {
    run -0 dfl-bucket -o out "$FIX/mixed.jsonl"
    [ -f out/shard-00000.dfl ]
    [ "$(mj out 'm["counts"]["samples"]')" = 8 ]
    [ "$(mj out 'm["counts"]["tokens"]')" = 24 ]
    [ "$(mj out 'm["counts"]["trained_tokens"]')" = 18 ]
    [ "$(mj out 'm["counts"]["lines"]')" = 9 ]
    [ "$(mj out 'm["counts"]["blank_lines"]')" = 1 ]
    [ "$(mj out 'm["inputs"][0]["name"]')" = "$FIX/mixed.jsonl" ]
}

@test "the manifest: settings, buckets, shards, warm-up shapes" {
    gen data.jsonl 400
    run -0 dfl-bucket --shards 3 --seed 9 --max-tokens 8192 --vocab-size 151936 -o out data.jsonl
    [ "$(mj out 'm["manifest_version"]')" = 1 ]
    [ "$(mj out 'm["seed"]')" = 9 ]
    [ "$(mj out 'm["max_tokens"]')" = 8192 ]
    [ "$(mj out 'm["max_len"]')" = 4096 ]
    [ "$(mj out 'm["vocab_size"]')" = 151936 ]
    [ "$(mj out 'm["long"]')" = truncate ]
    [ "$(mj out 'm["on_error"]')" = error ]
    [ "$(mj out '[b["bound"] for b in m["buckets"]]')" = "[512, 1024, 2048, 4096]" ]
    [ "$(mj out '[s["file"] for s in m["shards"]]')" = "['shard-00000.dfl', 'shard-00001.dfl', 'shard-00002.dfl']" ]
    # totals add up across buckets and shards
    [ "$(mj out 'sum(b["samples"] for b in m["buckets"]) == m["counts"]["samples"] == sum(s["samples"] for s in m["shards"])')" = True ]
    [ "$(mj out 'sum(b["tokens"] for b in m["buckets"]) == m["counts"]["tokens"] == sum(s["tokens"] for s in m["shards"])')" = True ]
    [ "$(mj out 'sum(b["batches"] for b in m["buckets"]) == m["counts"]["batches"] == sum(s["batches"] for s in m["shards"])')" = True ]
    # warm-up: one entry per non-empty bucket, within the budget and the bound
    [ "$(mj out 'len(m["warmup"]) == sum(1 for b in m["buckets"] if b["batches"])')" = True ]
    [ "$(mj out 'all(w["tokens"] <= 8192 and w["max_len"] <= w["bound"] and w["seqs"] >= 1 for w in m["warmup"])')" = True ]
    [ "$(mj out 'all(0 < b["efficiency"] <= 1 for b in m["buckets"] if b["batches"])')" = True ]
}

@test "--shards balances the token totals" {
    gen data.jsonl 600
    run -0 dfl-bucket --shards 4 -o out data.jsonl
    for i in 0 1 2 3; do [ -s out/shard-0000$i.dfl ]; done
    # greedy dealing: the spread is at most one batch
    [ "$(mj out 'max(s["tokens"] for s in m["shards"]) - min(s["tokens"] for s in m["shards"]) <= max(w["tokens"] for w in m["warmup"])')" = True ]
}

@test "fewer batches than shards: the extra shards are empty but complete streams" {
    run -0 dfl-bucket --shards 3 -o out "$FIX/mixed.jsonl"
    [ "$(mj out '[s["batches"] for s in m["shards"]]')" = "[1, 0, 0]" ]
    [ -s out/shard-00001.dfl ]
    [ -s out/shard-00002.dfl ]
}

@test "same inputs and seed give byte-identical output, whatever the threads" {
    gen data.jsonl 500
    # fewer, as many and more shards than threads (shards are written several at once)
    for shards in 1 2 5; do
        run -0 dfl-bucket --shards $shards --seed 4 -j 1 -o a$shards data.jsonl
        for j in 2 3 4; do
            run -0 dfl-bucket --shards $shards --seed 4 -j $j -o b$shards-$j data.jsonl
            for f in a$shards/*; do cmp "$f" "b$shards-$j/${f#a$shards/}"; done
            [ "$(ls b$shards-$j | wc -l)" = $((shards + 1)) ]
        done
    done
}

@test "another seed gives another order" {
    gen data.jsonl 300
    run -0 dfl-bucket --seed 1 -o a data.jsonl
    run -0 dfl-bucket --seed 2 -o b data.jsonl
    ! cmp -s a/shard-00000.dfl b/shard-00000.dfl
    [ "$(mj a 'm["counts"]')" = "$(mj b 'm["counts"]')" ]
}

@test "gzip, zstd and xz inputs give the same shards as plain" {
    gen data.jsonl 300
    gzip -k data.jsonl
    zstd -q data.jsonl
    xz -k data.jsonl
    run -0 dfl-bucket --shards 2 -o plain data.jsonl
    for f in data.jsonl.gz data.jsonl.zst data.jsonl.xz; do
        run -0 dfl-bucket --shards 2 -o "out-$f" "$f"
        cmp plain/shard-00000.dfl "out-$f/shard-00000.dfl"
        cmp plain/shard-00001.dfl "out-$f/shard-00001.dfl"
        [ "$(mj "out-$f" 'm["counts"]')" = "$(mj plain 'm["counts"]')" ]
    done
}

@test "tar and zip archives give the same shards as their members concatenated" {
    gen data.jsonl 300
    split -l 120 -d --additional-suffix=.jsonl data.jsonl part-
    echo "not data" > README.txt
    tar cf data.tar part-00.jsonl README.txt part-01.jsonl part-02.jsonl
    zip -q data.zip part-00.jsonl README.txt part-01.jsonl part-02.jsonl
    gzip -k part-01.jsonl
    tar czf data.tgz part-00.jsonl part-01.jsonl.gz part-02.jsonl
    run -0 dfl-bucket -o plain data.jsonl
    for f in data.tar data.zip data.tgz; do
        run -0 dfl-bucket -o "out-$f" "$f"
        cmp plain/shard-00000.dfl "out-$f/shard-00000.dfl"
    done
    [ "$(mj out-data.tgz '[i["name"] for i in m["inputs"]]')" = "['data.tgz:part-00.jsonl', 'data.tgz:part-01.jsonl.gz', 'data.tgz:part-02.jsonl']" ]
}

@test "messages name the archive member and its line" {
    printf '%s\n' '{"input_ids": [1]}' '{"input_ids": [1, -5]}' > bad.jsonl
    tar cf bad.tar bad.jsonl
    run -2 dfl-bucket -o out bad.tar
    assert_output --partial "bad.tar:bad.jsonl:2: input_ids[1] = -5 is negative"
    assert_no_output out
}

@test "stdin gives the same shards as the file" {
    gen data.jsonl 300
    run -0 dfl-bucket -o a data.jsonl
    dfl-bucket -o b - < data.jsonl
    cmp a/shard-00000.dfl b/shard-00000.dfl
    [ "$(mj b 'm["inputs"][0]["name"]')" = "(stdin)" ]
}

@test "several inputs are read in order" {
    gen data.jsonl 300
    head -n 100 data.jsonl > one.jsonl
    tail -n +101 data.jsonl | gzip > two.jsonl.gz
    run -0 dfl-bucket -o a data.jsonl
    run -0 dfl-bucket -o b one.jsonl two.jsonl.gz
    cmp a/shard-00000.dfl b/shard-00000.dfl
    [ "$(mj b '[(i["name"], i["lines"]) for i in m["inputs"]]')" = "[('one.jsonl', 100), ('two.jsonl.gz', 200)]" ]
}

@test "a truncated compressed input is invalid data" {
    gen data.jsonl 200
    gzip -c data.jsonl | head -c 20000 > cut.jsonl.gz
    run -2 dfl-bucket -o out cut.jsonl.gz
    assert_output --partial "cut.jsonl.gz"
    assert_no_output out
}

# assert_bad_input FILE MESSAGE...: a compressed input or archive of good samples whose data is
# bad is rejected with exit 2 naming FILE, by file and through stdin, even with --on-error skip.
assert_bad_input() {
    local f=$1
    shift
    cp "$BADB/$f" .
    for skip in error skip; do
        run -2 dfl-bucket --on-error "$skip" -o out "$f"
        assert_output --partial "dfl-bucket: error: $f"
        for m in "$@"; do assert_output --partial "$m"; done
        assert_no_output out
        run -2 dfl-bucket --on-error "$skip" -o out - < "$f"
        assert_output --partial "dfl-bucket: error: (stdin)"
        for m in "$@"; do assert_output --partial "$m"; done
        assert_no_output out
    done
}

@test "bad compressed data: a gzip member with a CRC error" {
    assert_bad_input gz-crc.jsonl.gz "corrupt gzip data: the CRC-32 or length of a member does not match"
}
@test "bad compressed data: a gzip member with a wrong length" {
    assert_bad_input gz-length.jsonl.gz "corrupt gzip data"
}
@test "bad compressed data: a second gzip member cut short" {
    assert_bad_input gz-cut-member.jsonl.gz "truncated"
}
@test "bad compressed data: a second gzip member cut inside its header" {
    assert_bad_input gz-cut-header.jsonl.gz "truncated: an incomplete member at byte 69"
}
@test "bad compressed data: gzip without its 4-byte trailer" {
    assert_bad_input gz-no-trailer.jsonl.gz "truncated"
    refute_output --partial "unknown libarchive error"
}
@test "bad compressed data: garbage after the gzip data" {
    assert_bad_input gz-trailing-garbage.jsonl.gz "data after the end of the compressed data, at byte 69"
}
@test "bad compressed data: a tar.gz with a CRC error" {
    assert_bad_input tgz-crc.tar.gz "corrupt gzip data"
}
@test "bad compressed data: a gzip member of a tar with a CRC error" {
    cp "$BADB/tar-member-crc.tar" .
    run -2 dfl-bucket -o out tar-member-crc.tar
    assert_output --partial "dfl-bucket: error: tar-member-crc.tar:part/a.jsonl.gz: corrupt gzip data"
    assert_no_output out
}
@test "bad compressed data: garbage after bzip2 data" {
    assert_bad_input bz2-trailing-garbage.jsonl.bz2 "data after the end of the compressed data"
}
@test "bad compressed data: xz cut short" {
    assert_bad_input xz-cut.jsonl.xz "truncated"
}
@test "bad compressed data: zstd with a wrong checksum" {
    assert_bad_input zst-checksum.jsonl.zst "checksum"
}
@test "bad compressed data: a zip cut between members" {
    assert_bad_input zip-cut.zip "truncated"
    refute_output --partial "unknown libarchive error"
}

@test "gzip of many members, empty ones too, gives the same shards as plain; one bad member fails" {
    gen data.jsonl 300
    python3 -c '
import gzip, sys
lines = open(sys.argv[1], "rb").readlines()
with open("many.jsonl.gz", "wb") as f:
    for i, l in enumerate(lines):
        f.write(gzip.compress(l, compresslevel=i % 10, mtime=0))
        if i % 7 == 0:
            f.write(gzip.compress(b"", mtime=0))
' data.jsonl
    run -0 dfl-bucket -o plain data.jsonl
    run -0 dfl-bucket -o many many.jsonl.gz
    cmp plain/shard-00000.dfl many/shard-00000.dfl
    run -0 dfl-bucket -o stdin - < many.jsonl.gz
    cmp plain/shard-00000.dfl stdin/shard-00000.dfl
    # the CRC of member 150 (of the sample on line 129) made wrong
    python3 -c '
import gzip, sys
lines = open(sys.argv[1], "rb").readlines()
with open("bad.jsonl.gz", "wb") as f:
    for i, l in enumerate(lines):
        m = bytearray(gzip.compress(l, mtime=0))
        if i == 128:
            m[-8] ^= 1
        f.write(m)
' data.jsonl
    run -2 dfl-bucket -o out bad.jsonl.gz
    assert_output --partial "bad.jsonl.gz: corrupt gzip data"
    assert_no_output out
}

@test "an empty compressed input, empty stdin and /dev/null are inputs with no samples" {
    printf '%s\n' '{"input_ids": [1, 2]}' > one.jsonl
    : > empty.jsonl
    gzip -c empty.jsonl > empty.jsonl.gz
    zstd -q -c empty.jsonl > empty.jsonl.zst
    xz -c empty.jsonl > empty.jsonl.xz
    bzip2 -c empty.jsonl > empty.jsonl.bz2
    run -0 dfl-bucket -o out empty.jsonl.gz empty.jsonl.zst one.jsonl empty.jsonl.xz empty.jsonl.bz2 /dev/null - < /dev/null
    [ "$(mj out 'm["counts"]["samples"]')" = 1 ]
    [ "$(mj out '[(i["name"], i["lines"]) for i in m["inputs"]]')" = "[('empty.jsonl.gz', 0), ('empty.jsonl.zst', 0), ('one.jsonl', 1), ('empty.jsonl.xz', 0), ('empty.jsonl.bz2', 0), ('/dev/null', 0), ('(stdin)', 0)]" ]
    # alone, each is what an empty plain file is: no samples
    for f in empty.jsonl empty.jsonl.gz empty.jsonl.zst /dev/null; do
        run -2 dfl-bucket -o out2 "$f"
        assert_output "dfl-bucket: error: no samples left (0 lines: 0 skipped, 0 too long, 0 without a trained token, 0 blank)"
    done
    run -2 dfl-bucket -o out2 - < /dev/null
    assert_output "dfl-bucket: error: no samples left (0 lines: 0 skipped, 0 too long, 0 without a trained token, 0 blank)"
    printf '' | { run -2 dfl-bucket --stats -; assert_output --partial "no samples left"; }
}

@test "an archive without JSON Lines members leaves no samples" {
    echo hello > notes.txt
    tar cf notes.tar notes.txt
    run -2 dfl-bucket -o out notes.tar
    assert_output --partial "no samples left"
    assert_no_output out
}

@test "bad record: not JSON" { assert_bad not-json.jsonl "not valid JSON"; }
@test "bad record: a cut line" { assert_bad truncated-line.jsonl "not valid JSON"; }
@test "bad record: not an object" { assert_bad not-object.jsonl "not a JSON object"; }
@test "bad record: missing input_ids" { assert_bad missing-input-ids.jsonl "missing input_ids"; }
@test "bad record: input_ids null" { assert_bad input-ids-null.jsonl "missing input_ids"; }
@test "bad record: input_ids not a list" { assert_bad input-ids-not-list.jsonl "input_ids is not a list"; }
@test "bad record: empty input_ids" { assert_bad empty-input-ids.jsonl "input_ids is empty"; }
@test "bad record: id not an integer" { assert_bad id-not-integer.jsonl "input_ids[1] is not an integer"; }
@test "bad record: id a string" { assert_bad id-string.jsonl "input_ids[1] is not an integer"; }
@test "bad record: negative id" { assert_bad id-negative.jsonl "input_ids[1] = -2 is negative"; }
@test "bad record: id over 32 bits" { assert_bad id-too-large.jsonl "input_ids[1] = 2147483648 does not fit a 32-bit token id"; }
@test "bad record: id over 64 bits" { assert_bad id-huge.jsonl "too big integer"; }
@test "bad record: loss_mask length mismatch" { assert_bad mask-length-mismatch.jsonl "loss_mask has 2 values for 3 input_ids"; }
@test "bad record: labels length mismatch" { assert_bad labels-length-mismatch.jsonl "labels has 2 values for 3 input_ids"; }
@test "bad record: loss_mask value 2" { assert_bad mask-value-2.jsonl "loss_mask[1] = 2 is not 0, 1, true or false"; }
@test "bad record: loss_mask value 0.5" { assert_bad mask-value-real.jsonl "loss_mask[1] is not 0, 1, true or false"; }
@test "bad record: loss_mask not a list" { assert_bad mask-not-list.jsonl "loss_mask is not a list"; }
@test "bad record: labels not integers" { assert_bad labels-not-integer.jsonl "labels[0] is not an integer"; }
@test "bad record: duplicate key" { assert_bad duplicate-key.jsonl "duplicate object key"; }
@test "bad record: invalid UTF-8" { assert_bad bad-utf8.jsonl "not valid JSON"; }
@test "bad record: NUL byte" { assert_bad nul-byte.jsonl "NUL byte"; }
@test "bad record: lone surrogate escape" { assert_bad lone-surrogate.jsonl "invalid Unicode"; }
@test "bad record: nested too deep" { assert_bad too-deep.jsonl "nested deeper than 64 levels"; }

@test "the bad corpus is rejected through stdin too, with the line" {
    run -2 dfl-bucket -o out - < "$BADB/mask-value-2.jsonl"
    assert_output --partial "(stdin):3: loss_mask[1] = 2"
    assert_no_output out
}

@test "--vocab-size: an id out of range is a bad record" {
    printf '%s\n' '{"input_ids": [1, 2]}' '{"input_ids": [5, 99, 100]}' > v.jsonl
    run -2 dfl-bucket --vocab-size 100 -o out v.jsonl
    assert_output --partial "v.jsonl:2: input_ids[2] = 100 is out of range for --vocab-size 100"
    assert_no_output out
    run -0 dfl-bucket --vocab-size 101 -o ok v.jsonl
}

@test "--on-error skip skips and counts bad records" {
    cat "$BADB/mask-value-2.jsonl" "$BADB/id-negative.jsonl" "$BADB/not-json.jsonl" > three.jsonl
    run -0 dfl-bucket --on-error skip -o out three.jsonl
    assert_output --partial "skipped 3 bad records; the first: three.jsonl:3: loss_mask[1] = 2"
    [ "$(mj out 'm["counts"]["skipped"]')" = 3 ]
    [ "$(mj out 'm["counts"]["samples"]')" = 9 ]
    [ "$(mj out 'm["on_error"]')" = skip ]
}

@test "other keys may hold \u0000 in a string" {
    printf '%s\n' '{"text": "a\u0000b", "input_ids": [1, 2]}' '{"input_ids": [3], "m": {"k": ["\u0000"]}}' > nul.jsonl
    run -0 dfl-bucket -o out nul.jsonl
    [ "$(mj out 'm["counts"]["samples"]')" = 2 ]
    run -0 dfl-bucket --stats - < nul.jsonl
    run -2 dfl-bucket -o out2 - <<< '{"input_ids": [1], "a\u0000": 1}'
    assert_output --partial "(stdin):1: not valid JSON"
}

# a line of 64 MiB + 1 byte (valid JSON) between two good samples, as FILE
overlong() {
    python3 -c '
import sys
n = 64 * 1024 * 1024 + 1
head = "{\"input_ids\": [1, 2], \"t\": \""
with open(sys.argv[1], "w") as f:
    f.write("{\"input_ids\": [5]}\n" + head + "x" * (n - len(head) - 2) + "\"}\n{\"input_ids\": [6]}\n")' "$1"
}

@test "a line over 64 MiB is refused alike in a plain file, through stdin and gzip, and in --stats" {
    overlong long.jsonl
    gzip -1 -c long.jsonl > long.jsonl.gz
    for src in long.jsonl long.jsonl.gz -; do
        run -2 dfl-bucket -o out "$src" < long.jsonl
        assert_output --partial ":2: line longer than the limit of 67108864 bytes"
        assert_no_output out
        run -2 dfl-bucket --stats "$src" < long.jsonl
        assert_output --partial ":2: line longer than the limit of 67108864 bytes"
        run -0 dfl-bucket --on-error skip -o out "$src" < long.jsonl
        assert_output --partial "skipped 1 bad record; the first: "
        [ "$(mj out 'm["counts"]["samples"]')" = 2 ]
        [ "$(mj out 'm["counts"]["lines"]')" = 3 ]
        rm -rf out
    done
}

@test "--on-error skip with nothing good left fails" {
    printf '%s\n' '{"input_ids": []}' 'x' > allbad.jsonl
    run -2 dfl-bucket --on-error skip -o out allbad.jsonl
    assert_output --partial "no samples left"
    assert_no_output out
}

@test "--max-len truncates by default, and counts" {
    printf '{"input_ids": [%s]}\n' "$(seq -s, 1 10)" "$(seq -s, 1 4)" > long.jsonl
    run -0 dfl-bucket --buckets 4,8 --max-len 6 -o out long.jsonl
    [ "$(mj out 'm["counts"]["truncated"]')" = 1 ]
    [ "$(mj out 'm["counts"]["tokens"]')" = 10 ]
    [ "$(mj out 'm["max_len"]')" = 6 ]
}

@test "--long drop drops longer samples, and counts" {
    printf '{"input_ids": [%s]}\n' "$(seq -s, 1 10)" "$(seq -s, 1 4)" > long.jsonl
    run -0 dfl-bucket --buckets 4,8 --max-len 6 --long drop -o out long.jsonl
    [ "$(mj out 'm["counts"]["dropped_too_long"]')" = 1 ]
    [ "$(mj out 'm["counts"]["truncated"]')" = 0 ]
    [ "$(mj out 'm["counts"]["tokens"]')" = 4 ]
    [ "$(mj out 'm["long"]')" = drop ]
}

@test "the default --max-len is the last bucket bound" {
    printf '{"input_ids": [%s]}\n' "$(seq -s, 1 10)" > long.jsonl
    run -0 dfl-bucket --buckets 4,8 -o out long.jsonl
    [ "$(mj out 'm["counts"]["tokens"]')" = 8 ]
}

@test "a sample with no trained position is dropped and counted" {
    run -0 dfl-bucket -o out "$FIX/masked.jsonl"
    [ "$(mj out 'm["counts"]["dropped_no_trained_token"]')" = 1 ]
    [ "$(mj out 'm["counts"]["samples"]')" = 2 ]
}

@test "truncation that cuts off every trained position drops the sample" {
    run -0 dfl-bucket --buckets 4,8 --max-len 4 -o out "$FIX/masked.jsonl"
    [ "$(mj out 'm["counts"]["dropped_no_trained_token"]')" = 2 ]
    [ "$(mj out 'm["counts"]["truncated"]')" = 0 ]
    [ "$(mj out 'm["counts"]["samples"]')" = 1 ]
}

@test "--buckets auto:K places bounds at length quantiles" {
    for n in $(seq 1 100); do printf '{"input_ids": [%s]}\n' "$(seq -s, 1 "$n")"; done > lens.jsonl
    run -0 dfl-bucket --buckets auto:4 -o out lens.jsonl
    [ "$(mj out '[b["bound"] for b in m["buckets"]]')" = "[25, 50, 75, 100]" ]
    [ "$(mj out '[b["samples"] for b in m["buckets"]]')" = "[25, 25, 25, 25]" ]
    [ "$(mj out 'm["buckets_auto"]')" = 4 ]
}

@test "--max-tokens bounds every batch; a longer sample is a batch of its own" {
    for n in 3 3 3 3 9; do printf '{"input_ids": [%s]}\n' "$(seq -s, 1 "$n")"; done > b.jsonl
    run -0 dfl-bucket --buckets 16 --max-tokens 7 -o out b.jsonl
    [ "$(mj out 'm["buckets"][0]["batches"]')" = 3 ]
    [ "$(mj out 'm["warmup"][0]["tokens"]')" = 9 ]
    [ "$(mj out 'm["warmup"][0]["seqs"]')" = 2 ]
    [ "$(mj out 'm["warmup"][0]["max_len"]')" = 9 ]
    [ "$(mj out 'm["max_tokens"]')" = 7 ]
}

@test "--max-tokens accepts size suffixes" {
    run -0 dfl-bucket --max-tokens 16K -o out "$FIX/mixed.jsonl"
    [ "$(mj out 'm["max_tokens"]')" = 16384 ]
}

@test "--stats prints the histogram and the plan, and writes nothing" {
    gen data.jsonl 300
    run -0 --separate-stderr dfl-bucket --stats --shards 2 -o out data.jsonl
    assert_output --partial "length histogram:"
    assert_output --partial "buckets (max-tokens 16384, seed 0):"
    assert_output --partial "shards: 2"
    assert_line --regexp "^ +512 +1023 +[0-9]+ +[0-9]+ +[0-9.]+%$"
    assert_line --regexp "^ +3 +4096 +[0-9]+ +[0-9]+ +[0-9]+ +[0-9.]+% "
    [ ! -e out ]
}

@test "--stats counts agree with a real run" {
    run -0 --separate-stderr dfl-bucket --stats "$FIX/mixed.jsonl"
    assert_line "tokens: 24, trained 18"
    assert_line --partial "samples: 8 kept; 0 skipped (bad)"
}

@test "a non-empty output directory is refused" {
    mkdir out
    echo keep > out/notes.txt
    run -1 dfl-bucket -o out "$FIX/mixed.jsonl"
    assert_output --partial "not empty"
    assert_output --partial "--force"
    [ "$(ls -A out)" = notes.txt ]
}

@test "--force replaces a previous output and keeps other files" {
    gen data.jsonl 300
    run -0 dfl-bucket --shards 3 -o out data.jsonl
    echo keep > out/notes.txt
    run -0 dfl-bucket --force --shards 2 -o out "$FIX/mixed.jsonl"
    [ ! -e out/shard-00002.dfl ]
    [ "$(ls -A out | sort | tr '\n' ' ')" = "manifest.json notes.txt shard-00000.dfl shard-00001.dfl " ]
    [ "$(mj out 'm["counts"]["samples"]')" = 8 ]
}

@test "a failed --force run leaves no manifest: the directory never looks complete" {
    run -0 dfl-bucket -o out "$FIX/mixed.jsonl"
    run -2 dfl-bucket --force -o out "$BADB/not-json.jsonl"
    [ ! -e out/manifest.json ]
    [ ! -e out/shard-00000.dfl ]
    run ls -A out
    assert_output ""
}

@test "-o naming a file is refused" {
    echo x > afile
    run -1 dfl-bucket -o afile "$FIX/mixed.jsonl"
    assert_output --partial "not a directory"
    [ "$(cat afile)" = x ]
}

@test "an interrupt leaves nothing behind" {
    mkfifo in.fifo
    dfl-bucket -o out - < in.fifo 2> err.txt 3>&- &
    pid=$!
    exec 7> in.fifo
    cat "$FIX/mixed.jsonl" >&7
    for i in $(seq 50); do [ -d out ] && break; sleep 0.1; done
    kill -TERM "$pid"
    # it must stop although no data comes and stdin stays open (at most 10 s here)
    for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    alive=0
    kill -0 "$pid" 2>/dev/null && alive=1
    exec 7>&-
    [ "$alive" = 0 ] || kill -KILL "$pid"
    rc=0
    wait "$pid" || rc=$?
    [ "$alive" = 0 ]
    [ "$rc" = 1 ]
    grep -q "interrupted" err.txt
    assert_no_output out
}

@test "binary garbage is rejected as not JSON" {
    head -c 3000 /dev/urandom > noise.jsonl
    printf '\n{"input_ids": [1]}\n' >> noise.jsonl
    run -2 dfl-bucket -o out noise.jsonl
    assert_output --partial "noise.jsonl"
    assert_no_output out
}

@test "round trip: every token and mask value of the fixture is in the shards exactly once" {
    run -0 dfl-bucket --shards 3 --max-tokens 8 -o out "$FIX/mixed.jsonl"
    dump out > got
    LC_ALL=C sort "$FIX/mixed.expect" > want
    diff want got
}

@test "round trip on generated data, with truncation, from a plain file" {
    gen data.jsonl 400 --min-len 1
    run -0 dfl-bucket --shards 3 --max-len 1000 --buckets 64,256,1000 --max-tokens 3000 -o out data.jsonl
    expect data.jsonl 1000 > want
    dump out > got
    [ "$(wc -l < want)" -gt 390 ]
    diff want got
}

@test "round trip from a compressed stream (the spill path)" {
    gen data.jsonl 300 --min-len 1
    zstd -q data.jsonl
    run -0 dfl-bucket --shards 2 --max-len 700 --buckets auto:3 --max-tokens 2000 -o out - < data.jsonl.zst
    expect data.jsonl 700 > want
    dump out > got
    diff want got
}

@test "every batch holds one bucket and keeps the token budget" {
    gen data.jsonl 400 --min-len 1
    run -0 dfl-bucket --shards 2 --buckets 100,500,2000,3000 --max-tokens 4000 -o out data.jsonl
    "$DFL_TOOLS/bucket-dump" --batches out/shard-*.dfl > batches
    [ "$(wc -l < batches)" = "$(mj out 'm["counts"]["batches"]')" ]
    # fields: file index seqs tokens max_len min_len
    awk 'function bucket(l) { return l <= 100 ? 0 : l <= 500 ? 1 : l <= 2000 ? 2 : 3 }
         { if (bucket($5) != bucket($6)) { print "mixed buckets: " $0; bad = 1 }
           if ($4 > 4000 && $3 > 1) { print "over budget: " $0; bad = 1 } }
         END { exit bad }' batches
}

@test "each shard header carries the plan and its warm-up shapes" {
    gen data.jsonl 300
    run -0 dfl-bucket --shards 2 --seed 5 -o out data.jsonl
    "$DFL_TOOLS/bucket-dump" --meta out/shard-00001.dfl > meta
    python3 -c '
import json, sys
meta = json.load(open(sys.argv[1]))
m = json.load(open(sys.argv[2] + "/manifest.json"))
assert meta["shard"] == 1 and meta["shards"] == 2 and meta["seed"] == 5, meta
assert meta["buckets"] == [b["bound"] for b in m["buckets"]], meta
assert meta["batches"] == m["shards"][1]["batches"] and meta["tokens"] == m["shards"][1]["tokens"], meta
glob = {w["bucket"]: w for w in m["warmup"]}
for w in meta["warmup"]:
    g = glob[w["bucket"]]
    assert w["seqs"] <= g["seqs"] and w["tokens"] <= g["tokens"] and w["max_len"] <= g["max_len"], (w, g)
' meta out
}

@test "more plain inputs than open descriptors allow" {
    for i in $(seq 1 300); do printf '{"input_ids": [%d, 1]}\n' "$i" > "in-$i.jsonl"; done
    run -0 bash -c 'ulimit -n 64 && dfl-bucket -o out in-*.jsonl'
    [ "$(mj out 'm["counts"]["samples"]')" = 300 ]
    [ "$(mj out 'len(m["inputs"])')" = 300 ]
}

@test "-q prints nothing on success; by default a summary line" {
    run -0 --separate-stderr dfl-bucket -q -o a "$FIX/mixed.jsonl"
    [ -z "$stderr" ]
    [ -z "$output" ]
    run -0 --separate-stderr dfl-bucket -o b "$FIX/mixed.jsonl"
    [ -z "$output" ]
    [[ "$stderr" == *"8 samples, 24 tokens"* ]]
}

@test "-v also prints timings and skipped archive members" {
    echo hello > notes.txt
    cp "$FIX/mixed.jsonl" .
    tar cf d.tar notes.txt mixed.jsonl
    run -0 --separate-stderr dfl-bucket -v -o out d.tar
    [[ "$stderr" == *"skipping member 'notes.txt'"* ]]
    [[ "$stderr" == *"timing: read"* ]]
}
