"""nanoGPT's train_shakespeare_char run in PyTorch, for Doppler's curve to be set against.

The model is Doppler's gpt2 flavour (LayerNorm and Linear biases, GELU tanh, learned
positions, tied embeddings), initialised as nanoGPT does (matrices and embeddings
N(0, 0.02), residual projections 0.02 / sqrt(2 n_layer); --pos-std 0.01 gives Doppler's
default "gpt2" scheme instead), with nanoGPT's dropout (--dropout, 0.2: on the embeddings'
sum, the attention probabilities and both residual branches; off in evaluation), trained
as nanoGPT's train.py trains it: random windows of
the first 90% of the characters, AdamW (betas 0.9, 0.99, weight decay 0.1 on matrices and
embeddings), linear warmup then cosine decay, clipping at 1.0; the validation loss is the
mean over --eval-batches random windows of the last 10% every --eval-interval steps.
Settings default to configs/shakespeare_char.toml's. Prints one JSON object per evaluation
and a summary line; `doppler train --config configs/shakespeare_char.toml --json` prints
the same events for Doppler.

Usage: python3 bench/nanogpt_curve.py [--steps 1000] [--pos-std 0.02] [--dropout 0.2] [--tf32] [--seed 1337]
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, c, h, dropout):
        super().__init__()
        self.h, self.p = h, dropout
        self.drop = torch.nn.Dropout(dropout)
        self.ln1, self.ln2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
        self.qkv = torch.nn.Linear(c, 3 * c)
        self.o = torch.nn.Linear(c, c)
        self.fc, self.proj = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        drop = self.p if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        x = x + self.drop(self.o(a.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class Gpt(torch.nn.Module):
    def __init__(self, vocab, layers, c, h, block, pos_std, dropout):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, c), torch.nn.Embedding(block, c)
        self.drop = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.ModuleList(Block(c, h, dropout) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(c)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o.weight", "proj.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)
        torch.nn.init.normal_(self.pos.weight, 0.0, pos_std)

    def forward(self, ids, targets):
        x = self.drop(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.tok.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default="data/corpus/shakespeare.txt")
    p.add_argument("--steps", type=int, default=1000, help="steps run (the schedule is --schedule-steps long)")
    p.add_argument("--schedule-steps", type=int, default=5000)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=200)
    p.add_argument("--pos-std", type=float, default=0.02)
    p.add_argument("--dropout", type=float, default=0.2,
                   help="on the embeddings, the attention probabilities and the residual branches (training only)")
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--seed", type=int, default=1337)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    torch.manual_seed(a.seed)
    dev = "cuda"
    text = open(a.corpus, encoding="utf-8").read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    train, val = ids[:cut].to(dev), ids[cut:].to(dev)

    def batch(data):
        ix = torch.randint(len(data) - a.block - 1, (a.batch,), device=dev)
        x = torch.stack([data[i:i + a.block] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + a.block] for i in ix])
        return x, y

    model = Gpt(len(chars), a.layers, a.width, a.heads, a.block, a.pos_std, a.dropout).to(dev)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    rest = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.99))

    def lr_at(it):
        if it < a.warmup:
            return a.lr * (it + 1) / (a.warmup + 1)
        r = (it - a.warmup) / max(1, a.schedule_steps - a.warmup)
        return a.min_lr + 0.5 * (1 + math.cos(math.pi * min(r, 1.0))) * (a.lr - a.min_lr)

    @torch.no_grad()
    def evaluate():
        model.eval()
        v = torch.stack([model(*batch(val)) for _ in range(a.eval_batches)]).mean().item()
        model.train()
        return v

    t0 = time.perf_counter()
    evals = [(0, evaluate())]
    print(json.dumps({"type": "eval", "step": 0, "val_loss": evals[-1][1]}), flush=True)
    for it in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        loss = model(*batch(train))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step = it + 1
        if step % a.eval_interval == 0 or step == a.steps:
            evals.append((step, evaluate()))
            print(json.dumps({"type": "eval", "step": step, "val_loss": evals[-1][1], "train_loss": loss.item()}), flush=True)
    print(json.dumps({"type": "summary", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "pos_std": a.pos_std, "dropout": a.dropout, "tf32": a.tf32, "params": sum(q.numel() for q in model.parameters()),
                      "vocab": len(chars), "seconds": time.perf_counter() - t0, "evals": evals}))


if __name__ == "__main__":
    main()
