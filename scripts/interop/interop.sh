#!/usr/bin/env bash
# Decodes checkpoints written by sala-export with the Python libraries' own readers
# (compressed-tensors, NVIDIA ModelOpt, GPTQModel; all on CPU) and compares them with our
# reader's dequantized weights. NOT part of CI: it installs a ~6 GB Python stack.
#
#   scripts/interop/interop.sh GPTQ_DIR NVFP4_DIR
#
# Each DIR is a checkpoint written by sala-export (for example by the pipeline on the bundled
# fixture). The venv goes to ${INTEROP_VENV:-target/interop-venv}.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${INTEROP_VENV:-$root/target/interop-venv}"
[ $# -eq 2 ] || { echo "usage: $0 GPTQ_DIR NVFP4_DIR" >&2; exit 2; }

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --upgrade pip
    # The CPU wheel index keeps the download small; set TORCH_INDEX= (empty) to take torch
    # from PyPI (with its CUDA libraries) where download.pytorch.org is not reachable.
    torch_index="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
    "$venv/bin/pip" install ${torch_index:+--index-url "$torch_index"} \
        "$(grep '^torch==' "$here/requirements.txt")"
    "$venv/bin/pip" install -r "$here/requirements.txt"
fi
"$venv/bin/pip" freeze | grep -iE '^(torch|safetensors|numpy|compressed-tensors|nvidia-modelopt|gptqmodel)=='

status=0
for dir in "$1" "$2"; do
    deq="$(mktemp -d)/ours.safetensors"
    cargo run --quiet --release --manifest-path "$root/Cargo.toml" \
        --example verify_checkpoint -- "$dir" --dump-dequantized "$deq"
    "$venv/bin/python" "$here/compare.py" "$dir" "$deq" || status=1
done
exit $status
