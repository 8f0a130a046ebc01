#!/usr/bin/env bash
# The GPTQ feature ablations of bench/real_model/ablations.txt on the trained tiny SALA
# (fixtures/tiny-sala-trained, INT4 g128), with the calibration of docs/quality.md:
#
#   bash bench/ablations_trained.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds quantize_sala and eval_quant (cargo build --release --example quantize_sala
# --example eval_quant: target/release/examples). For our defaults ("default") and each line
# "NAME FLAGS..." of the ablation file (ABLATIONS, default bench/real_model/ablations.txt):
# OUT_DIR/NAME (the checkpoint), NAME.json (eval_quant: perplexity, KL, top-1 on the held-out
# windows), NAME.time.txt (/usr/bin/time -v of the quantization). summary.json gathers them.
set -euo pipefail
if [[ $# -ne 2 ]]; then
    echo "usage: bash bench/ablations_trained.sh BIN_DIR OUT_DIR" >&2
    exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
BIN="$1"
mkdir -p "$2"
OUT="$(cd "$2" && pwd)"
ABLATIONS="${ABLATIONS:-$HERE/real_model/ablations.txt}"
T="$REPO/fixtures/tiny-sala-trained"
for tool in quantize_sala eval_quant; do
    [[ -x "$BIN/$tool" ]] || { echo "error: no executable $BIN/$tool" >&2; exit 1; }
done
[[ -f "$ABLATIONS" ]] || { echo "error: no ablation file $ABLATIONS" >&2; exit 1; }

run() {  # NAME [flags]
    local name="$1"; shift
    echo "[ablations] $name: quantize_sala $*"
    /usr/bin/time -v -o "$OUT/$name.time.txt" "$BIN/quantize_sala" --input "$T" \
        --output "$OUT/$name" --max-samples 82 --max-len 2048 --quiet --threads 2 --overwrite "$@" \
        > "$OUT/$name.log" 2>&1 || { echo "error: $name failed (see $OUT/$name.log)" >&2; exit 1; }
    "$BIN/eval_quant" "$T" "$OUT/$name" --json "$OUT/$name.json" > "$OUT/$name.eval.log" 2>&1 \
        || { echo "error: eval of $name failed (see $OUT/$name.eval.log)" >&2; exit 1; }
}

run default
while read -r name flags; do
    [[ -z "$name" || "$name" == \#* ]] && continue
    # shellcheck disable=SC2086
    run "$name" $flags
done < "$ABLATIONS"

python3 - "$OUT" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for ev in sorted(out.glob("*.json")):
    if ev.name == "summary.json":
        continue
    name = ev.stem
    report = json.loads((out / name / "quantization_report.json").read_text())["report"]
    wall = re.search(r"Elapsed \(wall clock\) time.*: (.*)", (out / f"{name}.time.txt").read_text())
    rows[name] = {
        "eval": json.loads(ev.read_text()),
        "proxy_error": sum(l.get("output_error") or 0 for l in report["linears"]),
        "wall": wall.group(1) if wall else None,
    }
(out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
print(f"[ablations] {out / 'summary.json'}")
PY
