"""Reference numbers for SmolLM2-135M-Instruct (Q4_1 GGUF) with a LoRA adapter, from
transformers + PEFT: `tests/smollm2.rs` (lora_logits_match_peft) checks Doppler's `--lora`
path (the adapter applied inside the products, unmerged) against them.

The adapter is not stored: every element is a formula of its place (below, and the same
in the test), rank 4, alpha 8, on all seven projections, written in PEFT's layout (A (r,
in), B (out, r), Hugging Face's q/k row order). transformers reads the GGUF itself and
PEFT applies the adapter unmerged, f32 on the CPU. Recorded per prompt: its ids, the 10
largest logits after it, and the greedy continuation with the 5 largest logits a step.

    python3 -m venv /tmp/fx && /tmp/fx/bin/pip install torch==2.15.0 transformers==5.24.0 gguf==0.19.0 peft==0.21.2 numpy
    /tmp/fx/bin/python scripts/make_smollm2_lora_fixture.py "$(bash scripts/fetch_model.sh)" \
        crates/doppler/tests/fixtures/smollm2_lora.json
"""
import json
import os
import sys
from importlib.metadata import version

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]
STEPS = 6
FORMULA = "0.03 * sin(0.37 r + 0.11 c + 1.7 layer + 0.5 t + (0.9 for B, 0 for A)), t the module's index in TARGETS, (r, c) the element's row and column"


def element(layer, t, which, rows, cols):
    r = torch.arange(rows, dtype=torch.float64)[:, None]
    c = torch.arange(cols, dtype=torch.float64)[None, :]
    shift = 0.9 if which == "B" else 0.0
    return (0.03 * torch.sin(0.37 * r + 0.11 * c + 1.7 * layer + 0.5 * t + shift)).float()


def top(logits, k):
    v, i = torch.topk(logits, k)
    return [[int(a), float(b)] for a, b in zip(i, v)]


def main():
    path, out = sys.argv[1], sys.argv[2]
    d, f = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    base = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    n = 0
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        t = next(i for i, m in enumerate(TARGETS) if f".{m}." in name)
        which = "A" if "lora_A" in name else "B"
        with torch.no_grad():
            p.copy_(element(layer, t, which, *p.shape))
        n += 1
    assert n == 2 * len(TARGETS) * base.config.num_hidden_layers, n
    model.eval()
    prompts = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            seq = list(ids)
            steps = []
            for _ in range(STEPS):
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
                nxt = int(torch.argmax(logits))
                steps.append({"token": nxt, "top": top(logits, 5)})
                seq.append(nxt)
            first = model(input_ids=torch.tensor([ids])).logits[0, -1]
            prompts.append({
                "text": text,
                "ids": ids,
                "top_logits": top(first, 10),
                "greedy": [s["token"] for s in steps],
                "greedy_text": tok.decode([s["token"] for s in steps]),
                "steps": steps,
            })
            print(repr(text), "->", repr(prompts[-1]["greedy_text"]), file=sys.stderr)
    fixture = {
        "model": f,
        "made_by": "scripts/make_smollm2_lora_fixture.py with "
                   + ", ".join(f"{p} {version(p)}" for p in ["torch", "transformers", "gguf", "peft"]),
        "adapter": {"rank": RANK, "alpha": ALPHA, "targets": TARGETS, "element": FORMULA},
        "prompts": prompts,
    }
    with open(out, "w") as fh:
        json.dump(fixture, fh, indent=1, ensure_ascii=False)
        fh.write("\n")


if __name__ == "__main__":
    main()
