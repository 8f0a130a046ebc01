"""Converts a llama.cpp GGUF (SmolLM2-135M-Instruct.Q4_1.gguf) into a Hugging Face model
directory: model.safetensors, config.json, generation_config.json, tokenizer.json,
tokenizer_config.json (+ chat_template.jinja), then checks that the result reloads and
generates sensible text.

    python convert.py --gguf FILE.gguf --output HF_DIR [--dtype bf16|f32] [--overwrite]

The route is transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`): it
dequantizes every tensor (Q4_1, Q8_0, F32) to f32 and undoes llama.cpp's q/k row permutation.
The model is then saved with `save_pretrained`:

- dtype: bf16 by default, the dtype SmolLM2 was released in and the one our pipeline's
  numerics assume (f32 compute with bf16 rounding). The Q4_1 values (f16 scale × code + f16
  min) are exact in f32 but not in bf16; the cost of that rounding is measured here (KL of the
  bf16 model against the f32 one on a held-out window) and written to conversion.json, so that
  it can be set against the quantizers' errors. `--dtype f32` keeps them exact.
- config.json: the GGUF `quantization_config` (quant_method gguf) that transformers attaches is
  removed (the directory holds plain weights); `tie_word_embeddings` is true and no
  `lm_head.weight` tensor is written (checked); `rope_theta` is also written at the top level
  (transformers 5 writes only `rope_parameters`, readers of the transformers-4 layout would fall
  back to the default base 10000 instead of SmolLM2's 100000).
- tokenizer: the GGUF vocabulary and merges rebuilt as a fast tokenizer by transformers; the
  GGUF says add_bos_token=false, and the tokenizer adds no special token (checked with the
  `tokenizers` package on tokenizer.json, the library our Rust side uses).

Everything goes to HF_DIR/conversion.json too (sizes, checks, generated text).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, type=Path, help="the .gguf file")
    ap.add_argument("--output", required=True, type=Path, help="HF model directory to write")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output")
    ap.add_argument(
        "--check-text",
        type=Path,
        default=None,
        help="text whose first 512 tokens measure the bf16-vs-f32 KL (default: none)",
    )
    args = ap.parse_args()

    if not args.gguf.is_file():
        sys.exit(f"error: {args.gguf}: GGUF file not found (run setup.sh first)")
    if args.output.exists():
        if not args.overwrite and (args.output / "model.safetensors").is_file():
            print(f"{args.output}: already converted (use --overwrite to redo)")
            return 0
        shutil.rmtree(args.output)

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    t0 = time.perf_counter()
    gdir, gname = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0

    # Plain weights: drop the GGUF quantization_config transformers attaches.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    assert model.config.tie_word_embeddings, "SmolLM2 ties its embeddings; the GGUF lost that"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # The bf16 rounding's own cost, measured before saving (f32 reference, bf16 candidate).
    rounding = None
    if args.check_text is not None and args.dtype == "bf16":
        ids = tokenizer(args.check_text.read_text(encoding="utf-8"))["input_ids"][:512]
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = torch.log_softmax(model(x).logits.float(), -1)
            bf = model.to(torch.bfloat16)
            cand = torch.log_softmax(bf(x).logits.float(), -1)
            model.to(torch.float32)
        kl = (ref.exp() * (ref - cand)).sum(-1).mean().item()
        top1 = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
        rounding = {"tokens": len(ids), "mean_kl_f32_vs_bf16": kl, "top1_agreement": top1}
        print(f"bf16 rounding of the f32 weights: mean KL {kl:.3e}, top-1 {top1:.4f} on {len(ids)} tokens")

    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    model.to(dtype)
    model.config.dtype = dtype
    args.output.mkdir(parents=True)
    model.save_pretrained(args.output, safe_serialization=True)
    tokenizer.save_pretrained(args.output)
    model.generation_config.save_pretrained(args.output)

    # config.json: no GGUF quantization_config, top-level rope_theta as well.
    cfg_path = args.output / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.setdefault("rope_scaling", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    # Checks on what was written.
    from safetensors import safe_open

    with safe_open(str(args.output / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        dtypes = sorted({str(f.get_slice(n).get_dtype()) for n in names})
    if any(n.startswith("lm_head") for n in names):
        sys.exit("error: model.safetensors holds lm_head.weight although the embeddings are tied")
    if not cfg.get("tie_word_embeddings"):
        sys.exit("error: config.json lost tie_word_embeddings")
    fast = Tokenizer.from_file(str(args.output / "tokenizer.json"))
    probe = "In the beginning God created the heaven and the earth."
    with_special = fast.encode(probe, add_special_tokens=True).ids
    without = fast.encode(probe, add_special_tokens=False).ids
    adds_special = with_special != without

    # Reload from the directory (as every later step will) and generate.
    reloaded = AutoModelForCausalLM.from_pretrained(args.output, dtype=torch.float32).eval()
    rtok = AutoTokenizer.from_pretrained(args.output)
    generations = {}
    prompts = {
        "chat": rtok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        "plain": "The three primary colors are",
    }
    for name, prompt in prompts.items():
        enc = rtok(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = reloaded.generate(**enc, max_new_tokens=40, do_sample=False)
        text = rtok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        generations[name] = {"prompt": prompt, "greedy_continuation": text}
        print(f"--- {name} prompt: {prompt!r}\n{text}\n")

    params = sum(p.numel() for p in reloaded.parameters())
    record = {
        "gguf": args.gguf.name,
        "gguf_bytes": args.gguf.stat().st_size,
        "dtype": args.dtype,
        "load_seconds": round(load_s, 1),
        "tensors": len(names),
        "safetensors_dtypes": dtypes,
        "parameters": params,
        "lm_head_in_safetensors": False,
        "tie_word_embeddings": True,
        "rope_theta": cfg.get("rope_theta"),
        "tokenizer_adds_special_tokens": adds_special,
        "probe_ids": with_special,
        "bf16_rounding": rounding,
        "generations": generations,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }
    (args.output / "conversion.json").write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"wrote {args.output}: {len(names)} tensors ({', '.join(dtypes)}), {params / 1e6:.1f}M "
        f"parameters, tied embeddings, tokenizer adds special tokens: {adds_special}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
