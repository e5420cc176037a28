"""Reference numbers for SmolLM2-135M-Instruct (Q4_1 GGUF) from Hugging Face transformers.

transformers reads the GGUF itself (gguf-py dequantizes every tensor to f32, the Q/K
weights are un-permuted to Hugging Face's layout) and runs its own Llama in f32 on the
CPU: an implementation independent of ours. For each prompt we record the token ids of its
tokenizer, the 10 largest logits after the prompt, and the greedy continuation with the 5
largest logits at every step. Also: tokenizations of awkward strings, and the chat
template applied to a short conversation.

    python3 -m venv /tmp/fx && /tmp/fx/bin/pip install torch==2.15.0 transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0 numpy
    /tmp/fx/bin/python scripts/make_smollm2_fixture.py "$(bash scripts/fetch_model.sh)" \
        crates/doppler/tests/fixtures/smollm2.json
"""
import json
import os
import sys
from importlib.metadata import version

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]
TOKENIZE = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "numbers 1234567 and 3.14159, dates 2026-11-30",
    "line one\nline two\n\n\ttabbed",
    "unicode: café naïve 日本語 😀 Ω≈ç√",
    "it's they're we've I'm you'll he'd",
    "<|im_start|>system\nhi<|im_end|>",
]
CONVERSATION = [
    {"role": "user", "content": "Hi! Who are you?"},
    {"role": "assistant", "content": "I am SmolLM."},
    {"role": "user", "content": "Name a colour."},
]
STEPS = 24


def top(logits, k):
    v, i = torch.topk(logits, k)
    return [[int(a), float(b)] for a, b in zip(i, v)]


def main():
    path, out = sys.argv[1], sys.argv[2]
    d, f = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    torch.manual_seed(0)
    prompts = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            seq = list(ids)
            steps = []
            first = None
            for _ in range(STEPS):
                logits = model(torch.tensor([seq])).logits[0, -1]
                if first is None:
                    first = top(logits, 10)
                nxt = int(torch.argmax(logits))
                steps.append({"token": nxt, "top": top(logits, 5)})
                seq.append(nxt)
            prompts.append({
                "text": text,
                "ids": ids,
                "top_logits": first,
                "greedy": [s["token"] for s in steps],
                "greedy_text": tok.decode([s["token"] for s in steps]),
                "steps": steps,
            })
            print(repr(text), "->", repr(prompts[-1]["greedy_text"]), file=sys.stderr)
    fixture = {
        "model": f,
        "made_by": "scripts/make_smollm2_fixture.py with "
                   + ", ".join(f"{p} {version(p)}" for p in ["torch", "transformers", "gguf"]),
        "prompts": prompts,
        "tokenize": [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TOKENIZE],
        "chat": {
            "messages": CONVERSATION,
            "text": tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True),
        },
    }
    with open(out, "w") as fh:
        json.dump(fixture, fh, indent=1, ensure_ascii=False)
        fh.write("\n")


if __name__ == "__main__":
    main()
