#!/usr/bin/env bash
# make.sh: (re)builds the committed seed corpora tests/fuzz/corpus/<reader>/ from the test
# fixtures and the known-bad corpora (small files only). run-fuzz also reads tests/bad/frame,
# tests/fixtures/frame, tests/bad/safetensors and tests/fixtures/st directly, so those are not
# copied. Run from anywhere; the seeds are named after where they came from.
set -euo pipefail
cd "$(dirname "$0")/../../.."
c=tests/fuzz/corpus
copy() { # DEST_DIR SRC NAME
    mkdir -p "$1"
    cp "$2" "$1/$3"
}
# frame: the .dfl streams of the other corpora
for f in tests/bad/target/*.dfl; do copy $c/frame "$f" "target-$(basename "$f")"; done
# config: every config.json of the fixtures and bad models, and the oracle's when present
for f in tests/fixtures/target/*/config.json tests/bad/target/*/config.json; do
    d=$(basename "$(dirname "$f")")
    copy $c/config "$f" "$d.json"
done
[ -f ../shared/oracle/qwen3-tiny-a/config.json ] && copy $c/config ../shared/oracle/qwen3-tiny-a/config.json qwen3-tiny-a.json
# stindex: the index of every bad model directory, and a good two-shard index for the fuzzer's
# fixed shards (see fuzz-stindex.c)
for f in tests/bad/safetensors/idx-*/model.safetensors.index.json; do
    copy $c/stindex "$f" "$(basename "$(dirname "$f")").json"
done
cat >$c/stindex/good-two-shards.json <<'JSON'
{
  "metadata": {"total_size": 64},
  "weight_map": {
    "a": "model-00001-of-00002.safetensors",
    "b": "model-00001-of-00002.safetensors",
    "c": "model-00002-of-00002.safetensors",
    "model.embed_tokens.weight": "model-00002-of-00002.safetensors"
  }
}
JSON
cat >$c/stindex/good-one-shard.json <<'JSON'
{"weight_map": {"a": "model-00001-of-00001.safetensors"}}
JSON
# draft: the drafter config fixture and the bad configs; two trainer states (kept as written here)
cp tests/fixtures/draft/config.json $c/draft/fixture-config.json
for f in tests/bad/draft/*.json; do copy $c/draft "$f" "bad-$(basename "$f")"; done
# safetensors: the seeds are the fixtures and the bad corpus, read in place; keep the dir
mkdir -p $c/safetensors
[ -f $c/safetensors/README ] || echo "Seeds are read from tests/fixtures/st and tests/bad/safetensors; libFuzzer finds more." >$c/safetensors/README
du -sh $c
