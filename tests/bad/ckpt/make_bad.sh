#!/usr/bin/env bash
# make_bad.sh [BUILD]: writes the corpus of inputs dfl-ckpt must reject (exit 2, a message naming
# the file and the defect) from inputs made by BUILD/tools/ckpt-gen (default build/), and EXPECT:
# "path<TAB>message substring" per case. Deterministic: same bytes every run.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
gen=${1:-$root/build}/tools/ckpt-gen
[ -x "$gen" ] || { echo "make_bad.sh: build $gen first (make)" >&2; exit 1; }
cd "$here"
find . -mindepth 1 ! -name make_bad.sh -exec rm -rf {} +
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
exp() { printf '%s\t%s\n' "$1" "$2" >> EXPECT; }
echo "# path<TAB>message substring (written by make_bad.sh)" > EXPECT

printf 'hello, this is not a checkpoint\n' > text.txt
exp text.txt "not a checkpoint"
: > empty.safetensors
exp empty.safetensors "truncated: empty input"
printf '\x89DFX\x01\x00\x00\x00 not a stream' > not-dfl.dfl
exp not-dfl.dfl "not-dfl.dfl"

"$gen" st "$tmp/good.safetensors" bf16 2 1000
head -c 1500 "$tmp/good.safetensors" > truncated.safetensors
exp truncated.safetensors "truncated.safetensors"
python3 - "$tmp/good.safetensors" bad-header.safetensors <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[12] = ord("!")                       # inside the JSON header
open(sys.argv[2], "wb").write(bytes(b))
PY
exp bad-header.safetensors "bad-header.safetensors"

mkdir no-model-dir
printf 'just a readme\n' > no-model-dir/README
exp no-model-dir "not a checkpoint or model directory"

"$gen" ckpt "$tmp/ck"
mkdir ckpt-bad-config ckpt-no-config ckpt-bad-optimizer
cp "$tmp/ck/model.safetensors" "$tmp/ck/trainer_state.json" ckpt-bad-config/
printf '{"block_size": 16,\n' > ckpt-bad-config/config.json
exp ckpt-bad-config "config.json"
cp "$tmp/ck/model.safetensors" "$tmp/ck/trainer_state.json" ckpt-no-config/
exp ckpt-no-config "without config.json"
cp "$tmp/ck/model.safetensors" "$tmp/ck/config.json" "$tmp/ck/trainer_state.json" ckpt-bad-optimizer/
head -c 3000 "$tmp/ck/optimizer.safetensors" > ckpt-bad-optimizer/optimizer.safetensors
exp ckpt-bad-optimizer "optimizer.safetensors"

"$gen" stream "$tmp/s.dfl" 3 bf16
size=$(stat -c %s "$tmp/s.dfl")
head -c $((size / 2)) "$tmp/s.dfl" > truncated.dfl
exp truncated.dfl "truncated.dfl"
head -c $((size - 64)) "$tmp/s.dfl" > no-end.dfl
exp no-end.dfl "no-end.dfl"
python3 - "$tmp/s.dfl" bad-checksum.dfl <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[1000] ^= 0x10                       # inside the first batch's payload
open(sys.argv[2], "wb").write(bytes(b))
PY
exp bad-checksum.dfl "bad-checksum.dfl"
