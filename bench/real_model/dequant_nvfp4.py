"""Decodes an NVFP4 checkpoint in ModelOpt's layout (ours, or one ModelOpt's `export_hf_checkpoint`
wrote) into a plain HF model directory that score.py scores like any unquantized model.

    python dequant_nvfp4.py --checkpoint NVFP4_DIR --reference HF_DIR --output OUT_DIR \
        [--dtype bf16|f32] [--check-dump DEQUANT.safetensors] [--modelopt-check]

Layout (docs/formats.md, crates/sala-formats/src/nvfp4.rs): per quantized linear `weight` uint8
[out, in/2] with E2M1 codes, element 2j in the LOW nibble of byte j and 2j+1 in the high nibble;
`weight_scale` float8_e4m3fn [out, in/16], one scale per 16 input columns; `weight_scale_2` f32
scalar that multiplies. Dequantization, in f32 and in the order of our Rust reader (so the result
is bit-identical to it): d = f32(weight_scale) · weight_scale_2, w = E2M1[code] · d. A
`pre_quant_scale` [in] (ModelOpt's AWQ export, when it is not folded into a norm) is folded into
the columns: W_eff = W · diag(s). `input_scale` is ignored (weights only). Every other tensor
(embeddings, norms: SmoothQuant changes the norms of our checkpoint) is taken from the
checkpoint as it is. The written directory gets the reference's config.json (no
quantization_config) and tokenizer files; the tensor names and shapes must be those of the
reference, or the script stops.

--check-dump FILE: compares with a dump of dequantized weights (our `verify_checkpoint DIR
--dump-dequantized FILE`, one f32 tensor per linear named like the linear or its weight) and
prints the largest difference. --modelopt-check: also decodes each linear with ModelOpt's
`NVFP4QTensor.dequantize` (needs modelopt installed) and prints the largest difference.
Everything is also returned by `dequantize_dir` for callers (run_modelopt.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
BLOCK = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        sys.exit(f"error: {directory}: no .safetensors file")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """f32 [out, in] from packed codes [out, in/2], E4M3 scales [out, in/16], f32 scalar."""
    if weight.dtype != torch.uint8:
        raise ValueError(f"weight dtype {weight.dtype}, expected uint8")
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight_scale dtype {weight_scale.dtype}, expected float8_e4m3fn")
    out, half = weight.shape
    cols = 2 * half
    if tuple(weight_scale.shape) != (out, cols // BLOCK):
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)}, expected {(out, cols // BLOCK)}")
    w = weight.to(torch.int64)
    codes = torch.stack([w & 0xF, w >> 4], dim=-1).reshape(out, cols)  # low nibble = even element
    d = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32).reshape(())
    return E2M1[codes] * d.repeat_interleave(BLOCK, dim=1)


def dequantize_dir(checkpoint: Path, reference: Path, output: Path | None, dtype: str = "bf16",
                   modelopt_check: bool = False) -> dict:
    """Decodes `checkpoint` into `output` (when given); returns the facts (tensor counts, checks)."""
    from safetensors.torch import save_file

    t = load_tensors(checkpoint)
    ref = load_tensors(reference)
    linears = sorted(k[: -len(".weight_scale")] for k in t if k.endswith(".weight_scale"))
    weights: dict[str, torch.Tensor] = {}
    info = {"checkpoint": str(checkpoint), "quantized_linears": len(linears), "pre_quant_scale_folded": 0,
            "ignored": [], "rel_frobenius_error_vs_reference": {}, "non_quantized_differing_from_reference": []}
    worst_mo = 0.0
    for m in linears:
        w = dequantize_nvfp4(t[m + ".weight"], t[m + ".weight_scale"], t[m + ".weight_scale_2"])
        if m + ".pre_quant_scale" in t:
            w = w * t[m + ".pre_quant_scale"].to(torch.float32).reshape(1, -1)
            info["pre_quant_scale_folded"] += 1
        if modelopt_check:
            from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

            q = NVFP4QTensor(torch.Size(w.shape), torch.float32, t[m + ".weight"])
            mo = q.dequantize(scale=t[m + ".weight_scale"], double_scale=t[m + ".weight_scale_2"],
                              block_sizes={-1: BLOCK}).float()
            if m + ".pre_quant_scale" in t:
                mo = mo * t[m + ".pre_quant_scale"].to(torch.float32).reshape(1, -1)
            worst_mo = max(worst_mo, (mo - w).abs().max().item())
        weights[m + ".weight"] = w
        if m + ".weight" in ref:
            r = ref[m + ".weight"].to(torch.float32)
            info["rel_frobenius_error_vs_reference"][m] = ((w - r).norm() / r.norm()).item()
    done = {m + s for m in linears for s in (".weight", ".weight_scale", ".weight_scale_2", ".pre_quant_scale")}
    for k, v in t.items():
        if k in done:
            continue
        if k.endswith((".input_scale", ".k_scale", ".v_scale")):
            info["ignored"].append(k)
            continue
        if v.dtype in (torch.uint8, torch.float8_e4m3fn):
            sys.exit(f"error: {checkpoint}: {k} ({v.dtype}) is not a tensor this decoder knows")
        weights[k] = v.to(torch.float32)
        if k in ref and not torch.equal(ref[k].to(torch.float32), weights[k]):
            info["non_quantized_differing_from_reference"].append(k)
    missing = sorted(set(ref) - set(weights))
    extra = sorted(set(weights) - set(ref))
    if missing or extra:
        sys.exit(f"error: {checkpoint}: tensor names differ from {reference}: missing {missing[:5]}, extra {extra[:5]}")
    for k in ref:
        if tuple(ref[k].shape) != tuple(weights[k].shape):
            sys.exit(f"error: {k}: shape {tuple(weights[k].shape)}, reference {tuple(ref[k].shape)}")
    rel = info["rel_frobenius_error_vs_reference"]
    if rel:
        info["rel_frobenius_error_summary"] = {"mean": sum(rel.values()) / len(rel), "max": max(rel.values()),
                                               "min": min(rel.values())}
    if modelopt_check:
        info["max_abs_diff_vs_modelopt_NVFP4QTensor_dequantize"] = worst_mo
    info["_weights"] = weights
    if output is not None:
        tdtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
        output.mkdir(parents=True, exist_ok=False)
        save_file({k: v.to(tdtype).contiguous() for k, v in weights.items()}, str(output / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = json.loads((reference / "config.json").read_text())
        cfg.pop("quantization_config", None)
        cfg["dtype"] = {"bf16": "bfloat16", "f32": "float32"}[dtype]
        cfg.pop("torch_dtype", None)
        (output / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for f in TOKENIZER_FILES:
            if (reference / f).is_file():
                shutil.copy2(reference / f, output / f)
        record = {k: v for k, v in info.items() if k != "_weights"} | {"dtype": dtype}
        (output / "dequant_nvfp4.json").write_text(json.dumps(record, indent=2) + "\n")
    return info


def compare_dump(weights: dict[str, torch.Tensor], dump: Path) -> dict:
    """Largest |ours_python - dump| over the dump's tensors that name a decoded linear."""
    from safetensors import safe_open

    worst, n, exact = 0.0, 0, 0
    with safe_open(str(dump), "pt") as st:
        for k in st.keys():
            name = k if k in weights else (k + ".weight" if k + ".weight" in weights else None)
            if name is None:
                continue
            d = st.get_tensor(k).to(torch.float32)
            w = weights[name]
            if d.shape != w.shape and d.t().shape == w.shape:
                d = d.t()
            diff = (d - w).abs().max().item()
            worst = max(worst, diff)
            exact += int(torch.equal(d, w))
            n += 1
    return {"dump": str(dump), "tensors_compared": n, "bit_identical": exact, "max_abs_diff": worst}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--reference", required=True, type=Path, help="the original HF model directory")
    ap.add_argument("--output", type=Path, default=None, help="plain HF directory to write (none: checks only)")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--check-dump", type=Path, default=None)
    ap.add_argument("--modelopt-check", action="store_true")
    args = ap.parse_args()
    if args.output is not None and args.output.exists():
        sys.exit(f"error: {args.output} exists; remove it first")
    info = dequantize_dir(args.checkpoint, args.reference, args.output, args.dtype, args.modelopt_check)
    if args.check_dump is not None:
        info["check_dump"] = compare_dump(info["_weights"], args.check_dump)
    info.pop("_weights")
    rel = info.pop("rel_frobenius_error_vs_reference")
    by_kind = {}
    for k, v in rel.items():
        by_kind.setdefault(k.rsplit(".", 1)[-1], []).append(v)
    info["rel_frobenius_error_by_linear_kind"] = {k: {"mean": sum(v) / len(v), "max": max(v)} for k, v in sorted(by_kind.items())}
    info["ignored"] = f"{len(info['ignored'])} tensors: " + ", ".join(sorted({k.rsplit('.', 1)[-1] for k in info["ignored"]}))
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
