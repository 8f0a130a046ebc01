"""Host <-> device copy speeds of one 268 MB f32 weight (a 16384 x 4096 linear) through
PyTorch on the GPU machine: pageable against page-locked host memory, best of five.

    python3 bench/h2d.py

The figures decide how `sala_kernels::cuda::DriverTransfer` copies (docs/results.md).
"""
import time

import torch

N = 268_435_456  # bytes


def best_gb_per_s(copy, reps=5):
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return N / best / 1e9


pageable = torch.ones(N // 4, dtype=torch.float32)
pinned = pageable.pin_memory()
device = pageable.cuda()
out_pageable = torch.empty_like(pageable)
out_pinned = torch.empty_like(pageable).pin_memory()
print(f"H2D pageable {best_gb_per_s(lambda: pageable.cuda()):.1f} GB/s")
print(f"H2D pinned   {best_gb_per_s(lambda: pinned.cuda(non_blocking=True)):.1f} GB/s")
print(f"D2H pageable {best_gb_per_s(lambda: out_pageable.copy_(device)):.1f} GB/s")
print(f"D2H pinned   {best_gb_per_s(lambda: out_pinned.copy_(device, non_blocking=True)):.1f} GB/s")
