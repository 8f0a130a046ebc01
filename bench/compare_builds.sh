#!/usr/bin/env bash
# Two quantize_sala builds on the same slice of the production length mix, the checkpoints'
# shards compared byte for byte: for a change that should not move the bits (a blocking, an
# ordering), checked in minutes instead of two whole real jobs.
#
#   BIN=DIR OUT=DIR bash bench/compare_builds.sh BUILD_A BUILD_B [quantize_sala flags...]
#
# BIN holds the two builds (files BUILD_A and BUILD_B, built with `--features cuda`),
# make_fixture and calib-production.jsonl (`make_calib --production-mix`); each may be
# xz-compressed (FILE.xz). SAMPLES (default 4) and MAX_LEN (default 8192) pick the slice,
# RECIPE (default gptq) the recipe and QTIMEOUT (default 120) bounds each run. OUT receives
# each build's log, report and SHA-256 list; the last line says SAME BYTES or BYTES DIFFER.
set -u
A=$1; Bb=$2; shift 2
B=${BIN:-.device-bin}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
source "$HERE/gpu_env.sh"
for f in $B/*.xz; do [ -e "$f" ] && [ ! -f "${f%.xz}" ] && xz -dk "$f"; done
chmod +x $B/$A $B/$Bb $B/make_fixture
mkdir -p target
export CUDA_CACHE_PATH=$PWD/target/cuda-jit CUDA_CACHE_MAXSIZE=1073741824
MODEL=/tmp/sala-full-size
if [ ! -f $MODEL/model.safetensors.index.json ]; then
  $B/make_fixture --full-size $MODEL --config fixtures/minicpm-sala-9b-config.json > $OUT/make_fixture.log 2>&1
fi
for build in $A $Bb; do
  rm -rf /tmp/q-$build
  t=$SECONDS
  timeout --signal=INT --kill-after=5 ${QTIMEOUT:-120} $B/$build --device cuda --recipe ${RECIPE:-gptq} \
    --input $MODEL --output /tmp/q-$build --calib-data $B/calib-production.jsonl \
    --max-samples ${SAMPLES:-4} --max-len ${MAX_LEN:-8192} "$@" > $OUT/$build.log 2>&1
  echo "$build rc=$? $((SECONDS - t)) s"
  cp /tmp/q-$build/quantization_report.json $OUT/$build-report.json 2>/dev/null
  (cd /tmp/q-$build 2>/dev/null && sha256sum *.safetensors) > $OUT/$build-sha256.txt
done
if [ -s $OUT/$A-sha256.txt ] && diff $OUT/$A-sha256.txt $OUT/$Bb-sha256.txt > /dev/null; then
  echo "SAME BYTES"
else
  echo "BYTES DIFFER"
fi
