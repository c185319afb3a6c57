#!/usr/bin/env python3
"""hf_bf16_vs_oracle.py ORACLE_DIR: the error of transformers' own bf16 forward against the float32
oracle (../shared/oracle/qwen3-tiny-a), with the metric of tests/gpu/gpu-target.c: per row of every
captured layer, ||x - ref|| / ||ref|| and the cosine; prints the worst, the mean and the number of
rows above 2e-2. It tells what bf16 rounding alone costs on this model (the bound issue #6 asks
of our bf16 forward is 2e-2 per row). Needs torch, transformers and a CUDA GPU."""
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    d = sys.argv[1]
    ref = load_file(f"{d}/ref.safetensors")
    for attn in ("sdpa", "eager"):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation=attn).cuda().eval()
        worst, cos_min, over, rows, total = 0.0, 1.0, 0, 0, 0.0
        i = 0
        while f"seq{i}.input_ids" in ref:
            ids = ref[f"seq{i}.input_ids"].long().cuda()[None]
            with torch.no_grad():
                hs = m(ids, output_hidden_states=True).hidden_states
            k = 0
            while f"seq{i}.layer{k}" in ref:
                x = hs[k + 1][0].float().cpu().double()
                y = ref[f"seq{i}.layer{k}"].double()
                rel = (x - y).norm(dim=1) / y.norm(dim=1).clamp_min(1e-30)
                cs = (x * y).sum(1) / (x.norm(dim=1) * y.norm(dim=1) + 1e-30)
                # a NaN row must show as the worst (max() and min() below would drop it)
                rel = torch.nan_to_num(rel, nan=float("inf"))
                cs = torch.nan_to_num(cs, nan=-1.0)
                worst = max(worst, rel.max().item())
                cos_min = min(cos_min, cs.min().item())
                over += int((rel > 2e-2).sum())
                rows += rel.numel()
                total += rel.sum().item()
                k += 1
            i += 1
        print(f"transformers bf16 ({attn}) vs the f32 oracle: worst row rel {worst:.3g}, min cos {cos_min:.6f}, "
              f"mean rel {total / rows:.3g}, {over} of {rows} rows above 2e-2")


if __name__ == "__main__":
    main()
