"""hf_target.py: the peer of dfl-target's GPU benchmark: Hugging Face transformers (sdpa, bf16)
running the same token batches (read from a dfl token stream), with the hidden states of the same
captured layers copied to the host as a careful PyTorch training system copies them. Prints
tokens/s.

    python3 hf_target.py --model DIR --tokens shard.dfl --layers 1,9,17,25,33 [--warmup 2]
        [--modes full,truncated]

A packed batch of S sequences of equal length L is run as a [S, L] batch (no padding needed); a
batch of unequal lengths is right-padded with an attention mask (counted tokens exclude padding,
and only the real tokens' rows are copied: gathered on the GPU first).

The copies are the careful user's (issue 15), not .to("cpu") into a fresh pageable tensor, which
stalls the GPU on every batch:
  - every captured layer is copied into preallocated pinned host buffers, sized once for the
    largest batch, with non_blocking=True copies;
  - double-buffered: two sets of host buffers; the copies of batch i run on a copy stream after
    an event recorded at the end of batch i's forward, so that they overlap the forward of batch
    i + 1 on the compute stream; before batch i + 2 reuses a set, the host waits for the event
    recorded after its copies (where a consumer would take the hidden states);
  - the GPU tensors being copied are marked as used by the copy stream (record_stream), so the
    caching allocator does not hand their memory to the next forward before the copy is done;
  - the input ids are in pinned memory, prepared before the timed loop (as a DataLoader with
    pin_memory=True in worker processes prepares them while the GPU runs) and uploaded with
    non_blocking=True.
The timed loop ends when the last copies have landed in host memory.

Modes (each timed over the same batches, in one process, after one load):
  full       the whole CausalLM (every layer, the final norm, the LM head), as an in-process
             training system runs it with output_hidden_states=True;
  truncated  the same work as dfl-target: the base model cut after the last captured layer, the
             final norm replaced by the identity (so hidden_states[l + 1] is layer l's output for
             every captured l) and no LM head: what a careful user of transformers would run.
Both modes copy the same way. Mixture-of-experts models (a config with num_experts) run
transformers' own experts implementation, --experts-implementation (default grouped_mm: the
tokens sorted by expert and one grouped GEMM per projection), passed to from_pretrained as
experts_implementation; a transformers without that argument loads its default, and the JSON
says which ran ("experts"). Prints one JSON line per mode (the keys bench/target reads:
tokens_per_s; "copy" says how the hidden states were copied).
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


def prepare(b):
    """A batch's inputs in pinned host memory: ids [S, L], the attention mask (None without
    padding) and the flat indices of the real tokens' rows in [S * L] (None without padding)."""
    lens = b["seq_lens"].astype(np.int64)
    ids = torch.from_numpy(b["input_ids"].astype(np.int64))
    S, L = len(lens), int(lens.max())
    if (lens == L).all():
        return {"x": ids.view(S, L).pin_memory(), "mask": None, "rows": None, "tokens": int(lens.sum())}
    x = torch.zeros(S, L, dtype=torch.int64)
    m = torch.zeros(S, L, dtype=torch.int64)
    o = 0
    for i, n in enumerate(lens):
        x[i, :n] = ids[o:o + n]
        m[i, :n] = 1
        o += n
    rows = torch.nonzero(m.view(-1), as_tuple=False).view(-1)
    return {"x": x.pin_memory(), "mask": m.pin_memory(), "rows": rows.pin_memory(), "tokens": int(lens.sum())}


class Copier:
    """Double-buffered copies of the captured layers into pinned host buffers on a copy stream."""

    def __init__(self, n_layers, max_tokens, hidden, dev):
        self.stream = torch.cuda.Stream(device=dev)
        self.host = [[torch.empty((max_tokens, hidden), dtype=torch.bfloat16, pin_memory=True)
                      for _ in range(n_layers)] for _ in range(2)]
        self.done = [None, None]    # per set: the event after its copies (None: free)
        self.fwd_done = [torch.cuda.Event(), torch.cuda.Event()]
        self.i = 0

    def submit(self, hs, T):
        """Copies the [T, H] device tensors hs (one per captured layer, made on the current
        stream) into the next set of host buffers, after the forward that made them."""
        k = self.i % 2
        self.i += 1
        if self.done[k] is not None:     # the set's previous batch has landed (a consumer takes it)
            self.done[k].synchronize()
        fwd = self.fwd_done[k]
        fwd.record(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(fwd)
            for dst, src in zip(self.host[k], hs):
                src.record_stream(self.stream)
                dst[:T].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.done[k] = ev

    def finish(self):
        for ev in self.done:
            if ev is not None:
                ev.synchronize()
        self.done = [None, None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="a dfl token stream (from dfl-bucket or mktokens)")
    ap.add_argument("--layers", required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-batches", type=int, default=0)
    ap.add_argument("--modes", default="full", help="comma-separated: full, truncated")
    ap.add_argument("--json", help="write the results here (a list, one entry per mode)")
    ap.add_argument("--experts-implementation", default="grouped_mm",
                    help="MoE models: transformers' experts backend (eager, batched_mm, grouped_mm)")
    a = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = [int(x) for x in a.layers.split(",")]
    _, batches = dflread.read(a.tokens)
    if a.max_batches:
        batches = batches[: a.max_batches]
    dev = torch.device("cuda")
    t0 = time.time()
    cfg = AutoConfig.from_pretrained(a.model)
    cfg = getattr(cfg, "text_config", None) or cfg
    kw = {"dtype": torch.bfloat16, "attn_implementation": "sdpa"}
    experts = None
    if getattr(cfg, "num_experts", None):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                a.model, experts_implementation=a.experts_implementation, **kw)
            experts = a.experts_implementation
        except (TypeError, ValueError) as err:   # a transformers without experts backends
            print("hf_target.py: experts_implementation=%s refused (%s): the default experts"
                  % (a.experts_implementation, err), file=sys.stderr)
            model = AutoModelForCausalLM.from_pretrained(a.model, **kw)
            experts = "default"
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, **kw)
    model = model.to(dev).eval()
    load_s = time.time() - t0
    inputs = [prepare(b) for b in batches]
    max_tokens = max(p["x"].numel() for p in inputs)
    copier = Copier(len(layers), max_tokens, model.config.hidden_size, dev)

    net = model

    def run(p):
        x = p["x"].to(dev, non_blocking=True)
        mask = p["mask"].to(dev, non_blocking=True) if p["mask"] is not None else None
        rows = p["rows"].to(dev, non_blocking=True) if p["rows"] is not None else None
        with torch.no_grad():
            out = net(input_ids=x, attention_mask=mask, output_hidden_states=True, use_cache=False)
            hs = []
            for l in layers:
                h = out.hidden_states[l + 1]
                h = h.reshape(-1, h.shape[-1])
                hs.append(h.index_select(0, rows) if rows is not None else h)
        copier.submit(hs, hs[0].shape[0])
        return p["tokens"]

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
        for p in inputs[: a.warmup]:
            run(p)
        copier.finish()
        torch.cuda.synchronize()
        t0 = time.time()
        tokens = 0
        for p in inputs:
            tokens += run(p)
        copier.finish()              # the last hidden states are in host memory
        torch.cuda.synchronize()
        dt = time.time() - t0
        res = {"peer": "transformers-sdpa-bf16", "mode": mode,
               "copy": "pinned host buffers, non_blocking, double-buffered on a copy stream",
               "transformers": __import__("transformers").__version__, "torch": torch.__version__,
               "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "batches": len(batches),
               "load_s": load_s, "max_memory_gb": torch.cuda.max_memory_allocated() / 1e9}
        if experts:
            res["experts"] = experts
        print(json.dumps(res), flush=True)
        results.append(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
