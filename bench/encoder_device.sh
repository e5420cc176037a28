#!/usr/bin/env bash
# On the GPU machine: sentence encoding speed, Doppler (`doppler embed`, batch 64) against
# sentence-transformers on CUDA (bench/encoder_bench.py) in the same call, 4,096 texts of
# exactly 128 tokens. Usage: bash bench/encoder_device.sh MODEL_DIR. Writes $OUT/encoder*.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1
out="${OUT:-/tmp}"
# Without weights (a model folder too large to bring along), random ones of the config's
# shapes: the speed does not depend on the values.
if [ ! -f "$model/model.safetensors" ]; then
    python3 -c "
import sys, torch
from transformers import BertConfig, BertModel
torch.manual_seed(0)
BertModel(BertConfig.from_pretrained(sys.argv[1]), add_pooling_layer=False).save_pretrained(sys.argv[1], safe_serialization=True)
" "$model"
    echo "random weights written to $model" >&2
fi
texts="$out/encoder_texts.txt"
# 126 one-token words a line between [CLS] and [SEP]; lines differ in their word order.
python3 -c "
w = 'the cat sat on a mat and the dog ran in park with my old red ball'.split()
for i in range(4096):
    print(' '.join(w[(i * 7 + j * (1 + i % 5)) % len(w)] for j in range(126)))
" > "$texts"
for run in 1 2 3; do
    ./target/release/doppler embed -m "$model" --file "$texts" --batch 64 --json 2>/dev/null \
        | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'run': $run, 'seconds': d['seconds'], 'sentences_per_s': len(d['tokens'])/d['seconds'], 'tokens': sorted(set(d['tokens']))}))"
done > "$out/encoder_doppler.jsonl"
python3 bench/encoder_bench.py "$model" "$texts" > "$out/encoder_torch.json"
cat "$out/encoder_doppler.jsonl" "$out/encoder_torch.json"
