#!/usr/bin/env bash
# The GPU-solved real job against the host solver on its first two layers (docs/results.md):
#
#   bash bench/run_host_comparison.sh BIN_DIR CALIB.jsonl OUT_DIR
#
# Run after bench/run_real_job.sh (same MODEL, QUANTIZED and calibration): quantizes MODEL again
# with `--host-solver` (statistics still on the GPU, GPTQ in f64 on the host with faer), layers
# 0 and 1 only (`--layer-bits 2-31:16` keeps the rest in bf16), into $HOST_QUANTIZED (default
# /tmp/sala-full-size-gptq-host, replaced); then BIN_DIR/compare_checkpoints compares the two
# checkpoints' layers 0 and 1 (codes, scales, dequantized weights) into OUT_DIR/comparison.json.
# HOST_TIMEOUT bounds the quantization (seconds).
set -uo pipefail

if [ $# -ne 3 ]; then
    echo "usage: $0 BIN_DIR CALIB.jsonl OUT_DIR" >&2
    exit 2
fi
BIN=$1
CALIB=$2
OUT=$3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
MODEL=${MODEL:-/tmp/sala-full-size}
QUANTIZED=${QUANTIZED:-/tmp/sala-full-size-gptq}
HOST_QUANTIZED=${HOST_QUANTIZED:-/tmp/sala-full-size-gptq-host}
mkdir -p "$OUT" target
source "$HERE/gpu_env.sh"
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$PWD/target/cuda-jit}

for dir in "$MODEL" "$QUANTIZED"; do
    if [ ! -d "$dir" ]; then
        echo "$dir is missing: run bench/run_real_job.sh first" >&2
        exit 1
    fi
done
rm -rf "$HOST_QUANTIZED"
echo "== host solver, layers 0-1 ($(date +%T))"
start=$SECONDS
timeout --signal=INT --kill-after=15 "${HOST_TIMEOUT:-300}" \
    "$BIN/quantize_sala" --device cuda --host-solver --layer-bits 2-31:16 \
    --input "$MODEL" --output "$HOST_QUANTIZED" --calib-data "$CALIB" \
    --max-samples 96 --max-len 4096 2>&1 | tee "$OUT/host_quantize.log"
rc=${PIPESTATUS[0]}
echo "== host solver exit $rc after $((SECONDS - start)) s"
[ "$rc" -ne 0 ] && exit 1
"$BIN/compare_checkpoints" "$QUANTIZED" "$HOST_QUANTIZED" --modules '^model\.layers\.[01]\.' \
    --json "$OUT/comparison.json" 2>&1 | tee "$OUT/comparison.log"
exit "${PIPESTATUS[0]}"
