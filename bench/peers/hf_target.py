"""hf_target.py: the peer of dfl-target's GPU benchmark: Hugging Face transformers (sdpa, bf16)
running the same token batches (read from a dfl token stream), with the hidden states of the same
captured layers copied to the host, as an in-process training system does. Prints tokens/s.

    python3 hf_target.py --model DIR --tokens shard.dfl --layers 1,9,17,25,33 [--warmup 2]
        [--modes full,truncated]

A packed batch of S sequences of equal length L is run as a [S, L] batch (no padding needed); a
batch of unequal lengths is right-padded with an attention mask (counted tokens exclude padding).

Modes (each timed over the same batches, in one process, after one load):
  full       the whole CausalLM (every layer, the final norm, the LM head), as an in-process
             training system runs it with output_hidden_states=True;
  truncated  the same work as dfl-target: the base model cut after the last captured layer, the
             final norm replaced by the identity (so hidden_states[l + 1] is layer l's output for
             every captured l) and no LM head: what a careful user of transformers would run.
Prints one JSON line per mode.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflread  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="a dfl token stream (from dfl-bucket or mktokens)")
    ap.add_argument("--layers", required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-batches", type=int, default=0)
    ap.add_argument("--modes", default="full", help="comma-separated: full, truncated")
    ap.add_argument("--json", help="write the results here (a list, one entry per mode)")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    layers = [int(x) for x in a.layers.split(",")]
    _, batches = dflread.read(a.tokens)
    if a.max_batches:
        batches = batches[: a.max_batches]
    dev = torch.device("cuda")
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to(dev).eval()
    load_s = time.time() - t0

    net = model

    def run(b):
        lens = b["seq_lens"].astype(np.int64)
        ids = torch.from_numpy(b["input_ids"].astype(np.int64))
        S, L = len(lens), int(lens.max())
        if (lens == L).all():
            x = ids.view(S, L).to(dev, non_blocking=True)
            mask = None
        else:
            x = torch.zeros(S, L, dtype=torch.int64)
            m = torch.zeros(S, L, dtype=torch.int64)
            o = 0
            for i, n in enumerate(lens):
                x[i, :n] = ids[o:o + n]
                m[i, :n] = 1
                o += n
            x, mask = x.to(dev), m.to(dev)
        with torch.no_grad():
            out = net(input_ids=x, attention_mask=mask, output_hidden_states=True, use_cache=False)
            hs = [out.hidden_states[l + 1].to("cpu", non_blocking=False) for l in layers]
        return int(lens.sum()), hs

    modes = a.modes.split(",")
    if "truncated" in modes and "full" in modes[modes.index("truncated"):]:
        raise SystemExit("hf_target.py: --modes: full must come before truncated (which cuts the model)")
    results = []
    for mode in modes:
        if mode == "truncated":
            base = model.model
            base.layers = base.layers[: layers[-1] + 1]
            base.config.num_hidden_layers = layers[-1] + 1
            base.norm = torch.nn.Identity()
            net = base
            torch.cuda.empty_cache()
        elif mode != "full":
            raise SystemExit("hf_target.py: unknown mode %r" % mode)
        for b in batches[: a.warmup]:
            run(b)
        torch.cuda.synchronize()
        t0 = time.time()
        tokens = 0
        for b in batches:
            n, _ = run(b)
            tokens += n
        torch.cuda.synchronize()
        dt = time.time() - t0
        res = {"peer": "transformers-sdpa-bf16", "mode": mode,
               "transformers": __import__("transformers").__version__, "torch": torch.__version__,
               "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "batches": len(batches),
               "load_s": load_s, "max_memory_gb": torch.cuda.max_memory_allocated() / 1e9}
        print(json.dumps(res), flush=True)
        results.append(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
