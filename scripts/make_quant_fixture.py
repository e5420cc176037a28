"""Fixture for the CPU dequantizers: random GGUF blocks of every supported type and their
values as decoded by llama.cpp's own Python package (gguf-py, an independent
implementation of the same block formats).

    pip install gguf==0.19.0 numpy
    python3 scripts/make_quant_fixture.py > crates/doppler/tests/fixtures/quant.json

Scales are drawn as finite f16 values (random bytes there would often be NaN/inf)."""
import json
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

# Byte offsets of the f16 scale fields in one block of each type.
SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
          "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def main():
    rng = np.random.default_rng(20261130)
    out = {"gguf_py": __import__("importlib.metadata").metadata.version("gguf"), "types": {}}
    for name in ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]:
        qt = T[name]
        block, size = GGML_QUANT_SIZES[qt]
        blocks = max(1, 512 // block)
        raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
        if name in ("F16", "BF16"):
            vals = rng.standard_normal(blocks * block).astype(np.float32)
            if name == "F16":
                raw = vals.astype(np.float16).view(np.uint8).reshape(blocks, size)
            else:
                raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(blocks, size)
        for off in SCALES.get(name, []):
            s = (rng.standard_normal(blocks) * 0.05).astype(np.float16)
            raw[:, off:off + 2] = s.view(np.uint8).reshape(blocks, 2)
        y = quants.dequantize(raw.reshape(-1), qt).reshape(-1).astype(np.float32)
        out["types"][name] = {"n": int(y.size), "bytes": raw.tobytes().hex(),
                              "values": [float(v) for v in y]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
