#!/usr/bin/env bash
# On the GPU machine: the KV cache's type and sliding windows, with PyTorch in the same call.
#   1. SmolLM2-135M's shapes (`--preset smollm2-135m`: Q4_1 blocks, random values): decode
#      and prefill at a 512-token prompt and at a 4,000-token prompt, f32, f16 and q8_0
#      caches.
#   2. Gemma 3 1B's shapes (26 layers, width 1152, 4 heads of 256, 1 key/value head, MLP
#      6912, vocabulary 262144, windows of 512 in five layers of six), random bf16 weights
#      written by transformers on the machine: Doppler's decode and prefill (512 and 4,000
#      prompt tokens: the windowed layers keep rings), default settings.
#      The same at Gemma 3 270M's shapes (18 layers, width 640, MLP 2048).
#   3. SmolLM2's shapes as a bf16 Hugging Face checkpoint (RoPE pairs half a head apart):
#      decode and prefill at 512 prompt tokens, f32 and f16 caches.
#   4. transformers (bf16, CUDA, eager, its default dynamic cache) on the same shapes:
#      128 greedy decode steps after the same prompts, median step time.
# Expects target/release/doppler and the Vulkan loader unpacked. Writes $OUT/kv-*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
d=./target/release/doppler
summary() {
    python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: (round(d[k], 2) if isinstance(d[k], float) else d[k]) for k in ['kv_cache_type', 'kv_cache_mib', 'prefill_tok_s', 'decode_tok_s', 'token_ms_p50', 'gpu_ms_per_token_p50', 'dispatches_per_token']})" "$1" "$2" || true
}
for p in 512 4000; do
    for c in f32 f16 q8_0; do
        $d bench generate --preset smollm2-135m --prompt $p --gen 128 --cache-type $c --json \
            > "$out/kv-smollm2-$p-$c.json" 2> "$out/kv-smollm2-$p-$c.err" || echo "smollm2 $p $c failed: $(tail -1 "$out/kv-smollm2-$p-$c.err")"
        summary "$out/kv-smollm2-$p-$c.json" "smollm2 prompt $p cache $c"
    done
done
python3 - "$work" <<'PY'
import sys, torch
import transformers as T
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
byte = pre_tokenizers.ByteLevel(add_prefix_space=False)
vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer, tok.decoder = byte, decoders.ByteLevel()
cfg = T.Gemma3TextConfig(
    vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
    query_pre_attn_scalar=256, sliding_window=512, tie_word_embeddings=True)
torch.manual_seed(0)
model = T.Gemma3ForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(f"{sys.argv[1]}/gemma3", safe_serialization=True)
tok.save(f"{sys.argv[1]}/gemma3/tokenizer.json")
# Gemma 3 270M's shapes (SmolLM2's size class): 18 layers, width 640, 4 heads of 256.
small = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
    query_pre_attn_scalar=256, sliding_window=512, tie_word_embeddings=True)).to(torch.bfloat16)
small.save_pretrained(f"{sys.argv[1]}/gemma3-270m", safe_serialization=True)
tok.save(f"{sys.argv[1]}/gemma3-270m/tokenizer.json")
# SmolLM2's shapes as a Hugging Face checkpoint (bf16): RoPE pairs half a head apart.
llama = T.LlamaForCausalLM(T.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    tie_word_embeddings=True)).to(torch.bfloat16)
llama.save_pretrained(f"{sys.argv[1]}/llama", safe_serialization=True)
tok.save(f"{sys.argv[1]}/llama/tokenizer.json")
PY
for c in f32 f16; do
    $d bench generate --model "$work/llama" --prompt 512 --gen 128 --cache-type $c --json \
        > "$out/kv-llamahf-$c.json" 2> "$out/kv-llamahf-$c.err" || echo "llama hf $c failed: $(tail -1 "$out/kv-llamahf-$c.err")"
    summary "$out/kv-llamahf-$c.json" "llama (HF, SmolLM2 shapes, bf16) prompt 512 cache $c"
done
for m in gemma3 gemma3-270m; do
    for p in 512 4000; do
        $d bench generate --model "$work/$m" --prompt $p --gen 128 --json \
            > "$out/kv-$m-$p.json" 2> "$out/kv-$m-$p.err" || echo "$m $p failed: $(tail -1 "$out/kv-$m-$p.err")"
        summary "$out/kv-$m-$p.json" "$m shapes prompt $p (default cache)"
    done
done
python3 - "$work" "$out" <<'PY'
import json, sys, time, torch
import transformers as T
work, out = sys.argv[1], sys.argv[2]
res = {"torch": torch.__version__, "transformers": T.__version__}
def decode(model, prompt, steps=128):
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device="cuda")
    with torch.no_grad():
        torch.cuda.synchronize(); t0 = time.perf_counter()
        o = model(ids, use_cache=True)
        torch.cuda.synchronize(); prefill = time.perf_counter() - t0
        past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            torch.cuda.synchronize(); t = time.perf_counter()
            o = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    times.sort()
    return {"prefill_tok_s": prompt / prefill, "decode_tok_s_p50": 1 / times[len(times) // 2]}
smol = T.LlamaForCausalLM(T.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    tie_word_embeddings=True)).to("cuda", torch.bfloat16).eval()
gemma = T.Gemma3ForCausalLM.from_pretrained(f"{work}/gemma3", dtype=torch.bfloat16).to("cuda").eval()
small = T.Gemma3ForCausalLM.from_pretrained(f"{work}/gemma3-270m", dtype=torch.bfloat16).to("cuda").eval()
for name, m in [("smollm2", smol), ("gemma3", gemma), ("gemma3-270m", small)]:
    for p in (512, 4000):
        decode(m, p, 8)  # warm-up
        res[f"{name}-{p}"] = decode(m, p)
        print(name, p, res[f"{name}-{p}"], flush=True)
json.dump(res, open(f"{out}/kv-torch.json", "w"), indent=1)
PY
