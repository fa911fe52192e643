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
if ! ldconfig -p | grep 'libvulkan\.so\.1 ' >/dev/null; then   # grep reads it all: no SIGPIPE
    for deb in "$kit"/debs/root/*.deb; do dpkg-deb -x "$deb" /; done
    ldconfig
fi
if ! command -v vulkaninfo >/dev/null; then   # the node facts list Vulkan devices with it
    mkdir -p "$home/vulkan-tools"
    for deb in "$kit"/debs/aside/*.deb; do dpkg-deb -x "$deb" "$home/vulkan-tools"; done
    mkdir -p "$home/bin"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$home/vulkan-tools/usr/lib/x86_64-linux-gnu" \
        "$home/vulkan-tools/usr/bin/vulkaninfo" >"$home/bin/vulkaninfo"
    chmod +x "$home/bin/vulkaninfo"
    export PATH=$home/bin:$PATH
fi
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json   # where the lent machines mount the driver's
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ]; then
    export VK_DRIVER_FILES=$icd __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
cp -f "$kit"/artifacts/* "$home/artifacts/"
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
echo "kit set up in $(( $(date +%s) - started )) s (python: $python; cuBLAS: ${cublas:-none};" \
    "Vulkan ICD: ${VK_DRIVER_FILES:-none})"
export PYTHONUNBUFFERED=1
"$python" "$repo/bench/gpu.py" --kit "$kit" ${cuda_libs[@]+"${cuda_libs[@]}"} --logs "$out/logs" \
    --write "$out/BENCHMARKS.md" "$@" 2>&1 | tee "$out/gpu-check.log"
