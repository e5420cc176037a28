#!/usr/bin/env bash
# On the GPU machine: training speed of configs/shakespeare_char.toml (nanoGPT's
# train_shakespeare_char shape) and of GPT-2-124M, Doppler (`doppler bench train`, f32 and
# f16 products, each with its per-kernel table) against PyTorch in the same call (f32,
# TF32, bf16 autocast, bf16 under torch.compile). Expects target/release/doppler and the
# Vulkan loader unpacked (../shared/device/README.md). Writes $OUT/*.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
d=./target/release/doppler
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$out/gpu.txt" 2>&1 || true
# f16 products train with dynamic loss scaling (the config's 1.0 would flush gradients).
# Timed without dropout, as bench/torch_bench.py's PyTorch model runs (configs/.shakespeare_char_f32.toml).
sed 's/^dropout = .*/dropout = 0.0/' configs/shakespeare_char.toml > configs/.shakespeare_char_f32.toml
sed 's/^seed = 1337/seed = 1337\nloss_scale = "dynamic"/' configs/.shakespeare_char_f32.toml > configs/.shakespeare_char_f16.toml
{
  echo "== doppler f32: configs/shakespeare_char.toml without dropout"
  $d bench train --config configs/.shakespeare_char_f32.toml --steps 10
  echo "== doppler f16 products: the same with loss_scale = dynamic"
  $d --matmul f16 bench train --config configs/.shakespeare_char_f16.toml --steps 10
  echo "== doppler gpt2-124m, f16 products"
  $d --matmul f16 bench train --preset gpt2-124m --steps 5
} > "$out/doppler.txt" 2>&1 || echo "doppler failed: see doppler.txt"
python3 bench/torch_bench.py --only-train --train-shape shakespeare-char --train-fast --train-compile \
  > "$out/torch_char.json" 2> "$out/torch_char.err" || echo "torch (char) failed"
python3 bench/torch_bench.py --only-train --train-fast > "$out/torch_gpt2.json" 2> "$out/torch_gpt2.err" \
  || echo "torch (gpt2) failed"
grep -v XDG_RUNTIME "$out/doppler.txt" | grep -E "^==|^train|^adapter|K tok/s" || true
cat "$out/torch_char.json" "$out/torch_gpt2.json" | grep -E '"name"|"value"' || true
