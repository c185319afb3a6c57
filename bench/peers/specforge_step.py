#!/usr/bin/env python3
"""bench/peers/specforge_step.py: the public DFlash trainer's own training step, timed on one GPU.

The public trainer is SpecForge (github.com/sgl-project/SpecForge). This script runs its code as
its training loop does, from a checkout the user names; nothing of it is copied here:
  - the drafter: specforge/modeling/draft/dflash.py's DFlashDraftModel, built from the recipe's
    own config file (configs/qwen3-8b-dflash.json, configs/qwen3.6-27b-dflash.json), with
    config._attn_implementation = "flex_attention", in bf16 (SpecForge's model providers do
    the same);
  - the loss: specforge/algorithms/common/dflash_family_model.py's OnlineDFlashModel (the
    anchors drawn on the GPU, the flex_attention block mask, the LM head and the cross-entropy
    in checkpointed chunks of 128 blocks, loss decay gamma 7), over a frozen bf16 embedding and
    LM head of random values (the target's);
  - the optimizer: specforge/optimizer.py's BF16Optimizer (AdamW over fp32 master copies,
    the gradient norm clipped at 1.0, lr 6e-4 with warm-up), over the drafter's parameters.
A step is model(input_ids, hidden_states, loss_mask) -> loss, loss.backward(), optimizer.step(),
on BATCH sequences of SEQ_LEN tokens at a time (the 8B recipe's batch_size is 4; the 27B's 1);
--seqs sequences are SEQS / BATCH such steps. Inputs are random: token ids, bf16 captured
features [BATCH, SEQ_LEN, K x hidden], every loss-mask position set.

SpecForge's package __init__ files are not run (they import the whole trainer: data loading,
sglang, distributed backends); its modules are loaded from their files under stand-in package
entries, unmodified. The anchors each step drew are read back (a wrapper around the model's
own _sample_anchor_positions) only to count the model FLOPs: drafter_flops() of
bench/peers/dflash_torch.py, the count bench/draft uses for every run (the LM head's slot-0 rows
and the last layer's slot-0 MLP rows the public step computes are not counted: they are not
model work).

Usage: specforge_step.py --specforge DIR [--shape 8b|27b] [--seqs N] [--seq-len L] [--anchors N]
                         [--batch B] [--warmup N] [--steps N] [--seed N] [--json FILE] [--check]
Prints one JSON line (tokens_per_s, tflops, seconds, loss, peak_mem_gb, specforge_commit, ...).
Exit status 2 when DIR is not a SpecForge checkout with these files (--check: only that check,
before torch is imported; bench/draft --public makes it before any other work)."""
import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import types

FILES = ["specforge/modeling/draft/dflash.py", "specforge/algorithms/common/dflash_family_model.py",
         "specforge/optimizer.py", "specforge/core/chunking.py"]
CONFIGS = {"8b": "configs/qwen3-8b-dflash.json", "27b": "configs/qwen3.6-27b-dflash.json"}
PACKAGES = ["specforge", "specforge.core", "specforge.modeling", "specforge.modeling.draft",
            "specforge.algorithms", "specforge.algorithms.common"]


def fail(msg):
    print("specforge_step.py: " + msg, file=sys.stderr)
    sys.exit(2)


def check_checkout(root, shape):
    for f in FILES + [CONFIGS[shape]]:
        if not os.path.isfile(os.path.join(root, f)):
            fail("%s: not a SpecForge checkout with the DFlash trainer (no %s)" % (root, f))


def commit_of(root):
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_specforge(root):
    """SpecForge's modules from their files, under package entries that do not run __init__.py"""
    for name in PACKAGES:
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = m
    family = importlib.import_module("specforge.algorithms.common.dflash_family_model")
    dflash = importlib.import_module("specforge.modeling.draft.dflash")
    optim = importlib.import_module("specforge.optimizer")
    return family, dflash, optim


def main():
    ap = argparse.ArgumentParser(description="the public DFlash trainer's (SpecForge's) step, timed")
    ap.add_argument("--specforge", required=True, help="a SpecForge checkout (its repository root)")
    ap.add_argument("--shape", choices=["8b", "27b"], default="8b")
    ap.add_argument("--seqs", type=int, default=4, help="sequences a step of bench/draft's (default 4)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens a sequence (default: 3072 at 8b, 4096 at 27b)")
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--batch", type=int, default=0, help="sequences a forward (default: all --seqs)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true", help="only check that the checkout has what the step runs")
    a = ap.parse_args()
    check_checkout(a.specforge, a.shape)
    if a.check:
        return
    root = os.path.abspath(a.specforge)
    L = a.seq_len or (4096 if a.shape == "27b" else 3072)
    batch = a.batch or a.seqs
    if batch <= 0 or a.seqs <= 0 or a.seqs % batch or L < 2 or a.anchors <= 0 or a.steps <= 0 or a.warmup < 0:
        fail("--seqs must be a positive multiple of --batch; --seq-len >= 2, --anchors and --steps >= 1")

    import torch
    from torch import nn
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dflash_torch import cfg_8b, cfg_27b, drafter_flops

    if not torch.cuda.is_available():
        fail("no CUDA device for torch")
    family, dflash, optim = load_specforge(root)
    torch.manual_seed(a.seed)
    dev = torch.device("cuda")
    with open(os.path.join(root, CONFIGS[a.shape])) as f:
        payload = json.load(f)
    config = dflash.DFlashDraftModel.config_class.from_dict(payload)
    config._attn_implementation = "flex_attention"
    with dev:   # made on the GPU (SpecForge makes it on the host and moves it: the same model, sooner)
        draft = dflash.DFlashDraftModel(config)
    draft = draft.to(device=dev, dtype=torch.bfloat16)
    H, V = config.hidden_size, config.vocab_size
    K = len(draft.target_layer_ids)
    embed = nn.Embedding(V, H, device=dev, dtype=torch.bfloat16)
    head = nn.Linear(H, V, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        embed.weight.normal_(0, 0.02)
        head.weight.normal_(0, H ** -0.5)
    embed.requires_grad_(False)
    head.requires_grad_(False)
    mask_id = payload["dflash_config"]["mask_token_id"]
    bs = int(payload["block_size"])
    model = family.OnlineDFlashModel(draft_model=draft, target_lm_head=head, target_embed_tokens=embed,
                                     mask_token_id=mask_id, block_size=bs, attention_backend="flex_attention",
                                     num_anchors=a.anchors, loss_decay_gamma=7.0).to(device=dev, dtype=torch.bfloat16)
    model.train()
    n_opt = a.seqs // batch * (a.warmup + a.steps)
    opt = optim.BF16Optimizer(draft, lr=6e-4, max_grad_norm=1.0, total_steps=max(n_opt, 100), warmup_ratio=0.04)

    drawn = []   # each forward's anchors and keep mask, for the FLOP count
    sample = model._sample_anchor_positions

    def record(*args, **kw):
        anchors, keep = sample(*args, **kw)
        drawn.append((anchors, keep))
        return anchors, keep
    model._sample_anchor_positions = record

    ids = torch.randint(0, V, (a.seqs, L), device=dev)
    hidden = torch.randn(a.seqs, L, K * H, device=dev).to(torch.bfloat16)
    loss_mask = torch.ones(a.seqs, L, device=dev)

    def step():
        loss = None
        for b0 in range(0, a.seqs, batch):
            sl = slice(b0, b0 + batch)
            loss, acc, _ = model(input_ids=ids[sl], hidden_states=hidden[sl], loss_mask=loss_mask[sl])
            loss.backward()
            opt.step()
        return loss

    t0 = time.time()
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    drawn.clear()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = time.time() - t0

    c = cfg_27b() if a.shape == "27b" else cfg_8b()
    flops = 0.0
    for anchors, keep in drawn:   # one forward of `batch` sequences, counted as the torch peer counts a step
        pos = [p for r in range(anchors.shape[0]) for p in anchors[r][keep[r]].tolist()]
        flops += drafter_flops(c, anchors.shape[0] * L, len(pos) * bs, pos, bs)
    T = a.seqs * L
    res = {"peer": "specforge-dflash-flex_attention-bf16", "shape": a.shape, "specforge_commit": commit_of(root),
           "torch": torch.__version__, "steps": a.steps, "seqs": a.seqs, "seq_len": L, "batch": batch,
           "anchors": a.anchors, "tokens_per_s": a.steps * T / dt, "seconds": dt, "step_ms": 1000 * dt / a.steps,
           "warmup_s": warm_s, "tflops": flops / dt / 1e12, "loss": loss.item(),
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9}
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
