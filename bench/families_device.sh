#!/usr/bin/env bash
# On the GPU machine: decode and prefill speed of each decoder family at SmolLM2-135M's
# shapes (30 layers, width 576, 9 heads of 64, 3 key/value heads, MLP 1536, vocabulary
# 49152, tied embeddings), random bf16 weights written by transformers on the machine
# (speed does not depend on the values), a byte-level tokenizer; `doppler bench generate
# --model DIR --prompt 512 --gen 128` each. Expects target/release/doppler and the Vulkan
# loader unpacked. Writes $OUT/family-*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import sys, torch
import transformers as T
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
byte = pre_tokenizers.ByteLevel(add_prefix_space=False)
vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer, tok.decoder = byte, decoders.ByteLevel()
common = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
              tie_word_embeddings=True)
families = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 64}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"head_dim": 64, "sliding_window": None}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"pad_token_id": 0, "sliding_window": None}),
}
for name, (cfg, cls, extra) in families.items():
    torch.manual_seed(0)
    model = cls(cfg(**common, **extra)).to(torch.bfloat16)
    model.save_pretrained(f"{sys.argv[1]}/{name}", safe_serialization=True)
    tok.save(f"{sys.argv[1]}/{name}/tokenizer.json")
PY
for name in llama qwen3 mistral phi3; do
    ./target/release/doppler bench generate --model "$work/$name" --prompt 512 --gen 128 --json \
        > "$out/family-$name.json" 2> "$out/family-$name.err" || echo "$name failed: $(tail -1 "$out/family-$name.err")"
    python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: round(d[k], 2) for k in ['load_ms', 'prefill_tok_s', 'decode_tok_s', 'token_ms_p50', 'gpu_ms_per_token_p50', 'dispatches_per_token', 'weights_mib']})" "$out/family-$name.json" "$name" || true
done
