#!/usr/bin/env bash
# On the GPU machine: the quantized products on cooperative matrices (quant_coop.wgsl).
# `DOPPLER_QUANT_COOP=on doppler verify --filter qmatmul` (every type and fusion against
# f64, the cooperative cases among them), then prefill and decode speed with
# DOPPLER_QUANT_COOP=on (experimental, off by default) and with default settings (the f32
# tiled kernel) at SmolLM2-135M's shapes (Q4_1) and the 8B
# Q4_K shapes (`doppler bench generate --preset ...`; their --json has the per-kernel
# times of the prefill). Expects the doppler binary as $DOPPLER (default target/release/doppler)
# and the Vulkan loader unpacked. Writes $OUT/*.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
bin="${DOPPLER:-target/release/doppler}"
"$bin" info --json > "$out/info.json" 2>&1
grep -E '"(cooperative_matrix|PASSTHROUGH_SHADERS|quantized_prompts)' -A2 "$out/info.json" | head -12
{
  for f in qmatmul dequantize; do DOPPLER_QUANT_COOP=on "$bin" verify --filter $f; echo "verify $f rc=$?"; done
  # The f16 matmul and attention kernels: cooperative matrices too, built the same way.
  for f in matmul attention; do DOPPLER_MATMUL=f16 "$bin" verify --filter $f; echo "verify f16 $f rc=$?"; done
} > "$out/verify.txt" 2>&1
grep -E "rc=|passed|failed" "$out/verify.txt" | head -20
grep -E "FAIL" "$out/verify.txt" | cut -c1-300 | head -30
# The f16 matmul on cooperative matrices at 4096^3 (it is built as the quantized product is).
DOPPLER_MATMUL=f16 "$bin" bench matmul --size 4096 --json > "$out/matmul-f16.json" 2> /dev/null
echo "matmul f16 rc=$?"; grep -iE "tflop" "$out/matmul-f16.json" | head -5
for preset in smollm2-135m llama3-8b-q4k; do
  gen=64
  DOPPLER_QUANT_COOP=on "$bin" bench generate --preset $preset --prompt 512 --gen $gen --json \
    > "$out/gen-$preset-coop.json" 2> /dev/null
  echo "$preset coop rc=$?"
  "$bin" bench generate --preset $preset --prompt 512 --gen $gen --json \
    > "$out/gen-$preset.json" 2> /dev/null
  echo "$preset default rc=$?"
done
grep -H prefill_tok_s "$out"/gen-*.json
