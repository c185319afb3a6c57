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
for o in qwen3-tiny-a qwen35-tiny-a llama31-tiny-a qwen3moe-tiny-a; do
    [ -f ../shared/oracle/$o/config.json ] && copy $c/config ../shared/oracle/$o/config.json $o.json
done
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
# torch: every torch.save fixture and bad file as a member list for fuzz-torch (the .pt files
# themselves are read in place as zip seeds)
if compgen -G 'tests/fixtures/torch/*.pt' >/dev/null; then
    mkdir -p $c/torch
    python3 - $c/torch tests/fixtures/torch/*.pt tests/fixtures/torch/real/*.pt tests/bad/torch/*.pt <<'PY'
import os, sys, zipfile
out = sys.argv[1]
for path in sys.argv[2:]:
    try:
        z = zipfile.ZipFile(path)
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    except Exception:
        continue  # not a readable zip: a bad case about the zip itself
    blob = b''.join(b'\0\0ENTRY:' + n.encode() + b'\n' + d for n, d in members)
    if len(blob) <= 8192:
        name = path.replace('tests/', '', 1).replace('/', '-') + '.members'
        open(os.path.join(out, name), 'wb').write(blob)
PY
fi
# jsonl: the sample fixtures compressed and archived (the plain files are read in place)
if compgen -G 'tests/fixtures/bucket/*.jsonl' >/dev/null; then
    mkdir -p $c/jsonl
    python3 - $c/jsonl tests/fixtures/bucket/*.jsonl <<'PY'
import gzip, io, os, sys, tarfile, zipfile
out, paths = sys.argv[1], sys.argv[2:]
data = {os.path.basename(p): open(p, 'rb').read() for p in paths}
for name, d in data.items():
    # mtime 0: the same bytes every time
    open(os.path.join(out, name + '.gz'), 'wb').write(gzip.compress(d, mtime=0))
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode='w', format=tarfile.USTAR_FORMAT) as t:
    for name, d in sorted(data.items()):
        ti = tarfile.TarInfo('samples/' + name)
        ti.size, ti.mtime = len(d), 0
        t.addfile(ti, io.BytesIO(d))
    ti = tarfile.TarInfo('samples/README')
    ti.size = 5
    t.addfile(ti, io.BytesIO(b'skip\n'))
open(os.path.join(out, 'fixtures.tar'), 'wb').write(buf.getvalue())
buf = io.BytesIO()
with zipfile.ZipFile(buf, 'w') as z:
    for name, d in sorted(data.items()):
        z.writestr(zipfile.ZipInfo('part/' + name, (1980, 1, 1, 0, 0, 0)), d)
open(os.path.join(out, 'fixtures.zip'), 'wb').write(buf.getvalue())
PY
fi
# tune: good --tune-files (the bad ones, tests/bad/tune, are read in place)
mkdir -p $c/tune
h=$(printf '%0128d' 0)
printf '{"format": "dfl-tune 1", "scope": "NVIDIA H200 sm_90 cuBLASLt 130100", "products": {}}\n' >$c/tune/good-empty.json
printf '{"format": "dfl-tune 1", "scope": "NVIDIA H200 sm_90 cuBLASLt 130100", "products": {"16384x6144x4096 ld 4096,4096,6144 dtype 1,1,1 trans 0,1 beta 0 bias 0 align 256,256,256,0": "%s", "256x512x384": "%s"}}\n' "$h" "${h%??}ff" >$c/tune/good-two.json
# safetensors: the seeds are the fixtures and the bad corpus, read in place; keep the dir
mkdir -p $c/safetensors
[ -f $c/safetensors/README ] || echo "Seeds are read from tests/fixtures/st and tests/bad/safetensors; libFuzzer finds more." >$c/safetensors/README
du -sh $c
