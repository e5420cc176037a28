"""Tiny random models of the decoder families Doppler runs, with their logits from Hugging
Face transformers (f32, CPU): the independent reference for tests/families.rs.

Each family gets a folder OUT/<family>-tiny holding what `save_pretrained` writes
(config.json, model.safetensors) and logits.json: the token ids, the logits (T, V) of every
position, and the versions used. Norm weights are drawn around 1 (transformers initialises
them to exactly 1, which would hide a norm applied with the wrong weight).

    python3 scripts/make_family_fixtures.py crates/doppler/tests/fixtures [FAMILY...]
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


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    # head_dim set apart from the width (as Mistral Nemo), untied head, no sliding window.
    cfg = MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False, sliding_window=None,
    )
    return MistralForCausalLM(cfg)


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    # Fused qkv and gate_up projections; LongRoPE ("su") with per-frequency factors: 256
    # positions from an original 64 (attention factor sqrt(1 + ln 4 / ln 64)).
    half = 8  # head size 16
    cfg = Phi3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        original_max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, sliding_window=None, pad_token_id=0,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
        },
    )
    return Phi3ForCausalLM(cfg)


def mistralswa():
    from transformers import MistralConfig, MistralForCausalLM

    # A sliding window of 5 over 17 tokens: most queries see only their last 5 keys.
    cfg = MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=5,
    )
    return MistralForCausalLM(cfg)


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Gemma 3's text model at toy size: five sliding-window layers (window 6) then a global
    # one, each kind with its RoPE base (the global one linearly scaled), a query scale
    # (query_pre_attn_scalar 24) that is not 1/sqrt(head size 32), the final soft-cap set
    # (Gemma 2 has one) so that it is exercised, tied embeddings.
    common = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=6,
        final_logit_softcapping=5.0, attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    try:
        # transformers 5: RoPE per layer kind.
        cfg = Gemma3TextConfig(**common, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        })
    except (TypeError, ValueError, KeyError):
        cfg = Gemma3TextConfig(**common, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                               rope_scaling={"rope_type": "linear", "factor": 2.0})
    return Gemma3ForCausalLM(cfg)


def bert():
    from transformers import BertConfig, BertModel

    # Head size 16; erf GELU; two token types.
    cfg = BertConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=64, type_vocab_size=2,
        layer_norm_eps=1e-12, hidden_act="gelu",
    )
    return BertModel(cfg, add_pooling_layer=False)


FAMILIES = {
    "qwen3": qwen3, "mistral": mistral, "phi3": phi3, "bert": bert,
    "mistralswa": mistralswa, "gemma3": gemma3,
}


def main():
    out = sys.argv[1]
    only = sys.argv[2:] or list(FAMILIES)
    for name, make in FAMILIES.items():
        if name not in only:
            continue
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
            if name == "bert":
                # The encoder's last hidden states, the second half of the text as type 1.
                types = [0] * 9 + [1] * 8
                logits = model(torch.tensor([ids]), token_type_ids=torch.tensor([types])).last_hidden_state[0].float()
            else:
                logits = model(torch.tensor([ids])).logits[0].float()
        out_json = {
            "family": name, "ids": ids,
            "logits": [[round(v, 7) for v in row] for row in logits.tolist()],
            "transformers": version("transformers"), "torch": version("torch"),
        }
        orig = getattr(model.config, "original_max_position_embeddings", None)
        if name == "phi3" and orig:
            # Past the original context transformers turns to the long factors (for the
            # whole sequence of one forward): 80 tokens, the last 8 positions' logits.
            long_ids = torch.randint(0, model.config.vocab_size, (orig + 16,), generator=g).tolist()
            with torch.no_grad():
                long_logits = model(torch.tensor([long_ids])).logits[0, -8:].float()
            out_json["long_ids"] = long_ids
            out_json["long_logits"] = [[round(v, 7) for v in row] for row in long_logits.tolist()]
        with open(os.path.join(d, "logits.json"), "w") as f:
            json.dump(out_json, f)
        print(name, d, "logits", tuple(logits.shape), "max", logits.abs().max().item())
        print(open(os.path.join(d, "config.json")).read())


if __name__ == "__main__":
    main()
