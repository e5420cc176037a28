"""PyTorch + PEFT LoRA fine-tuning speed and memory at a Llama's shapes (random weights):
the figure Doppler's `doppler finetune` is set against (bench/lora_device.sh).

SmolLM2-135M's shapes by default (30 layers, width 576, 9 heads, 3 key/value heads, MLP
1536, vocabulary 49152, tied head); LoRA rank 16 (alpha 32) on all seven projections;
batch 8 of 512 tokens, loss over every token; torch.optim.AdamW on the adapters. The base
in bf16 (PEFT keeps the adapters in f32 and autocasts) or f32. Prints one JSON line a
dtype: median tokens/s over the timed steps and peak allocated GPU memory.

Usage: python3 bench/lora_bench.py [--dtypes bf16 f32] [--steps 10] [--batch 8] [--seq 512]
"""
import argparse
import json
import statistics
import time

import torch


def main():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["bf16", "f32"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    a = p.parse_args()
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    )
    for name in a.dtypes:
        dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[name]
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype)
        lcfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        model = get_peft_model(base, lcfg)
        model.train()
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
        times = []
        for i in range(a.warmup + a.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(json.dumps({
            "name": f"peft lora r16 {name}", "tokens_per_s": a.batch * a.seq / med, "step_ms": med * 1e3,
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "trainable": sum(q.numel() for q in params), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
        }), flush=True)
        del model, base, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
