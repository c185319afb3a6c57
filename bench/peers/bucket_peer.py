#!/usr/bin/env python3
"""bucket_peer.py: the Python peer of dfl-bucket for bench/bucket.

What a user would write instead of dfl-bucket, with json and numpy: read JSON Lines samples
(input_ids, optional loss_mask or labels with -100), check them, truncate to --max-len, drop
samples without a trained token, bucket by length, shuffle, pack batches of at most --max-tokens
tokens (first fit over 8 open batches, as dfl-bucket does), shuffle the batches, deal them to
shards by token totals, and write each shard as a .npz of packed arrays under -o DIR.

It does the same work as dfl-bucket, in one process, with numpy's generator for the shuffles
(so its batches are not the same as dfl-bucket's, but its counts of samples and tokens are).
Prints one JSON line of figures on stdout.

    bucket_peer.py [--shards N] [--buckets 512,1024,2048,4096] [--max-tokens N] [--max-len N]
                   [--seed N] -o DIR INPUT...
"""
import argparse
import gzip
import heapq
import json
import lzma
import os
import sys
import time

import numpy as np

OPEN = 8


def open_input(path):
    if path == "-":
        return sys.stdin.buffer
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    return open(path, "rb")


def read_samples(paths, max_len, vocab):
    """Yields (ids int32, mask uint8) per kept sample; returns counts through the dict."""
    counts = {"lines": 0, "bytes": 0, "truncated": 0, "dropped_no_trained_token": 0}
    samples = []
    for path in paths:
        f = open_input(path)
        for lineno, line in enumerate(f, 1):
            counts["lines"] += 1
            counts["bytes"] += len(line)
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            obj = json.loads(line)
            if not isinstance(obj, dict) or obj.get("input_ids") is None:
                sys.exit(f"{where}: missing input_ids")
            ids = np.asarray(obj["input_ids"])
            if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
                sys.exit(f"{where}: input_ids must be a non-empty list of integers")
            if ids.min() < 0 or ids.max() >= (vocab or 2**31):
                sys.exit(f"{where}: token id out of range")
            ids = ids.astype(np.int32)
            if obj.get("loss_mask") is not None:
                mask = np.asarray(obj["loss_mask"])
                if mask.dtype == bool:
                    mask = mask.astype(np.uint8)
                if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
                    sys.exit(f"{where}: bad loss_mask")
                mask = mask.astype(np.uint8)
            elif obj.get("labels") is not None:
                labels = np.asarray(obj["labels"])
                if labels.shape != ids.shape or labels.dtype.kind not in "iu":
                    sys.exit(f"{where}: bad labels")
                mask = (labels != -100).astype(np.uint8)
            else:
                mask = np.ones(ids.shape, dtype=np.uint8)
            if max_len and ids.size > max_len:
                ids, mask = ids[:max_len], mask[:max_len]
                truncated = True
            else:
                truncated = False
            if not mask.any():
                counts["dropped_no_trained_token"] += 1
                continue
            counts["truncated"] += truncated
            samples.append((ids, mask))
        if f is not sys.stdin.buffer:
            f.close()
    return samples, counts


def pack(order, lens, min_len, max_tokens):
    """First fit over at most OPEN open batches, as dfl-bucket(1) describes."""
    batches, open_b = [], []  # open: [tokens, [members]]
    for s in order:
        n = int(lens[s])
        if n > max_tokens:
            batches.append([s])
            continue
        for b in open_b:
            if b[0] + n <= max_tokens:
                break
        else:
            if len(open_b) == OPEN:
                batches.append(open_b.pop(0)[1])
            b = [0, []]
            open_b.append(b)
        b[0] += n
        b[1].append(s)
        if max_tokens - b[0] < min_len:
            batches.append(b[1])
            open_b.remove(b)
    batches.extend(b[1] for b in open_b)
    return batches


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--buckets", default="512,1024,2048,4096")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--max-len", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.monotonic()
    bounds = np.array([int(x) for x in a.buckets.split(",")], dtype=np.int64)
    max_len = a.max_len or int(bounds[-1])
    samples, counts = read_samples(a.inputs, max_len, a.vocab_size)
    t_read = time.monotonic()
    lens = np.array([s[0].size for s in samples], dtype=np.int64)
    bucket_of = np.searchsorted(bounds, lens, side="left")
    rng = np.random.default_rng(a.seed)
    batches = []
    for b in range(len(bounds)):
        members = np.flatnonzero(bucket_of == b)
        order = rng.permutation(members)
        min_len = 1 if b == 0 else int(bounds[b - 1]) + 1
        batches.extend(pack(order, lens, min_len, a.max_tokens))
    order = rng.permutation(len(batches))
    heap = [(0, s) for s in range(a.shards)]
    shard_batches = [[] for _ in range(a.shards)]
    for bi in order:
        tok, s = heapq.heappop(heap)
        batch = batches[bi]
        shard_batches[s].append(batch)
        heapq.heappush(heap, (tok + int(lens[batch].sum()), s))
    os.makedirs(a.output, exist_ok=True)
    for s, blist in enumerate(shard_batches):
        members = [m for batch in blist for m in batch]
        seq_lens = lens[members].astype(np.uint32) if members else np.zeros(0, np.uint32)
        batch_seqs = np.array([len(b) for b in blist], dtype=np.uint32)
        ids = np.concatenate([samples[m][0] for m in members]) if members else np.zeros(0, np.int32)
        mask = np.concatenate([samples[m][1] for m in members]) if members else np.zeros(0, np.uint8)
        np.savez(os.path.join(a.output, f"shard-{s:05d}.npz"), batch_seqs=batch_seqs, seq_lens=seq_lens,
                 input_ids=ids, loss_mask=mask)
    t1 = time.monotonic()
    out = {
        "seconds": round(t1 - t0, 3),
        "read_seconds": round(t_read - t0, 3),
        "bytes": counts["bytes"],
        "lines": counts["lines"],
        "samples": len(samples),
        "tokens": int(lens.sum()),
        "batches": len(batches),
        "truncated": counts["truncated"],
        "dropped_no_trained_token": counts["dropped_no_trained_token"],
    }
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
