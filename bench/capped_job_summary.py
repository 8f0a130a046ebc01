#!/usr/bin/env python3
"""One capped real-job run's figures (bench/run_capped_job.sh) as a JSON entry, added to the
`capped_runs` list of bench/results/real-job-h200.json (an entry with the same recipe and cap
is replaced), or to the list `--key` names (an entry with the same tag is replaced):

    python3 bench/capped_job_summary.py OUT TAG CAP_GB --note "..." [--key default_runs] [--device GPU] \
        --into bench/results/real-job-h200.json

Reads OUT/TAG.log (the command's log, GNU time's figures at its end), OUT/TAG-report.json (the
report, when the run finished), OUT/TAG-gpumem.txt (nvidia-smi's MiB in use every 2 s, the
holder's share included), OUT/TAG-holder.log (what the holder took), OUT/TAG-rss.txt (the
resident set by kind every 2 s) and OUT/TAG-sha256.txt (the checkpoint's shards).
"""
import argparse
import json
import re

# The per-layer stages of the report, seconds.
STAGES = ["load", "capture", "accumulate", "finalize", "smooth", "solve", "write", "propagate"]


def log_figures(text):
    """Exit status, wall time, peak RSS, start-up and the last layer reached, from the log."""
    out = {}
    m = re.search(r"== \S+ rc=(\d+) wall=(\d+) s", text)
    if m:
        out["exit_status"] = int(m.group(1))
        out["wall_s"] = int(m.group(2))
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if m:
        out["peak_rss_bytes"] = int(m.group(1)) * 1024
    m = re.search(r"start-up: layer \d+ starts ([\d.]+) s", text)
    if m:
        out["startup_s"] = float(m.group(1))
    m = re.search(r"layer-0 inputs: (\d+) tokens embedded (.*?) in ([\d.]+) s", text)
    if m:
        out["embed_s"] = float(m.group(3))
        out["embedded"] = m.group(2)
    m = re.search(r"^device budget .*$", text, re.M)
    if m:
        out["memory_plan"] = m.group(0)
    layers = re.findall(r"^layer (\d+) \(", text, re.M)
    out["layers_done"] = len(layers)
    errors = [l for l in text.splitlines() if l.startswith("error: ")]
    if errors:
        out["error"] = errors[-1]
    out["panicked"] = "panicked" in text
    return out


def report_figures(path):
    try:
        report = json.load(open(path))["report"]
    except (OSError, ValueError, KeyError):
        return {}
    stages = {}
    for layer in report["layers"]:
        # "load" is in reports from the twenty-sixth session on (capture held it before).
        for k in (k for k in STAGES if k in layer):
            stages[k] = stages.get(k, 0.0) + layer[k]
    peak = report.get("peak_device_memory") or {}
    # Where the solve stage's seconds went (reports from binaries that time their steps).
    steps = {}
    for linear in report["linears"]:
        for step, seconds in (linear.get("solve_steps") or {}).items():
            steps[step] = steps.get(step, 0.0) + seconds
    figures = {
        "layers_done": len(report["layers"]),
        "samples": report["samples"],
        "tokens": report["tokens"],
        "pipeline_s": report["seconds"],
        "stage_totals_s": {k: round(v, 2) for k, v in stages.items()},
        "peak_device_in_use_bytes": peak.get("in_use"),
        "peak_device_reserved_bytes": peak.get("reserved"),
        "hidden_states": report.get("hidden_states_location"),
        "hidden_state_bytes": report.get("hidden_state_bytes"),
        "total_output_error": sum(l.get("output_error") or 0.0 for l in report["linears"]),
        "verify_summary": report.get("verify_summary"),
        "verified": str(report.get("verify_summary", "")).startswith("verified ok"),
    }
    if steps:
        figures["solve_steps_s"] = {k: round(v, 2) for k, v in sorted(steps.items(), key=lambda kv: -kv[1])}
    return figures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("cap_gb", type=float, help="0: uncapped")
    p.add_argument("--note", default="")
    p.add_argument("--device", default="",
                   help="the GPU the run had (nvidia-smi's name), where it is not the file's H200")
    p.add_argument("--into", required=True)
    p.add_argument("--key", default="capped_runs",
                   help="the list to put the entry in (an entry with the same tag, or in "
                        "capped_runs the same recipe and cap, is replaced)")
    args = p.parse_args()
    text = open(f"{args.out}/{args.tag}.log").read()
    entry = {"tag": args.tag, "device_cap_gb": args.cap_gb or None}
    entry["recipe"] = "nvfp4" if "--recipe nvfp4" in text else "gptq"
    entry.update(log_figures(text))
    # The report (written only when the run finished) counts every layer, where a log that came
    # back only in part lists fewer: its count replaces the log's.
    entry.update(report_figures(f"{args.out}/{args.tag}-report.json"))
    if args.device:
        entry["device"] = args.device
    try:
        used = [int(l.split()[1]) for l in open(f"{args.out}/{args.tag}-gpumem.txt") if len(l.split()) == 2]
        entry["peak_nvidia_smi_used_mib"] = max(used)
    except (OSError, ValueError):
        pass
    try:
        holder = open(f"{args.out}/{args.tag}-holder.log").read()
        m = re.search(r"holding ([\d.]+) GB of ([\d.]+) GB; free before [\d.]+ GB, after ([\d.]+) GB", holder)
        if m:
            entry["holder_gb"] = float(m.group(1))
            entry["free_after_holder_gb"] = float(m.group(3))
            if "peak_nvidia_smi_used_mib" in entry:
                ours = entry["peak_nvidia_smi_used_mib"] * 2**20 / 1e9 - float(m.group(1))
                entry["peak_nvidia_smi_ours_gb"] = round(ours, 2)
    except OSError:
        pass
    try:
        peaks = {}
        for line in open(f"{args.out}/{args.tag}-rss.txt"):
            f = line.split()
            for k, v in zip(f[1::2], f[2::2]):
                peaks[k.rstrip(":")] = max(peaks.get(k.rstrip(":"), 0), int(v) * 1024)
        if peaks:
            entry["peak_rss_by_kind_bytes"] = peaks
    except (OSError, ValueError):
        pass
    try:
        entry["checkpoint_sha256"] = dict(
            reversed(l.split()) for l in open(f"{args.out}/{args.tag}-sha256.txt") if l.strip())
    except (OSError, ValueError):
        pass
    entry["command"] = (
        f"BIN=DIR OUT=DIR bash bench/run_capped_job.sh {int(args.cap_gb)} {entry['recipe']} {args.tag}"
    )
    if args.note:
        entry["note"] = args.note
    results = json.load(open(args.into))
    def same(r):
        if args.key == "capped_runs":
            return (r.get("recipe"), r.get("device_cap_gb")) == (entry["recipe"], entry["device_cap_gb"])
        return r.get("tag") == entry["tag"]
    runs = [r for r in results.get(args.key, []) if not same(r)]
    runs.append(entry)
    results[args.key] = runs
    with open(args.into, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(json.dumps(entry, indent=2))


if __name__ == "__main__":
    main()
