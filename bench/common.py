"""Helpers shared by the benchmark scripts: reading the inputs `bench_gpu` wrote, one timing
helper, one table printer, one result record.

Only the standard library, numpy and torch are needed (the `safetensors` package is not: the
format is an 8-byte header length, a JSON header and the raw little-endian tensors).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import struct
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

# safetensors dtype -> (numpy dtype of the raw bytes, bytes per element)
_RAW_DTYPES = {
    "F32": (np.float32, 4),
    "F64": (np.float64, 8),
    "BF16": (np.uint16, 2),  # numpy has no bfloat16: reinterpreted by torch below
    "F16": (np.float16, 2),
    "U8": (np.uint8, 1),
    "I32": (np.int32, 4),
}


def read_safetensors(path: str) -> Dict[str, Any]:
    """All tensors of a safetensors file as torch CPU tensors (bf16 stays bf16)."""
    import torch

    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = meta["dtype"], meta["shape"]
        if dtype not in _RAW_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        np_dtype, size = _RAW_DTYPES[dtype]
        begin, end = meta["data_offsets"]
        expected = size * math.prod(shape)
        if end - begin != expected:
            raise ValueError(
                f"{path}: tensor {name} holds {end - begin} bytes, shape {shape} needs {expected}"
            )
        array = np.array(data[begin:end]).view(np_dtype).reshape(shape)
        tensor = torch.from_numpy(array)
        if dtype == "BF16":
            tensor = tensor.view(torch.int16).view(torch.bfloat16)
        tensors[name] = tensor
    return tensors


def write_safetensors(path: str, tensors: Dict[str, Any]) -> None:
    """Writes torch CPU tensors (f32, bf16, u8) as safetensors (used by the test-data maker)."""
    import torch

    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        raw = (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()
        blob = raw.tobytes()
        header[name] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    encoded += b" " * ((8 - len(encoded) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


def load_manifest(data_dir: str) -> Dict[str, Any]:
    """The `manifest.json` that `bench_gpu --data DIR` writes (see that example's docs)."""
    path = os.path.join(data_dir, "manifest.json")
    with open(path) as f:
        return json.load(f)


def timed(fn: Callable[[], Any], sync: Callable[[], None], warmup: int, reps: int):
    """Median wall time in seconds of `fn` over `reps` runs after `warmup` runs, each run
    bracketed by `sync` (the device is idle when the clock starts and when it stops).
    Returns `(median, all times, result of the last run)`."""
    result = None
    for _ in range(warmup):
        result = fn()
    sync()
    times = []
    for _ in range(max(reps, 1)):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def record(
    kernel: str,
    time_s: Optional[float] = None,
    times_s: Optional[Sequence[float]] = None,
    flops: Optional[float] = None,
    bytes_moved: Optional[float] = None,
    loss: Optional[float] = None,
    error: Optional[str] = None,
    **extra: Any,
) -> Dict[str, Any]:
    """One result row, the same record `bench_gpu` writes: `time_s` is the median in seconds,
    `flops`/`bytes` the work of one run (to derive TFLOP/s and GB/s), `loss` the algorithm's
    objective (GPTQ loss or weighted NVFP4 error), `error` the failure message if it failed."""
    row = {
        "kernel": kernel,
        "time_s": time_s,
        "times_s": list(times_s) if times_s is not None else None,
        "flops": flops,
        "bytes": bytes_moved,
        "loss": loss,
        "error": error,
    }
    row.update(extra)
    return row


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: numbers with `digits` significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return str(value)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Prints an aligned text table."""
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def rate(amount: Optional[float], seconds: Optional[float], unit: float) -> Optional[float]:
    """`amount / seconds / unit` (e.g. unit 1e12 for TFLOP/s), None when unknown."""
    if amount is None or not seconds:
        return None
    return amount / seconds / unit


def write_json(path: str, payload: Dict[str, Any]) -> None:
    """Writes `payload` as indented JSON (creating the parent directory)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
