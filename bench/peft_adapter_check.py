"""Loads a base model and a LoRA adapter that `doppler finetune` wrote into transformers +
PEFT and prints PEFT's greedy tokens for chat questions, to set against `doppler generate
--chat Q --temperature 0 --lora DIR --json` (the tokens must be the same).

    python3 bench/peft_adapter_check.py MODEL_DIR GGUF_NAME ADAPTER_DIR [QUESTION...]
(MODEL_DIR holding GGUF_NAME; transformers reads GGUF files with the `gguf` package; torch,
transformers, peft and gguf needed)
"""
import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    d, name, adapter = sys.argv[1:4]
    questions = sys.argv[4:] or ["What is 23 + 45?", "Add 71 and 18."]
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    pm = PeftModel.from_pretrained(m, adapter).eval()
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt")
        if not torch.is_tensor(ids):
            ids = ids["input_ids"]
        with torch.no_grad():
            out = pm.generate(ids, max_new_tokens=15, do_sample=False)
        new = out[0, ids.shape[1]:]
        print(json.dumps({"q": q, "prompt_tokens": ids.shape[1], "tokens": new.tolist(), "text": tok.decode(new)}))


if __name__ == "__main__":
    main()
