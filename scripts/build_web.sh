#!/usr/bin/env bash
# Builds the browser package into web/pkg: the wasm32 build of crates/doppler-web, its
# wasm-bindgen glue and TypeScript types, and the JS API (crates/doppler-web/js). Prints
# the .wasm's size, raw and gzip.
set -euo pipefail
cd "$(dirname "$0")/.."
# RUSTFLAGS set in the environment would replace .cargo/config.toml's; keep its cfg.
export RUSTFLAGS="${RUSTFLAGS:-} --cfg getrandom_backend=\"wasm_js\""
cargo build --release --quiet --target wasm32-unknown-unknown -p doppler-web
rm -rf web/pkg.tmp
wasm-bindgen --target web --out-dir web/pkg.tmp target/wasm32-unknown-unknown/release/doppler_web.wasm
cp crates/doppler-web/js/doppler.js crates/doppler-web/js/doppler.d.ts crates/doppler-web/js/package.json web/pkg.tmp/
rm -rf web/pkg && mv web/pkg.tmp web/pkg
raw=$(stat -c %s web/pkg/doppler_web_bg.wasm)
gz=$(gzip -9 -c web/pkg/doppler_web_bg.wasm | wc -c)
echo "web/pkg: doppler_web_bg.wasm $raw bytes, $gz gzip -9" >&2
