#!/usr/bin/env bash
# --resume on a GPU, as a user would meet it (run on an H200 on 2026-12-02: identical files for
# both recipes; docs/formats.md):
#
#   bash bench/resume_gpu.sh path/to/quantize_sala OUT_DIR
#
# For each recipe on the bundled trained fixture: two uninterrupted `--device cuda` runs (so
# that a difference can be told apart from run-to-run nondeterminism), then a `--resume` run
# killed by the test hook after layer 3 and resumed; every file but the reports
# (quantization_report.json and .html, which hold timings) is compared with the first run's.
# quantize_sala must be built with `--features cuda`.
set -u
if [ $# -ne 2 ]; then
    echo "usage: $0 QUANTIZE_SALA_BINARY OUT_DIR" >&2
    exit 2
fi
Q=$1
W=$2
mkdir -p "$W" target
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$PWD/target/cuda-jit}
status=0
for r in gptq nvfp4; do
    common=(--device cuda --recipe "$r" --nvfp4-coverage all)
    for run in ref ref2; do
        timeout 600 "$Q" "${common[@]}" --output "$W/$run-$r" --quiet >"$W/$run-$r.log" 2>&1
        echo "$run $r: exit $?"
    done
    SALA_QUANTIZE_KILL_AFTER_LAYER=3 timeout 600 "$Q" "${common[@]}" --output "$W/res-$r" \
        --resume >"$W/kill-$r.log" 2>&1
    echo "killed $r: exit $? (SIGKILL expected: 137)"
    timeout 600 "$Q" "${common[@]}" --output "$W/res-$r" --resume >"$W/res-$r.log" 2>&1
    echo "resumed $r: exit $?"
    grep -E "continuing" "$W/res-$r.log" | head -2
    for other in ref2 res; do
        for f in $(cd "$W/ref-$r" && ls); do
            # The reports carry wall-clock timings (the HTML page is rendered from the JSON).
            case "$f" in quantization_report.json|quantization_report.html) continue ;; esac
            if cmp -s "$W/ref-$r/$f" "$W/$other-$r/$f"; then
                echo "  $other-$r: $f identical"
            else
                echo "  $other-$r: $f DIFFERS"
                status=1
            fi
        done
    done
done
exit $status
