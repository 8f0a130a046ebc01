#!/usr/bin/env bash
# The whole GPU comparison in one command (H200: driver 580, CUDA 13 toolkit, torch cu130):
#
#   bash bench/run_h200.sh gpu/bench_gpu OUT_DIR [extra bench_gpu options...]
#
# 1. bench_gpu (our CUDA path + CPU checks) writes the inputs to OUT_DIR/data and its results
#    to OUT_DIR/ours.json;
# 2. bench/torch_gptq.py runs the PyTorch baselines on the same inputs -> OUT_DIR/torch.json;
# 3. bench/compare.py prints the comparison -> OUT_DIR/comparison.json.
# Every step's output is teed to OUT_DIR/<step>.log; a failing step does not stop the next
# ones, and the script exits non-zero if any failed. Time limits per step (seconds) can be
# changed with BENCH_TIMEOUT, TORCH_TIMEOUT; the defaults keep the run under 8 minutes.
# PYTHON picks the interpreter (default python3).
# SYNTHETIC=path/to/synthetic_sala (built with --features cuda) adds the synthetic full-size
# run with the GPU solver -> OUT_DIR/synthetic.json (SYNTHETIC_ARGS sets its size, default
# "--layers 3 --samples 2 --seq-len 1024"; SYNTHETIC_TIMEOUT its limit, default 300 s).
set -uo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 BENCH_GPU_BINARY OUT_DIR [bench_gpu options...]" >&2
    exit 2
fi
BIN=$1
OUT=$2
shift 2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SUMMARY="$OUT/run.log"
: > "$SUMMARY"

source "$HERE/gpu_env.sh"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee -a "$SUMMARY"
echo "CUDA_PATH=${CUDA_PATH:-}" | tee -a "$SUMMARY"

status=0
# step NAME TIMEOUT_S COMMAND...: runs COMMAND with a time limit, tees OUT/NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T)): $*" | tee -a "$SUMMARY"
    local start=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=$?
    echo "== $name exit $rc after $((SECONDS - start)) s" | tee -a "$SUMMARY"
    if [ $rc -ne 0 ]; then
        status=1
        [ $rc -eq 124 ] && echo "   ($name hit its ${limit} s limit)" | tee -a "$SUMMARY"
    fi
}

if command -v nvidia-smi > /dev/null; then
    step nvidia-smi 30 nvidia-smi
fi
step bench_gpu "${BENCH_TIMEOUT:-300}" "$BIN" --data "$OUT/data" --json "$OUT/ours.json" "$@"
# TORCH_ARGS: extra torch_gptq.py options (word-split), e.g. "--reps 5".
# shellcheck disable=SC2086
step torch "${TORCH_TIMEOUT:-150}" "$PY" "$HERE/torch_gptq.py" \
    --data "$OUT/data" --json "$OUT/torch.json" ${TORCH_ARGS:-}
if [ -f "$OUT/ours.json" ] && [ -f "$OUT/torch.json" ]; then
    step compare 60 "$PY" "$HERE/compare.py" "$OUT/ours.json" "$OUT/torch.json" \
        --json "$OUT/comparison.json"
else
    echo "== compare skipped: ours.json or torch.json missing" | tee -a "$SUMMARY"
    status=1
fi
if [ -n "${SYNTHETIC:-}" ]; then
    # shellcheck disable=SC2086
    step synthetic "${SYNTHETIC_TIMEOUT:-300}" env CUBECL_AUTOTUNE_LEVEL=minimal "$SYNTHETIC" \
        --device cuda ${SYNTHETIC_ARGS:---layers 3 --samples 2 --seq-len 1024} \
        --json "$OUT/synthetic.json"
fi
echo "== done, status $status; logs in $OUT" | tee -a "$SUMMARY"
exit $status
