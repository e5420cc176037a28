#!/usr/bin/env bash
# Fetches the 8x8 handwritten digits (1,797 images, 10 classes, pixels 0..16) into
# data/digits/digits.csv and prints its path: one image a line, 64 pixel values then the
# digit, the format `doppler train` reads for conv nets (configs/digits_cnn.toml). The
# file ships gzipped inside scikit-learn's wheel (sklearn/datasets/data/digits.csv.gz);
# we download that wheel from PyPI (no install; a pinned version and platform so that
# its SHA-256 can be checked on any machine), check it and the CSV, and unpack the CSV.
# Nothing of it is committed. Source and licences: data/digits/README.md.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/data/digits/digits.csv"
wheel_sha="52a0703bbc07ad27f560fa63fa68e4c54dd735bfbbf65b4dd3c225dc7547b6df"
csv_sha="6ebb3d2fee246a4e99363262ddf8a00a3c41bee6014c373ed9d9216ba7f651b8"
if [ -f "$out" ] && echo "$csv_sha  $out" | sha256sum -c --status; then
    echo "$out"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching the digits (scikit-learn 1.9.1's wheel from PyPI, 9 MB)" >&2
python3 -m pip download --quiet --no-deps --no-cache-dir --dest "$tmp" --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
    "scikit-learn==1.9.1" >&2
wheel="$tmp/scikit_learn-1.9.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
echo "$wheel_sha  $wheel" | sha256sum -c --status || { echo "fetch_digits: $wheel: SHA-256 mismatch" >&2; exit 1; }
python3 - "$wheel" "$tmp/digits.csv" <<'PY'
import gzip, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    data = gzip.decompress(z.read("sklearn/datasets/data/digits.csv.gz"))
open(sys.argv[2], "wb").write(data)
PY
echo "$csv_sha  $tmp/digits.csv" | sha256sum -c --status || { echo "fetch_digits: digits.csv: SHA-256 mismatch" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
mv "$tmp/digits.csv" "$out.tmp" && mv "$out.tmp" "$out"
echo "$out"
