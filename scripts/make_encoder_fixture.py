"""Sentence embeddings of an encoder directory from sentence-transformers (f32, CPU), for
Doppler's `embed` to be checked against: tests/encoder.rs reads the JSON.

    python3 scripts/make_encoder_fixture.py MODEL_DIR OUT.json
(run where sentence-transformers is installed; the GPU machine has it)
"""
import json
import sys
from importlib.metadata import version

import torch
from sentence_transformers import SentenceTransformer

TEXTS = [
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Doppler runs neural networks on your own GPU through WebGPU.",
    "unicode: café naïve 日本語 😀",
    "Short.",
    "It's raining cats and dogs; don't forget your umbrella!",
    # Longer than the model's 256 tokens: sentence-transformers cuts it.
    "word " * 300,
]


def main():
    model = SentenceTransformer(sys.argv[1], device="cpu")
    model.float()
    emb = model.encode(TEXTS, batch_size=4, convert_to_numpy=True, normalize_embeddings=False)
    tok = model.tokenizer(TEXTS, truncation=True, max_length=model.max_seq_length)
    with open(sys.argv[2], "w") as f:
        json.dump({
            "texts": TEXTS,
            "tokens": [len(ids) for ids in tok["input_ids"]],
            "embeddings": [[round(float(v), 8) for v in e] for e in emb],
            "max_seq_length": model.max_seq_length,
            "sentence_transformers": version("sentence-transformers"),
            "transformers": version("transformers"), "torch": version("torch"),
        }, f)
    print("embeddings", emb.shape)


if __name__ == "__main__":
    main()
