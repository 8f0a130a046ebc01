#!/usr/bin/env python3
"""PyTorch baselines of the kernels `bench_gpu` times, on the SAME inputs.

Reads the directory `bench_gpu --data DIR` wrote (`manifest.json` plus safetensors files:
activations X bf16 `[tokens, in]`, the undamped Hessian H = XᵀX/tokens f32 `[in, in]`, the
weight W f32 `[out, in]`) and times, per shape:

- `hessian_bf16`: `torch.matmul(X.T, X)` in bf16 (bf16 output, f32 accumulation inside
  cuBLAS); `hessian_f32`: the same in f32 with TF32 off (the counterpart of our f32 CubeCL
  path). TFLOP/s = 2·tokens·in²/t.
- `inverse`: IST-DASLab's route to the upper factor, `cholesky` → `cholesky_inverse` →
  `cholesky(upper=True)` of the damped H (f32).
- `gptq` (the column loop given the factor) and `gptq_total` (damping + inverse + loop): the
  GPTQ algorithm as published (lazy blocks of 128, groups of 128 whose scale is computed at
  the group start from the current weights, symmetric 4-bit grid `scale = 2·absmax/15`,
  zero 8, round half to even: `sala_formats::IntScheme::SymmetricIst`), written from the
  algorithm. loss = Σ (w − q)² / (2·d²).
- `nvfp4_search`: the NVFP4 E4M3 block-scale search (120 candidates, shrink up to 0.6,
  p = 2, weighted by diag H / max diag H) vectorised over rows × blocks × candidates, E4M3
  rounding by `torch.float8_e4m3fn` casts, E2M1 rounding by the midpoint comparisons of
  `sala_formats::minifloat::e2m1_encode_fast`. loss = Σ over blocks of the chosen error.

and the machine's ceilings: device-to-device copy bandwidth (bytes read + written) and the
bf16 8192³ matmul rate. Prints a table and writes JSON (`--json`).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    load_manifest,
    print_table,
    rate,
    read_safetensors,
    record,
    timed,
    write_json,
)

# E2M1 magnitudes by index (sala_formats::minifloat::E2M1_VALUES, positive half).
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_POSITIVE = 2.0**-9


def make_sync(device: torch.device) -> Callable[[], None]:
    """The barrier the timings use: `torch.cuda.synchronize` on CUDA, nothing on CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# ---------------------------------------------------------------------------------------------
# GPTQ (IST-DASLab fasterquant, symmetric IST grid)
# ---------------------------------------------------------------------------------------------


def sym_params(x: torch.Tensor, maxq: int):
    """Per-row scale of a group `x [rows, g]` (sala_formats IntScheme::SymmetricIst):
    range including 0, `hi = max(max, −min)`, 1 if the group is all zero,
    `scale = max(2·hi/maxq, 1e-10)`; the zero point is `(maxq + 1)/2`."""
    lo = torch.clamp(x.min(dim=1).values, max=0.0)
    hi = torch.clamp(x.max(dim=1).values, min=0.0)
    hi = torch.maximum(hi, -lo)
    hi = torch.where(hi == 0, torch.ones_like(hi), hi)
    scale = torch.clamp(2.0 * hi / maxq, min=1e-10)
    return scale, float((maxq + 1) // 2)


def fake_quant(w: torch.Tensor, scale: torch.Tensor, zero: float, maxq: int):
    """`q = scale·(clamp(round(w/scale) + zero, 0, maxq) − zero)`; torch.round is half-to-even."""
    code = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
    return scale * (code - zero)


def damped(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """H with dead columns given a unit diagonal and `percdamp·mean(diag H)` added (a copy)."""
    h = h.clone()
    diag = torch.diagonal(h)
    dead = diag == 0
    diag[dead] = 1.0
    diag += percdamp * torch.mean(diag)
    return h


def inverse_upper(h_damped: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of H⁻¹, IST's way: chol → cholesky_inverse → chol(upper)."""
    lower = torch.linalg.cholesky(h_damped)
    h_inv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(h_inv, upper=True)


def gptq_loop(w: torch.Tensor, u: torch.Tensor, bits: int, group: int, block: int):
    """The lazy-block column loop on a copy of `w [out, in]` given the factor `u [in, in]`.
    Returns `(dequantized Q, loss)`, loss = Σ (w − q)²/(2·d²) accumulated in f64."""
    if block % group != 0:
        raise ValueError(f"group size {group} must divide the block size {block}")
    w = w.clone()
    maxq = 2**bits - 1
    rows, cols = w.shape
    q_all = torch.zeros_like(w)
    loss = torch.zeros((), dtype=torch.float64, device=w.device)
    scale, zero = None, 0.0
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        losses1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            d = u1[i, i]
            if (i1 + i) % group == 0:
                # Group start: parameters from the current (error-updated) weights; the
                # group lies inside this block (group | block), where w1 is current.
                scale, zero = sym_params(w1[:, i : i + group], maxq)
            q = fake_quant(col, scale, zero, maxq)
            q1[:, i] = q
            losses1[:, i] = (col - q) ** 2 / d**2
            e = (col - q) / d
            w1[:, i:] -= e.unsqueeze(1).matmul(u1[i, i:].unsqueeze(0))
            err1[:, i] = e
        q_all[:, i1:i2] = q1
        loss += losses1.double().sum() / 2
        w[:, i2:] -= err1.matmul(u[i1:i2, i2:])
    return q_all, float(loss)


def gptq_total(w, h, percdamp, bits, group, block):
    """fasterquant end to end: dead columns zeroed, damping, inverse, column loop."""
    dead = torch.diagonal(h) == 0
    w = w.clone()
    w[:, dead] = 0
    u = inverse_upper(damped(h, percdamp))
    return gptq_loop(w, u, bits, group, block)


# ---------------------------------------------------------------------------------------------
# NVFP4 block-scale search
# ---------------------------------------------------------------------------------------------


def shrink_factors(iters: int, max_shrink: float) -> np.ndarray:
    """`1 − i·max_shrink/iters` in f32 with Rust's operation order
    (`1.0 - i as f32 * max_shrink / iters as f32`)."""
    i = np.arange(iters, dtype=np.float32)
    return np.float32(1.0) - (i * np.float32(max_shrink)) / np.float32(iters)


def e2m1_round(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """The E2M1 value of each element (e2m1_encode_fast: `>` sends a midpoint tie down,
    `>=` up, whichever neighbour has the even mantissa)."""
    a = x.abs()
    index = (
        (a > 0.25).to(torch.int64)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    magnitude = lut[index]
    return torch.where(x < 0, -magnitude, magnitude)


def nvfp4_search(w, diag_h, global_scale, iters, max_shrink, p, chunk):
    """Best E4M3 block scale of every 16-block of `w [rows, cols]`. Candidates are evaluated
    `chunk` at a time, all rows × blocks × candidates × 16 as one tensor expression; the first
    candidate with the smallest error wins. Returns `(scales f32 [rows, cols/16],
    errors f32 [rows, cols/16])`."""
    rows, cols = w.shape
    device = w.device
    blocks = w.reshape(rows, cols // 16, 1, 16)
    hmax = diag_h.max()
    h = diag_h / hmax if float(hmax) > 0 else torch.ones_like(diag_h)
    h = h.reshape(1, cols // 16, 1, 16)
    gs = torch.tensor(global_scale, dtype=torch.float32, device=device)
    init = blocks.abs().amax(dim=-1) / (E2M1_MAX * gs)  # [rows, blocks, 1]
    shrink = torch.from_numpy(shrink_factors(iters, max_shrink)).to(device)
    lut = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    best_err = torch.full(init.shape[:2], math.inf, dtype=torch.float32, device=device)
    best_scale = torch.zeros_like(best_err)
    for c0 in range(0, iters, chunk):
        cand = torch.clamp(init * shrink[c0 : c0 + chunk], E4M3_MIN_POSITIVE, E4M3_MAX)
        cand = cand.to(torch.float8_e4m3fn).to(torch.float32)  # [rows, blocks, C]
        divisor = (cand * gs).unsqueeze(-1)
        deq = e2m1_round(blocks / divisor, lut) * divisor
        diff = (blocks - deq).abs()
        term = diff * diff if p == 2.0 else diff.pow(p)
        err = (term * h).sum(dim=-1)  # [rows, blocks, C]
        chunk_err, chunk_idx = err.min(dim=-1)
        better = chunk_err < best_err
        best_err = torch.where(better, chunk_err, best_err)
        chosen = cand.gather(-1, chunk_idx.unsqueeze(-1)).squeeze(-1)
        best_scale = torch.where(better, chosen, best_scale)
    return best_scale, best_err


def nvfp4_chunk(rows: int, cols: int, iters: int, device: torch.device, asked: int) -> int:
    """Candidates per chunk: `asked` if positive, else as many as fit ~8 temporaries of
    `rows·cols·C` f32 in a quarter of the free device memory (1 GiB on CPU)."""
    if asked > 0:
        return min(asked, iters)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free // 4
    else:
        budget = 1 << 30
    per_candidate = rows * cols * 4 * 8
    return int(max(1, min(iters, budget // per_candidate)))


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


def stage(results: List[Dict[str, Any]], kernel: str, fn: Callable[[], Dict[str, Any]]):
    """Runs one measurement; a failure becomes a row with its error and the run goes on."""
    try:
        row = fn()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, none is fatal
        traceback.print_exc()
        row = record(kernel, error=f"{type(exc).__name__}: {exc}")
        print(f"[{kernel}] FAILED: {row['error']}", flush=True)
    results.append(row)
    return row


def run_shape(spec, manifest, data_dir, device, args) -> Dict[str, Any]:
    """Every torch measurement of one shape."""
    sync = make_sync(device)
    name, out, inp = spec["name"], spec["out"], spec["in"]
    tokens = manifest["tokens"]
    results: List[Dict[str, Any]] = []
    act = read_safetensors(os.path.join(data_dir, spec["activations"]))
    weight = read_safetensors(os.path.join(data_dir, spec["weight"]))
    x = act["x"].to(device)
    h = act["h"].to(device)
    w = weight["w"].to(device)
    assert x.shape == (tokens, inp), f"x has shape {tuple(x.shape)}"
    assert h.shape == (inp, inp) and w.shape == (out, inp)
    hess_flops = 2.0 * tokens * inp * inp
    warm, reps = args.warmup, args.reps

    def hessian_bf16():
        t, ts, _ = timed(lambda: torch.matmul(x.T, x), sync, warm, reps)
        return record("hessian_bf16", t, ts, flops=hess_flops)

    def hessian_f32():
        xf = x.float()
        t, ts, hf = timed(lambda: torch.matmul(xf.T, xf), sync, warm, reps)
        # Self-check: the file's H (bf16 X, f32 accumulation, /tokens) against torch's.
        rel = float((hf / tokens - h).abs().max() / h.abs().max())
        status = "ok" if rel < 1e-3 else "MISMATCH: the inputs or the bf16 decoding differ"
        print(f"  check: max|XᵀX/tokens (torch f32) − H(file)| / max|H| = {rel:.3e} {status}")
        return record("hessian_f32", t, ts, flops=hess_flops, check_rel_err=rel)

    stage(results, "hessian_bf16", hessian_bf16)
    stage(results, "hessian_f32", hessian_f32)
    del x
    percdamp = manifest["percdamp"]
    bits, group, block = manifest["bits"], manifest["group_size"], manifest["block_size"]
    inv_flops = 4.0 * inp**3 / 3.0  # potrf n³/3 + potri 2n³/3 + potrf n³/3
    u_holder = {}

    def inverse():
        hd = damped(h, percdamp)
        t, ts, u = timed(lambda: inverse_upper(hd), sync, warm, reps)
        u_holder["u"] = u
        return record("inverse", t, ts, flops=inv_flops)

    stage(results, "inverse", inverse)
    gptq_flops = float(out) * inp * inp  # the trailing updates, Σ 2·out·128·(in − i2)

    def gptq():
        u = u_holder.get("u")
        if u is None:
            u = inverse_upper(damped(h, percdamp))
        t, ts, (_, loss) = timed(lambda: gptq_loop(w, u, bits, group, block), sync, warm, reps)
        return record("gptq", t, ts, flops=gptq_flops, loss=loss)

    def gptq_full():
        t, ts, (_, loss) = timed(
            lambda: gptq_total(w, h, percdamp, bits, group, block), sync, 0, reps
        )
        return record("gptq_total", t, ts, flops=gptq_flops + inv_flops, loss=loss)

    stage(results, "gptq", gptq)
    u_holder.clear()
    stage(results, "gptq_total", gptq_full)
    crop = min(int(manifest.get("crop_rows", 0)), out)

    def gptq_crop():
        # The first rows alone: the same problem bench_gpu's CPU reference solves
        # (`gptq_cpu_crop`), so the two losses check the algorithms against each other.
        t, ts, (_, loss) = timed(
            lambda: gptq_total(w[:crop], h, percdamp, bits, group, block), sync, 0, 1
        )
        return record("gptq_crop", t, ts, loss=loss, rows=crop)

    if crop > 0:
        stage(results, "gptq_crop", gptq_crop)
    nv = manifest["nvfp4"]
    diag_h = torch.diagonal(h).clone()
    del h

    def nvfp4():
        gs = float(np.float32(spec["global_scale"]))
        amax_gs = float(np.float32(w.abs().max().item()) / np.float32(E2M1_MAX * E4M3_MAX))
        if amax_gs != gs:
            print(f"  note: global scale from W ({amax_gs!r}) differs from the manifest ({gs!r})")
        chunk = nvfp4_chunk(out, inp, nv["iters"], device, args.nvfp4_chunk)
        run = lambda: nvfp4_search(  # noqa: E731
            w, diag_h, gs, nv["iters"], nv["max_shrink"], nv["error_norm"], chunk
        )
        t, ts, (_, err) = timed(run, sync, warm, reps)
        total = float(err.double().sum())
        return record("nvfp4_search", t, ts, loss=total, candidates_per_chunk=chunk)

    stage(results, "nvfp4_search", nvfp4)

    def nvfp4_crop():
        gs = float(np.float32(spec["global_scale"]))
        run = lambda: nvfp4_search(  # noqa: E731
            w[:crop], diag_h, gs, nv["iters"], nv["max_shrink"], nv["error_norm"], nv["iters"]
        )
        t, ts, (_, err) = timed(run, sync, 0, 1)
        return record("nvfp4_crop", t, ts, loss=float(err.double().sum()), rows=crop)

    if crop > 0:
        stage(results, "nvfp4_crop", nvfp4_crop)
    del w, diag_h
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"name": name, "out": out, "in": inp, "results": results}


def ceilings(device: torch.device, args) -> Dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written per second) and the bf16
    8192³ matmul rate."""
    sync = make_sync(device)
    result: Dict[str, Any] = {}
    try:
        n = (args.copy_mib << 20) // 4
        src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        t, ts, _ = timed(lambda: dst.copy_(src), sync, 2, max(args.reps, 5))
        result["copy_bytes"] = 2.0 * n * 4
        result["copy_time_s"] = t
        result["copy_gbps"] = 2.0 * n * 4 / t / 1e9
        del src, dst
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        result["copy_error"] = f"{type(exc).__name__}: {exc}"
    try:
        m = args.matmul_size
        a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
        b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
        t, ts, _ = timed(lambda: a @ b, sync, 2, max(args.reps, 5))
        result["matmul_size"] = m
        result["matmul_time_s"] = t
        result["bf16_matmul_tflops"] = 2.0 * m**3 / t / 1e12
        del a, b
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        result["matmul_error"] = f"{type(exc).__name__}: {exc}"
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="directory written by bench_gpu --data")
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=3, help="timed runs (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--shapes", help="comma-separated shape names (default: all)")
    parser.add_argument("--nvfp4-chunk", type=int, default=0, help="candidates per chunk, 0=auto")
    parser.add_argument("--copy-mib", type=int, default=2048, help="copy ceiling buffer size")
    parser.add_argument("--matmul-size", type=int, default=8192, help="matmul ceiling size")
    parser.add_argument("--skip-ceilings", action="store_true")
    args = parser.parse_args()

    device = torch.device(args.device)
    # Plain f32 everywhere (our cuBLAS path is pedantic FP32 by default).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    manifest = load_manifest(args.data)
    wanted = set(args.shapes.split(",")) if args.shapes else None
    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})"
    )
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {device_name}", flush=True)
    shapes: List[Dict[str, Any]] = []
    ceil: Dict[str, Any] = {}

    def payload() -> Dict[str, Any]:
        return {
            "producer": "torch_gptq.py",
            "device": device_name,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "tf32": False,
            "tokens": manifest["tokens"],
            "ceilings": ceil,
            "shapes": shapes,
        }

    if not args.skip_ceilings:
        # First: quick, and compare.py needs them even if a shape runs out of time.
        ceil.update(ceilings(device, args))
        print(f"ceilings: {ceil}", flush=True)
    for spec in manifest["shapes"]:
        if wanted and spec["name"] not in wanted:
            continue
        print(f"== shape {spec['name']} (out {spec['out']} × in {spec['in']})", flush=True)
        try:
            shapes.append(run_shape(spec, manifest, args.data, device, args))
        except Exception as exc:  # noqa: BLE001 - a shape whose inputs fail is reported
            traceback.print_exc()
            shapes.append(
                {
                    "name": spec["name"],
                    "out": spec["out"],
                    "in": spec["in"],
                    "results": [],
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
        if args.json:  # after every shape, so that a run cut short keeps what it measured
            write_json(args.json, payload())
    rows = []
    for shape in shapes:
        for r in shape["results"]:
            rows.append(
                [
                    shape["name"],
                    r["kernel"],
                    r["time_s"],
                    rate(r["flops"], r["time_s"], 1e12),
                    r["loss"],
                    r["error"],
                ]
            )
    print()
    print_table(["shape", "kernel", "time s", "TFLOP/s", "loss/error", "failure"], rows)
    if ceil:
        print(
            f"ceilings: copy {ceil.get('copy_gbps')} GB/s (read+write), "
            f"bf16 {ceil.get('matmul_size')}³ matmul {ceil.get('bf16_matmul_tflops')} TFLOP/s"
        )
    if args.json:
        write_json(args.json, payload())
        print(f"wrote {args.json}")
    failed = [r for s in shapes for r in s["results"] if r["error"]] + [
        s for s in shapes if s.get("error")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
