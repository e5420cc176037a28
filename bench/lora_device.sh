#!/usr/bin/env bash
# On the GPU machine: LoRA fine-tuning speed and memory at SmolLM2-135M's shapes, Doppler
# against PyTorch + PEFT in the same call. Doppler: `doppler finetune` on a synthetic
# SmolLM2 GGUF (the real file's header and types, Q4_1 blocks; bench/synthetic_gguf.py,
# carried xz-compressed as .bench/smollm2-synth.gguf.xz) over data/finetune padded to 512
# tokens, batch 8, rank 16 on all seven projections; tokens/s from its --json steps, peak
# GPU memory by nvidia-smi; the 8B Q4_K shape by `doppler bench finetune`. PyTorch:
# bench/lora_bench.py (bf16 and f32 bases). Expects target/release/doppler and the Vulkan
# loader unpacked. Writes $OUT/*.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
xz -dkf .bench/smollm2-synth.gguf.xz
cat > configs/.lora_bench.toml <<TOML
base = "../.bench/smollm2-synth.gguf"
data = "../data/finetune/train.jsonl"
eval_fraction = 0.0
out_dir = "../runs/lora_bench"
[lora]
rank = 16
alpha = 32
dropout = 0.05
[train]
seq_len = 512
batch_size = 8
steps = 12
lr = 1e-4
save_interval = 1000
TOML
# mem FILE CMD...: runs CMD while nvidia-smi samples the GPU's memory in use every 200 ms
# into FILE; prints the peak (MiB).
mem() {
  local f=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$f" 2>/dev/null &
  local pid=$!
  "$@" || echo "failed: $*" >&2
  kill $pid 2>/dev/null; wait $pid 2>/dev/null || true
  sort -n "$f" | tail -1
}
base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
echo "GPU memory in use before: $base MiB"
# Doppler with what a user gets by default (each layer recomputed in the backward), then
# with recompute = false (one tape over the whole model).
for mode in default norecompute; do
  cfg=configs/.lora_bench.toml
  if [ "$mode" = norecompute ]; then
    sed 's/^save_interval = 1000$/save_interval = 1000\nrecompute = false/' configs/.lora_bench.toml > configs/.lora_bench_nr.toml
    cfg=configs/.lora_bench_nr.toml
  fi
  rm -rf runs/lora_bench
  peak=$(mem "$out/doppler_mem_$mode.txt" sh -c "./target/release/doppler finetune --config $cfg --json > $out/doppler_lora_$mode.jsonl 2> $out/doppler_lora_$mode.err")
  echo "doppler ($mode) peak GPU memory (nvidia-smi): $peak MiB"
  python3 - "$out/doppler_lora_$mode.jsonl" "$mode" <<'PY'
import json, statistics, sys
s = [json.loads(l)["step"] for l in open(sys.argv[1]) if '"event":"step"' in l]
t = [x["tokens_per_s"] for x in s[2:]]
print(json.dumps({"name": f"doppler lora r16 (Q4_1 base, {sys.argv[2]})", "tokens_per_s_median": statistics.median(t) if t else None,
                  "steps": len(t), "pool_peak_mb": s[-1]["gpu_peak_bytes"] / 1e6 if s else None,
                  "losses": [round(x["loss"], 4) for x in s]}))
PY
done
# The 8B Q4_K shape (synthetic weights, made in memory): `doppler bench finetune`.
peak=$(mem "$out/doppler_8b_mem.txt" sh -c "./target/release/doppler bench finetune --preset llama3-8b-q4k --json > $out/doppler_8b.json 2> $out/doppler_8b.err")
echo "doppler 8B Q4_K peak GPU memory (nvidia-smi): $peak MiB"
cat "$out/doppler_8b.json"
peak=$(mem "$out/peft_mem.txt" sh -c "python3 bench/lora_bench.py --dtypes bf16 > $out/peft.jsonl 2> $out/peft.err")
echo "pytorch+peft bf16 peak GPU memory (nvidia-smi): $peak MiB"
peak=$(mem "$out/peft32_mem.txt" sh -c "python3 bench/lora_bench.py --dtypes f32 >> $out/peft.jsonl 2>> $out/peft.err")
echo "pytorch+peft f32 peak GPU memory (nvidia-smi): $peak MiB"
cat "$out/peft.jsonl"
