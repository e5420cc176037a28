"""PyTorch reference figures for `doppler bench`, measured in the same call on the same GPU.

Copy: y.copy_(x) on a buffer of --mib MiB, GB/s counting bytes read + written.
Matmul: torch.matmul in f32 with TF32 off, TFLOP/s. Medians of CUDA-event timings.
Usage: python3 bench/torch_bench.py [--mib 1024] [--size 4096 ...] [--repeat 20]
"""
import argparse
import json
import statistics

import torch


def timed(fn, repeat, batch):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--size", type=int, action="append")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--batch", type=int, default=10)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    n = a.mib << 18
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), a.repeat, a.batch)
    rows.append({"name": "torch copy_", "shape": f"{a.mib} MiB", "ms": ms, "value": 2 * n * 4 / ms / 1e6, "unit": "GB/s"})
    del x, y
    for s in a.size or [4096]:
        m1 = torch.randn(s, s, device="cuda")
        m2 = torch.randn(s, s, device="cuda")
        ms = timed(lambda: torch.matmul(m1, m2), a.repeat, a.batch)
        rows.append({"name": "torch.matmul f32 (TF32 off)", "shape": f"{s}x{s}x{s}", "ms": ms,
                     "value": 2 * s**3 / ms / 1e9, "unit": "TFLOP/s"})
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
