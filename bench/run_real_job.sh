#!/usr/bin/env bash
# The real job through the real CLI on one GPU (H200; see docs/results.md):
#
#   bash bench/run_real_job.sh BIN_DIR CALIB.jsonl OUT_DIR [quantize_sala options...]
#
# 1. BIN_DIR/make_fixture --full-size writes a seeded random-weight full-size MiniCPM-SALA in
#    the released layout (4 bf16 shards, ~19 GB) to $MODEL (default /tmp/sala-full-size),
#    unless it is already there;
# 2. BIN_DIR/quantize_sala --device cuda quantizes it with CALIB.jsonl (96 samples truncated
#    to 4096 tokens by default: --max-samples 96 --max-len 4096) into $QUANTIZED (default
#    /tmp/sala-full-size-gptq, replaced), GPTQ W4A16 with SmoothQuant unless options say
#    otherwise; its log and reports (quantization_report.json, .html) go to OUT_DIR;
# 3. BIN_DIR/verify_checkpoint checks the output.
# Binaries are built with `cargo build --release --features cuda --example ...`. The kernel
# caches live under target/ of the working directory (target/sala-kernels/<fingerprint>,
# target/autotune;
# the driver's CUDA_CACHE_PATH=target/cuda-jit): keep them between runs for a warm start.
# MAKE_TIMEOUT, QUANTIZE_TIMEOUT and VERIFY_TIMEOUT (seconds) bound the steps.
set -uo pipefail

if [ $# -lt 3 ]; then
    echo "usage: $0 BIN_DIR CALIB.jsonl OUT_DIR [quantize_sala options...]" >&2
    exit 2
fi
BIN=$1
CALIB=$2
OUT=$3
shift 3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
MODEL=${MODEL:-/tmp/sala-full-size}
QUANTIZED=${QUANTIZED:-/tmp/sala-full-size-gptq}
mkdir -p "$OUT" target
source "$HERE/gpu_env.sh"
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$PWD/target/cuda-jit}
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-1073741824}
export RUST_BACKTRACE=1

# timed NAME LIMIT COMMAND...: runs COMMAND under a time limit (and GNU time when present, for
# the peak RSS), tees OUT/NAME.log, prints the exit status and the wall time.
status=0
timed() {
    local name=$1 limit=$2
    shift 2
    local gnu_time=()
    [ -x /usr/bin/time ] && gnu_time=(/usr/bin/time -v)
    echo "== $name ($(date +%T)): $*"
    local start=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "${gnu_time[@]}" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name exit $rc after $((SECONDS - start)) s"
    [ "$rc" -ne 0 ] && status=1
    return "$rc"
}

if [ ! -f "$MODEL/model.safetensors.index.json" ]; then
    timed make_fixture "${MAKE_TIMEOUT:-300}" "$BIN/make_fixture" --full-size "$MODEL" \
        --config fixtures/minicpm-sala-9b-config.json || exit 1
fi
rm -rf "$QUANTIZED"
timed quantize "${QUANTIZE_TIMEOUT:-560}" "$BIN/quantize_sala" --device cuda \
    --input "$MODEL" --output "$QUANTIZED" --calib-data "$CALIB" \
    --max-samples 96 --max-len 4096 "$@"
[ -f "$QUANTIZED/quantization_report.json" ] && cp "$QUANTIZED/quantization_report.json" "$OUT/"
[ -f "$QUANTIZED/quantization_report.html" ] && cp "$QUANTIZED/quantization_report.html" "$OUT/"
if [ -d "$QUANTIZED" ]; then
    timed verify "${VERIFY_TIMEOUT:-240}" "$BIN/verify_checkpoint" "$QUANTIZED"
fi
exit $status
