#!/usr/bin/env python3
"""Compares `bench_gpu --json ours.json` with `torch_gptq.py --json torch.json`.

    python3 bench/compare.py ours.json torch.json [--json comparison.json]

Per shape and kernel it prints our time, torch's time, the speed-up torch/ours, both losses
(GPTQ loss Σ(w−q)²/(2d²), NVFP4 weighted error) and their relative difference, and each of
our kernels' fraction of the machine's measured ceilings (torch.json's `ceilings`): TFLOP/s
against the bf16 8192³ matmul rate, GB/s (bytes the kernel must move) against the
device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, rate, write_json  # noqa: E402

# (our kernel, torch kernel, what is compared). Our names are those bench_gpu writes.
PAIRS = [
    ("hessian_cublas_bf16", "hessian_bf16", "XᵀX bf16→f32: cuBLAS GemmEx vs torch bf16"),
    ("hessian_cubecl_f32", "hessian_f32", "XᵀX f32: CubeCL vs torch f32"),
    ("inverse_cusolver", "inverse", "upper factor of H⁻¹: cuSOLVER 2 passes vs torch 3"),
    ("inverse_faer_cpu", "inverse", "upper factor of H⁻¹: faer CPU vs torch GPU"),
    ("gptq_cublas", "gptq", "GPTQ column loop given U (CublasGemm)"),
    ("gptq_cubecl", "gptq", "GPTQ column loop given U (CubeGemm)"),
    ("gptq_cublas_total", "gptq_total", "GPTQ with the inverse (CublasGemm)"),
    ("gptq_cubecl_total", "gptq_total", "GPTQ with the inverse (CubeGemm)"),
    ("nvfp4_search", "nvfp4_search", "NVFP4 block-scale search"),
    # Algorithm cross-checks on the first crop_rows rows: our CPU reference vs torch.
    ("gptq_cpu_crop", "gptq_crop", "GPTQ on the first rows: sala_hessian CPU vs torch"),
    ("nvfp4_cpu_crop", "nvfp4_crop", "NVFP4 search on the first rows: CPU naive vs torch"),
]


def by_kernel(shape: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {r["kernel"]: r for r in shape.get("results", [])}


def rel_diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def compare(ours: Dict[str, Any], torch: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One comparison row per (shape, pair) for which we have a result (or a failure)."""
    ceil = torch.get("ceilings", {})
    tflops_ceiling = ceil.get("bf16_matmul_tflops")
    gbps_ceiling = ceil.get("copy_gbps")
    torch_shapes = {s["name"]: s for s in torch.get("shapes", [])}
    rows = []
    for shape in ours.get("shapes", []):
        mine = by_kernel(shape)
        theirs = by_kernel(torch_shapes.get(shape["name"], {}))
        for ours_key, torch_key, what in PAIRS:
            a, b = mine.get(ours_key), theirs.get(torch_key)
            if a is None:
                continue  # a stage we did not run (skipped, or no GPU)
            b = b or {}
            t_ours, t_torch = a.get("time_s"), b.get("time_s")
            tflops = rate(a.get("flops"), t_ours, 1e12)
            gbps = rate(a.get("bytes"), t_ours, 1e9)
            rows.append(
                {
                    "shape": shape["name"],
                    "ours": ours_key,
                    "torch": torch_key,
                    "what": what,
                    "ours_s": t_ours,
                    "torch_s": t_torch,
                    "torch_over_ours": (t_torch / t_ours) if t_ours and t_torch else None,
                    "ours_loss": a.get("loss"),
                    "torch_loss": b.get("loss"),
                    "loss_rel_diff": rel_diff(a.get("loss"), b.get("loss")),
                    "ours_tflops": tflops,
                    "frac_bf16_ceiling": (tflops / tflops_ceiling)
                    if tflops is not None and tflops_ceiling
                    else None,
                    "ours_gbps": gbps,
                    "frac_copy_bw": (gbps / gbps_ceiling) if gbps is not None and gbps_ceiling else None,
                    "errors": "; ".join(
                        f"{side}: {r['error']}"
                        for side, r in (("ours", a), ("torch", b))
                        if r.get("error")
                    )
                    or None,
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ours", help="bench_gpu --json output")
    parser.add_argument("torch", help="torch_gptq.py --json output")
    parser.add_argument("--json", help="also write the comparison rows here")
    args = parser.parse_args()
    with open(args.ours) as f:
        ours = json.load(f)
    with open(args.torch) as f:
        torch = json.load(f)
    rows = compare(ours, torch)
    ceil = torch.get("ceilings", {})
    print(f"ours: {ours.get('device')}; torch {torch.get('torch')} on {torch.get('device')}")
    print(
        f"ceilings: copy {ceil.get('copy_gbps')} GB/s (read+write), "
        f"bf16 matmul {ceil.get('bf16_matmul_tflops')} TFLOP/s"
    )
    print()
    headers = [
        "shape",
        "ours",
        "ours s",
        "torch s",
        "torch/ours",
        "our loss",
        "torch loss",
        "rel diff",
        "TFLOP/s",
        "of bf16",
        "GB/s",
        "of copy",
    ]
    print_table(
        headers,
        (
            [
                r["shape"],
                r["ours"],
                r["ours_s"],
                r["torch_s"],
                r["torch_over_ours"],
                r["ours_loss"],
                r["torch_loss"],
                r["loss_rel_diff"],
                r["ours_tflops"],
                r["frac_bf16_ceiling"],
                r["ours_gbps"],
                r["frac_copy_bw"],
            ]
            for r in rows
        ),
    )
    failures = [r for r in rows if r["errors"]]
    if failures:
        print()
        print("failures:")
        for r in failures:
            print(f"  {r['shape']} {r['ours']} / {r['torch']}: {r['errors']}")
    if args.json:
        write_json(args.json, {"ceilings": ceil, "rows": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
