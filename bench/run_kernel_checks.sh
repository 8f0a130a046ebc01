#!/usr/bin/env bash
# A device session's first call, before any real-job run (see docs/results.md, the last
# section's plan): the CUDA kernel tests, the kernel benchmark and the forward's op-by-op
# profile, all from a scratch directory with kernel caches of their own, so that a real job
# run after them on the same machine still starts cold.
#
#   BIN=DIR OUT=DIR bash bench/run_kernel_checks.sh
#
# BIN holds, built with `--features cuda` (each may be xz-compressed, FILE.xz):
#   kernel_tests   the sala-kernels test binary (`cargo test -p sala-kernels --features cuda
#                  --release --test wgpu --no-run`)
#   bench_gpu      `cargo build -p sala-kernels --features cuda --release --example bench_gpu`
#   bench_forward  `cargo build --release --features cuda --example bench_forward`
# OUT receives kernel-tests.log, bench-gpu.log and .json, forward-profile.log and .json.
# KT_TIMEOUT, GPU_TIMEOUT and FWD_TIMEOUT bound the three steps (defaults 200, 150, 230 s: together inside one 600 s device call).
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
B=$(cd "${BIN:-.device-bin}" && pwd)
: "${OUT:?set OUT to the directory for the logs}"
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
for name in kernel_tests bench_gpu bench_forward; do
    if [ ! -f "$B/$name" ] && [ -f "$B/$name.xz" ]; then xz -dk "$B/$name.xz"; fi
    chmod +x "$B/$name"
done
PY=${PYTHON:-python3}
source "$HERE/gpu_env.sh"
SCRATCH=$(mktemp -d /tmp/kernel-checks.XXXXXX)
cd "$SCRATCH" || exit 1
export CUDA_CACHE_PATH=$SCRATCH/cuda-jit CUDA_CACHE_MAXSIZE=1073741824
export SALA_REQUIRE_DEVICE_TESTS=1

t=$SECONDS
timeout "${KT_TIMEOUT:-200}" "$B/kernel_tests" --test-threads 4 > "$OUT/kernel-tests.log" 2>&1
echo "kernel_tests rc=$? $((SECONDS - t)) s" | tee -a "$OUT/kernel-tests.log"
grep -E "^test result|FAILED|panicked" "$OUT/kernel-tests.log" | head -20

t=$SECONDS
timeout "${GPU_TIMEOUT:-150}" "$B/bench_gpu" --shapes 4096x4096,4096x16384 --tokens 16384 \
    --reps 3 --skip inverse_cpu,gptq_cpu,nvfp4_cpu,gptq_cubecl --json "$OUT/bench-gpu.json" \
    > "$OUT/bench-gpu.log" 2>&1
echo "bench_gpu rc=$? $((SECONDS - t)) s" | tee -a "$OUT/bench-gpu.log"
grep -E "hessian_|inverse_cusolver|nvfp4_gptq|gptq_cublas" "$OUT/bench-gpu.log" | head -30

t=$SECONDS
timeout "${FWD_TIMEOUT:-230}" "$B/bench_forward" --device cuda --cases 16x1024,1x131072 --reps 1 \
    --profile-ops --json "$OUT/forward-profile.json" > "$OUT/forward-profile.log" 2>&1
echo "bench_forward rc=$? $((SECONDS - t)) s" | tee -a "$OUT/forward-profile.log"
grep -A12 "synchronised per op" "$OUT/forward-profile.log" | head -80
rm -rf "$SCRATCH"
