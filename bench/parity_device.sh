#!/usr/bin/env bash
# On the GPU machine: Doppler's training step for step against PyTorch (bench/torch_parity.py)
# on nanoGPT's shakespeare-char shape (configs/shakespeare_char.toml: gpt2 flavour, tied
# head, clipping) from steps 1 and 200, its f16-product path (dynamic loss scaling), and a
# llama-flavour model (grouped-query attention, RoPE, SwiGLU) with an untied and a tied
# head and grad_accum 2. Expects target/release/doppler and the Vulkan loader unpacked
# (../shared/device/README.md). Writes $OUT/parity-*.json and $OUT/parity.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
d="$PWD/target/release/doppler"
work=$(mktemp -d)
trap 'rm -rf "$work" configs/.parity-*.toml' EXIT

# config NAME SED-EXPRESSIONS...: configs/.parity-NAME.toml from shakespeare_char.toml,
# without dropout (PyTorch cannot replay Doppler's masks).
config() {
    local name=$1; shift
    local f="configs/.parity-$name.toml"
    sed -e "s|^out_dir = .*|out_dir = \"$work/$name\"|" -e 's/^eval_batches = .*/eval_batches = 2/' \
        -e 's/^dropout = .*/dropout = 0.0/' \
        "$@" configs/shakespeare_char.toml > "$f"
    echo "$f"
}

# parity NAME CONFIG FROM N [doppler options]: train to step FROM, keep that checkpoint,
# train N more steps dumping their batches, replay them in PyTorch.
parity() {
    local name=$1 cfg=$2 from=$3 n=$4; shift 4
    echo "== $name: steps $from -> $((from + n))"
    "$d" "$@" train --config "$cfg" --max-steps "$from" --json > /dev/null
    cp -r "$work/$name/step-$(printf %08d "$from")" "$work/$name-from"
    "$d" "$@" train --config "$cfg" --resume --max-steps "$n" --json \
        --dump-batches "$work/$name.batches" > /dev/null
    python3 bench/torch_parity.py --from "$work/$name-from" --to "$work/$name" \
        --batches "$work/$name.batches" --json "$out/parity-$name.json" || { echo "PARITY FAILED: $name"; touch "$work/failed"; }
}

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  parity gpt2-from1 "$(config gpt2-from1)" 1 2
  parity gpt2-200 "$(config gpt2-200)" 200 2
  parity gpt2-f16 "$(config gpt2-f16 -e 's/^seed = 1337/seed = 1337\nloss_scale = "dynamic"/')" 1 3 --matmul f16
  llama=(-e 's/^arch = "gpt2"/arch = "llama"\nn_kv_head = 2/' -e 's/^init = .*//' -e 's/^grad_accum = 1/grad_accum = 2/' -e 's/^batch_size = 64/batch_size = 32/')
  parity llama-untied "$(config llama-untied "${llama[@]}")" 1 3
  parity llama-tied "$(config llama-tied "${llama[@]}" -e 's/^n_head = 6/n_head = 6\ntie_embeddings = true/')" 1 3
} 2>&1 | grep -v XDG_RUNTIME | tee "$out/parity.txt"
! [ -e "$work/failed" ]
