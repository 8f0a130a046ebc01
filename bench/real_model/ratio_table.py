"""Ratios of mean KL between quantizers over calibration subsets, from one score.py run.

    python ratio_table.py SCORES_JSON --baseline gm-g64 --variant ours-g64 [--variant ...]
        [--phases 0,1,2] [--windows N] [--json OUT]

Candidates must be named PREFIX-pP (P a calibration phase of make_data.py --calib-phase),
e.g. `--candidate gm-g64-p0=DIR` in score.py. For each text and each prefix: the mean KL per
subset (score.py's `mean_kl`; over the first N windows when --windows is given, from its
per-window `window_mean_kl`: all windows are the same length, so the mean of window means is
the mean per token), their mean, and each variant's ratio of means to the baseline's with the
per-subset ratios beside it: the figure docs/quality.md reports and its noise band.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def subset_kl(models: dict, name: str, text: str, windows: int | None) -> float:
    if name not in models:
        sys.exit(f"error: {name} is not a candidate of this scores file")
    if windows is None:
        return models[name]["texts"][text]["mean_kl"]
    per_window = models[name]["texts"][text].get("window_mean_kl")
    if per_window is None:
        sys.exit(f"error: {name} has no window_mean_kl (scored before score.py kept it)")
    if len(per_window) < windows:
        sys.exit(f"error: {name} was scored on {len(per_window)} windows of {text}, not {windows}")
    return sum(per_window[:windows]) / windows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scores", type=Path)
    ap.add_argument("--baseline", required=True, help="prefix of the baseline's candidates")
    ap.add_argument("--variant", action="append", required=True, help="prefix of a compared quantizer")
    ap.add_argument("--phases", default="0,1,2")
    ap.add_argument("--windows", type=int, default=None, help="first N windows of each text only")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    args = ap.parse_args()

    record = json.loads(args.scores.read_text())
    models = record["models"]
    phases = [int(p) for p in args.phases.split(",")]
    texts = list(record["heldout"])
    table = {"scores": str(args.scores), "windows": args.windows, "phases": phases, "texts": {}}
    for text in texts:
        rows = {}
        for prefix in [args.baseline, *args.variant]:
            per_subset = [subset_kl(models, f"{prefix}-p{p}", text, args.windows) for p in phases]
            rows[prefix] = {"per_subset": per_subset, "mean": sum(per_subset) / len(per_subset)}
        base = rows[args.baseline]
        for prefix in args.variant:
            row = rows[prefix]
            row["ratio_of_means"] = row["mean"] / base["mean"]
            row["per_subset_ratio"] = [v / b for v, b in zip(row["per_subset"], base["per_subset"])]
        table["texts"][text] = rows

    shown = f"first {args.windows} windows" if args.windows else "all windows"
    print(f"| model | text | KL mean ({len(phases)} subsets, {shown}) | per subset | × {args.baseline} (per subset) |")
    print("|---|---|---|---|---|")
    for text, rows in table["texts"].items():
        for prefix, row in rows.items():
            ratio = ""
            if "ratio_of_means" in row:
                lo, hi = min(row["per_subset_ratio"]), max(row["per_subset_ratio"])
                ratio = f"{row['ratio_of_means']:.3f}× ({lo:.3f}–{hi:.3f})"
            subsets = ", ".join(f"{v:.4f}" for v in row["per_subset"])
            print(f"| {prefix} | {text} | {row['mean']:.4f} | {subsets} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
