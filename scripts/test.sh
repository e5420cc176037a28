#!/usr/bin/env bash
# The test command: set-up, then every test. Runs on a machine with or without a GPU
# (without one, wgpu runs the real WGSL on lavapipe, Mesa's CPU Vulkan driver; the browser
# tests run WebGPU on SwiftShader, Chromium's CPU implementation, about 13 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== wasm32: the library and the browser package build (web/pkg), without warnings"
RUSTFLAGS='-D warnings' bash scripts/build_web.sh

echo "== SmolLM2-135M-Instruct for the model tests (fetched into ~/.cache/doppler if missing)"
export DOPPLER_SMOLLM2="$(bash scripts/fetch_model.sh)"
echo "== all-MiniLM-L6-v2 for the encoder tests (fetched into ~/.cache/doppler if missing)"
export DOPPLER_MINILM="$(bash scripts/fetch_minilm.sh)"
echo "== Gemma 3 270M (Q4_K_M GGUF) for the Gemma test (fetched into ~/.cache/doppler if missing)"
export DOPPLER_GEMMA3="$(bash scripts/fetch_gemma3.sh)"
echo "== the 8x8 digits for the conv-net tests (fetched into data/digits if missing)"
export DOPPLER_DIGITS="$(bash scripts/fetch_digits.sh)"

echo "== cargo test (naga validation, CPU reference, GPU kernels, CLI, SmolLM2 and Gemma 3 against transformers)"
cargo test --workspace

echo "== serve: doppler serve against the official openai Python client (tests/serve)"
cargo build --quiet -p doppler-cli
# openai and pytest into a folder of their own (no system packages touched).
pydeps="${DOPPLER_CACHE:-$HOME/.cache/doppler}/pydeps"
pip_args=(--quiet --disable-pip-version-check --target "$pydeps" --upgrade 'openai==3.51.0' 'pytest==9.2.0')
python3 -m pip install "${pip_args[@]}" || python3 -m pip install --break-system-packages "${pip_args[@]}"
PYTHONPATH="$pydeps" DOPPLER_BIN="$PWD/target/debug/doppler" python3 -m pytest -q -p no:cacheprovider tests/serve

echo "== browser: the wasm package and the demo page in headless Chromium (tests/browser)"
# The native numbers the browser must match come from the CLI that `cargo test` built.
if ! command -v node >/dev/null; then
    echo "test: node not found: install Node.js 20 or newer for the browser tests" >&2
    exit 1
fi
(cd tests/browser && DOPPLER_BIN="$PWD/../../target/debug/doppler" node --test --test-concurrency=1)

echo "== fuzzing: each parser target for 20 s (crates/doppler-fuzz; seed corpus in fuzz/corpus)"
cargo run --quiet -p doppler-fuzz -- run --seconds "${DOPPLER_FUZZ_SECONDS:-20}"
