#!/usr/bin/env bash
# On the GPU machine: the quantized products on cooperative matrices (quant_coop.wgsl, the
# default where the adapter has them). `doppler verify --filter qmatmul` and `dequantize`
# (every type and fusion against f64, the cooperative cases among them), the f16 matmul
# and attention kernels' checks (cooperative matrices too, built through the same SPIR-V
# path, gpu/spirv.rs), the f16 matmul at 4096^3, then prefill and decode speed by default
# and with DOPPLER_QUANT_COOP=off (the f32 tiled kernel) at SmolLM2-135M's shapes (Q4_1)
# and the 8B Q4_K shapes (`doppler bench generate --preset ...`; their --json has the
# per-kernel times of the prefill). Expects the doppler binary as $DOPPLER (default
# target/release/doppler) and the Vulkan loader unpacked. Writes $OUT/*.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
bin="${DOPPLER:-target/release/doppler}"
"$bin" info --json > "$out/info.json" 2>&1
grep -E '"(cooperative_matrix|PASSTHROUGH_SHADERS|quantized_prompts)' -A2 "$out/info.json" | head -12
{
  for f in qmatmul dequantize; do "$bin" verify --filter $f; echo "verify $f rc=$?"; done
  for f in matmul attention; do DOPPLER_MATMUL=f16 "$bin" verify --filter $f; echo "verify f16 $f rc=$?"; done
} > "$out/verify.txt" 2>&1
grep -E "rc=|passed|failed" "$out/verify.txt" | head -20
grep -E "FAIL" "$out/verify.txt" | cut -c1-300 | head -30
DOPPLER_MATMUL=f16 "$bin" bench matmul --size 4096 --json > "$out/matmul-f16.json" 2> /dev/null
echo "matmul f16 rc=$?"
for preset in smollm2-135m llama3-8b-q4k; do
  gen=64
  # --rows: the products of batched decode steps (issue 25's small-M goal: >= 80% of the
  # floor's read rate).
  "$bin" bench generate --preset $preset --prompt 512 --gen $gen --rows 2,4,8,16,32,64 --json \
    > "$out/gen-$preset.json" 2> /dev/null
  echo "$preset rc=$?"
  DOPPLER_QUANT_COOP=off "$bin" bench generate --preset $preset --prompt 512 --gen $gen --json \
    > "$out/gen-$preset-off.json" 2> /dev/null
  echo "$preset off rc=$?"
done
grep -H prefill_tok_s "$out"/gen-*.json
