"""Checks `doppler export` against PyTorch + PEFT: the base read by transformers (a Hugging
Face directory, or a GGUF file through transformers' GGUF reader), the adapter by PEFT and
merged with `merge_and_unload()`; then every tensor Doppler wrote against the merged
model's, the exported directory loaded by transformers against the merged model's logits,
and the exported tokenizer against the base's.

    python3 scripts/check_export.py --base DIR [--gguf NAME] --adapter ADIR \
        [--make-adapter] --out OUT [--doppler target/release/doppler] [--dtype f32]

--make-adapter first writes a random adapter with PEFT (rank 8, all seven projections,
B not zero) to ADIR: an adapter trained elsewhere. Needs torch, transformers, peft,
safetensors (and gguf for a GGUF base). Prints one JSON object; exits 1 past the
tolerances (weights 1e-6 of each tensor's largest for f32, logits 1e-4 of the largest).
"""
import argparse
import glob
import json
import os
import subprocess
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(a):
    kw = {"gguf_file": a.gguf} if a.gguf else {}
    return AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32, **kw).eval()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--gguf")
    p.add_argument("--adapter", required=True)
    p.add_argument("--make-adapter", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--doppler", default="target/release/doppler")
    p.add_argument("--dtype", default="f32")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.make_adapter:
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(base_model(a), cfg).save_pretrained(a.adapter)
    model_path = os.path.join(a.base, a.gguf) if a.gguf else a.base
    run = subprocess.run(
        [a.doppler, "export", "-m", model_path, "--lora", a.adapter, "-o", a.out,
         "--dtype", a.dtype, "--json"],
        capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stderr, file=sys.stderr)
        sys.exit(1)
    exported = json.loads(run.stdout)
    merged = PeftModel.from_pretrained(base_model(a), a.adapter).merge_and_unload().eval()
    want = merged.state_dict()
    got = {}
    for f in sorted(glob.glob(os.path.join(a.out, "*.safetensors"))):
        got.update(load_file(f))
    tied = merged.config.tie_word_embeddings
    expected = {k for k in want if not (tied and k == "lm_head.weight")}
    worst_w, worst_name = 0.0, ""
    for k in expected:
        if k not in got:
            print(f"missing {k}", file=sys.stderr)
            sys.exit(1)
        w, g = want[k].float(), got[k].float()
        d = ((w - g).abs().max() / w.abs().max().clamp_min(1e-30)).item()
        if d > worst_w:
            worst_w, worst_name = d, k
    extra = sorted(set(got) - expected)
    # The exported directory as transformers reads it, against the merged model.
    out_model = AutoModelForCausalLM.from_pretrained(a.out, dtype=torch.float32).eval()
    kw = {"gguf_file": a.gguf} if a.gguf else {}
    tok_base = AutoTokenizer.from_pretrained(a.base, **kw)
    tok_out = AutoTokenizer.from_pretrained(a.out)
    texts = ["What is 23 + 45?", "Hello, world!  Tabs\tand\nnewlines, ünïcödé, 12345."]
    chat = [{"role": "user", "content": texts[0]}]
    same_tokens = all(tok_base(t)["input_ids"] == tok_out(t)["input_ids"] for t in texts)
    same_chat = (tok_base.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                 == tok_out.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    ids = torch.tensor([tok_base(texts[1])["input_ids"]])
    with torch.no_grad():
        lw = merged(ids).logits
        lg = out_model(ids).logits
    worst_l = ((lw - lg).abs().max() / lw.abs().max()).item()
    tol_w = 1e-6 if a.dtype == "f32" else 4e-3
    tol_l = 1e-4 if a.dtype == "f32" else 2e-2
    ok = (worst_w <= tol_w and worst_l <= tol_l and not extra and same_tokens and same_chat)
    print(json.dumps({
        "exported": exported, "tensors_compared": len(expected), "extra_tensors": extra,
        "weights_max_rel": worst_w, "worst_tensor": worst_name, "logits_max_rel": worst_l,
        "same_token_ids": same_tokens, "same_chat_template": same_chat, "ok": ok,
        "versions": {"torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "peft": __import__("peft").__version__},
    }))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
