"""NVIDIA ModelOpt NVFP4 weight quantization on CPU over the same calibration tokens as ours,
timed, written as a plain HF model directory whose linear weights are ModelOpt's fake-quantized
(dequantized) weights, so that score.py scores it like any unquantized model.

    python run_modelopt.py --model HF_DIR --calib-tokens calib_tokens.json --output OUT_DIR \
        --config NVFP4_DEFAULT_CFG [--dtype bf16|f32] [--threads 2] [--export-dir NVFP4_DIR]
    python run_modelopt.py --list          # the NVFP4 presets and recipes this ModelOpt offers

--config is a preset of `modelopt.torch.quantization` (an attribute such as NVFP4_DEFAULT_CFG,
NVFP4_AWQ_LITE_CFG, NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG) or `recipe:PATH`, a PTQ recipe of the
installed `modelopt_recipes` (e.g. `recipe:general/ptq/nvfp4_default-kv_none-gptq`), loaded with
`modelopt.recipe.load_recipe`. Whatever the preset says for activations, only WEIGHTS are
quantized here: entries disabling `*input_quantizer`, `*output_quantizer` and the KV-cache and
attention quantizers (`*[kv]_bmm_quantizer`, `*q_bmm_quantizer`, `*softmax_quantizer`) are
appended to the preset's `quant_cfg` (later entries win), and the script checks afterwards that
only weight quantizers are enabled. The preset's algorithm (max, awq_lite, awq_clip, awq_full,
mse, local_hessian, gptq ...) is kept as it is. A layerwise `checkpoint_dir` of a recipe is
dropped (it would write into the current directory). A failing `mtq.quantize` (ModelOpt 0.47
needs CUDA for NVFP4 fake quantization, which every calibration algorithm but max runs) is
recorded with its error and traceback, exit status 1.

Calibration: the token windows of calib_tokens.json (make_data.py: the ids our reader gets from
calib.jsonl, what run_gptqmodel.py gives GPTQModel), one window per forward, batch size 1, no
padding, with the model in `--calib-dtype` (default bf16: the dtype GPTQModel and ModelOpt's own
examples load the model in).

Export: ModelOpt's own `export_hf_checkpoint` writes the NVFP4 checkpoint it would ship
(`--export-dir`, default OUTPUT.nvfp4; W4A16_NVFP4 with the inputs disabled), and
dequant_nvfp4.py, the decoder used for our checkpoint too, writes OUTPUT: a plain HF directory
with the decoded weights in `--dtype` (bf16 by default; f32 keeps them exact), checked against
ModelOpt's `NVFP4QTensor.dequantize` (`decoded.max_abs_diff_vs_modelopt_NVFP4QTensor_dequantize`).
Where ModelOpt can fake-quantize on the machine, its in-memory fake-quantized weights are compared
with the decoded export too (`fakequant_vs_export`; otherwise the reason it was skipped).

Writes OUTPUT, the export, and OUTPUT/../<name>.modelopt.json: the config as applied, wall times
(load, quantize, export, decode, script), peak RSS, versions, the quantizer counts and the checks.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import sys
import time
import traceback
from pathlib import Path

T_START = time.perf_counter()

# Appended to every preset's quant_cfg: weight quantization only, no KV cache quantization.
WEIGHT_ONLY_OVERRIDES = [
    {"quantizer_name": "*input_quantizer", "enable": False},
    {"quantizer_name": "*output_quantizer", "enable": False},
    {"quantizer_name": "*[kv]_bmm_quantizer", "enable": False},
    {"quantizer_name": "*q_bmm_quantizer", "enable": False},
    {"quantizer_name": "*softmax_quantizer", "enable": False},
]

def list_configs() -> dict:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.opt.config_loader import BUILTIN_CONFIG_ROOT

    presets = sorted(n for n in dir(mtq) if n.endswith("_CFG") and "FP4" in n.upper())
    recipes = []
    ptq = BUILTIN_CONFIG_ROOT.joinpath("general/ptq")
    if ptq.is_dir():
        recipes = sorted("general/ptq/" + p.name.rsplit(".", 1)[0] for p in ptq.iterdir()
                         if p.name.endswith((".yml", ".yaml")) and "fp4" in p.name)
    return {"presets": presets, "recipes": recipes}


def build_config(name: str) -> tuple[dict, str]:
    """The preset or recipe as a plain dict {quant_cfg, algorithm}, with the weight-only overrides."""
    import modelopt.torch.quantization as mtq

    if name.startswith("recipe:"):
        from modelopt.recipe import load_recipe

        recipe = load_recipe(name.split(":", 1)[1])
        cfg = recipe.quantize.model_dump(exclude_unset=True)
        source = f"modelopt.recipe.load_recipe({name.split(':', 1)[1]!r})"
    else:
        if not hasattr(mtq, name):
            sys.exit(f"error: modelopt.torch.quantization has no {name} (see --list)")
        cfg = copy.deepcopy(getattr(mtq, name))
        source = f"modelopt.torch.quantization.{name}"
    cfg = copy.deepcopy(dict(cfg))  # no JSON round trip: block_sizes has int keys (-1)
    algo = cfg.get("algorithm")
    if isinstance(algo, dict) and isinstance(algo.get("layerwise"), dict):
        algo["layerwise"].pop("checkpoint_dir", None)
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(WEIGHT_ONLY_OVERRIDES)
    return cfg, source


def _jsonable(o):
    if hasattr(o, "model_dump"):
        return o.model_dump()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def quantized_linears(model) -> dict:
    return {n: m for n, m in model.named_modules()
            if hasattr(m, "weight_quantizer") and hasattr(m, "weight") and m.weight is not None}


def quantizer_counts(model) -> dict:
    from modelopt.torch.quantization.nn import TensorQuantizer

    counts = {}
    for n, m in model.named_modules():
        if isinstance(m, TensorQuantizer):
            kind = n.rsplit(".", 1)[-1]
            c = counts.setdefault(kind, {"enabled": 0, "disabled": 0})
            c["enabled" if m.is_enabled else "disabled"] += 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--calib-tokens", type=Path, help="calib_tokens.json (make_data.py)")
    ap.add_argument("--output", type=Path)
    ap.add_argument("--config", help="a modelopt.torch.quantization preset name, or recipe:PATH")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16", help="dtype of the written weights")
    ap.add_argument("--calib-dtype", choices=["bf16", "f32"], default="bf16", help="model dtype while calibrating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-samples", type=int, default=None, help="first N calibration windows only")
    ap.add_argument("--export-dir", type=Path, default=None,
                    help="where ModelOpt's NVFP4 checkpoint goes (default: OUTPUT.nvfp4 beside OUTPUT)")
    ap.add_argument("--list", action="store_true", help="print the NVFP4 presets and recipes and exit")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.list:
        print(json.dumps(list_configs(), indent=2))
        return 0
    for a in ("model", "calib_tokens", "output", "config"):
        if getattr(args, a) is None:
            ap.error(f"--{a.replace('_', '-')} is required")
    if args.output.exists():
        sys.exit(f"error: {args.output} exists; remove it first")
    windows = json.loads(args.calib_tokens.read_text())[: args.max_samples]
    if not windows or not all(isinstance(w, list) and w for w in windows):
        sys.exit(f"error: {args.calib_tokens}: expected a JSON list of non-empty token lists")

    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from transformers import AutoModelForCausalLM

    record = {
        "quantizer": "nvidia-modelopt",
        "modelopt": modelopt.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "config_name": args.config,
        "calib_dtype": args.calib_dtype,
        "export_dtype": args.dtype,
        "calibration": {"windows": len(windows), "tokens": sum(len(w) for w in windows), "batch_size": 1},
        "cuda_available": torch.cuda.is_available(),
    }
    rec_path = args.output.parent / f"{args.output.name}.modelopt.json"
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def write_record():
        record["seconds"] = record.get("seconds", {}) | {"script": round(time.perf_counter() - T_START, 2)}
        record["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        rec_path.write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")

    cfg, source = build_config(args.config)
    record["config_source"] = source
    record["config_applied"] = cfg
    cdtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.calib_dtype]

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=cdtype).eval()
    record["seconds"] = {"load": round(time.perf_counter() - t0, 2)}

    def forward_loop(m):
        with torch.no_grad():
            for w in windows:
                m(input_ids=torch.tensor([w], dtype=torch.long))

    t0 = time.perf_counter()
    try:
        model = mtq.quantize(model, cfg, forward_loop)
    except Exception as e:  # recorded, so a recipe that needs CUDA says why
        record["seconds"]["quantize_failed_after"] = round(time.perf_counter() - t0, 2)
        record["error"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()
        write_record()
        print(record["traceback"], file=sys.stderr)
        print(f"error: mtq.quantize failed with {args.config}: {record['error']}", file=sys.stderr)
        return 1
    record["seconds"]["quantize"] = round(time.perf_counter() - t0, 2)
    record["quantizers"] = quantizer_counts(model)
    for kind, c in record["quantizers"].items():
        if kind != "weight_quantizer" and c["enabled"]:
            sys.exit(f"error: {c['enabled']} {kind}s are enabled; this script quantizes weights only")
    try:
        mtq.print_quant_summary(model)
    except Exception as e:  # the summary is informational
        print(f"(print_quant_summary failed: {e})")

    # ModelOpt's own export: the NVFP4 checkpoint it would ship (packed E2M1, E4M3 block
    # scales, weight_scale_2; q/k/v and gate/up share weight_scale_2 as its exporter makes them).
    from modelopt.torch.export import export_hf_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dequant_nvfp4 import dequantize_dir

    export_dir = args.export_dir or args.output.parent / f"{args.output.name}.nvfp4"
    if export_dir.exists():
        shutil.rmtree(export_dir)
    t0 = time.perf_counter()
    try:
        export_hf_checkpoint(model, export_dir=str(export_dir))
    except Exception as e:
        record["error"] = f"export_hf_checkpoint: {type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()
        write_record()
        print(record["traceback"], file=sys.stderr)
        return 1
    record["seconds"]["export_hf_checkpoint"] = round(time.perf_counter() - t0, 2)
    hq = export_dir / "hf_quant_config.json"
    record["exported"] = {"dir": str(export_dir),
                          "hf_quant_config": json.loads(hq.read_text()) if hq.is_file() else None}

    # Decoded with the same decoder as our checkpoint (dequant_nvfp4.py), checked against
    # ModelOpt's NVFP4QTensor.dequantize.
    t0 = time.perf_counter()
    info = dequantize_dir(export_dir, args.model, args.output, args.dtype, modelopt_check=True)
    weights = info.pop("_weights")
    rel = info.pop("rel_frobenius_error_vs_reference")
    info["rel_frobenius_error_example"] = {k: rel[k] for k in list(rel)[:2]}
    record["decoded"] = info
    record["seconds"]["decode"] = round(time.perf_counter() - t0, 2)

    # ModelOpt's in-memory fake-quantized weights against the decoded export, where ModelOpt can
    # fake-quantize on this machine (0.47 needs CUDA for NVFP4 fake quantization: then recorded).
    check = {}
    with torch.no_grad():
        worst, n = 0.0, 0
        try:
            for name, m in quantized_linears(model).items():
                if not m.weight_quantizer.is_enabled:
                    continue
                q = m.weight_quantizer(m.weight.detach().to(torch.float32)).to(torch.float32)
                s = getattr(m.input_quantizer, "pre_quant_scale", None) if hasattr(m, "input_quantizer") else None
                if s is not None:
                    q = q * s.to(torch.float32).reshape(1, -1)
                e = weights[name + ".weight"]
                worst = max(worst, ((q - e).norm() / e.norm()).item())
                n += 1
            check = {"linears": n, "max_rel_frobenius_fakequant_vs_export": worst}
        except Exception as e:
            check = {"skipped": f"{type(e).__name__}: {e}"}
    record["fakequant_vs_export"] = check
    print("fake-quant vs export:", json.dumps(check))

    write_record()
    print(json.dumps({k: v for k, v in record.items() if k != "config_applied"}, indent=2, default=_jsonable))
    return 0


if __name__ == "__main__":
    sys.exit(main())
