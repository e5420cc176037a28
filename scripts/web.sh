#!/usr/bin/env bash
# The browser demo: set-up, SmolLM2-135M-Instruct (fetched into ~/.cache/doppler if
# missing), the wasm package (scripts/build_web.sh), then serves web/ on
# http://127.0.0.1:PORT (default 8080) until Ctrl-C. The page's default model URL,
# models/SmolLM2-135M-Instruct.Q4_1.gguf, and its config and corpus (configs/, data/) are
# symlinks under web/ (git-ignored).
#   bash scripts/web.sh [PORT]        (or PORT=8081 bash scripts/web.sh)
# Open the URL in Chrome or Edge 113+ (on Linux without a GPU: start Chrome with
# --enable-unsafe-webgpu), Safari 26+ or Firefox 141+ on Windows.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${1:-${PORT:-8080}}"
bash scripts/setup.sh
model="$(bash scripts/fetch_model.sh)"
# The Train tab's digits (its conv-net task).
bash scripts/fetch_digits.sh > /dev/null || echo "web: the digits could not be fetched: the Train tab's digits task will not find its data" >&2
bash scripts/build_web.sh
mkdir -p web/models
ln -sfn "$model" web/models/SmolLM2-135M-Instruct.Q4_1.gguf
ln -sfn ../configs web/configs
ln -sfn ../data web/data
# The pyenv python3 shim forks (Ctrl-C would leave the server running): the system's.
py=/usr/bin/python3
[ -x "$py" ] || py="$(command -v python3)"
echo "Doppler demo: http://127.0.0.1:$port/  (Ctrl-C stops the server)"
exec "$py" -m http.server "$port" --bind 127.0.0.1 --directory web
