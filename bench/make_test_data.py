#!/usr/bin/env python3
"""Writes a small input directory in the format `bench_gpu --data DIR` writes, to test the
PyTorch scripts without a GPU:

    python3 bench/make_test_data.py /tmp/bench-data --tokens 256 --shapes 64x256,128x128
    python3 bench/torch_gptq.py --data /tmp/bench-data --json /tmp/torch.json --device cpu

Format (shared with kernels/examples/bench_gpu.rs): `manifest.json` with the run's settings
and one entry per shape naming two safetensors files, `activations` (`x` bf16
`[tokens, in]`, `h` f32 `[in, in]` = XᵀX/tokens without damping) and `weight` (`w` f32
`[out, in]`), plus the shape's NVFP4 `global_scale` (amax(W)/(6·448), f32).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_safetensors  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--shapes", default="64x256,128x128", help="OUTxIN,...")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    shapes, written = [], set()
    for item in args.shapes.split(","):
        out, inp = (int(v) for v in item.lower().split("x"))
        act_file = f"act_in{inp}.safetensors"
        if act_file not in written:
            scale = torch.exp(0.5 * torch.randn(inp, generator=gen))
            x = (torch.randn(args.tokens, inp, generator=gen) * scale).to(torch.bfloat16)
            xf = x.float()
            h = (xf.T @ xf) / args.tokens
            write_safetensors(os.path.join(args.out_dir, act_file), {"x": x, "h": h})
            written.add(act_file)
        w = torch.randn(out, inp, generator=gen) * 0.02
        w[:, :: max(inp // 8, 1)] *= 8.0  # a few outlier columns
        w_file = f"w_{out}x{inp}.safetensors"
        write_safetensors(os.path.join(args.out_dir, w_file), {"w": w})
        global_scale = float(np.float32(w.abs().max().item()) / np.float32(6.0 * 448.0))
        shapes.append(
            {
                "name": f"{out}x{inp}",
                "out": out,
                "in": inp,
                "activations": act_file,
                "weight": w_file,
                "global_scale": global_scale,
            }
        )
    manifest = {
        "producer": "make_test_data.py",
        "tokens": args.tokens,
        "percdamp": 0.01,
        "bits": 4,
        "group_size": 128 if all(s["in"] % 128 == 0 for s in shapes) else 16,
        "block_size": 128,
        "nvfp4": {"iters": 120, "max_shrink": 0.6, "error_norm": 2.0},
        "shapes": shapes,
    }
    with open(os.path.join(args.out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    print(f"wrote {len(shapes)} shapes to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
