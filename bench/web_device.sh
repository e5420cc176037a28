#!/usr/bin/env bash
# On the GPU machine: SmolLM2-135M decode of the browser build (web/pkg in Node on
# Dawn's WebGPU over Vulkan) against the native binary, same model file, same call.
# Expects in .webbench/ (git-ignored, carried along): node.xz (this machine's Node),
# dawn.node.xz and index.js of npm `webgpu` 0.6.2, smollm2-synth.gguf.xz
# (bench/synthetic_gguf.py); and target/release/doppler, web/pkg. Writes $OUT/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
w=.webbench
mkdir -p /tmp/wb/webgpu/dist/linux-x64
xz -dc $w/node.xz > /tmp/wb/node && chmod +x /tmp/wb/node
xz -dc $w/dawn.node.xz > /tmp/wb/webgpu/dist/linux-x64/dawn.node
cp $w/index.js $w/package.json /tmp/wb/webgpu/
xz -dc $w/smollm2-synth.gguf.xz > /tmp/wb/model.gguf
out="${OUT:-/tmp}"
log="$out/log.txt"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv || true
  for i in 1 2; do
    echo "== native bench generate, run $i"
    ./target/release/doppler bench generate --model /tmp/wb/model.gguf --prompt 16 --gen 128 --json > /tmp/wb/native.json
    python3 -c 'import json;d=json.load(open("/tmp/wb/native.json"));print(json.dumps({k:d[k] for k in ("decode_tok_s","gpu_ms_per_token_p50","load_ms","prefill_tok_s","adapter") if k in d}))'
    echo "== native generate --json (the same measure as the wasm run), run $i"
    ./target/release/doppler generate -m /tmp/wb/model.gguf "The capital of France is" -n 128 --temperature 0 --json
    echo "== wasm (web/pkg) in Node on Dawn, run $i"
    /tmp/wb/node bench/web_node.mjs /tmp/wb/model.gguf --webgpu /tmp/wb/webgpu --gen 128 --runs 6 --verify "${VERIFY:-matmul}"
  done
} > "$log" 2>&1
cat "$log" | grep -v XDG_RUNTIME | tail -c 6000
