"""The conv-net classifier in PyTorch: step-for-step parity with Doppler's training, and
PyTorch's own training speed at a config's shape.

Parity: from Doppler's step-0 checkpoint (its initial weights), PyTorch replays the steps
Doppler took, on the same images, with torch.optim.AdamW and clip_grad_norm_, and compares
every step's loss, and after the last one the weights and AdamW moments with Doppler's
checkpoint there:

    doppler train --config C --max-steps 0                 # RUN/step-00000000
    cp -r RUN/step-00000000 /tmp/from
    doppler train --config C --resume --max-steps 10 --dump-batches /tmp/batches.safetensors
    python3 bench/torch_convnet.py parity --from /tmp/from --to RUN \\
        --batches /tmp/batches.safetensors [--device cuda] [--json out.json]

The model is models/convnet.rs written out with torch.nn.functional (conv2d, group_norm,
exact GELU, avg_pool2d, linear, cross_entropy) over Doppler's parameter names, in f32
with TF32 off. Each step: the mean cross-entropy of each of grad_accum micro-batches, its
gradient scaled by 1/grad_accum, clipping to grad_clip, then AdamW (weight decay on conv
kernels and the head's matrix only, as Doppler's `decayed`). Tolerances: --loss-tol
(default 1e-5, relative), --tensor-tol (1e-4 of each tensor's largest magnitude). Exit
status 1 when a difference is outside them.

Speed: PyTorch eager training steps at the config's shape (batch_size random images),
f32 (TF32 off) and bf16 autocast, images/s as the median of --steps timed steps:

    python3 bench/torch_convnet.py speed --config configs/digits_cnn.toml [--steps 50]
"""
import argparse
import json
import os
import statistics
import sys
import time
import tomllib

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_parity import load_checkpoint, warmup_cosine  # noqa: E402


def forward(cfg, p, x):
    """Class scores (N, classes) of images x (N, C, H, W) under parameters p."""
    groups, eps = cfg.get("groups", 8), cfg.get("norm_eps", 1e-5)

    def conv(x, name, stride=1):
        return F.conv2d(x, p[name + ".weight"], p[name + ".bias"], stride=stride, padding=1)

    def norm_gelu(x, name):
        return F.gelu(F.group_norm(x, groups, p[name + ".weight"], p[name + ".bias"], eps))

    x = conv(x, "stem")
    for s in range(len(cfg["channels"])):
        if s > 0:
            x = conv(x, f"down.{s}", stride=2)
        for b in range(cfg.get("blocks", 1)):
            pre = f"stages.{s}.{b}"
            y = conv(norm_gelu(x, pre + ".norm1"), pre + ".conv1")
            y = conv(norm_gelu(y, pre + ".norm2"), pre + ".conv2")
            x = x + y
    x = norm_gelu(x, "head_norm")
    x = F.avg_pool2d(x, x.shape[-1]).flatten(1)
    return F.linear(x, p["head.weight"], p["head.bias"])


def optimizer(params, tcfg):
    decay = [t for t in params.values() if t.dim() >= 2]
    plain = [t for t in params.values() if t.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tcfg.get("weight_decay", 0.1)},
         {"params": plain, "weight_decay": 0.0}],
        lr=tcfg["lr"], betas=tuple(tcfg.get("betas", (0.9, 0.95))), eps=1e-8)


def parity(args):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(args.device)
    cfg, state, w, _, _ = load_checkpoint(getattr(args, "from"))
    _, state_to, w_to, m_to, v_to = load_checkpoint(args.to)
    mcfg, tcfg = cfg["model"], cfg["train"]
    if mcfg.get("arch") != "convnet":
        sys.exit("torch_convnet: the checkpoint does not hold a conv net")
    bt = load_file(args.batches)
    steps = bt["step"].tolist()
    if not steps or steps[0] != state["step"] or state_to["step"] != steps[-1] + 1:
        sys.exit(f"torch_convnet: batches of steps {steps[:1]}..{steps[-1:]}, checkpoints at "
                 f"{state['step']} and {state_to['step']}")
    params = {k: t.to(dev).requires_grad_(True) for k, t in w.items()}
    opt = optimizer(params, tcfg)
    accum, clip = tcfg.get("grad_accum", 1), tcfg.get("grad_clip")
    rows, worst = [], 0.0
    for i, step in enumerate(steps):
        lr = bt["lr"][i].item()
        want_lr = warmup_cosine(step, tcfg["lr"], tcfg.get("min_lr", 0.0), tcfg.get("warmup", 0), tcfg["steps"])
        assert abs(lr - want_lr) <= 1e-12 * max(1.0, want_lr), (lr, want_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(accum):
            x = bt["images"][i, m].to(dev)
            y = bt["labels"][i, m].to(dev).long()
            loss = F.cross_entropy(forward(mcfg, params, x), y)
            (loss / accum).backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
        got, want = total / accum, bt["loss"][i].item()
        rel = abs(got - want) / abs(want)
        worst = max(worst, rel)
        rows.append({"step": step + 1, "doppler": want, "torch": got, "rel": rel})
        print(f"step {step + 1}: Doppler {want:.8f}  PyTorch {got:.8f}  rel {rel:.2e}")
    # Weights and moments after the steps, relative to each tensor's largest magnitude.
    tensors = {}
    for what, mine, theirs in [("weight", {k: t.detach() for k, t in params.items()}, w_to),
                               ("m", {k: opt.state[params[k]]["exp_avg"] for k in params}, m_to),
                               ("v", {k: opt.state[params[k]]["exp_avg_sq"] for k in params}, v_to)]:
        for k, t in mine.items():
            ref = theirs[k].to(dev)
            big = ref.abs().max().item()
            d = (t - ref).abs().max().item() / max(big, 1e-30)
            tensors[f"{what} {k}"] = d
    worst_tensor = max(tensors.values())
    fails = [f"loss at step {r['step']}: {r['rel']:.2e}" for r in rows if r["rel"] > args.loss_tol]
    fails += [f"{k}: {d:.2e}" for k, d in tensors.items() if d > args.tensor_tol]
    out = {"steps": len(steps), "worst_loss_rel": worst, "worst_tensor_rel": worst_tensor,
           "losses": rows, "torch": torch.__version__, "device": str(dev), "fails": fails}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"parity: {len(steps)} steps, losses within {worst:.1e} (tol {args.loss_tol}), weights and "
          f"moments within {worst_tensor:.1e} (tol {args.tensor_tol}){'; FAIL: ' + '; '.join(fails) if fails else ''}")
    return 1 if fails else 0


def speed(args):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(args.device)
    with open(args.config, "rb") as f:
        cfg = tomllib.load(f)
    mcfg, tcfg = cfg["model"], cfg["train"]
    b, c, s = tcfg["batch_size"], mcfg["in_channels"], mcfg["image_size"]
    gen = torch.Generator().manual_seed(0)
    # Fresh parameters of the right shapes (PyTorch's default init).
    ch = mcfg["channels"]
    shapes = {"stem": (ch[0], c)}
    for i, w in enumerate(ch):
        if i > 0:
            shapes[f"down.{i}"] = (w, ch[i - 1])
        for k in range(mcfg.get("blocks", 1)):
            shapes[f"stages.{i}.{k}.conv1"] = (w, w)
            shapes[f"stages.{i}.{k}.conv2"] = (w, w)
    params = {}
    for name, (co, ci) in shapes.items():
        bound = (ci * 9) ** -0.5
        params[name + ".weight"] = (torch.rand(co, ci, 3, 3, generator=gen) * 2 - 1) * bound
        params[name + ".bias"] = (torch.rand(co, generator=gen) * 2 - 1) * bound
    norms = ["head_norm"] + [f"stages.{i}.{k}.norm{j}" for i in range(len(ch))
                             for k in range(mcfg.get("blocks", 1)) for j in (1, 2)]
    for n in norms:
        width = ch[-1] if n == "head_norm" else ch[int(n.split(".")[1])]
        params[n + ".weight"], params[n + ".bias"] = torch.ones(width), torch.zeros(width)
    params["head.weight"] = (torch.rand(mcfg["classes"], ch[-1], generator=gen) * 2 - 1) * ch[-1] ** -0.5
    params["head.bias"] = torch.zeros(mcfg["classes"])
    x = (torch.rand(b, c, s, s, generator=gen) * 2 - 1).to(dev)
    y = torch.randint(0, mcfg["classes"], (b,), generator=gen).to(dev)
    results = {}
    for mode in ["f32", "bf16"]:
        p = {k: t.clone().to(dev).requires_grad_(True) for k, t in params.items()}
        opt = optimizer(p, tcfg)
        times = []
        for i in range(args.steps + 5):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mode == "bf16"):
                loss = F.cross_entropy(forward(mcfg, p, x), y)
            loss.backward()
            if tcfg.get("grad_clip") is not None:
                torch.nn.utils.clip_grad_norm_(list(p.values()), tcfg["grad_clip"])
            opt.step()
            loss.item()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        results[mode] = {"median_ms": med * 1e3, "images_per_s": b / med}
        print(f"PyTorch eager {mode}: {med * 1e3:.3f} ms a step, {b / med:,.0f} images/s (batch {b})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "torch": torch.__version__, "device": str(dev),
                       "results": results}, f, indent=1)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("parity")
    p.add_argument("--from", required=True, help="Doppler's checkpoint the replay starts from")
    p.add_argument("--to", required=True, help="Doppler's checkpoint after the dumped steps")
    p.add_argument("--batches", required=True, help="doppler train --dump-batches output")
    p.add_argument("--loss-tol", type=float, default=1e-5)
    p.add_argument("--tensor-tol", type=float, default=1e-4)
    s = sub.add_parser("speed")
    s.add_argument("--config", required=True)
    s.add_argument("--steps", type=int, default=50)
    for q in (p, s):
        q.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        q.add_argument("--json")
    args = ap.parse_args()
    sys.exit(parity(args) if args.cmd == "parity" else speed(args))


if __name__ == "__main__":
    main()
