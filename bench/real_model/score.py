"""Scores quantized candidates against the original model on held-out token windows, with the
same code for every candidate: perplexity, mean KL(original ‖ candidate) per token, top-1
agreement with the original.

    python score.py --reference HF_DIR --heldout heldout.json --out scores.json \
        --candidate gptqmodel-g128=CKPT_DIR --candidate rtn-g128=rtn:128 [--candidate NAME=DIR ...] \
        [--compute f32|kernel] [--windows N] [--threads 2]

A candidate is NAME=DIR (a GPTQ checkpoint in the AutoGPTQ layout, or a plain HF model
directory) or NAME=rtn:GROUP (round-to-nearest INT4 sym of the reference, built here with
rtn.py). Every GPTQ checkpoint is loaded by transformers (its GPTQ integration, which
optimum/gptqmodel back with gptqmodel's torch kernel on CPU): the record names the class of
the quantized linears it made, so a checkpoint transformers cannot load fails here.

--compute f32 (default): every model runs in f32. The reference's bf16 weights are exact in
f32; each quantized linear that transformers built is replaced by an f32 nn.Linear holding the
checkpoint's weights dequantized exactly from qweight/qzeros/scales/g_idx (rtn.py's
`dequantize_gptq_v1`, independent of gptqmodel and of our tool), after checking that it agrees
with what the loaded kernel dequantizes (`max_rel_vs_kernel`, bf16 level expected). The
figures then measure the weights alone, with no compute rounding. --compute kernel: all models
in bf16, GPTQ checkpoints through the kernel transformers loaded, as served on CPU.

Per held-out text: the reference's log-probabilities of every window are computed once, then
each candidate's. Perplexity: exp of the mean next-token NLL (each window's first token has no
prediction: windows × (len − 1) tokens). KL and top-1: over every position of every window;
`window_mean_kl` lists each window's own mean KL, so that a run over all windows also gives the
figure over any first N of them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rtn import dequantize_gptq_v1, rtn_model  # noqa: E402


def is_gptq_dir(path: Path) -> bool:
    cfg = json.loads((path / "config.json").read_text())
    q = cfg.get("quantization_config") or {}
    return q.get("quant_method") == "gptq"


def load_plain(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def load_gptq(path: Path, compute: str) -> tuple[torch.nn.Module, dict]:
    """Loads a GPTQ checkpoint with transformers; in f32 mode swaps its quantized linears for
    exact f32 dequantizations of the checkpoint's tensors."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu").eval()
    qmods = {n: m for n, m in model.named_modules() if hasattr(m, "qweight")}
    if not qmods:
        raise SystemExit(f"error: {path}: transformers loaded no quantized linear (is quantization_config right?)")
    info = {
        "kind": "gptq",
        "quantization_config": {k: qc.get(k) for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format")},
        "loaded_by": "transformers " + __import__("transformers").__version__,
        "quant_linear_class": sorted({type(m).__module__ + "." + type(m).__name__ for m in qmods.values()}),
        "quantized_linears": len(qmods),
    }
    if compute != "f32":
        return model, info

    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx"):
                    tensors[k] = st.get_tensor(k)
    worst = 0.0
    for name, mod in qmods.items():
        w = dequantize_gptq_v1(
            tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"],
            tensors[f"{name}.g_idx"], int(qc["bits"]), mod.out_features, mod.in_features,
        )
        with torch.no_grad():
            kernel = mod.dequantize_weight().t().to(torch.float32)[: mod.out_features, : mod.in_features]
        rel = ((kernel - w).abs().max() / w.abs().max().clamp(min=1e-30)).item()
        worst = max(worst, rel)
        lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=getattr(mod, "bias", None) is not None)
        lin.weight.data = w
        if lin.bias is not None:
            lin.bias.data = mod.bias.detach().to(torch.float32)
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, name.rsplit(".", 1)[1], lin)
    # transformers refuses .to(dtype) on a GPTQ model; no quantized module is left, so cast as a plain module.
    torch.nn.Module.to(model, torch.float32)
    info["f32_dequantized_from_checkpoint_tensors"] = True
    info["max_rel_vs_kernel"] = worst
    return model, info


@torch.inference_mode()
def window_logprobs(model, ids: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([ids], dtype=torch.long)).logits[0]
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True, type=Path)
    ap.add_argument("--heldout", required=True, type=Path, help="heldout.json from make_data.py")
    ap.add_argument("--candidate", action="append", default=[], help="NAME=DIR or NAME=rtn:GROUP")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--compute", choices=["f32", "kernel"], default="f32")
    ap.add_argument("--windows", type=int, default=None, help="first N windows of each text only")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    heldout = json.loads(args.heldout.read_text())
    texts = {k: v["windows"][: args.windows] for k, v in heldout.items()}
    cands = []
    for spec in args.candidate:
        if "=" not in spec:
            sys.exit(f"error: --candidate {spec!r}: expected NAME=DIR or NAME=rtn:GROUP")
        name, target = spec.split("=", 1)
        if target.startswith("rtn:"):
            cands.append((name, target))
        elif not (Path(target) / "config.json").is_file():
            sys.exit(f"error: --candidate {name}: {target} has no config.json")
        else:
            cands.append((name, target))
    dtype = torch.float32 if args.compute == "f32" else torch.bfloat16

    t0 = time.perf_counter()
    ref = load_plain(args.reference, dtype)
    ref_lp = {k: [window_logprobs(ref, w) for w in ws] for k, ws in texts.items()}
    ref_s = time.perf_counter() - t0

    def score(model) -> dict:
        out = {}
        for k, ws in texts.items():
            nll = kl = agree = 0.0
            n_pred = n_pos = 0
            window_kl = []
            for w, rlp in zip(ws, ref_lp[k]):
                lp = rlp if model is None else window_logprobs(model, w)
                tgt = torch.tensor(w[1:], dtype=torch.long)
                nll -= lp[:-1].gather(1, tgt[:, None]).sum().item()
                n_pred += len(w) - 1
                w_kl = (rlp.exp() * (rlp - lp)).sum().item()
                kl += w_kl
                window_kl.append(w_kl / len(w))
                agree += (rlp.argmax(-1) == lp.argmax(-1)).sum().item()
                n_pos += len(w)
            out[k] = {
                "ppl": math.exp(nll / n_pred),
                "mean_kl": kl / n_pos,
                "top1_agreement": agree / n_pos,
                "windows": len(ws),
                "predicted_tokens": n_pred,
                "positions": n_pos,
                "window_mean_kl": window_kl,
            }
        return out

    results = {"original": {"path": str(args.reference), "kind": "reference", "texts": score(None), "seconds": round(ref_s, 1)}}
    for name, target in cands:
        t0 = time.perf_counter()
        if target.startswith("rtn:"):
            group = int(target.split(":", 1)[1])
            model = load_plain(args.reference, torch.float32)
            n = rtn_model(model, group)
            model.to(dtype)
            info = {"kind": "rtn (rtn.py, torch)", "group_size": group, "bits": 4, "sym": True, "linears": n}
        elif is_gptq_dir(Path(target)):
            model, info = load_gptq(Path(target), args.compute)
        else:
            model, info = load_plain(Path(target), dtype), {"kind": "plain"}
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        info["texts"] = score(model)
        info["path"] = target
        info["seconds"] = {"load": round(load_s, 1), "score": round(time.perf_counter() - t0, 1)}
        results[name] = info
        del model
        print(f"scored {name}: " + ", ".join(
            f"{k} ppl {v['ppl']:.3f} KL {v['mean_kl']:.4f} top-1 {v['top1_agreement']:.4f}" for k, v in info["texts"].items()
        ), flush=True)

    record = {
        "compute": args.compute,
        "heldout": {k: {"source": heldout[k]["source"], "windows": len(v), "window_tokens": len(v[0]) if v else 0} for k, v in texts.items()},
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "models": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(markdown(record))
    return 0


def markdown(record: dict) -> str:
    names = list(record["heldout"])
    head = "| model | " + " | ".join(f"{t} ppl | {t} KL | {t} top-1" for t in names) + " |"
    sep = "|---|" + "---:|" * (3 * len(names))
    rows = [head, sep]
    for m, r in record["models"].items():
        cells = []
        for t in names:
            v = r["texts"][t]
            cells += [f"{v['ppl']:.3f}", f"{v['mean_kl']:.4f}", f"{v['top1_agreement']:.4f}"]
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
