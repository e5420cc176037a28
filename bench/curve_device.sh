#!/usr/bin/env bash
# On the GPU machine: configs/shakespeare_char.toml (nanoGPT's train_shakespeare_char
# settings) trained 1000 steps by Doppler, and the same run in PyTorch
# (bench/nanogpt_curve.py) with nanoGPT's init (position embedding N(0, 0.02), as the
# config's init = "nanogpt") and with Doppler's default (0.01); f32 everywhere. Expects
# target/release/doppler and the Vulkan loader unpacked. Writes $OUT/*.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
steps="${STEPS:-1000}"
./target/release/doppler train --config configs/shakespeare_char.toml --max-steps "$steps" --json \
  > "$out/doppler_curve.jsonl" 2> "$out/doppler_curve.err" || echo "doppler failed"
python3 bench/nanogpt_curve.py --steps "$steps" > "$out/torch_nanogpt_init.jsonl" 2> "$out/torch.err" || echo "torch failed"
python3 bench/nanogpt_curve.py --steps "$steps" --pos-std 0.01 > "$out/torch_gpt2_init.jsonl" 2>> "$out/torch.err" || echo "torch (0.01) failed"
for f in doppler_curve torch_nanogpt_init torch_gpt2_init; do
  echo "== $f"
  grep -E '"eval"' "$out/$f.jsonl" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l)
    if "eval" in (d.get("type"), d.get("event")):
        print(d["step"], round(d.get("val_loss", d.get("valLoss", float("nan"))), 4))'
done
