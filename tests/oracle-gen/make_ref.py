#!/usr/bin/env python3
"""make_ref.py: small random llama / qwen2 target models in the Hugging Face layout, and reference
hidden states computed with Hugging Face transformers, for dfl-target's oracle tests.

    python3 tests/oracle-gen/make_ref.py llama tests/fixtures/target/llama-tiny
    python3 tests/oracle-gen/make_ref.py qwen2 tests/fixtures/target/qwen2-tiny

Needs python3, torch and transformers (made with transformers 5.17). Writes into OUTDIR:
  config.json, model.safetensors   the model as save_pretrained writes it: bf16 weights, untied
                                   embeddings, RMSNorm weights perturbed away from 1 (qwen2: q/k/v
                                   biases perturbed away from 0)
  ref.safetensors                  for sequences seq{i} of lengths LENS:
                                     seq{i}.input_ids [L] int32
                                     seq{i}.layer{k}  [L, H] float32: output of decoder layer k
                                       (0-based), before the final norm (a forward hook on
                                       model.model.layers[k])
The reference runs in float32 (eager attention, no TF32) on the same bf16 values, on the model
reloaded from OUTDIR with from_pretrained in bf16 and then cast to float32 (so the files written are
the files checked, and the RoPE inv_freq buffer carries the bf16 rounding that transformers gives a
model loaded in bf16, as in the shared qwen3 oracle), each sequence on its own with positions
from 0.

qwen2 only: config.json is then rewritten in the spelling of real Qwen2 checkpoints (top-level
rope_theta instead of transformers 5's rope_parameters, and an unused sliding_window with
use_sliding_window false) so that dfl-target's parser is tested on both spellings; the model is
reloaded from the rewritten file, so the reference is computed from exactly what is shipped.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

LENS = [1, 7, 64, 300]

SPECS = {
    # hidden 128, 4 layers, GQA 4:2 with head_dim 32, vocab 1024
    "llama": dict(hidden_size=128, intermediate_size=320, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, rope_theta=500000.0),
    # hidden 128, 3 layers, GQA 8:2 with head_dim 16, vocab 1536, q/k/v biases
    "qwen2": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=1536, rope_theta=1000000.0),
}


def make_config(kind):
    s = dict(SPECS[kind])
    theta = s.pop("rope_theta")
    common = dict(rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
                  initializer_range=0.05, hidden_act="silu", attention_dropout=0.0, use_cache=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, **s)
    if kind == "llama":
        cfg = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    else:
        cfg = transformers.Qwen2Config(use_sliding_window=False, **common)
    # transformers 5 keeps the RoPE base in rope_parameters; older versions in rope_theta.
    if hasattr(cfg, "rope_parameters") and cfg.rope_parameters is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    else:
        cfg.rope_theta = theta
    cfg.architectures = ["LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM"]
    return cfg


def perturb(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def rewrite_qwen2_config(path, theta):
    with open(path) as f:
        c = json.load(f)
    c.pop("rope_parameters", None)
    c["rope_theta"] = theta
    c["sliding_window"] = 4096
    c["use_sliding_window"] = False
    c["max_window_layers"] = c["num_hidden_layers"]
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=sorted(SPECS))
    ap.add_argument("outdir")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu", help="where the float32 reference runs (cpu, cuda)")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    os.makedirs(args.outdir, exist_ok=True)
    cfg = make_config(args.kind)
    cls = transformers.LlamaForCausalLM if args.kind == "llama" else transformers.Qwen2ForCausalLM
    model = cls(cfg)
    perturb(model, gen)
    model = model.to(torch.bfloat16)
    model.save_pretrained(args.outdir)
    gc = os.path.join(args.outdir, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)
    cfg_path = os.path.join(args.outdir, "config.json")
    theta = SPECS[args.kind]["rope_theta"]
    if args.kind == "qwen2":
        rewrite_qwen2_config(cfg_path, theta)
    with open(cfg_path) as f:
        saved = json.load(f)
    # The checkpoint's dtype must say bf16: dfl rounds RoPE inv_freq to it, as transformers does
    # to a model loaded in bf16 (which the reference below is).
    if saved.get("dtype", saved.get("torch_dtype")) != "bfloat16":
        saved.pop("torch_dtype", None)
        saved["dtype"] = "bfloat16"
        with open(cfg_path, "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)
            f.write("\n")
    saved_theta = saved.get("rope_theta", (saved.get("rope_parameters") or {}).get("rope_theta"))
    if saved_theta != theta:
        sys.exit(f"{cfg_path}: rope theta is {saved_theta}, expected {theta}")
    del model

    # The reference: the shipped files, reloaded as transformers loads a bf16 checkpoint, then
    # run in float32 (weights are exact in float32; the RoPE inv_freq buffer keeps the bf16
    # rounding that loading in bf16 gave it, as in the qwen3 oracle and in bf16 inference).
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        args.outdir, dtype=torch.bfloat16, attn_implementation="eager")
    ref_model = ref_model.float().to(args.device).eval()
    layers = ref_model.model.layers
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rot = ref_model.model.rotary_emb
    exact = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    want = exact.to(torch.bfloat16).float()
    rope_note = "inv_freq rounded to bf16 by transformers (model loaded in bf16)"
    have = rot.inv_freq.float().cpu()
    if not torch.equal(have, want):
        if torch.allclose(have, exact, rtol=1e-6, atol=0):
            # this transformers kept inv_freq in float32: apply the bf16 rounding that loading
            # in bf16 gives (dfl rounds inv_freq to the checkpoint dtype: dfl_be.rope_dtype)
            with torch.no_grad():
                rot.inv_freq.copy_(want.to(rot.inv_freq.device))
            if hasattr(rot, "original_inv_freq"):
                rot.original_inv_freq = rot.inv_freq.clone()
            rope_note = "inv_freq computed in float32 by transformers, rounded to bf16 here"
        else:
            sys.exit(f"reloaded model has inv_freq {have[:4].tolist()}, expected "
                     f"{want[:4].tolist()} (rope theta {theta})")
    print(f"{args.outdir}: {rope_note}", file=sys.stderr)
    captured = {}

    def hook(k):
        def fn(_module, _inputs, output):
            h = output[0] if isinstance(output, (tuple, list)) else output
            captured[k] = h.detach().float()[0].cpu().contiguous()
        return fn

    for k, layer in enumerate(layers):
        layer.register_forward_hook(hook(k))

    vocab = cfg.vocab_size
    out = {}
    for i, n in enumerate(LENS):
        ids = torch.randint(0, vocab, (n,), generator=gen)
        if n >= 2:  # the edges of the vocabulary
            ids[0] = vocab - 1
            ids[1] = 0
        captured.clear()
        with torch.no_grad():
            ref_model(input_ids=ids[None].to(args.device), use_cache=False)
        out[f"seq{i}.input_ids"] = ids.to(torch.int32).contiguous()
        for k in range(len(layers)):
            h = captured[k]
            assert h.shape == (n, cfg.hidden_size), (k, h.shape)
            assert torch.isfinite(h).all(), f"non-finite reference at seq{i} layer{k}"
            out[f"seq{i}.layer{k}"] = h
    meta = {
        "layerK": "output of decoder layer K (0-based), before the final norm, float32",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "lens": json.dumps(LENS),
        "weights": "model.safetensors holds bf16 weights; reference ran in float32 on the same "
                   "values (eager attention, no TF32)",
        "rope": rope_note,
        "generator": "tests/oracle-gen/make_ref.py %s --seed %d" % (args.kind, args.seed),
    }
    save_file(out, os.path.join(args.outdir, "ref.safetensors"), metadata=meta)
    total = sum(os.path.getsize(os.path.join(args.outdir, f)) for f in os.listdir(args.outdir))
    print(f"{args.outdir}: {args.kind}, {len(layers)} layers, {len(LENS)} sequences, "
          f"{total / 1e6:.2f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
