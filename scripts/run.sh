#!/usr/bin/env bash
# The main job: set-up, build, fetch SmolLM2-135M-Instruct if it is missing (98 MB, into
# ~/.cache/doppler), then answer a prompt with it on this machine's GPU, streaming.
#   bash scripts/run.sh ["prompt"] [more doppler generate options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --quiet -p doppler-cli
model="$(bash scripts/fetch_model.sh)"
./target/release/doppler info
prompt="${1:-What is the capital of France? Answer in one sentence.}"
shift || true
./target/release/doppler generate -m "$model" --chat "$prompt" -n 64 -v "$@"
