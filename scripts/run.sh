#!/usr/bin/env bash
# The main job: set-up, build, check every kernel on this machine's GPU, then benchmark it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --quiet -p doppler-cli
./target/release/doppler info
./target/release/doppler verify
./target/release/doppler bench "$@"
