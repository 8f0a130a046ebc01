"""GPTQModel's GPTQ W4A16 on CPU over the same calibration tokens as ours, timed, saved as an
AutoGPTQ-layout checkpoint (qweight/qzeros/scales/g_idx, checkpoint_format gptq).

    GPTQMODEL_CPU_WORKERS=2 python run_gptqmodel.py --model HF_DIR --calib-tokens calib_tokens.json \
        --output CKPT_DIR [--group-size 128|64] [--gar] [--threads 2]

Settings: bits 4, group size 128 (or 64), sym, desc_act false, GPTQModel's default damping
(damp_percent 0.05, auto-increment 0.01); MSE clipping off (its default); the calibration
windows as given (token ids from make_data.py, batch size 1, no concatenation, no padding).
GPTQModel 7.x turns on "act_group_aware" (GAR: a group-preserving activation reordering while
solving, still saved with desc_act false) by default for GPTQ; here it is off unless `--gar`,
so that the comparison is with plain GPTQ in column order, as ours runs. offload_to_disk is
off (the model is small; offloading measures the disk, not the solver).

Writes CKPT_DIR (model.safetensors, config.json with quantization_config, tokenizer files) and
CKPT_DIR/../<name>.timing.json: wall time of the quantize() call, of save(), of the whole
script, peak RSS of the process, versions, settings, and the layout of one quantized linear
(qweight/qzeros/scales/g_idx shapes and g_idx's groups) so the partial-group handling can be read.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

T_START = time.perf_counter()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--calib-tokens", required=True, type=Path, help="calib_tokens.json (make_data.py)")
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    ap.add_argument("--gar", action="store_true", help="GPTQModel's default act_group_aware reordering")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument(
        "--gptaq",
        type=float,
        metavar="ALPHA",
        help="asymmetric calibration (GPTQModel's GPTAQConfig, alpha 0.25 recommended)",
    )
    args = ap.parse_args()

    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(args.threads))
    if args.output.exists():
        sys.exit(f"error: {args.output} exists; remove it first")
    if not (args.model / "config.json").is_file():
        sys.exit(f"error: {args.model}: no config.json (run convert.py first)")
    windows = json.loads(args.calib_tokens.read_text())
    if not windows or not all(isinstance(w, list) and w for w in windows):
        sys.exit(f"error: {args.calib_tokens}: expected a JSON list of non-empty token lists")

    import torch

    torch.set_num_threads(args.threads)
    t_import = time.perf_counter()
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    import gptqmodel

    gptaq = None
    if args.gptaq is not None:
        from gptqmodel.quantization.config import GPTAQConfig

        gptaq = GPTAQConfig(alpha=args.gptaq, device="cpu")

    import_s = time.perf_counter() - t_import

    qcfg = QuantizeConfig(
        bits=4,
        group_size=args.group_size,
        sym=True,
        desc_act=False,
        act_group_aware=args.gar,
        offload_to_disk=False,
        device="cpu",
        gptaq=gptaq,
    )
    t0 = time.perf_counter()
    model = GPTQModel.load(str(args.model), qcfg, dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    calibration = [{"input_ids": w, "attention_mask": [1] * len(w)} for w in windows]

    t0 = time.perf_counter()
    model.quantize(calibration, batch_size=1, calibration_sort=None, backend=BACKEND.TORCH)
    quantize_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save(str(args.output))
    save_s = time.perf_counter() - t0

    layout = describe_layout(args.output)
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    record = {
        "quantizer": "gptqmodel",
        "gptqmodel": gptqmodel.__version__,
        "torch": torch.__version__,
        "threads": args.threads,
        "cpu_workers": os.environ.get("GPTQMODEL_CPU_WORKERS"),
        "settings": {
            "bits": 4,
            "group_size": args.group_size,
            "sym": True,
            "desc_act": False,
            "act_group_aware": args.gar,
            "damp_percent": qcfg.damp_percent,
            "damp_auto_increment": qcfg.damp_auto_increment,
            "mse": getattr(qcfg, "mse", None),
            "true_sequential": qcfg.true_sequential,
            "gptaq_alpha": args.gptaq,
        },
        "calibration": {"windows": len(windows), "tokens": sum(len(w) for w in windows)},
        "seconds": {
            "import": round(import_s, 2),
            "load": round(load_s, 2),
            "quantize": round(quantize_s, 2),
            "save": round(save_s, 2),
            "script": round(time.perf_counter() - T_START, 2),
        },
        "peak_rss_mb": round(rss_kb / 1024, 1),
        "layout": layout,
    }
    out = args.output.parent / f"{args.output.name}.timing.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


def describe_layout(ckpt: Path) -> dict:
    """Shapes of one attention input linear (576 columns) and of down_proj, and g_idx's groups."""
    from safetensors import safe_open

    files = sorted(ckpt.glob("*.safetensors"))
    info = {}
    cfg = json.loads((ckpt / "config.json").read_text())
    info["quantization_config"] = cfg.get("quantization_config")
    for f in files:
        with safe_open(str(f), "pt") as st:
            for prefix in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
                if f"{prefix}.qweight" not in st.keys():
                    continue
                d = {}
                for t in ("qweight", "qzeros", "scales", "g_idx"):
                    x = st.get_tensor(f"{prefix}.{t}")
                    d[t] = {"shape": list(x.shape), "dtype": str(x.dtype)}
                g = st.get_tensor(f"{prefix}.g_idx")
                groups = {int(k): int(v) for k, v in zip(*g.unique(return_counts=True))}
                d["g_idx_columns_per_group"] = groups
                qz = st.get_tensor(f"{prefix}.qzeros")
                d["qzeros_distinct_int32"] = sorted({int(v) for v in qz.flatten().unique()})[:4]
                info[prefix] = d
            info.setdefault("tensor_names_sample", sorted(st.keys())[:12])
    return info


if __name__ == "__main__":
    sys.exit(main())
