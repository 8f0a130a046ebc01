"""Decode a sala-export checkpoint with compressed-tensors, ModelOpt and GPTQModel (CPU) and
compare every quantized linear with our reader's dequantized weight (`ours.safetensors`).

Recipes (docs/formats.md, "Checkpoint formats on disk"):
- GPTQ: compressed-tensors `dequantize(unpack_from_int32(qweight.T, 4, (out, in)), scales.T)`;
  GPTQModel's torch kernel `TorchQuantLinear.dequantize_weight()` with the v1 buffers.
- NVFP4: compressed-tensors `dequantize(unpack_fp4_from_uint8(weight, out, in), weight_scale,
  global_scale=1/weight_scale_2)`; ModelOpt's `NVFP4QTensor.dequantize`.
A library whose API differs from what this script expects is reported as SKIPPED, not passed.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def load_all(directory: Path) -> dict:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def modules(tensors: dict, suffix: str) -> list:
    return sorted(n[: -len(suffix) - 1] for n in tensors if n.endswith("." + suffix))


def ct_args(**kwargs):
    """compressed-tensors >= 0.20 needs explicit QuantizationArgs to dequantize."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**kwargs)


def ct_gptq(t, m, group_size):
    try:  # compressed-tensors 0.20
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError:  # 0.12
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    qweight, scales = t[m + ".qweight"], t[m + ".scales"].float()
    out, inp = qweight.shape[1], t[m + ".g_idx"].shape[0]
    codes = unpack_from_int32(qweight.T.contiguous(), 4, torch.Size((out, inp)))
    args = ct_args(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return dequantize(codes, scales.T.contiguous(), args=args).float()


def gptqmodel_gptq(t, m, group_size):
    from gptqmodel.nn_modules.qlinear.torch import TorchQuantLinear

    qweight = t[m + ".qweight"]
    out, inp = qweight.shape[1], t[m + ".g_idx"].shape[0]
    layer = TorchQuantLinear(bits=4, group_size=group_size, sym=True, desc_act=False,
                             in_features=inp, out_features=out, bias=False)
    layer.qweight.copy_(qweight)
    layer.qzeros.copy_(t[m + ".qzeros"])
    layer.scales.copy_(t[m + ".scales"])
    layer.g_idx.copy_(t[m + ".g_idx"])
    layer.post_init()
    return layer.dequantize_weight().T.float()


def ct_nvfp4(t, m, _):
    try:  # compressed-tensors 0.20
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    except ImportError:  # 0.12
        from compressed_tensors.compressors.quantized_compressors.fp4_quantized import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    w = t[m + ".weight"]
    out, inp = w.shape[0], w.shape[1] * 2
    codes = unpack_fp4_from_uint8(w, out, inp, torch.float32)
    gs = 1.0 / t[m + ".weight_scale_2"].float().reshape(1)
    args = ct_args(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16)
    return dequantize(codes, t[m + ".weight_scale"].float(), args=args, global_scale=gs).float()


def modelopt_nvfp4(t, m, _):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = t[m + ".weight"]
    out, inp = w.shape[0], w.shape[1] * 2
    q = NVFP4QTensor(torch.Size((out, inp)), torch.float32, w)
    return q.dequantize(scale=t[m + ".weight_scale"], double_scale=t[m + ".weight_scale_2"],
                        block_sizes={-1: 16}).float()


def main(directory: str, ours_file: str) -> int:
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    tensors = load_all(directory)
    with safe_open(ours_file, framework="pt") as f:
        ours = {n: f.get_tensor(n) for n in f.keys()}
    if config["quant_method"] == "gptq":
        names, readers = modules(tensors, "qweight"), [("compressed-tensors", ct_gptq, 0.0), ("gptqmodel", gptqmodel_gptq, 0.0)]
    else:
        # compressed-tensors divides by the reciprocal global scale (`scale / (1/weight_scale_2)`)
        # where ModelOpt multiplies: one rounding apart, so 2 ulps of relative slack for it.
        names, readers = modules(tensors, "weight_scale"), [("compressed-tensors", ct_nvfp4, 2.0**-22), ("modelopt", modelopt_nvfp4, 0.0)]
    group_size = config.get("group_size", 16)
    failed = False
    for label, reader, tolerance in readers:
        worst, worst_rel, status = 0.0, 0.0, "PASS"
        try:
            for m in names:
                theirs, mine = reader(tensors, m, group_size), ours[m + ".weight"]
                diff = (theirs - mine).abs()
                worst = max(worst, diff.max().item())
                worst_rel = max(worst_rel, (diff / mine.abs().clamp_min(1e-30)).max().item())
            if worst_rel > tolerance:
                status, failed = "FAIL", True
        except Exception as e:  # an API we do not know: report, never count as a pass
            status = f"SKIPPED ({type(e).__name__}: {e})"
        print(f"{directory.name}: {label}: {len(names)} linears, max |theirs - ours| = {worst}, "
              f"max relative {worst_rel:.3g} (allowed {tolerance:.3g}) -> {status}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
