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
DOPPLER_QUANT_COOP=on "$bin" verify --filter qmatmul > "$out/verify.txt" 2>&1; echo "verify rc=$?" >> "$out/verify.txt"
tail -3 "$out/verify.txt"
grep -E "coop|fail" "$out/verify.txt" | head -40
for preset in smollm2-135m llama3-8b-q4k; do
  gen=64
  DOPPLER_QUANT_COOP=on "$bin" bench generate --preset $preset --prompt 512 --gen $gen --json \
    > "$out/gen-$preset-coop.json" 2> /dev/null
  echo "$preset coop rc=$?"; tail -c 600 "$out/gen-$preset-coop.json"; echo
  "$bin" bench generate --preset $preset --prompt 512 --gen $gen --json \
    > "$out/gen-$preset.json" 2> /dev/null
  echo "$preset default rc=$?"; tail -c 600 "$out/gen-$preset.json"; echo
done
