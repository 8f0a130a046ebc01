#!/usr/bin/env bash
# The calibration-forward benchmark in one command (H200; see docs/results.md):
#
#   bash bench/run_forward.sh path/to/bench_forward OUT_DIR [bench_forward options...]
#
# 1. bench_forward (built with --features cuda) times one layer of each kind on packs of short
#    samples and one long sample, writes OUT_DIR/ours.json and dumps weights, inputs and
#    outputs to OUT_DIR/dump;
# 2. bench/torch_layer.py runs the same layers in PyTorch on the dumped inputs and writes the
#    merged report OUT_DIR/forward.json (the shape of bench/results/forward-h200.json).
# The kernel caches live under target/ of the working directory: ours
# (target/sala-kernels/<fingerprint>,
# target/autotune) and the driver's JIT cache (CUDA_CACHE_PATH=target/cuda-jit, so that a
# second run skips the PTX → SASS compilation too). Keep them between runs for a warm start.
# FORWARD_TIMEOUT and TORCH_TIMEOUT (seconds) bound the two steps (defaults 420 and 240).
set -uo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 BENCH_FORWARD_BINARY OUT_DIR [bench_forward options...]" >&2
    exit 2
fi
BIN=$1
OUT=$2
shift 2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT" target
source "$HERE/gpu_env.sh"
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$PWD/target/cuda-jit}
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-1073741824}
export RUST_BACKTRACE=1

status=0
echo "== bench_forward ($(date +%T)): $*"
timeout --signal=INT --kill-after=15 "${FORWARD_TIMEOUT:-420}" \
    "$BIN" --device cuda --json "$OUT/ours.json" --dump "$OUT/dump" "$@" 2>&1 | tee "$OUT/forward.log"
rc=${PIPESTATUS[0]}
echo "== bench_forward exit $rc"
[ "$rc" -ne 0 ] && status=1
if [ -f "$OUT/ours.json" ]; then
    echo "== torch_layer ($(date +%T))"
    PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=15 "${TORCH_TIMEOUT:-240}" \
        "$PY" "$HERE/torch_layer.py" --dump "$OUT/dump" --ours "$OUT/ours.json" \
        --out "$OUT/forward.json" 2>&1 | tee "$OUT/torch.log"
    rc=${PIPESTATUS[0]}
    echo "== torch_layer exit $rc"
    [ "$rc" -ne 0 ] && status=1
fi
exit $status
