"""Reference numbers for Gemma 3 270M (the Q4_K_M GGUF of scripts/fetch_gemma3.sh) from
Hugging Face transformers: it reads the GGUF itself (gguf-py dequantizes every tensor to
f32; the norms come back as llama.cpp stored them, 1 + w, and transformers takes the 1
off) and runs its own Gemma 3 in f32 on the CPU. For each prompt: the token ids of its
tokenizer (BOS first), the 10 largest logits after the prompt, and the greedy
continuation with the 5 largest logits at every step.

    python3 -m venv /tmp/fx && /tmp/fx/bin/pip install torch transformers gguf numpy
    /tmp/fx/bin/python scripts/make_gemma3_fixture.py "$(bash scripts/fetch_gemma3.sh)" \
        crates/doppler/tests/fixtures/gemma3-270m.json
"""
import json
import os
import sys
from importlib.metadata import version

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
]
STEPS = 8


def top(logits, k):
    v, i = torch.topk(logits, k)
    return [[int(a), float(b)] for a, b in zip(i, v)]


def main():
    path, out = sys.argv[1], sys.argv[2]
    d, f = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    prompts = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tok(text)["input_ids"]
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
        "transformers": version("transformers"), "torch": version("torch"),
        "gguf": version("gguf"),
        "prompts": prompts,
    }
    with open(out, "w") as fh:
        json.dump(fixture, fh, indent=1)


if __name__ == "__main__":
    main()
