"""Round-to-nearest INT4 baseline and an independent AutoGPTQ-v1 dequantizer, in torch.

    python rtn.py --model HF_DIR --output RTN_DIR [--group-size 128] [--bits 4]

writes a dequantized copy of HF_DIR (f32 safetensors) whose decoder linears (q/k/v/o,
gate/up/down) went through plain RTN on GPTQ's symmetric grid: per output row and group of
`group-size` input columns (the last group of a 576-column input holds 64), scale = 2·max|w| / 15
rounded to fp16 (as a GPTQ checkpoint stores it), zero point 8, codes clamp(round(w/scale) + 8,
0, 15), weight (code − 8)·scale. Embeddings, norms and the tied lm_head stay as they are, as in
the GPTQ checkpoints. It shares no code with our tool (whose `--rtn` is the other RTN row).

score.py imports `rtn_model` (to build the baseline in memory) and `dequantize_gptq_v1` (to read
any AutoGPTQ-layout checkpoint into exact f32 weights, independently of gptqmodel's kernels).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_weight(w: torch.Tensor, group_size: int, bits: int = 4) -> torch.Tensor:
    """RTN of `w` [out, in] on the symmetric GPTQ grid, groups along `in`; returns f32."""
    w = w.detach().to(torch.float32)
    out_f, in_f = w.shape
    maxq = 2**bits - 1
    zero = (maxq + 1) / 2
    res = torch.empty_like(w)
    for start in range(0, in_f, group_size):
        g = w[:, start : start + group_size]
        xmax = torch.maximum(g.max(dim=1).values.clamp(min=0), -g.min(dim=1).values.clamp(max=0))
        xmax = torch.where(xmax == 0, torch.ones_like(xmax), xmax)
        scale = (2 * xmax / maxq).to(torch.float16).to(torch.float32).unsqueeze(1)
        q = torch.clamp(torch.round(g / scale) + zero, 0, maxq)
        res[:, start : start + group_size] = (q - zero) * scale
    return res


def rtn_model(model: torch.nn.Module, group_size: int, bits: int = 4) -> int:
    """Replaces, in place, every decoder linear's weight by its RTN dequantization (f32).
    Returns the number of linears."""
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEARS:
            module.weight.data = rtn_weight(module.weight.data, group_size, bits).to(module.weight.dtype)
            n += 1
    return n


def unpack_int32(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """AutoGPTQ packing: value k of an int32 holds bits [bits·k, bits·(k+1)); unpacked along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    x = x.to(torch.int32)
    if dim == 0:  # qweight [in/per, out] -> [in, out]
        v = (x.unsqueeze(1) >> shifts.view(1, per, 1)) & (2**bits - 1)
        return v.reshape(x.shape[0] * per, x.shape[1])
    v = (x.unsqueeze(2) >> shifts.view(1, 1, per)) & (2**bits - 1)  # qzeros [g, out/per] -> [g, out]
    return v.reshape(x.shape[0], x.shape[1] * per)


def dequantize_gptq_v1(qweight, qzeros, scales, g_idx, bits: int, out_features: int, in_features: int) -> torch.Tensor:
    """Weight [out, in] in f32 from AutoGPTQ v1 tensors (qzeros store zero − 1)."""
    q = unpack_int32(qweight, bits, 0)[:in_features, :out_features].to(torch.float32)
    z = (unpack_int32(qzeros, bits, 1)[:, :out_features] + 1).to(torch.float32)
    s = scales.to(torch.float32)[:, :out_features]
    g = g_idx.to(torch.long)[:in_features]
    w = (q - z[g]) * s[g]
    return w.t().contiguous()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args()
    if args.output.exists():
        sys.exit(f"error: {args.output} exists; remove it first")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    n = rtn_model(model, args.group_size, args.bits)
    model.save_pretrained(args.output)
    AutoTokenizer.from_pretrained(args.model).save_pretrained(args.output)
    print(f"wrote {args.output}: {n} linears RTN INT{args.bits} sym group {args.group_size} (f32, dequantized)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
