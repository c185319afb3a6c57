"""dflash_torch.py: the PyTorch peer of dfl-draft's GPU step, written from doc/dflash-step.md:
flex_attention with the DFlash block mask, torch.compile, bf16 autocast over fp32 master weights,
fused AdamW, global-norm clipping. Packed batches (sequences concatenated, positions restart).

  Benchmark (random weights and inputs, the 8B drafter shape by default; --shape 27b: the
  Qwen3.6-27B drafter, 4 sliding-window layers of window 2048 + 1 full-attention layer):
    python3 dflash_torch.py bench [--shape 8b|27b] [--seqs 4 --seq-len 3072 --anchors 512 --steps 10] [--json OUT]
  Self-check against the golden step (float32, fixed anchors):
    python3 dflash_torch.py golden FILE
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope(x, pos, theta):
    """x [R, heads, d], pos [R]: rotate-half RoPE with f32 angles."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.int64).float() / d))
    ang = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], -1)
    return x * cos + rot * sin


class Attn(nn.Module):
    def __init__(s, c):
        super().__init__()
        H, nh, nkv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        s.nh, s.nkv, s.d, s.theta = nh, nkv, d, c["rope_theta"]
        s.q_proj = nn.Linear(H, nh * d, bias=False)
        s.k_proj = nn.Linear(H, nkv * d, bias=False)
        s.v_proj = nn.Linear(H, nkv * d, bias=False)
        s.o_proj = nn.Linear(nh * d, H, bias=False)
        s.q_norm = RMSNorm(d, c["rms_norm_eps"])
        s.k_norm = RMSNorm(d, c["rms_norm_eps"])

    def forward(s, x, ctx, pos_blk, pos_ctx, amask):
        Q, T = x.shape[0], ctx.shape[0]
        q = rope(s.q_norm(s.q_proj(x).view(Q, s.nh, s.d)), pos_blk, s.theta)
        k = torch.cat([s.k_proj(ctx), s.k_proj(x)]).view(T + Q, s.nkv, s.d)
        k = rope(s.k_norm(k), torch.cat([pos_ctx, pos_blk]), s.theta)
        v = torch.cat([s.v_proj(ctx), s.v_proj(x)]).view(T + Q, s.nkv, s.d)
        o = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], amask)
        return s.o_proj(o[0].transpose(0, 1).reshape(Q, s.nh * s.d))


class Layer(nn.Module):
    def __init__(s, c):
        super().__init__()
        H, I, eps = c["hidden_size"], c["intermediate_size"], c["rms_norm_eps"]
        s.input_layernorm = RMSNorm(H, eps)
        s.self_attn = Attn(c)
        s.post_attention_layernorm = RMSNorm(H, eps)
        s.mlp = nn.Module()
        s.mlp.gate_proj = nn.Linear(H, I, bias=False)
        s.mlp.up_proj = nn.Linear(H, I, bias=False)
        s.mlp.down_proj = nn.Linear(I, H, bias=False)

    def forward(s, h, ctx, pos_blk, pos_ctx, amask):
        """amask: this layer's mask (its window's)."""
        h = h + s.self_attn(s.input_layernorm(h), ctx, pos_blk, pos_ctx, amask)
        y = s.post_attention_layernorm(h)
        return h + s.mlp.down_proj(F.silu(s.mlp.gate_proj(y)) * s.mlp.up_proj(y))


_flex = None


def attend(q, k, v, amask):
    """q [1, nh, Q, d], k/v [1, nkv, T+Q, d]; amask: a flex BlockMask, or a bool [Q, T+Q] tensor
    (eager reference path, f32 softmax)."""
    if isinstance(amask, torch.Tensor):
        g = q.shape[1] // k.shape[1]
        k2, v2 = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q.float() @ k2.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(~amask, float("-inf"))
        return (torch.softmax(s, -1) @ v2.float()).to(q.dtype)
    return _flex(q, k, v, block_mask=amask, enable_gqa=True, scale=q.shape[-1] ** -0.5)


class Drafter(nn.Module):
    def __init__(s, c):
        super().__init__()
        H, k = c["hidden_size"], len(c["target_layer_ids"])
        s.fc = nn.Linear(k * H, H, bias=False)
        s.hidden_norm = RMSNorm(H, c["rms_norm_eps"])
        s.layers = nn.ModuleList([Layer(c) for _ in range(c["num_draft_layers"])])
        s.norm = RMSNorm(H, c["rms_norm_eps"])


def make_batch_meta(seq_lens, anchors_per_seq, bs, device):
    """Packed-batch indices: ctx positions, block anchor rows and positions, label rows."""
    starts, o = [], 0
    for L in seq_lens:
        starts.append(o)
        o += L
    pos_ctx = torch.cat([torch.arange(L) for L in seq_lens]).to(device)
    a_row, a_pos, a_end = [], [], []
    for s, (L, an) in enumerate(zip(seq_lens, anchors_per_seq)):
        for a in an:
            a_row.append(starts[s] + a)
            a_pos.append(a)
            a_end.append(starts[s] + L)
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)
    return pos_ctx, t(a_row), t(a_pos), t(a_end)


def head_loss(z, W_lm, labels, w, w0):
    logits = (z @ W_lm.to(z.dtype).t()).float()
    lse = torch.logsumexp(logits, -1)
    ce = lse - logits.gather(1, labels.view(-1, 1))[:, 0]
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels.view(-1)) & w0.view(-1)
    return (w * ce).sum(), correct.sum()


def step_forward(m, c, E, W_lm, hidden, ids, mask, seq_lens, anchors, mask_factory, dtype, head=head_loss):
    dev = ids.device
    bs, M, gamma = c["block_size"], c["mask_token_id"], c["gamma"]
    pos_ctx, a_row, a_pos, a_end = make_batch_meta(seq_lens, anchors, bs, dev)
    N, T = a_row.shape[0], ids.shape[0]
    Q = N * bs
    j = torch.arange(bs, device=dev)
    tok = torch.full((N, bs), M, dtype=torch.int64, device=dev)
    tok[:, 0] = ids[a_row]
    h = E[tok.view(-1)].to(dtype)
    pos_blk = (a_pos[:, None] + j[None, :]).view(-1)
    lab_row = a_row[:, None] + j[None, :]
    inb = lab_row < a_end[:, None]
    lab_row_c = torch.where(inb, lab_row, torch.zeros_like(lab_row))
    labels = ids[lab_row_c]
    w0 = (j[None, :] >= 1) & inb & (mask[lab_row_c] > 0)
    decay = torch.exp(-torch.clamp(j.float() - 1, min=0) / gamma)
    w = (w0.float() * decay[None, :]).view(-1)
    ctx = m.hidden_norm(m.fc(torch.cat(hidden, -1).to(dtype)))
    # one mask per window in use (0: full attention), layer l takes windows[l]'s
    windows = layer_windows(c)
    masks = {win: mask_factory(a_row - a_pos, a_row, T, Q, bs, win) for win in set(windows)}
    for layer, win in zip(m.layers, windows):   # (not w: that is the slots' weights)
        h = layer(h, ctx, pos_blk, pos_ctx, masks[win])
    z = m.norm(h)
    loss_num, acc_num = head(z, W_lm, labels, w, w0)
    return loss_num, w.sum(), acc_num, w0.sum()


def layer_windows(c):
    """The attention window of each drafter layer (0: full attention), from layer_types and
    sliding_window (SpecForge's names)."""
    types = c.get("layer_types") or ["full_attention"] * c["num_draft_layers"]
    return [int(c["sliding_window"]) if t == "sliding_attention" else 0 for t in types]


def flex_factory(compiled=True):
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    _flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def factory(ctx_start, a_row, T, Q, bs, window=0):
        # the sliding rule (SpecForge's, the dflash-swa golden's mask_rule): slot j of a block sees
        # the context rows from its anchor's row + j - (window - 1) and the slots i <= j
        def mask_mod(b, h, q_idx, kv_idx):
            blk, j = q_idx // bs, q_idx % bs
            is_ctx = kv_idx < T
            ctx_ok = is_ctx & (kv_idx >= ctx_start[blk]) & (kv_idx < a_row[blk])
            blk_ok = (~is_ctx) & ((kv_idx - T) // bs == blk)
            if window > 0:
                ctx_ok = ctx_ok & (kv_idx >= a_row[blk] + j - (window - 1))
                blk_ok = blk_ok & ((kv_idx - T) % bs <= j)
            return ctx_ok | blk_ok
        return create_block_mask(mask_mod, None, None, Q, T + Q, device=a_row.device)
    return factory


def eager_factory():
    def factory(ctx_start, a_row, T, Q, bs, window=0):
        dev = a_row.device
        qi = torch.arange(Q, device=dev)[:, None]
        ki = torch.arange(T + Q, device=dev)[None, :]
        blk, j = qi // bs, qi % bs
        ctx_ok = (ki < T) & (ki >= ctx_start[blk]) & (ki < a_row[blk])
        blk_ok = (ki >= T) & ((ki - T) // bs == blk)
        if window > 0:
            ctx_ok = ctx_ok & (ki >= a_row[blk] + j - (window - 1))
            blk_ok = blk_ok & ((ki - T) % bs <= j)
        return ctx_ok | blk_ok
    return factory


def golden(path):
    from safetensors import safe_open
    f = safe_open(path, "pt")
    meta = f.metadata()
    c = json.loads(meta["config"])   # dflash-swa: layer_types and sliding_window too
    c["gamma"] = c["loss_decay_gamma"]
    g = {k: f.get_tensor(k) for k in f.keys()}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = Drafter(c).to(dev)
    sd = {k: g[k] for k in m.state_dict().keys()}
    m.load_state_dict(sd)
    seq_lens = g["seq_lens"].tolist()
    ids = torch.cat([g["seq%d.input_ids" % i] for i in range(len(seq_lens))]).long().to(dev)
    mask = torch.cat([g["seq%d.loss_mask" % i] for i in range(len(seq_lens))]).to(dev)
    hid = torch.cat([g["seq%d.hidden_states" % i] for i in range(len(seq_lens))]).to(dev)
    H = c["hidden_size"]
    hidden = [hid[:, i * H:(i + 1) * H] for i in range(len(c["target_layer_ids"]))]
    anchors = [g["seq%d.anchors" % i].tolist() for i in range(len(seq_lens))]
    E, W = g["target.embed_tokens.weight"].to(dev), g["target.lm_head.weight"].to(dev)
    worst = {}
    for name, fac in (("eager", eager_factory()), ("flex", flex_factory(compiled=dev.type == "cuda"))):
        m.zero_grad()
        ln, ld, an, ad = step_forward(m, c, E, W, hidden, ids, mask, seq_lens, anchors, fac, torch.float32)
        ln.backward()
        loss = (ln / ld).item()
        errs = []
        for k, p in m.named_parameters():
            gr = p.grad / ld
            ref = g["grad." + k].to(dev)
            errs.append(((gr - ref).abs().max() / ref.abs().max()).item())
        worst[name] = dict(loss=loss, loss_ref=g["loss"].item(), acc=(an / ad).item(), acc_ref=g["accuracy"].item(),
                           grad_worst_rel=max(errs))
    print(json.dumps(worst, indent=1))
    ok = all(abs(v["loss"] - v["loss_ref"]) <= 1e-5 * abs(v["loss_ref"]) and v["grad_worst_rel"] <= 1e-4
             and v["acc"] == v["acc_ref"] for v in worst.values())
    print("golden:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


def cfg_8b():
    return dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                num_draft_layers=5, target_layer_ids=[1, 9, 17, 25, 33], block_size=16, gamma=7.0,
                mask_token_id=151669)


def cfg_27b():
    """The public Qwen3.6-27B drafter (SpecForge's recipe)."""
    return dict(hidden_size=5120, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=17408, vocab_size=248320, rms_norm_eps=1e-6, rope_theta=1e7,
                num_draft_layers=5, target_layer_ids=[1, 16, 31, 46, 61], block_size=16, gamma=7.0,
                mask_token_id=248070, layer_types=["sliding_attention"] * 4 + ["full_attention"],
                sliding_window=2048)


def drafter_flops(c, T, Q, anchor_pos, bs):
    """Matmul FLOPs of one step (forward + backward), the same count dfl's benchmark uses."""
    H, nh, nkv, d, I, V = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                           c["intermediate_size"], c["vocab_size"])
    K, Ld = len(c["target_layer_ids"]), c["num_draft_layers"]
    N, Qs = Q // bs, Q - Q // bs                     # blocks; the scored rows: slots 1..bs-1
    fc = 2 * T * K * H * H * 2                       # forward + weight gradient (inputs need no grad)

    def layer(rq, rkv, ro):   # a layer's products: queries, block keys/values, output proj + MLP rows
        return 2 * rq * H * nh * d + 2 * (rkv + T) * H * 2 * nkv * d + 2 * ro * nh * d * H + 2 * ro * H * 3 * I
    # The first layer's block rows hold 2 distinct inputs a block (the anchor's token, the mask
    # token at every other slot): its queries, keys and values are model work at N + 1 rows (dfl
    # makes them at 2 rows a block). The last layer's slot-0 rows are keys and values of their
    # block, but their query, attention output, output projection and MLP reach only slot 0's
    # logits, which are never scored: not model work (dfl skips the output projection and the
    # MLP there). Likewise the LM head: slot 0 (the anchor's own token) is never scored, so its
    # logits are not model work (dfl skips them; a peer that computes them does more).
    rq, rkv, ro = [Q] * Ld, [Q] * Ld, [Q] * Ld
    rq[0] = rkv[0] = N + 1
    rq[-1], ro[-1] = min(rq[-1], Qs), Qs
    layers = sum(layer(rq[l], rkv[l], ro[l]) for l in range(Ld))

    def keys(a, w, j0=0):   # the keys a block anchored at a sees, over its slots j0.. (window w, 0: full)
        if w <= 0:
            return (bs - j0) * (a + bs)
        return sum(a - min(a, max(0, a + j - (w - 1))) + j + 1 for j in range(j0, bs))
    wins = layer_windows(c)
    # the attention FLOPs of each layer: only the keys its window leaves
    attn = sum(sum(4 * keys(a, w, 1 if l == len(wins) - 1 else 0) * nh * d for a in anchor_pos)
               for l, w in enumerate(wins))
    head = 2 * Qs * H * V
    return fc + 3 * layers + 3.5 * attn + 2 * head


def bench(a):
    torch.manual_seed(a.seed)
    dev = torch.device("cuda")
    c = cfg_27b() if a.shape == "27b" else cfg_8b()
    m = Drafter(c).to(dev)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0, p.shape[1] ** -0.5)
    H, V = c["hidden_size"], c["vocab_size"]
    E = (torch.randn(V, H, device=dev) * 0.02).to(torch.bfloat16)
    W = (torch.randn(V, H, device=dev) * H ** -0.5).to(torch.bfloat16)
    seq_lens = [a.seq_len] * a.seqs
    T = sum(seq_lens)
    ids = torch.randint(0, V, (T,), device=dev)
    mask = torch.ones(T, dtype=torch.uint8, device=dev)
    hidden = [torch.randn(T, H, device=dev).to(torch.bfloat16) for _ in c["target_layer_ids"]]
    opt = torch.optim.AdamW(m.parameters(), lr=6e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    fac = flex_factory(compiled=True)
    g = torch.Generator().manual_seed(a.seed)

    def draw():
        return [sorted(torch.randperm(L - 1, generator=g)[: a.anchors].tolist()) for L in seq_lens]

    head = head_loss
    if a.compile:
        for layer in m.layers:
            layer.compile(dynamic=False)
        head = torch.compile(head_loss, dynamic=False)

    def step(anchors):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ln, ld, an, ad = step_forward(m, c, E, W, hidden, ids, mask, seq_lens, anchors, fac, torch.bfloat16, head)
        ln.backward()
        for p in m.parameters():
            p.grad.div_(ld)
        gn = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return ln / ld, gn

    for _ in range(a.warmup):
        step(draw())
    torch.cuda.synchronize()
    times, flops = [], 0.0
    t0 = time.time()
    for _ in range(a.steps):
        an = draw()
        flops += drafter_flops(c, T, sum(len(x) for x in an) * c["block_size"], [p for x in an for p in x],
                               c["block_size"])
        loss, gn = step(an)
    torch.cuda.synchronize()
    dt = time.time() - t0
    res = {"peer": "torch-flex_attention-compile-bf16", "shape": a.shape, "torch": torch.__version__, "steps": a.steps,
           "tokens_per_s": a.steps * T / dt, "seconds": dt, "tflops": flops / dt / 1e12,
           "loss": float(loss), "seqs": a.seqs, "seq_len": a.seq_len, "anchors": a.anchors,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9}
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--shape", choices=["8b", "27b"], default="8b")
    b.add_argument("--seqs", type=int, default=4)
    b.add_argument("--seq-len", type=int, default=3072)
    b.add_argument("--anchors", type=int, default=512)
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--compile", type=int, default=1)
    b.add_argument("--json")
    gp = sub.add_parser("golden")
    gp.add_argument("file")
    a = ap.parse_args()
    if a.cmd == "golden":
        sys.exit(golden(a.file))
    bench(a)


if __name__ == "__main__":
    main()
