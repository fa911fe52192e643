#!/bin/bash
# The GPU check on a lent machine, from the kit bench/gpu_kit.py made (this file is the kit's run.sh):
#   bash .gpu-kit/run.sh [bench/gpu.py's options]
# No network. It installs only what the machine lacks: the carried wheels when rpcfleet's dependencies do
# not import (pip --target, on PYTHONPATH), Debian's Vulkan loader when the linker knows none (root:
# unpacked over /, then ldconfig).
# The report goes to $OUT (the device tool's folder that comes back), else the kit's out/.
set -euo pipefail
kit=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$kit/.." && pwd)
out=${OUT:-$kit/out}
home=${RPCFLEET_HOME:-/tmp/rpcfleet-gpu}
python=${PYTHON:-python3}
mkdir -p "$out" "$home/artifacts" "$home/engine"
export RPCFLEET_HOME=$home
started=$(date +%s)

deps="import asyncssh, structlog, tenacity, gguf, yaml, psutil, rich, numpy"
if ! "$python" -c "$deps" 2>/dev/null; then
    # into a folder of their own (no venv: the image's Python may lack ensurepip), first on PYTHONPATH
    "$python" -m pip install -q --no-index --no-deps --target "$home/site" "$kit"/wheels/*.whl
    export PYTHONPATH=$home/site${PYTHONPATH:+:$PYTHONPATH}
    "$python" -c "$deps"
fi
if ! ldconfig -p | grep -q 'libvulkan\.so\.1 '; then
    for deb in "$kit"/debs/*.deb; do dpkg-deb -x "$deb" /; done
    ldconfig
fi
cp -n "$kit"/artifacts/* "$home/artifacts/"
tar -xzf "$kit/engine.tar.gz" -C "$home/engine"
[ -f "$out/BENCHMARKS.md" ] || cp "$repo/BENCHMARKS.md" "$out/BENCHMARKS.md"

# The machine's cuBLAS alone in a folder for rpc_env's LD_LIBRARY_PATH (the kit's libcudart stays first).
cublas=$("$python" - <<'EOF'
import sys
from pathlib import Path
for entry in sys.path:
    for lib in sorted(Path(entry or ".").glob("nvidia/cu13/lib/libcublasLt.so.13")):
        print(lib.parent)
        raise SystemExit
EOF
)
cuda_libs=()
if [ -n "$cublas" ]; then
    mkdir -p "$home/cublas"
    ln -sf "$cublas/libcublas.so.13" "$cublas/libcublasLt.so.13" "$home/cublas/"
    cuda_libs=(--cuda-libs "$home/cublas")
fi
echo "kit set up in $(( $(date +%s) - started )) s (python: $python; cuBLAS: ${cublas:-none})"
exec "$python" "$repo/bench/gpu.py" --kit "$kit" "${cuda_libs[@]}" --write "$out/BENCHMARKS.md" "$@"
