"""Doppler's conv nets (the classifier and the DDPM U-Net) in PyTorch: step-for-step parity
with Doppler's training, and PyTorch's own training speed at a config's shape.

Parity: from Doppler's step-0 checkpoint (its initial weights), PyTorch replays the steps
Doppler took, on the same images, with torch.optim.AdamW and clip_grad_norm_, and compares
every step's loss, and after the last one the weights and AdamW moments with Doppler's
checkpoint there:

    doppler train --config C --max-steps 0                 # RUN/step-00000000
    cp -r RUN/step-00000000 /tmp/from
    doppler train --config C --resume --max-steps 10 --dump-batches /tmp/batches.safetensors
    python3 bench/torch_convnet.py parity --from /tmp/from --to RUN \\
        --batches /tmp/batches.safetensors [--device cuda] [--json out.json]

The models are models/convnet.rs written out with torch.nn.functional (conv2d,
group_norm, exact GELU, avg_pool2d, linear, embedding, nearest interpolate, cross_entropy,
mse_loss) over Doppler's parameter names, in f32 with TF32 off. Each step: the mean loss
(the classifier's cross-entropy, the U-Net's noise-prediction error on the noisy images,
steps and noise Doppler drew) of each of grad_accum micro-batches, its gradient scaled by
1/grad_accum, clipping to grad_clip, then AdamW (weight decay on tensors of two or more
dimensions only, as Doppler's `decayed`). Tolerances: --loss-tol
(default 1e-5, relative), --tensor-tol (1e-4 of each tensor's largest magnitude). Exit
status 1 when a difference is outside them.

Speed: PyTorch eager training steps at a checkpoint's shape and weights (batch_size random
images, and for the U-Net random steps and noise), f32 (TF32 off) and bf16 autocast,
images/s as the median of --steps timed steps:

    doppler train --config configs/digits_cnn.toml --max-steps 0
    python3 bench/torch_convnet.py speed --checkpoint runs/digits_cnn [--steps 50]

Conv: one 3x3 convolution's forward and backward (dx, dw, db), the shape `doppler bench
kernels` times (N 8, 64 -> 128 channels, 64x64, padding 1), in cuDNN f32 (TF32 off), TF32,
bf16 and f16 autocast; median ms and TFLOP/s (3 GEMMs of 2 N Cout H W Cin 9 flops):

    python3 bench/torch_convnet.py conv [--shape 8,64,128,64] [--repeat 50]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_parity import load_checkpoint, warmup_cosine  # noqa: E402


class Net:
    """models/convnet.rs's layers over the parameters p."""

    def __init__(self, cfg, p):
        self.cfg, self.p = cfg, p
        self.groups, self.eps = cfg.get("groups", 8), cfg.get("norm_eps", 1e-5)

    def conv(self, x, name, stride=1):
        return F.conv2d(x, self.p[name + ".weight"], self.p[name + ".bias"], stride=stride, padding=1)

    def linear(self, x, name):
        return F.linear(x, self.p[name + ".weight"], self.p[name + ".bias"])

    def norm_gelu(self, x, name):
        p = self.p
        return F.gelu(F.group_norm(x, self.groups, p[name + ".weight"], p[name + ".bias"], self.eps))

    def block(self, x, pre, emb=None):
        y = self.conv(self.norm_gelu(x, pre + ".norm1"), pre + ".conv1")
        if emb is not None:
            y = y + self.linear(emb, pre + ".emb")[:, :, None, None]
        y = self.conv(self.norm_gelu(y, pre + ".norm2"), pre + ".conv2")
        return x + y

    def logits(self, x):
        """The classifier's class scores (N, classes) of images x (N, C, H, W)."""
        x = self.conv(x, "stem")
        for s in range(len(self.cfg["channels"])):
            if s > 0:
                x = self.conv(x, f"down.{s}", stride=2)
            for b in range(self.cfg.get("blocks", 1)):
                x = self.block(x, f"stages.{s}.{b}")
        x = self.norm_gelu(x, "head_norm")
        x = F.avg_pool2d(x, x.shape[-1]).flatten(1)
        return self.linear(x, "head")

    def denoise(self, x, t, k):
        """The U-Net's predicted noise in x (N, C, H, W) at steps t (N) of classes k (N)."""
        p = self.p
        emb = F.embedding(t, p["time_emb.weight"]) + F.embedding(k, p["class_emb.weight"])
        emb = F.gelu(self.linear(emb, "emb_proj"))
        levels, blocks = len(self.cfg["channels"]), self.cfg.get("blocks", 1)
        x, skips = self.conv(x, "stem"), []
        for l in range(levels):
            for b in range(blocks):
                x = self.block(x, f"down.{l}.{b}", emb)
            skips.append(x)
            if l + 1 < levels:
                x = self.conv(x, f"downsample.{l}", stride=2)
        x = self.block(x, "mid", emb)
        for l in reversed(range(levels)):
            x = x + skips[l]
            for b in range(blocks):
                x = self.block(x, f"up.{l}.{b}", emb)
            if l > 0:
                x = self.conv(F.interpolate(x, scale_factor=2, mode="nearest"), f"upsample.{l}")
        return self.conv(self.norm_gelu(x, "out_norm"), "out")

    def loss(self, x, y, t=None, noise=None):
        """The classifier's cross-entropy (x images, y labels), or the U-Net's error (x noisy
        images, y classes, t steps, noise the target)."""
        if self.cfg["arch"] == "unet":
            return F.mse_loss(self.denoise(x, t, y), noise)
        return F.cross_entropy(self.logits(x), y)


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
    if mcfg.get("arch") not in ("convnet", "unet"):
        sys.exit("torch_convnet: the checkpoint does not hold a conv net")
    if state["step"] != 0:
        # The replay starts a fresh torch AdamW: Doppler's moments are not restored.
        sys.exit(f"torch_convnet: --from must be a step-0 checkpoint (doppler train --max-steps 0), not step {state['step']}")
    if bt["skipped"].any():
        sys.exit("torch_convnet: the dumped steps include skipped (overflowed) steps: replay them with f32 loss scaling")
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
            t = bt["timesteps"][i, m].to(dev).long() if "timesteps" in bt else None
            noise = bt["noise"][i, m].to(dev) if "noise" in bt else None
            loss = Net(mcfg, params).loss(x, y, t, noise)
            (loss / accum).backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
        got, want = total / accum, bt["loss"][i].item()
        rel = abs(got - want) / max(abs(want), 1e-30)
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
    cfg, _, w, _, _ = load_checkpoint(args.checkpoint)
    mcfg, tcfg = cfg["model"], cfg["train"]
    b, c, s = tcfg["batch_size"], mcfg["in_channels"], mcfg["image_size"]
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(b, c, s, s, generator=gen) * 2 - 1).to(dev)
    y = torch.randint(0, mcfg["classes"], (b,), generator=gen).to(dev)
    t = torch.randint(0, mcfg.get("timesteps") or 200, (b,), generator=gen).to(dev)
    noise = torch.randn(b, c, s, s, generator=gen).to(dev)
    results = {}
    for mode in ["f32", "bf16"]:
        p = {k: v.clone().to(dev).requires_grad_(True) for k, v in w.items()}
        opt = optimizer(p, tcfg)
        net = Net(mcfg, p)
        times = []
        for i in range(args.steps + 5):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mode == "bf16"):
                loss = net.loss(x, y, t, noise)
            loss.backward()
            if tcfg.get("grad_clip") is not None:
                torch.nn.utils.clip_grad_norm_(list(p.values()), tcfg["grad_clip"])
            opt.step()
            loss.item()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        results[mode] = {"median_ms": med * 1e3, "images_per_s": b / med}
        print(f"PyTorch eager {mode} ({mcfg['arch']}): {med * 1e3:.3f} ms a step, {b / med:,.0f} images/s (batch {b})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint": args.checkpoint, "torch": torch.__version__, "device": str(dev),
                       "results": results}, f, indent=1)
    return 0


def conv(args):
    dev = torch.device(args.device)
    n, ci, co, hw = (int(v) for v in args.shape.split(","))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, ci, hw, hw, generator=gen).to(dev).requires_grad_(True)
    w = (torch.randn(co, ci, 3, 3, generator=gen) * 0.05).to(dev).requires_grad_(True)
    b = torch.randn(co, generator=gen).to(dev).requires_grad_(True)
    dy = torch.randn(n, co, hw, hw, generator=gen).to(dev)
    flops = 3 * 2 * n * co * hw * hw * ci * 9
    results = {}
    for mode in ["f32", "tf32", "bf16", "f16"]:
        torch.backends.cudnn.allow_tf32 = mode == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
        dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(mode)
        times = []
        for i in range(args.repeat + 5):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                y = F.conv2d(x, w, b, padding=1)
            torch.autograd.grad(y, (x, w, b), dy.to(y.dtype))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        results[mode] = {"median_ms": med * 1e3, "tflops": flops / med / 1e12}
        print(f"PyTorch conv2d 3x3 fwd+bwd {mode} {n}x{ci}->{co}x{hw}x{hw}: {med * 1e3:.3f} ms, "
              f"{flops / med / 1e12:.1f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "torch": torch.__version__, "device": str(dev),
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
    s.add_argument("--checkpoint", required=True, help="a run's checkpoint: its config and weights")
    s.add_argument("--steps", type=int, default=50)
    c = sub.add_parser("conv")
    c.add_argument("--shape", default="8,64,128,64", help="N,Cin,Cout,H=W")
    c.add_argument("--repeat", type=int, default=50)
    for q in (p, s, c):
        q.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        q.add_argument("--json")
    args = ap.parse_args()
    sys.exit({"parity": parity, "speed": speed, "conv": conv}[args.cmd](args))


if __name__ == "__main__":
    main()
