#!/usr/bin/env bash
# The README's main job on the CPU, timed as a new user sees it: both recipes on the bundled
# trained tiny SALA (8 layers, hidden 256, 30,489 calibration tokens), release build.
#
#   bash bench/fixture_cpu.sh [OUT_JSON]      (default: bench/results/fixture-cpu.json)
#
# Builds `quantize_sala` (release; the build's wall time is printed and recorded, cold or warm
# as the target directory is), runs each recipe twice (the first run reads the model and the
# calibration file from a cold page cache only if nothing read them before: both runs are
# recorded), and writes per run: the process's wall time, the pipeline's own total, the stage
# totals, the per-layer capture/propagate split by layer kind, and the peak RSS, from the run's
# quantization_report.json. Prints one line per run. Needs python3 for the JSON (no packages).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
OUT_JSON="${1:-$REPO/bench/results/fixture-cpu.json}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$REPO"
# seconds_since NANOS: seconds elapsed, to the millisecond.
seconds_since() { local ns=$(( $(date +%s%N) - $1 )); printf '%d.%03d' $((ns / 1000000000)) $((ns / 1000000 % 1000)); }

start=$(date +%s%N)
cargo build --release --example quantize_sala >"$WORK/build.log" 2>&1 \
    || { tail -20 "$WORK/build.log"; exit 1; }
build_s=$(seconds_since "$start")
printf 'build (release, quantize_sala): %.1f s\n' "$build_s"

runs=()
for recipe in gptq nvfp4; do
    for attempt in 1 2; do
        out="$WORK/$recipe-$attempt"
        t0=$(date +%s%N)
        ./target/release/examples/quantize_sala --recipe "$recipe" --output "$out" --quiet \
            >"$WORK/$recipe-$attempt.log" 2>&1 || { tail -20 "$WORK/$recipe-$attempt.log"; exit 1; }
        wall=$(seconds_since "$t0")
        grep -q "verified ok" "$WORK/$recipe-$attempt.log" \
            || { echo "error: $recipe run $attempt did not verify" >&2; exit 1; }
        cp "$out/quantization_report.json" "$WORK/$recipe-$attempt.report.json"
        runs+=("$recipe:$attempt:$wall")
    done
done

python3 - "$OUT_JSON" "$WORK" "$build_s" "${runs[@]}" <<'PY'
import json, os, platform, subprocess, sys, datetime
out_json, work, build_s, *runs = sys.argv[1:]
def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()
records = []
for run in runs:
    recipe, attempt, wall = run.split(":")
    rep = json.load(open(os.path.join(work, f"{recipe}-{attempt}.report.json")))["report"]
    stages = {}
    by_kind = {}
    for layer in rep["layers"]:
        for stage in ("capture", "accumulate", "finalize", "smooth", "solve", "write", "propagate"):
            stages[stage] = stages.get(stage, 0.0) + layer[stage]
        kind = by_kind.setdefault(layer["kind"], {"layers": 0, "capture_s": 0.0, "propagate_s": 0.0})
        kind["layers"] += 1
        kind["capture_s"] += layer["capture"]
        kind["propagate_s"] += layer["propagate"]
    for kind in by_kind.values():
        kind["capture_per_layer_s"] = round(kind["capture_s"] / kind["layers"], 3)
        kind["propagate_per_layer_s"] = round(kind["propagate_s"] / kind["layers"], 3)
    record = {
        "recipe": recipe,
        "run": int(attempt),
        "process_wall_s": round(float(wall), 2),
        "pipeline_s": round(rep["seconds"], 2),
        "stages_s": {k: round(v, 2) for k, v in stages.items()},
        "per_layer_kind": by_kind,
        "tokens": rep["tokens"],
        "samples": rep["samples"],
        "peak_rss_mb": round(rep["peak_rss_bytes"] / 2**20, 1),
    }
    records.append(record)
    print(f"{recipe} run {attempt}: {record['process_wall_s']} s wall, pipeline {record['pipeline_s']} s, "
          f"stages {record['stages_s']}")
doc = {
    "what": "quantize_sala on fixtures/tiny-sala-trained with fixtures/calib/calib.jsonl, release build, --device cpu",
    "command": "bash bench/fixture_cpu.sh",
    "date": datetime.date.today().isoformat(),
    "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "os": platform.platform()},
    "build_s": round(float(build_s), 1),
    "runs": records,
}
with open(out_json, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
print(f"wrote {out_json}")
PY
