"""Make the GPU kit: what bench/gpu.py needs on a lent GPU machine that has no network, no rpcfleet
dependencies beyond a few and no llama-cpp-python, within the files it may be sent (64 MiB with the tree).

    .venv/bin/python bench/gpu_kit.py                     # make .gpu-kit/ (the sm_90 build, cached)
    .venv/bin/python bench/gpu_kit.py --cuda-arch 89      # another GPU architecture
    .venv/bin/python bench/gpu_kit.py --image-libs DIR    # also check the binaries against older cuBLAS

The kit (a folder at the repository's root, ignored by git, carried to the machine with the tree):
- `artifacts/`: the cuda artifact for one architecture, built here with `artifact build --backend cuda
  --cuda-arch ARCH`, less the cuBLAS it deploys with (hundreds of MB): the machine's own cuBLAS is used,
  through `rpc_env` LD_LIBRARY_PATH; its libcudart (under 1 MB) stays in; and the vulkan artifact;
- `engine.tar.gz`: llama-server and llama-fit-params (CPU, this source's): the check loads through them;
- `wheels/`: cp312 wheels (the lock's versions) of what the machine's Python lacks;
- `debs/`: Debian's Vulkan loader with glvnd (`root/`, unpacked over / when the machine has no loader) and
  vulkaninfo with its libraries (`aside/`, unpacked into the cache folder when vulkaninfo is absent);
- `run.sh`: the one command (bench/gpu_kit_run.sh), and `kit.json`: what is in it, with sizes.

With --image-libs DIR (a folder holding an older libcublas.so.13 and libcublasLt.so.13, such as NVIDIA's
13.0 wheels' nvidia/cu13/lib), it checks that every versioned symbol the kit's binaries take from cuBLAS is
defined there, and refuses the kit otherwise. Its only network is PyPI and Debian (wheels, packages).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from _common import ROOT, commit

KIT_DIR = ROOT / ".gpu-kit"
# What the device may be sent is 64 MiB with the tree; the tree takes about 6 MiB.
KIT_LIMIT = 58 << 20
# What the GPU image's Python lacks of rpcfleet's dependencies (the listing), with theirs; numpy,
# pyyaml, psutil, rich and httpx are there. Versions are the lock's.
KIT_PACKAGES = (
    "asyncssh", "cryptography", "cffi", "pycparser", "typing-extensions", "structlog", "tenacity", "gguf",
    "tqdm",
)  # fmt: skip
# Debian's Vulkan loader and what NVIDIA's ICD needs of glvnd, unpacked over / (as the lent machines'
# notes say), and vulkaninfo with its X11/Wayland libraries, unpacked aside (they could break /): the
# node facts ask vulkaninfo which Vulkan devices there are.
KIT_DEBS = {
    "root": ("libvulkan1", "libegl1", "libglvnd0", "libopengl0", "libgl1", "libglx0", "libgles2"),
    "aside": ("vulkan-tools", "libwayland-client0", "libx11-6", "libxcb1", "libxau6", "libxdmcp6",
              "libbsd0", "libmd0", "libffi8"),
}  # fmt: skip
# cuBLAS is left to the machine; libcudart stays (small, and the binaries' own release).
MACHINE_LIBS = ("libcublas.so.13", "libcublasLt.so.13")
PYTHON = "3.12"


class Refused(Exception):
    """A reason the kit cannot be made (exit status 2)."""


def lock_pins(names: tuple[str, ...], lock: Path = ROOT / "requirements.lock") -> list[str]:
    """`name==version` for each name from the dependency lock (names as the lock writes them)."""
    found = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock.read_text(), re.M))
    missing = [n for n in names if n not in found]
    if missing:
        raise Refused(f"{lock}: no pin for {', '.join(missing)}")
    return [f"{n}=={found[n]}" for n in names]


def run(command: list[str], what: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise Refused(f"{what} failed ({done.returncode}): {said[-1] if said else ''}")
    return done  # type: ignore[no-any-return]


def cuda_artifact(arch: str) -> str:
    """The id of the cuda artifact for `arch`, built here once (about 40 minutes on 2 cores)."""
    done = run(
        [sys.executable, "-m", "orchestrator", "artifact", "build", "--backend", "cuda", "--cuda-arch", arch,
         "--json"],
        "the cuda artifact's build", cwd=ROOT, timeout=4 * 3600,
    )  # fmt: skip
    return str(json.loads(done.stdout)["id"])


def kit_cuda_artifact(artifact_id: str) -> tuple[str, dict[str, int]]:
    """The cuda artifact less `MACHINE_LIBS`, stored as an artifact of its own (its manifest says what it
    is): (its id, {left-out soname: bytes})."""
    from orchestrator.artifacts.manifest import scan_files
    from orchestrator.artifacts.store import load_artifact, store, unpack_artifact

    full = load_artifact(artifact_id)
    with tempfile.TemporaryDirectory(prefix="rpcfleet-kit-") as tmp:
        stage = Path(tmp) / "stage"
        unpack_artifact(full, stage)
        (stage / "manifest.json").unlink(missing_ok=True)
        left_out = {}
        for name in MACHINE_LIBS:
            path = stage / "bin" / name
            if path.exists():
                left_out[name] = path.stat().st_size
                path.unlink()
        manifest = dataclasses.replace(
            full.manifest,
            files=scan_files(stage),
            source=f"kit:{full.id} less {', '.join(MACHINE_LIBS)} (the machine's, through rpc_env)",
        )
        return store(stage, manifest).id, left_out


def undefined_versioned(path: Path) -> set[tuple[str, str]]:
    """(symbol, version) pairs an ELF file takes from others (`nm -D --undefined-only`)."""
    out = run(["nm", "-D", "--undefined-only", str(path)], f"nm {path.name}").stdout
    return {(m.group(1), m.group(2)) for m in re.finditer(r"\bU (\S+?)@+(\S+)", out)}


def defined_versioned(path: Path) -> set[tuple[str, str]]:
    out = run(["nm", "-D", "--defined-only", str(path)], f"nm {path.name}").stdout
    return {(m.group(1), m.group(2)) for m in re.finditer(r"\b[TtWwDdBbRrVvi] (\S+?)@+(\S+)", out)}


def check_machine_libs(bin_dir: Path, image_libs: Path) -> list[str]:
    """What the kit's binaries need from cuBLAS that `image_libs`' cuBLAS lacks ([] when it loads)."""
    offered: set[tuple[str, str]] = set()
    for name in MACHINE_LIBS:
        library = image_libs / name
        if not library.is_file():
            raise Refused(f"--image-libs {image_libs}: no {name}")
        offered |= defined_versioned(library)
    versions = {version for _, version in offered}
    needed = set()
    for path in bin_dir.iterdir():  # the kit's own files: the machine's libraries are not checked
        if path.is_file() and not path.is_symlink() and path.name not in MACHINE_LIBS:
            needed |= {s for s in undefined_versioned(path) if s[1] in versions}
    return sorted(f"{symbol}@{version}" for symbol, version in needed - offered)


# pip's target: the machine's CPython and its manylinux platform (the image is glibc 2.28 or newer)
TARGET = ["--only-binary", ":all:", "--python-version", PYTHON, "--implementation", "cp",
          "--abi", f"cp{PYTHON.replace('.', '')}", "--abi", "abi3", "--abi", "none",
          "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
          "--platform", "manylinux2014_x86_64", "--platform", "any"]  # fmt: skip


def download_wheels(folder: Path) -> None:
    """The lock's wheels of `KIT_PACKAGES` for the machine's Python, and pip's own word, offline, that
    they install there (a dry run against the same target)."""
    folder.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    pins = lock_pins(KIT_PACKAGES)
    run([*pip, "download", "-q", "--no-deps", *TARGET, "-d", str(folder), *pins],
        "pip download of the kit's wheels", timeout=600)  # fmt: skip
    with tempfile.TemporaryDirectory() as target:
        run([*pip, "install", "-q", "--dry-run", "--no-index", "--no-deps", *TARGET, "--target", target,
             *map(str, sorted(folder.glob("*.whl")))], "the wheels' install check", timeout=300)  # fmt: skip


def download_debs(folder: Path) -> None:
    for where, packages in KIT_DEBS.items():
        (folder / where).mkdir(parents=True)
        run(["apt-get", "download", *packages], "apt-get download of the Vulkan loader", cwd=folder / where,
            timeout=300)  # fmt: skip


def pack_engine(dest: Path) -> str:
    """llama-server and llama-fit-params (built here, cached) as `<key>/...` in a tar.gz; their key."""
    from orchestrator.artifacts.build import build_llama_tools

    folder = build_llama_tools()
    with tarfile.open(dest, "w:gz", compresslevel=9) as tar:
        tar.add(folder, arcname=folder.name)
    return folder.name


def make_kit(out: Path, arch: str, image_libs: Path | None) -> dict[str, object]:
    from orchestrator.artifacts.build import default_artifact
    from orchestrator.artifacts.store import artifacts_dir, load_artifact

    full_id = cuda_artifact(arch)
    full = load_artifact(full_id)
    kit_id, left_out = kit_cuda_artifact(full_id)
    vulkan_id = default_artifact("vulkan").id
    staging = Path(tempfile.mkdtemp(prefix=".gpu-kit-", dir=out.parent))
    try:
        if image_libs is not None:
            with tempfile.TemporaryDirectory() as tmp:
                unpack = Path(tmp)
                from orchestrator.artifacts.store import unpack_artifact

                unpack_artifact(full, unpack)
                lacking = check_machine_libs(unpack / "bin", image_libs)
            if lacking:
                raise Refused(f"the image's cuBLAS ({image_libs}) lacks {', '.join(lacking[:5])}")
        (staging / "artifacts").mkdir()
        for artifact_id in (kit_id, vulkan_id):
            for suffix in (".tar.gz", ".json"):
                shutil.copy(artifacts_dir() / f"{artifact_id}{suffix}", staging / "artifacts")
        engine_key = pack_engine(staging / "engine.tar.gz")
        download_wheels(staging / "wheels")
        download_debs(staging / "debs")
        shutil.copy(ROOT / "bench" / "gpu_kit_run.sh", staging / "run.sh")
        (staging / "run.sh").chmod(0o755)
        sizes = {p.relative_to(staging).as_posix(): p.stat().st_size for p in sorted(staging.rglob("*"))
                 if p.is_file()}  # fmt: skip
        info: dict[str, object] = {
            "commit": commit(),
            "cuda_arch": arch,
            "cuda": kit_id,
            "cuda_deployed": full_id,
            "cuda_deployed_bytes": sum(f.size for f in full.manifest.files),
            "cuda_version": full.manifest.cuda_version,
            "left_to_the_machine": left_out,
            "image_libs_checked": str(image_libs) if image_libs else None,
            "vulkan": vulkan_id,
            "engine": engine_key,
            "bytes": sum(sizes.values()),
            "files": sizes,
        }
        (staging / "kit.json").write_text(json.dumps(info, indent=1) + "\n")
        total = sum(sizes.values())
        if total > KIT_LIMIT:
            biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
            raise Refused(
                f"the kit is {total / 2**20:.1f} MiB, over {KIT_LIMIT >> 20} MiB: "
                + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in biggest)
            )
        shutil.rmtree(out, ignore_errors=True)
        staging.replace(out)
        return info
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=KIT_DIR, help="the kit's folder (default .gpu-kit)")
    # SASS for sm_90 only (H100, H200): "90" adds PTX, and the kit no longer fits (62 MiB, measured)
    parser.add_argument(
        "--cuda-arch", default="90-real", metavar="ARCH", help="GPU architecture (default 90-real)"
    )
    parser.add_argument("--image-libs", type=Path, default=None, metavar="DIR",
                        help="check the binaries against the cuBLAS in DIR")  # fmt: skip
    args = parser.parse_args()
    from orchestrator.artifacts.cuda import check_cuda_architectures

    try:
        arch = check_cuda_architectures(args.cuda_arch)
    except ValueError as exc:
        print(f"bench/gpu_kit.py: --cuda-arch: {exc}", file=sys.stderr)
        return 2
    try:
        info = make_kit(args.out.resolve(), arch, args.image_libs)
    except Refused as why:
        print(f"bench/gpu_kit.py: {why}", file=sys.stderr)
        return 2
    files = info["files"]
    assert isinstance(files, dict)
    for name, size in files.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"{info['bytes'] / 2**20:8.2f} MiB  in all, in {args.out} (limit {KIT_LIMIT >> 20} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
