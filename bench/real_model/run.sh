#!/usr/bin/env bash
# The real-model benchmark, end to end, on CPU (not in CI: it downloads at setup):
#
#   bash bench/real_model/run.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds our release binaries (quantize_sala; verify_checkpoint if present), from
# `cargo build --release --example quantize_sala --example verify_checkpoint` (they are in
# target/release/examples). Without BIN_DIR/quantize_sala our rows are skipped with a message
# and everything else runs.
#
# 1. setup.sh: venv + the SmolLM2-135M-Instruct Q4_1 GGUF (under $WORK, default target/real-model);
# 2. convert.py: GGUF -> $WORK/smollm2-135m-instruct (bf16 HF directory; kept between runs);
# 3. make_data.py: OUT_DIR/data: calib.jsonl (ours), calib_tokens.json (GPTQModel), heldout.json;
# 4. GPTQModel 7.7.0 GPTQ W4A16 (sym, desc_act false, default damping) for each group size in
#    $GROUP_SIZES (default "128 64") -> $WORK/ckpt/gptqmodel-g<G>;
# 5. ours: quantize_sala --target gptq (when the binary has it) with the same calibration text,
#    --max-samples 32 --max-len 512 --group-size G --threads $THREADS $OURS_ARGS ->
#    $WORK/ckpt/ours-g<G>, and `--rtn` at group 128 -> $WORK/ckpt/ours-rtn-g128; each checked by
#    verify_checkpoint when BIN_DIR has it;
# 6. score.py: original, every checkpoint above, and RTN built in torch (rtn.py) per group size,
#    on the held-out windows -> OUT_DIR/scores.json;
# 7. summarize.py: OUT_DIR/real-model.json (timings, peak RSS, scores, data and conversion
#    facts, versions) and a Markdown table on standard output.
#
# Each quantizer runs under /usr/bin/time -v (wall time, peak RSS): OUT_DIR/<name>.time.txt,
# its log in OUT_DIR/<name>.log. Checkpoints are reused when present (REUSE=1, the default;
# REUSE=0 redoes them, timing included). Environment: WORK, GROUP_SIZES, THREADS (default 2),
# OURS_ARGS (extra quantize_sala flags, e.g. --smooth-alpha 0.5), ABLATIONS (a file of lines "NAME
# FLAGS...": one more run of ours at group 128 per line, named ours-g128-NAME, e.g.
# bench/real_model/ablations.txt), SCORE_ARGS (e.g. --windows 4: the first
# 4 windows of each text; all 16 cost ~10-20 s per window and model on 2 busy cores),
# PYTHON (for the venv), REUSE, GPTQMODEL_GAR (1: GPTQModel with its default act_group_aware).
set -uo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: bash bench/real_model/run.sh BIN_DIR OUT_DIR" >&2
    exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
# Absolute: the quantizers run from inside OUT_DIR.
BIN_DIR="$(cd "$1" 2>/dev/null && pwd || echo "$1")"
mkdir -p "$2" || { echo "error: cannot create $2" >&2; exit 1; }
OUT="$(cd "$2" && pwd)"
WORK="${WORK:-$REPO/target/real-model}"
GROUP_SIZES="${GROUP_SIZES:-128 64}"
THREADS="${THREADS:-2}"
REUSE="${REUSE:-1}"
OURS_ARGS="${OURS_ARGS:-}"
ABLATIONS="${ABLATIONS:-}"
SCORE_ARGS="${SCORE_ARGS:-}"

log() { printf '[run %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/run.log"; }
die() { printf 'error: %s\n' "$*" | tee -a "$OUT/run.log" >&2; exit 1; }
: > "$OUT/run.log"

# 1. setup
bash "$HERE/setup.sh" "$WORK" > "$OUT/setup.log" 2>&1 || die "setup failed (see $OUT/setup.log)"
grep '^\[setup\]' "$OUT/setup.log"
WORK="$(cd "$WORK" && pwd)"
PY="$WORK/venv/bin/python"
MODEL="$WORK/smollm2-135m-instruct"
CKPT="$WORK/ckpt"
DATA="$OUT/data"
mkdir -p "$CKPT"
export GPTQMODEL_CPU_WORKERS="$THREADS" OMP_NUM_THREADS="$THREADS" TOKENIZERS_PARALLELISM=false

# 2. convert (kept between runs)
log "convert: $MODEL"
"$PY" "$HERE/convert.py" --gguf "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" --output "$MODEL" \
    --check-text "$REPO/fixtures/text/heldout.txt" > "$OUT/convert.log" 2>&1 \
    || die "convert.py failed (see $OUT/convert.log)"
grep -A3 '^--- ' "$OUT/convert.log" | sed 's/^/    /' | head -12

# 3. data
log "data: $DATA"
"$PY" "$HERE/make_data.py" --model "$MODEL" --out "$DATA" 2>&1 | tee "$OUT/data.log" \
    || die "make_data.py failed"

# timed NAME CMD...: runs CMD under /usr/bin/time -v in $OUT (GPTQModel writes ./logs/).
timed() {
    local name="$1"; shift
    (cd "$OUT" && /usr/bin/time -v -o "$OUT/$name.time.txt" "$@") > "$OUT/$name.log" 2>&1
}

candidates=()
# 4. GPTQModel
# GPTQMODEL_GAR=1: GPTQModel at its own default, act_group_aware on (names gptqmodel-gar-g<G>).
gm_name=gptqmodel; gm_args=()
if [[ "${GPTQMODEL_GAR:-0}" == 1 ]]; then gm_name=gptqmodel-gar; gm_args=(--gar); fi
for g in $GROUP_SIZES; do
    dest="$CKPT/$gm_name-g$g"
    if [[ "$REUSE" == 1 && -f "$dest/config.json" && -f "$OUT/$gm_name-g$g.time.txt" ]]; then
        log "GPTQModel g$g: reusing $dest"
    else
        rm -rf "$dest" "$dest.timing.json"
        log "GPTQModel g$g: quantizing (CPU, $THREADS workers; ~30 min on 2 busy cores)"
        timed "$gm_name-g$g" "$PY" "$HERE/run_gptqmodel.py" --model "$MODEL" \
            --calib-tokens "$DATA/calib_tokens.json" --output "$dest" --group-size "$g" \
            --threads "$THREADS" "${gm_args[@]}" || die "GPTQModel g$g failed (see $OUT/$gm_name-g$g.log)"
        cp "$dest.timing.json" "$OUT/$gm_name-g$g.timing.json"
    fi
    candidates+=("--candidate" "$gm_name-g$g=$dest")
done

# 5. ours
Q="$BIN_DIR/quantize_sala"
if [[ ! -x "$Q" ]]; then
    log "ours: SKIPPED, no executable $Q (build it with cargo build --release --example quantize_sala)"
else
    target=()
    if "$Q" --help 2>/dev/null | grep -q -- '--target'; then
        target=(--target gptq)
    else
        log "ours: $Q has no --target flag; running without it"
    fi
    run_ours() {  # NAME GROUP [extra flags]
        local name="$1" g="$2"; shift 2
        local dest="$CKPT/$name"
        if [[ "$REUSE" == 1 && -f "$dest/config.json" && -f "$OUT/$name.time.txt" ]]; then
            log "ours $name: reusing $dest"
        else
            log "ours $name: quantizing"
            # shellcheck disable=SC2086
            timed "$name" "$Q" --input "$MODEL" --output "$dest" --overwrite \
                --calib-data "$DATA/calib.jsonl" --max-samples 32 --max-len 512 --group-size "$g" \
                "${target[@]}" --threads "$THREADS" --quiet $OURS_ARGS "$@" \
                || { log "ours $name FAILED (see $OUT/$name.log): $(tail -1 "$OUT/$name.log")"; return 1; }
            [[ -f "$dest/quantization_report.json" ]] && cp "$dest/quantization_report.json" "$OUT/$name.report.json"
        fi
        if [[ -x "$BIN_DIR/verify_checkpoint" ]]; then
            "$BIN_DIR/verify_checkpoint" "${target[@]}" "$dest" > "$OUT/$name.verify.log" 2>&1 \
                || log "ours $name: verify_checkpoint FAILED (see $OUT/$name.verify.log)"
        fi
        candidates+=("--candidate" "$name=$dest")
    }
    for g in $GROUP_SIZES; do run_ours "ours-g$g" "$g"; done
    run_ours "ours-rtn-g128" 128 --rtn
    # Ablations: one run per line of $ABLATIONS ("NAME FLAGS...", # comments), group 128.
    if [[ -n "$ABLATIONS" ]]; then
        [[ -f "$ABLATIONS" ]] || die "ABLATIONS=$ABLATIONS is not a file"
        while read -r name flags; do
            [[ -z "$name" || "$name" == \#* ]] && continue
            # shellcheck disable=SC2086
            run_ours "ours-g128-$name" 128 $flags
        done < "$ABLATIONS"
    fi
fi

# 6. score
for g in $GROUP_SIZES; do candidates+=("--candidate" "rtn-g$g=rtn:$g"); done
log "score: ${candidates[*]}"
# shellcheck disable=SC2086
"$PY" "$HERE/score.py" --reference "$MODEL" --heldout "$DATA/heldout.json" --out "$OUT/scores.json" \
    --threads "$THREADS" $SCORE_ARGS "${candidates[@]}" > "$OUT/score.log" 2>&1 \
    || die "score.py failed (see $OUT/score.log)"

# 7. summary
"$PY" "$HERE/summarize.py" --out-dir "$OUT" --model "$MODEL" || die "summarize.py failed"
log "done: $OUT/real-model.json"
