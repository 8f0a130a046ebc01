"""Our GPTQ checkpoint as transformers runs it against our own dequantized model, on logits.

    python logits_check.py --checkpoint CKPT --heldout DATA/heldout.json --sala-logits BIN \
        [--text botchan] [--window 0] [--tokens 256] --out OUT.json

Runs the first `--tokens` ids of one held-out window (make_data.py's heldout.json) through
1. transformers with gptqmodel's kernel, as a user loads the checkpoint (bf16, the quantized
   linears' own forward: "kernel"; where its fused CPU int4 op refuses the shapes, its
   dequantize-then-matmul path, and the refusal is recorded);
2. transformers with each quantized linear swapped for an f32 Linear holding the weights
   dequantized from the checkpoint's tensors by rtn.py's `dequantize_gptq_v1` (score.py's f32
   mode: "f32-dequantized");
3. our `sala_logits` (BIN) on the checkpoint directory: our reader dequantizes it and our CPU
   graph runs it in f32 ("ours").
and reports, for ours against each: the largest absolute logit difference relative to the
largest logit, the mean KL(ours ‖ other) per position and the top-1 agreement. (1) and (3)
differ by the kernel's bf16 arithmetic; (2) and (3) compute the same function in f32, so their
difference is summation order. With `--reference`, the original model's f32 logits against its
bf16 ones show what bf16 arithmetic alone moves.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from score import load_gptq  # noqa: E402


def compare(ours: torch.Tensor, other: torch.Tensor) -> dict:
    lo, lp = torch.log_softmax(ours, -1), torch.log_softmax(other, -1)
    kl = (lo.exp() * (lo - lp)).sum(-1)
    return {
        "max_abs_diff_over_max_logit": ((ours - other).abs().max() / ours.abs().max()).item(),
        "mean_kl_ours_vs_other": kl.mean().item(),
        "top1_agreement": (ours.argmax(-1) == other.argmax(-1)).float().mean().item(),
    }


@torch.inference_mode()
def transformers_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], dtype=torch.long)).logits[0].to(torch.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--sala-logits", type=Path, required=True, help="our sala_logits binary")
    ap.add_argument("--reference", type=Path, help="the original model: its bf16 against f32 logits give the bf16 noise floor")
    ap.add_argument("--text", default="botchan")
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    heldout = json.loads(args.heldout.read_text())
    windows = heldout[args.text]["windows"] if isinstance(heldout[args.text], dict) else heldout[args.text]
    ids = [int(t) for t in windows[args.window][: args.tokens]]

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.safetensors"
        cmd = [str(args.sala_logits), str(args.checkpoint), "--ids", ",".join(map(str, ids)), "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        from safetensors.torch import load_file

        ours = load_file(str(out))["logits"]

    kernel_model, info = load_gptq(args.checkpoint, "bf16")
    try:
        kernel = transformers_logits(kernel_model, ids)
        fused_error = None
    except RuntimeError as e:
        # gptqmodel's fused CPU int4 op (aten _weight_int4pack_mm_for_cpu) needs in % group
        # == 0: it refuses a partial last group, GPTQModel's own checkpoints of this model
        # included. Its other forward path (dequantize_weight, then matmul) serves them; the
        # failed attempt has already repacked the weights, so the model is loaded again.
        fused_error = str(e).splitlines()[0]
        kernel_model, info = load_gptq(args.checkpoint, "bf16")
        for m in kernel_model.modules():
            if hasattr(m, "qweight") and hasattr(m, "linear_mode"):
                m.linear_mode = "train"
        kernel = transformers_logits(kernel_model, ids)
    del kernel_model
    f32_model, f32_info = load_gptq(args.checkpoint, "f32")
    f32 = transformers_logits(f32_model, ids)
    record = {
        "checkpoint": args.checkpoint.name,
        "text": args.text,
        "window": args.window,
        "tokens": len(ids),
        "loaded_by": info["loaded_by"],
        "quant_linear_class": info["quant_linear_class"],
        "quantized_linears": info["quantized_linears"],
        "kernel_vs_checkpoint_weights_max_rel": f32_info["max_rel_vs_kernel"],
        "fused_cpu_op_error": fused_error,
        "ours_vs_kernel_bf16": compare(ours, kernel),
        "ours_vs_f32_dequantized": compare(ours, f32),
    }
    if args.reference:
        from score import load_plain

        ref32 = transformers_logits(load_plain(args.reference, torch.float32), ids)
        ref16 = transformers_logits(load_plain(args.reference, torch.bfloat16), ids)
        record["reference_f32_vs_bf16"] = compare(ref32, ref16)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
