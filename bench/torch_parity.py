"""Step-for-step parity of Doppler's training with PyTorch.

From a Doppler checkpoint (weights, AdamW moments and step count, config), PyTorch
replays the steps that Doppler took next, on the same batches, with torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_, and compares the losses of every step and, after the last
one, the weights and both AdamW moments with Doppler's later checkpoint.

    doppler train --config C --max-steps S                # checkpoint at step S
    cp -r RUN/step-S /tmp/from                            # (only the newest two are kept)
    doppler train --config C --resume --max-steps N --dump-batches /tmp/batches.safetensors
    python3 bench/torch_parity.py --from /tmp/from --to RUN/step-(S+N) \\
        --batches /tmp/batches.safetensors [--device cuda] [--json out.json]

The model is Doppler's training transformer written out in PyTorch: the gpt2 flavour
(LayerNorm, learned positions, biases, GELU tanh, tied head) and the llama flavour (RMSNorm,
RoPE with rotate-half pairing, grouped-query attention, SwiGLU, tied or untied head), in
f32 with TF32 off (--dtype float64 for a CPU check). Each step: the mean cross-entropy of
each of grad_accum micro-batches, its gradient scaled by 1/grad_accum, clipping to
grad_clip, then AdamW (weight decay on tensors of two or more dimensions only, as
Doppler's `decayed`). Steps that Doppler skipped (dynamic loss scaling overflowed) are
skipped here too. Dropout must be 0 (masks are Doppler's own).

Differences are relative to the largest magnitude in each tensor (a floor of 1e-3 of the
largest anywhere for tensors that are near zero). The attention key bias (gpt2) has a true
gradient of zero (softmax ignores a constant added to every score): both sides hold
rounding noise there, which AdamW turns into steps of up to lr each; it is reported and
judged only against that bound. Tolerances: --loss-tol (default 1e-5; 2e-3 when the batches
file says the products took f16 operands), --tensor-tol (default 1e-4; 2e-2 for f16).
Exit status 1 when a difference is outside them.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from safetensors import safe_open


def load_checkpoint(path):
    """(config, state, weights, moments m, moments v) of a checkpoint directory."""
    if os.path.isfile(os.path.join(path, "latest")):
        with open(os.path.join(path, "latest")) as f:
            path = os.path.join(path, f.read().strip())
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    w = load_file(os.path.join(path, "model.safetensors"))
    opt = load_file(os.path.join(path, "optim.safetensors"))
    m = {k[2:]: v for k, v in opt.items() if k.startswith("m.")}
    v = {k[2:]: v for k, v in opt.items() if k.startswith("v.")}
    return state["config"], state, w, m, v


def rope_tables(block, d, theta, dtype, device):
    inv = torch.tensor([theta ** (-2.0 * k / d) for k in range(d // 2)], dtype=torch.float64)
    ang = torch.arange(block, dtype=torch.float64)[:, None] * inv[None, :]
    # Doppler's table holds cos and sin rounded to f32.
    return ang.cos().float().to(dtype).to(device), ang.sin().float().to(dtype).to(device)


def rope(x, cos, sin):
    # x (B, T, H, D); rotate-half pairing: element k pairs with k + D/2.
    t, h = x.shape[1], x.shape[-1] // 2
    c, s = cos[:t, None, :], sin[:t, None, :]
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


def forward(cfg, p, ids, tables):
    """Logits (B, T, V) of Doppler's training transformer."""
    gpt = cfg["arch"] == "gpt2"
    c, h = cfg["n_embd"], cfg["n_head"]
    hkv = cfg.get("n_kv_head") or h
    d = c // h
    eps = cfg.get("norm_eps", 1e-5)
    b, t = ids.shape

    def norm(x, name):
        if gpt:
            return F.layer_norm(x, (c,), p[name + ".weight"], p[name + ".bias"], eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * p[name + ".weight"]

    def lin(x, name, bias=gpt):
        return F.linear(x, p[name + ".weight"], p[name + ".bias"] if bias else None)

    x = F.embedding(ids, p["tok_emb"])
    if gpt:
        x = x + p["pos_emb"][:t][None]
    for l in range(cfg["n_layer"]):
        n = f"blocks.{l}."
        hn = norm(x, n + ("ln1" if gpt else "attn_norm"))
        q = lin(hn, n + "attn.q").view(b, t, h, d)
        k = lin(hn, n + "attn.k").view(b, t, hkv, d)
        v = lin(hn, n + "attn.v").view(b, t, hkv, d)
        if not gpt:
            q, k = rope(q, *tables), rope(k, *tables)
        if hkv != h:
            k = k.repeat_interleave(h // hkv, dim=2)
            v = v.repeat_interleave(h // hkv, dim=2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + lin(a.transpose(1, 2).reshape(b, t, c), n + "attn.o")
        if gpt:
            u = F.gelu(lin(norm(x, n + "ln2"), n + "mlp.fc"), approximate="tanh")
            x = x + lin(u, n + "mlp.proj")
        else:
            hn = norm(x, n + "mlp_norm")
            u = F.silu(lin(hn, n + "mlp.gate", False)) * lin(hn, n + "mlp.up", False)
            x = x + lin(u, n + "mlp.down", False)
    x = norm(x, "norm")
    head = p["tok_emb"] if "lm_head.weight" not in p else p["lm_head.weight"]
    return F.linear(x, head)


def rel_diff(got, want, floor):
    scale = max(want.abs().max().item(), floor)
    return (got - want).abs().max().item() / scale


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", required=True, help="checkpoint the replay starts from")
    ap.add_argument("--to", required=True, help="Doppler's checkpoint after the dumped steps")
    ap.add_argument("--batches", required=True, help="doppler train --dump-batches FILE")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--loss-tol", type=float)
    ap.add_argument("--tensor-tol", type=float)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)

    cfg, state, w, m, v = load_checkpoint(args.src)
    tcfg, mcfg = cfg["train"], cfg["model"]
    _, state_to, w_to, m_to, v_to = load_checkpoint(args.to)
    attn_drop = mcfg.get("attn_dropout")
    if mcfg.get("dropout", 0.0) != 0.0 or (attn_drop is not None and attn_drop != 0.0):
        sys.exit("torch_parity: the config trains with dropout; replays need dropout = 0")
    with safe_open(args.batches, "pt") as f:
        meta = f.metadata() or {}
        bt = {k: f.get_tensor(k) for k in f.keys()}
    f16 = meta.get("matmul", "f32") == "f16"
    loss_tol = args.loss_tol or (2e-3 if f16 else 1e-5)
    tensor_tol = args.tensor_tol or (2e-2 if f16 else 1e-4)
    steps = bt["step"].tolist()
    if not steps or steps[0] != state["step"]:
        sys.exit(f"torch_parity: the batches start at step {steps[:1]}, the checkpoint is at step {state['step']}")
    if state_to["step"] != steps[-1] + 1:
        sys.exit(f"torch_parity: --to is at step {state_to['step']}, the batches end at step {steps[-1] + 1}")

    params = {k: torch.nn.Parameter(t.to(dev, dtype)) for k, t in w.items()}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    betas = tuple(tcfg["betas"])
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": tcfg["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=tcfg["lr"], betas=betas, eps=1e-8,
    )
    for k, p in params.items():
        opt.state[p] = {
            "step": torch.tensor(float(state["adamw_step"])),
            "exp_avg": m[k].to(dev, dtype).clone(),
            "exp_avg_sq": v[k].to(dev, dtype).clone(),
        }
    d = mcfg["n_embd"] // mcfg["n_head"]
    tables = None
    if mcfg["arch"] == "llama":
        tables = rope_tables(mcfg["block_size"], d, mcfg.get("rope_theta", 10000.0), dtype, dev)
    accum, clip = tcfg["grad_accum"], tcfg.get("grad_clip")
    rows = []
    worst_loss = 0.0
    for i, step in enumerate(steps):
        lr = bt["lr"][i].item()
        want_lr = warmup_cosine(step, tcfg["lr"], tcfg["min_lr"], tcfg["warmup"], tcfg["steps"])
        if abs(lr - want_lr) > 1e-12 * max(lr, 1e-30):
            sys.exit(f"torch_parity: step {step}: Doppler's lr {lr} is not the schedule's {want_lr}")
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in range(accum):
            ids = bt["ids"][i, mb].long().to(dev)
            tg = bt["targets"][i, mb].long().to(dev)
            logits = forward(mcfg, params, ids, tables)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tg.reshape(-1))
            (loss / accum).backward()
            total += loss.item()
        total /= accum
        norm = None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), clip).item()
        if bt["skipped"][i].item():
            # Doppler's dynamic loss scale overflowed: it applied no update.
            pass
        else:
            opt.step()
        dl = bt["loss"][i].item()
        diff = abs(total - dl) / abs(dl)
        worst_loss = max(worst_loss, diff)
        rows.append({"step": step + 1, "torch": total, "doppler": dl, "rel": diff, "grad_norm": norm})
        print(f"step {step + 1}: loss PyTorch {total:.7f}  Doppler {dl:.7f}  rel {diff:.1e}"
              + (f"  grad norm {norm:.4f}" if norm is not None else ""))

    # Weights and moments after the steps.
    n_steps = sum(1 for s in bt["skipped"].tolist() if not s)
    max_lr = max(bt["lr"].tolist())
    results, fails = {}, []
    for what, got_of, want in (
        ("weights", lambda k: params[k].detach(), w_to),
        ("m", lambda k: opt.state[params[k]]["exp_avg"], m_to),
        ("v", lambda k: opt.state[params[k]]["exp_avg_sq"], v_to),
    ):
        floor = 1e-3 * max(t.abs().max().item() for t in want.values())
        per = {}
        for k in params:
            got = got_of(k).double().cpu()
            ref = want[k].double()
            if k.endswith("attn.k.bias"):
                if what == "weights":
                    # Judged against AdamW's bound on steps from rounding noise.
                    moved = (got - ref).abs().max().item()
                    per[k] = {"abs": moved, "bound": 2 * max_lr * n_steps}
                    if moved > 2 * max_lr * n_steps:
                        fails.append(f"{what} {k}: {moved:.2e} past 2 lr x steps")
                continue
            per[k] = rel_diff(got, ref, floor)
            if per[k] > tensor_tol:
                fails.append(f"{what} {k}: {per[k]:.2e} > {tensor_tol:.0e}")
        judged = [x for x in per.values() if not isinstance(x, dict)]
        results[what] = {"max_rel": max(judged), "per_tensor": per}
        worst = max((x, k) for k, x in per.items() if not isinstance(x, dict))
        print(f"{what}: largest relative difference {worst[0]:.1e} ({worst[1]})")
    if worst_loss > loss_tol:
        fails.append(f"loss: {worst_loss:.2e} > {loss_tol:.0e}")
    summary = {
        "from_step": state["step"], "to_step": state_to["step"], "arch": mcfg["arch"],
        "matmul": meta.get("matmul", "f32"), "device": str(dev), "dtype": args.dtype,
        "torch": torch.__version__, "grad_accum": accum, "grad_clip": clip,
        "tied": "lm_head.weight" not in params, "losses": rows, "max_loss_rel": worst_loss,
        "tolerance": {"loss": loss_tol, "tensor": tensor_tol}, "tensors": results,
        "failures": fails,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if fails:
        print("FAIL:\n  " + "\n  ".join(fails))
        sys.exit(1)
    print(f"parity: {len(steps)} steps, losses within {worst_loss:.1e}, tensors within "
          f"{max(r['max_rel'] for r in results.values()):.1e}")


def warmup_cosine(step, lr, min_lr, warmup, total):
    """Doppler's schedule (optim::warmup_cosine)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    p = (step - warmup) / max(total - warmup, 1)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * p))


if __name__ == "__main__":
    main()
