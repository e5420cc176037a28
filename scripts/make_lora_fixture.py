"""A tiny random Llama written by transformers with a random PEFT LoRA adapter on all seven
projections, and what PyTorch + PEFT compute with it: the reference for Doppler's LoRA
fine-tuning (crates/doppler/tests/gpu.rs, lora_matches_peft).

OUT/lora-tiny holds the base (save_pretrained: config.json, model.safetensors), the
adapter as PEFT saves it (adapter/adapter_config.json, adapter/adapter_model.safetensors)
and lora.json: a batch (ids, labels with -100 where no loss is taken, as transformers
takes them: labels[:, 1:] against logits[:, :-1]), the logits, the masked mean loss, every
adapter gradient (PEFT's saved names), then the losses of 5 torch.optim.AdamW steps on that
batch and the adapter after them. f32 on the CPU.

    python3 scripts/make_lora_fixture.py crates/doppler/tests/fixtures
(needs torch, transformers and peft)
"""
import json
import os
import sys
from importlib.metadata import version

import torch


def main():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    out = os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "lora-tiny")
    torch.manual_seed(2412)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    )
    base = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    base.save_pretrained(out)
    lcfg = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lcfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(os.path.join(out, "adapter"))

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 300, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100   # a prompt
    labels[1, :2] = -100
    labels[1, 7] = -100

    def named():
        return {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}

    model.train()
    res = model(input_ids=ids, labels=labels)
    res.loss.backward()
    grads = {n: p.grad.detach().flatten().tolist() for n, p in named().items()}
    logits = res.logits.detach()
    loss0 = res.loss.item()
    opt = torch.optim.AdamW(list(named().values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    opt.zero_grad()
    for _ in range(5):
        l = model(input_ids=ids, labels=labels).loss
        losses.append(l.item())
        l.backward()
        opt.step()
        opt.zero_grad()
    after = {n: p.detach().flatten().tolist() for n, p in named().items()}
    with open(os.path.join(out, "lora.json"), "w") as f:
        json.dump({
            "ids": ids.tolist(), "labels": labels.tolist(), "loss": loss0,
            "logits": logits.flatten().tolist(), "grads": grads,
            "adamw": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
            "step_losses": losses, "after": after,
            "versions": {k: version(k) for k in ["torch", "transformers", "peft"]},
        }, f)
    print(f"wrote {out}: loss {loss0:.6f}, step losses {losses}")


if __name__ == "__main__":
    main()
