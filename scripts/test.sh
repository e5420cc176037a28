#!/usr/bin/env bash
# The test command: set-up, then every test. Runs on a machine with or without a GPU
# (without one, wgpu runs the real WGSL on lavapipe, Mesa's CPU Vulkan driver).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== wasm32: the library builds for the browser"
RUSTFLAGS="-D warnings" cargo check -p doppler --target wasm32-unknown-unknown --quiet

echo "== SmolLM2-135M-Instruct for the model tests (fetched into ~/.cache/doppler if missing)"
export DOPPLER_SMOLLM2="$(bash scripts/fetch_model.sh)"

echo "== cargo test (naga validation, CPU reference, GPU kernels, CLI, SmolLM2 against transformers)"
cargo test --workspace
