"""A model file with a real model's header (metadata, tokenizer, tensor table) and
synthetic weights that compress to almost nothing: for speed figures on a machine that
the real file cannot reach (the GPU machine takes 64 MiB). Every quantized block gets
the same random quants and a scale of 0.01, norms 1.0; decoding reads the same bytes as
with the real weights, so the speed is the same, the text is not.

    pip install gguf   # llama.cpp's reader
    python3 bench/synthetic_gguf.py REAL.gguf OUT.gguf
"""
import random
import sys

import gguf
import numpy as np

real, out = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(real)
tensors = sorted(r.tensors, key=lambda t: t.data_offset)
start = tensors[0].data_offset
rng = random.Random(0)
F16_001 = np.float16(0.01).tobytes()


def block(ty):
    """One block of a quantized type: random quants, every f16 scale field 0.01."""
    per, size = gguf.GGML_QUANT_SIZES[ty]
    b = bytearray(rng.randbytes(size))
    if ty in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q5_0):
        b[0:2] = F16_001
    elif ty in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q5_1):
        b[0:2] = F16_001
        b[2:4] = np.float16(-0.005).tobytes()
    else:
        raise SystemExit(f"synthetic_gguf: type {ty.name} not handled")
    return bytes(b)


with open(real, "rb") as f, open(out, "wb") as o:
    o.write(f.read(start))
    at = start
    for t in tensors:
        o.write(b"\0" * (t.data_offset - at))
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            data = np.ones(t.n_elements, dtype=np.float32).tobytes()
        elif t.name == "token_embd.weight":
            # Rows that differ (their scales), so the tied output head's argmax is a
            # token of the text (the largest or smallest scale: rows 46 or 47 of each
            # 97, by the sign of the product), never the control tokens at the start
            # (id 0 ends the text): greedy decoding runs to its length.
            one = block(t.tensor_type)
            per_row = int(t.shape[0]) // gguf.GGML_QUANT_SIZES[t.tensor_type][0]
            rows = []
            for r in range(int(t.shape[1])):
                b = bytearray(one)
                b[0:2] = np.float16(0.01 * (1 + ((r + 50) % 97) / 97)).tobytes()
                rows.append(bytes(b) * per_row)
            data = b"".join(rows)
        else:
            one = block(t.tensor_type)
            data = one * (t.n_bytes // len(one))
        assert len(data) == t.n_bytes, t.name
        o.write(data)
        at = t.data_offset + t.n_bytes
print(out)
