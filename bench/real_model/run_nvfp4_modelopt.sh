#!/usr/bin/env bash
# Ours (quantize_sala --recipe nvfp4) against NVIDIA ModelOpt 0.47's NVFP4 weight recipes on
# SmolLM2-135M-Instruct, on CPU, scored in one score.py run:
#
#   bash bench/real_model/run_nvfp4_modelopt.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds quantize_sala (and verify_checkpoint, used to check our decoder bit for bit).
# Steps (each skipped when its output is there and REUSE=1, the default):
# 1. setup.sh (benchmark venv, GGUF), convert.py, make_data.py for each phase of $PHASES
#    (default "0"; "0 1 2" for the three-subset noise band) -> OUT_DIR/data (phase 0),
#    OUT_DIR/data-pP;
# 2. WORK/venv-modelopt from requirements-modelopt.txt (apart from the benchmark venv);
# 3. run_modelopt.py for each config of $MODELOPT_CONFIGS (default: NVFP4_DEFAULT_CFG, the one
#    ModelOpt 0.47 runs on CPU; the others need CUDA and fail with their error recorded in
#    OUT_DIR/modelopt-<name>.modelopt.json) -> WORK/ckpt/modelopt-<name>[-pP] (decoded) and
#    .nvfp4 (ModelOpt's own checkpoint);
# 4. ours: quantize_sala --recipe nvfp4 --calib-data .../calib.jsonl --max-samples 32
#    --max-len 512 --threads $THREADS $OURS_ARGS -> WORK/ckpt/ours-nvfp4[-pP]; verify_checkpoint
#    --dump-dequantized; dequant_nvfp4.py -> WORK/ckpt/ours-nvfp4[-pP].hf (checked against the dump);
# 5. score.py --windows 4 (SCORE_ARGS) on the reference and every candidate -> OUT_DIR/scores.json,
#    and the ratio of our KL to the best ModelOpt row per phase and text -> OUT_DIR/nvfp4-vs-modelopt.json.
# Environment: WORK (default target/real-model), THREADS (2), PHASES, MODELOPT_CONFIGS, OURS_ARGS,
# SCORE_ARGS (default "--windows 4"), DEQUANT_DTYPE (bf16 or f32, default f32: exact weights for
# both sides), REUSE.
set -uo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: bash bench/real_model/run_nvfp4_modelopt.sh BIN_DIR OUT_DIR" >&2
    exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BIN_DIR="$(cd "$1" 2>/dev/null && pwd || echo "$1")"
mkdir -p "$2" || { echo "error: cannot create $2" >&2; exit 1; }
OUT="$(cd "$2" && pwd)"
WORK="${WORK:-$REPO/target/real-model}"
THREADS="${THREADS:-2}"
PHASES="${PHASES:-0}"
MODELOPT_CONFIGS="${MODELOPT_CONFIGS:-NVFP4_DEFAULT_CFG}"
OURS_ARGS="${OURS_ARGS:-}"
SCORE_ARGS="${SCORE_ARGS:---windows 4}"
DEQUANT_DTYPE="${DEQUANT_DTYPE:-f32}"
REUSE="${REUSE:-1}"

log() { printf '[nvfp4 %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/run.log"; }
die() { printf 'error: %s\n' "$*" | tee -a "$OUT/run.log" >&2; exit 1; }
timed() {  # NAME CMD...: CMD under /usr/bin/time -v in $OUT, log in $OUT/NAME.log
    local name="$1"; shift
    (cd "$OUT" && /usr/bin/time -v -o "$OUT/$name.time.txt" "$@") > "$OUT/$name.log" 2>&1
}
export OMP_NUM_THREADS="$THREADS" TOKENIZERS_PARALLELISM=false

# 1. benchmark venv, model, data
bash "$HERE/setup.sh" "$WORK" > "$OUT/setup.log" 2>&1 || die "setup failed (see $OUT/setup.log)"
WORK="$(cd "$WORK" && pwd)"
PY="$WORK/venv/bin/python"
MODEL="$WORK/smollm2-135m-instruct"
CKPT="$WORK/ckpt"
mkdir -p "$CKPT"
"$PY" "$HERE/convert.py" --gguf "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" --output "$MODEL" \
    --check-text "$REPO/fixtures/text/heldout.txt" > "$OUT/convert.log" 2>&1 || die "convert.py failed"
data_dir() { [[ "$1" == 0 ]] && echo "$OUT/data" || echo "$OUT/data-p$1"; }
suffix() { [[ "$1" == 0 ]] && echo "" || echo "-p$1"; }
for p in $PHASES; do
    d="$(data_dir "$p")"
    [[ "$REUSE" == 1 && -f "$d/calib.jsonl" ]] || "$PY" "$HERE/make_data.py" --model "$MODEL" --out "$d" \
        --calib-phase "$p" > "$OUT/data$(suffix "$p").log" 2>&1 || die "make_data.py --calib-phase $p failed"
done

# 2. ModelOpt venv
MVENV="$WORK/venv-modelopt"
MREQ="$HERE/requirements-modelopt.txt"
want="$(sha256sum "$MREQ" | cut -d' ' -f1)"
if [[ ! -f "$MVENV/.requirements.sha256" || "$(cat "$MVENV/.requirements.sha256")" != "$want" ]]; then
    log "installing $MREQ into $MVENV"
    [[ -x "$MVENV/bin/python" ]] || "${PYTHON:-python3}" -m venv "$MVENV" || die "cannot create $MVENV"
    "$MVENV/bin/pip" install -q -r "$MREQ" > "$OUT/venv-modelopt.log" 2>&1 || die "pip install -r $MREQ failed"
    echo "$want" > "$MVENV/.requirements.sha256"
fi
MPY="$MVENV/bin/python"

candidates=()
# 3. ModelOpt
for p in $PHASES; do
    for c in $MODELOPT_CONFIGS; do
        slug="$(echo "$c" | tr 'A-Z:/' 'a-z__' | sed 's/_cfg$//')"
        name="modelopt-$slug$(suffix "$p")"
        dest="$CKPT/$name"
        if [[ "$REUSE" == 1 && -f "$dest/config.json" && -f "$OUT/$name.time.txt" ]]; then
            log "ModelOpt $c phase $p: reusing $dest"
        else
            rm -rf "$dest" "$dest.nvfp4" "$dest.modelopt.json"
            log "ModelOpt $c phase $p: quantizing"
            if ! timed "$name" "$MPY" "$HERE/run_modelopt.py" --model "$MODEL" \
                --calib-tokens "$(data_dir "$p")/calib_tokens.json" --output "$dest" --config "$c" \
                --dtype "$DEQUANT_DTYPE" --threads "$THREADS"; then
                cp "$dest.modelopt.json" "$OUT/$name.modelopt.json" 2>/dev/null
                log "ModelOpt $c phase $p FAILED: $(grep -m1 '^error' "$OUT/$name.log")"
                continue
            fi
            cp "$dest.modelopt.json" "$OUT/$name.modelopt.json"
        fi
        candidates+=("--candidate" "$name=$dest")
    done
done

# 4. ours
Q="$BIN_DIR/quantize_sala"
if [[ ! -x "$Q" ]]; then
    log "ours: SKIPPED, no executable $Q"
else
    for p in $PHASES; do
        name="ours-nvfp4$(suffix "$p")"
        dest="$CKPT/$name"
        if [[ "$REUSE" == 1 && -f "$dest/config.json" && -f "$OUT/$name.time.txt" ]]; then
            log "ours $name: reusing $dest"
        else
            log "ours $name: quantizing"
            # shellcheck disable=SC2086
            timed "$name" "$Q" --recipe nvfp4 --input "$MODEL" --output "$dest" --overwrite \
                --calib-data "$(data_dir "$p")/calib.jsonl" --max-samples 32 --max-len 512 \
                --threads "$THREADS" --quiet $OURS_ARGS \
                || { log "ours $name FAILED (see $OUT/$name.log): $(tail -1 "$OUT/$name.log")"; continue; }
            [[ -f "$dest/quantization_report.json" ]] && cp "$dest/quantization_report.json" "$OUT/$name.report.json"
        fi
        check=()
        if [[ -x "$BIN_DIR/verify_checkpoint" ]]; then
            "$BIN_DIR/verify_checkpoint" "$dest" --dump-dequantized "$OUT/$name.dequantized.safetensors" \
                > "$OUT/$name.verify.log" 2>&1 || log "ours $name: verify_checkpoint FAILED (see $OUT/$name.verify.log)"
            [[ -f "$OUT/$name.dequantized.safetensors" ]] && check=(--check-dump "$OUT/$name.dequantized.safetensors")
        fi
        rm -rf "$dest.hf"
        "$PY" "$HERE/dequant_nvfp4.py" --checkpoint "$dest" --reference "$MODEL" --output "$dest.hf" \
            --dtype "$DEQUANT_DTYPE" "${check[@]}" > "$OUT/$name.dequant.json" 2>"$OUT/$name.dequant.log" \
            || die "dequant_nvfp4.py failed on $dest (see $OUT/$name.dequant.log)"
        rm -f "$OUT/$name.dequantized.safetensors"
        candidates+=("--candidate" "$name=$dest.hf")
    done
fi

# 5. score, ratios
log "score: ${candidates[*]}"
# shellcheck disable=SC2086
"$PY" "$HERE/score.py" --reference "$MODEL" --heldout "$OUT/data/heldout.json" --out "$OUT/scores.json" \
    --threads "$THREADS" $SCORE_ARGS "${candidates[@]}" > "$OUT/score.log" 2>&1 \
    || die "score.py failed (see $OUT/score.log)"
"$PY" - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
models = json.loads((out / "scores.json").read_text())["models"]
res = {}
for name, r in models.items():
    m = re.match(r"ours-nvfp4(-p\d)?$", name)
    if not m:
        continue
    sfx = m.group(1) or ""
    mo = {n: v for n, v in models.items() if n.startswith("modelopt-") and n.endswith(sfx) and (sfx or not re.search(r"-p\d$", n))}
    for text, v in r["texts"].items():
        if not mo:
            continue
        best = min(mo, key=lambda n: mo[n]["texts"][text]["mean_kl"])
        kl_best = mo[best]["texts"][text]["mean_kl"]
        res.setdefault(name, {})[text] = {"ours_kl": v["mean_kl"], "best_modelopt": best,
                                          "best_modelopt_kl": kl_best, "ratio": v["mean_kl"] / kl_best}
(out / "nvfp4-vs-modelopt.json").write_text(json.dumps(res, indent=2) + "\n")
for name, texts in res.items():
    for text, v in texts.items():
        print(f"{name} / {v['best_modelopt']} on {text}: KL {v['ours_kl']:.4f} / {v['best_modelopt_kl']:.4f} = {v['ratio']:.3f}x")
PY
grep -A100 '^| model' "$OUT/score.log"
log "done: $OUT/scores.json, $OUT/nvfp4-vs-modelopt.json"
