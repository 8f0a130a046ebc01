# The environment of the GPU benchmarks, sourced by run_h200.sh and run_forward.sh: library
# paths for cudarc (cuBLAS, cuSOLVER, NVRTC) and CUDA_PATH for cubecl-cuda's NVRTC includes.
# Expects PY (the Python interpreter holding torch) to be set.
# Libraries: the toolkit's first (cuBLAS/cuSOLVER/NVRTC 13), then those bundled with torch
# (nvidia/*/lib), so that the binary finds a complete set either way.
libdirs=()
if [ -d /usr/local/cuda/lib64 ]; then
    libdirs+=(/usr/local/cuda/lib64)
fi
while IFS= read -r dir; do
    [ -n "$dir" ] && libdirs+=("$dir")
done < <("$PY" - <<'EOF' 2>/dev/null
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
try:
    import torch
    roots.append(os.path.dirname(torch.__file__))
except Exception:
    pass
seen = set()
for root in roots:
    for pattern in ("*/lib", "*/*/lib", "lib"):
        for d in sorted(glob.glob(os.path.join(root, pattern))):
            if os.path.isdir(d) and d not in seen:
                seen.add(d)
                print(d)
EOF
)
LD_LIBRARY_PATH="$(IFS=:; echo "${libdirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
# cubecl-cuda looks for the CUDA headers (NVRTC includes) under CUDA_PATH.
if [ -z "${CUDA_PATH:-}" ] && [ -d /usr/local/cuda ]; then
    export CUDA_PATH=/usr/local/cuda
fi
