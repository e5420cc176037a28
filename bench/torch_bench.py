"""PyTorch reference figures for `doppler bench`, measured in the same call on the same GPU.

Copy: y.copy_(x) on a buffer of --mib MiB, GB/s counting bytes read + written.
Matmul: torch.matmul in f32 with TF32 off, TFLOP/s.
Kernels (--kernels): the same shapes and work counts as `doppler bench kernels`, forward +
backward through autograd (embedding: aten's dense backward alone), f32, TF32 off.
Medians of CUDA-event timings.
Train (--train): a GPT-2-124M-shaped model (12 layers, 768 wide, 12 heads, vocab 50304,
learned positions, tied embeddings, GELU tanh, batch 8 x 1024) trained with AdamW and
global-norm clipping, eager, each step synchronised by loss.item(); f32 with TF32 off, and
(--train-fast) also TF32 and bf16 autocast. Median wall time per step -> tokens/s.
Generate (--generate): a SmolLM2-135M-shaped Llama (30 layers, 576 wide, 9 heads / 3 kv,
SwiGLU 1536, vocab 49152, tied embeddings) written in plain torch, eager, f16 weights and
activations, batch 1, KV cache: prefill of --prompt tokens and greedy decode of --gen tokens,
each token's argmax taken to the host (as a generation loop does). Eager torch is what
Hugging Face transformers runs; ours has less Python overhead than theirs.
Train shapes (--train-shape): gpt2-124m, or shakespeare-char (nanoGPT's train_shakespeare_char:
6 layers, 384 wide, 6 heads, vocab 65, batch 64 x 256, betas (0.9, 0.99)); --train-compile adds
bf16 autocast under torch.compile.
Usage: python3 bench/torch_bench.py [--mib 1024] [--size 4096 ...] [--repeat 20] [--kernels]
       [--train [--train-fast] [--train-compile] [--train-shape S] [--only-train]]
       [--generate [--prompt 512] [--gen 128]]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def timed(fn, repeat, batch):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def kernels(a):
    rows = []

    def row(name, shape, ms, work, unit):
        rows.append({"name": name, "shape": shape, "ms": ms, "value": work / ms / 1e6, "unit": unit})

    dev = "cuda"
    # conv2d 3x3, N=8, 64 -> 128, 64x64, padding 1: forward + backward (dx, dw, db).
    n, ci, co, hw = 8, 64, 128, 64
    x = torch.randn(n, ci, hw, hw, device=dev, requires_grad=True)
    w = torch.randn(co, ci, 3, 3, device=dev, requires_grad=True)
    b = torch.randn(co, device=dev, requires_grad=True)
    dy = torch.randn(n, co, hw, hw, device=dev)

    def conv():
        F.conv2d(x, w, b, padding=1).backward(dy)

    row("torch conv2d 3x3 fwd+bwd", f"{n}x{ci}->{co}x{hw}x{hw}", timed(conv, a.repeat, a.batch),
        3 * 2 * n * co * hw * hw * ci * 9 / 1e3, "TFLOP/s")
    # GroupNorm, 32 groups, N=8, C=256, 64x64.
    n, c, hw = 8, 256, 64
    x = torch.randn(n, c, hw, hw, device=dev, requires_grad=True)
    g = torch.randn(c, device=dev, requires_grad=True)
    bt = torch.randn(c, device=dev, requires_grad=True)
    dy = torch.randn(n, c, hw, hw, device=dev)

    def gn():
        F.group_norm(x, 32, g, bt, 1e-5).backward(dy)

    row("torch group_norm fwd+bwd", f"{n}x{c}x{hw}x{hw} g32", timed(gn, a.repeat, a.batch), 5 * 4 * n * c * hw * hw, "GB/s")
    # Cross-entropy, 4096 x 49152.
    t, v = 4096, 49152
    logits = (torch.randn(t, v, device=dev) * 4).requires_grad_()
    y = torch.randint(0, v, (t,), device=dev)

    def ce():
        F.cross_entropy(logits, y).backward()

    row("torch cross_entropy fwd+bwd", f"{t}x{v}", timed(ce, a.repeat, a.batch), 3 * 4 * t * v, "GB/s")
    del logits
    # Embedding backward, 16384 x 576, vocabulary 49152, one id in half of the positions.
    t, h, v = 16384, 576, 49152
    ids = torch.randint(0, v, (t,), device=dev)
    ids[::2] = 7
    dout = torch.randn(t, h, device=dev)

    def emb():
        torch.ops.aten.embedding_dense_backward(dout, ids, v, -1, False)

    row("torch embedding backward", f"{t}x{h} -> {v}x{h}", timed(emb, a.repeat, a.batch), 4 * (t * h + v * h), "GB/s")
    return rows


class Block(torch.nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(c, c) for _ in range(4))
        self.fc, self.proj = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.h, c // self.h).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.o(a)
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, layers=12, c=768, h=12, vocab=50304, block=1024):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, c), torch.nn.Embedding(block, c)
        self.blocks = torch.nn.ModuleList(Block(c, h) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(c)

    def forward(self, ids, targets):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.tok.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# Training shapes: (layers, width, heads, vocab, batch, block, AdamW betas).
SHAPES = {
    "gpt2-124m": (12, 768, 12, 50304, 8, 1024, (0.9, 0.999)),
    # nanoGPT's train_shakespeare_char (configs/shakespeare_char.toml).
    "shakespeare-char": (6, 384, 6, 65, 64, 256, (0.9, 0.99)),
}


def train(a, mode, shape="gpt2-124m"):
    """Median ms per training step of `shape` in `mode` (f32, tf32, bf16, bf16-compile)."""
    import time
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    torch.manual_seed(0)
    layers, c, h, vocab, b, t, betas = SHAPES[shape]
    model = Gpt(layers, c, h, vocab, t).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=betas)
    ids = torch.randint(0, vocab, (b, t), device="cuda")
    tg = torch.randint(0, vocab, (b, t), device="cuda")
    fwd = torch.compile(model) if mode == "bf16-compile" else model

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode.startswith("bf16")):
            loss = fwd(ids, tg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(3):
        step()
    times = []
    for _ in range(a.train_steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    del model, opt
    torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {"name": f"torch train {shape} ({mode})", "shape": f"B{b} T{t}", "ms": ms,
            "value": b * t / ms, "unit": "K tok/s"}


def generate(a):
    import time
    L, E, H, KV, D, FF, V = 30, 576, 9, 3, 64, 1536, 49152
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    w = lambda *s: (torch.randn(*s, device=dev, generator=g) * 0.02).to(dt)
    emb = w(V, E)
    layers = [dict(n1=torch.ones(E, device=dev, dtype=dt), q=w(H * D, E), k=w(KV * D, E), v=w(KV * D, E),
                   o=w(E, H * D), n2=torch.ones(E, device=dev, dtype=dt), g=w(FF, E), u=w(FF, E), d=w(E, FF))
              for _ in range(L)]
    norm = torch.ones(E, device=dev, dtype=dt)
    ctx = a.prompt + a.gen + 1
    inv = 1.0 / (100000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
    ang = torch.outer(torch.arange(ctx, device=dev).float(), inv)
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)

    def rms(x, wt):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(dt) * wt

    def rope(x, pos):  # x (T, h, D), rotate-half
        c, s_ = cos[pos:pos + x.shape[0], None, :], sin[pos:pos + x.shape[0], None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)

    kc = [torch.zeros(ctx, KV, D, device=dev, dtype=dt) for _ in range(L)]
    vc = [torch.zeros(ctx, KV, D, device=dev, dtype=dt) for _ in range(L)]

    def forward(ids, pos):
        t = ids.shape[0]
        x = emb[ids]
        for i, l in enumerate(layers):
            h = rms(x, l["n1"])
            q = rope((h @ l["q"].T).view(t, H, D), pos)
            k = rope((h @ l["k"].T).view(t, KV, D), pos)
            kc[i][pos:pos + t] = k
            vc[i][pos:pos + t] = (h @ l["v"].T).view(t, KV, D)
            kk = kc[i][:pos + t].repeat_interleave(H // KV, 1).transpose(0, 1)
            vv = vc[i][:pos + t].repeat_interleave(H // KV, 1).transpose(0, 1)
            mask = torch.ones(t, pos + t, device=dev, dtype=torch.bool).tril(pos)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
            x = x + o.transpose(0, 1).reshape(t, H * D) @ l["o"].T
            h = rms(x, l["n2"])
            x = x + (F.silu(h @ l["g"].T) * (h @ l["u"].T)) @ l["d"].T
        return rms(x[-1:], norm) @ emb.T

    prompt = torch.randint(0, V, (a.prompt,), device=dev, generator=g)
    out = {}
    with torch.no_grad():
        for rep in range(2):  # the first round warms up
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            nxt = int(forward(prompt, 0).argmax())
            prefill = time.perf_counter() - t0
            times = []
            for i in range(a.gen):
                t0 = time.perf_counter()
                nxt = int(forward(torch.tensor([nxt], device=dev), a.prompt + i).argmax())
                times.append(time.perf_counter() - t0)
            times.sort()
            out = {"name": "torch eager generate smollm2-135m-shaped (f16)", "shape": f"prompt {a.prompt}, gen {a.gen}",
                   "prefill_tok_s": a.prompt / prefill, "decode_tok_s": len(times) / sum(times),
                   "token_ms_p50": times[len(times) // 2] * 1e3, "token_ms_p95": times[int(len(times) * 0.95)] * 1e3}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--size", type=int, action="append")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--train", action="store_true")
    p.add_argument("--train-fast", action="store_true")
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--train-shape", default="gpt2-124m", choices=sorted(SHAPES))
    p.add_argument("--train-compile", action="store_true", help="also bf16 with torch.compile")
    p.add_argument("--only-train", action="store_true", help="the training figures alone")
    p.add_argument("--generate", action="store_true")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    a = p.parse_args()
    if a.generate:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print(json.dumps({"device": name, "torch": torch.__version__, "results": [generate(a)]}, indent=2))
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    if a.only_train:
        a.train, a.size, a.mib = True, [], 0
    n = a.mib << 18
    if n:
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        ms = timed(lambda: y.copy_(x), a.repeat, a.batch)
        rows.append({"name": "torch copy_", "shape": f"{a.mib} MiB", "ms": ms, "value": 2 * n * 4 / ms / 1e6, "unit": "GB/s"})
        del x, y
    for s in a.size if a.size is not None else [4096]:
        m1 = torch.randn(s, s, device="cuda")
        m2 = torch.randn(s, s, device="cuda")
        ms = timed(lambda: torch.matmul(m1, m2), a.repeat, a.batch)
        rows.append({"name": "torch.matmul f32 (TF32 off)", "shape": f"{s}x{s}x{s}", "ms": ms,
                     "value": 2 * s**3 / ms / 1e9, "unit": "TFLOP/s"})
        # The tensor-core figures Doppler's f16-operand product is compared with.
        torch.backends.cuda.matmul.allow_tf32 = True
        ms = timed(lambda: torch.matmul(m1, m2), a.repeat, a.batch)
        torch.backends.cuda.matmul.allow_tf32 = False
        rows.append({"name": "torch.matmul TF32", "shape": f"{s}x{s}x{s}", "ms": ms,
                     "value": 2 * s**3 / ms / 1e9, "unit": "TFLOP/s"})
        h1, h2 = m1.half(), m2.half()
        ms = timed(lambda: torch.matmul(h1, h2), a.repeat, a.batch)
        rows.append({"name": "torch.matmul f16 (cuBLAS)", "shape": f"{s}x{s}x{s}",
                     "ms": ms, "value": 2 * s**3 / ms / 1e9, "unit": "TFLOP/s"})
        del m1, m2, h1, h2
    if a.kernels:
        rows += kernels(a)
    if a.train:
        modes = ["f32"] + (["tf32", "bf16"] if a.train_fast else []) + (["bf16-compile"] if a.train_compile else [])
        for mode in modes:
            rows.append(train(a, mode, a.train_shape))
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
