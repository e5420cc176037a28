"""Tiny random models of the decoder families Doppler runs, with their logits from Hugging
Face transformers (f32, CPU): the independent reference for tests/families.rs.

Each family gets a folder OUT/<family>-tiny holding what `save_pretrained` writes
(config.json, model.safetensors) and logits.json: the token ids, the logits (T, V) of every
position, and the versions used. Norm weights are drawn around 1 (transformers initialises
them to exactly 1, which would hide a norm applied with the wrong weight).

    python3 scripts/make_family_fixtures.py crates/doppler/tests/fixtures
(run where transformers >= 4.51 and torch are installed; the GPU machine has them)
"""
import json
import os
import sys
from importlib.metadata import version

import torch


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 32 with 4 heads on a width of 64: q is wider than the model, as in Qwen3.
    cfg = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False,
    )
    return Qwen3ForCausalLM(cfg)


FAMILIES = {"qwen3": qwen3}


def main():
    out = sys.argv[1]
    for name, make in FAMILIES.items():
        torch.manual_seed(1234)
        model = make().float().eval()
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
        d = os.path.join(out, f"{name}-tiny")
        model.save_pretrained(d, safe_serialization=True)
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, model.config.vocab_size, (17,), generator=g).tolist()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        with open(os.path.join(d, "logits.json"), "w") as f:
            json.dump({
                "family": name, "ids": ids,
                "logits": [[round(v, 7) for v in row] for row in logits.tolist()],
                "transformers": version("transformers"), "torch": version("torch"),
            }, f)
        print(name, d, "logits", tuple(logits.shape), "max", logits.abs().max().item())


if __name__ == "__main__":
    main()
