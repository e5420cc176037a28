"""sentence-transformers' encoding speed on CUDA for `bash bench/encoder_device.sh`: N texts
of exactly 128 tokens (126 one-token words between [CLS] and [SEP]), batch 64, f32 (TF32
off) and fp16; the median of 5 runs after a warm-up. Prints JSON.

    python3 bench/encoder_bench.py MODEL_DIR TEXTS_FILE
"""
import json
import statistics
import sys
import time

import torch
from sentence_transformers import SentenceTransformer


def run(model, texts, batch):
    times = []
    for i in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.encode(texts, batch_size=batch, convert_to_numpy=True)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    texts = [l.rstrip("\n") for l in open(sys.argv[2]) if l.strip()]
    model = SentenceTransformer(sys.argv[1], device="cuda")
    lens = {len(x) for x in model.tokenizer(texts[:64])["input_ids"]}
    out = {"texts": len(texts), "token_counts": sorted(lens), "batch": 64}
    model.float()
    out["f32_s"] = run(model, texts, 64)
    out["f32_sentences_per_s"] = len(texts) / out["f32_s"]
    model.half()
    out["fp16_s"] = run(model, texts, 64)
    out["fp16_sentences_per_s"] = len(texts) / out["fp16_s"]
    out["torch"] = torch.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
