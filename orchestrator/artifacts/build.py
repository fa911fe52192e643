"""Building a `ggml-rpc-server` artifact from the same source as the installed binding."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from orchestrator.artifacts.cuda import (
    PYPI_TOOLKIT_DEFINES,
    bundle_runtime,
    cuda_toolkit,
    system_toolkit,
    toolkit_key,
    toolkit_release,
)
from orchestrator.artifacts.manifest import (
    BACKENDS,
    DEFAULT_LLAMA_CPP_PYTHON_VERSION,
    SERVER_NAME,
    Artifact,
    ArtifactChoiceError,
    ArtifactSpec,
    Manifest,
    host_platform,
    llama_cpp_python_version,
    scan_files,
)
from orchestrator.artifacts.patches import SourcePatch, apply_patches, client_patches, patches_for
from orchestrator.artifacts.source import (
    ensure_sdist,
    extract_source,
    read_ggml_version,
    read_llama_cpp_commit,
    read_protocol_version,
)
from orchestrator.artifacts.store import Progress, artifacts_dir, recall, remember, store, unpack_artifact
from orchestrator.core.errors import ArtifactError
from orchestrator.core.log import get_logger
from orchestrator.core.paths import rpcfleet_home
from orchestrator.engine.children import open_child, run_child

# cmake -D definitions every build gets; the user's --cmake-arg overrides them by variable name.
BASE_DEFINES: dict[str, str] = {
    "GGML_RPC": "ON",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_SERVER": "OFF",
    "LLAMA_CURL": "OFF",
    # Portable by default: GGML_NATIVE=ON adds -march=native and the binary may not run on another CPU.
    "GGML_NATIVE": "OFF",
    "CMAKE_BUILD_TYPE": "Release",
    # The binary must find its libggml*.so wherever it is unpacked: RUNPATH=$ORIGIN, never the build dir.
    "CMAKE_BUILD_WITH_INSTALL_RPATH": "ON",
    "CMAKE_INSTALL_RPATH": "$ORIGIN",
}


BACKEND_DEFINES: dict[str, dict[str, str]] = {
    "cpu": {},
    "cuda": {"GGML_CUDA": "ON"},
    "rocm": {"GGML_HIP": "ON"},
    "vulkan": {"GGML_VULKAN": "ON"},
    "metal": {"GGML_METAL": "ON"},
}


CONFIGURE_TIMEOUT_S = 900.0


BUILD_TIMEOUT_S = 3600.0


def _split_define(arg: str) -> tuple[str, str] | None:
    """("NAME", "VALUE") for "-DNAME=VALUE" or "-DNAME:TYPE=VALUE", else None."""
    match = re.match(r"^-D([A-Za-z_][A-Za-z0-9_]*)(?::[A-Za-z]+)?=(.*)$", arg)
    return (match.group(1), match.group(2)) if match else None


def effective_cmake_args(backend: str, cmake_args: Sequence[str] = ()) -> tuple[str, ...]:
    """The full cmake configure arguments: base defines + backend defines + the user's, in a canonical
    order (defines sorted by name, later ones overriding earlier; other arguments after, as given)."""
    if backend not in BACKENDS:
        raise ArtifactChoiceError(f"unknown backend {backend!r}", hint=f"one of: {', '.join(BACKENDS)}")
    defines = {**BASE_DEFINES, **BACKEND_DEFINES[backend]}
    if backend == "cuda" and system_toolkit() is None:
        defines.update(PYPI_TOOLKIT_DEFINES)  # the PyPI toolkit (artifacts.cuda) has no driver stub
    others: list[str] = []
    for arg in cmake_args:
        split = _split_define(arg)
        if split is None:
            others.append(arg)
        else:
            defines[split[0]] = split[1]
    return (*(f"-D{k}={v}" for k, v in sorted(defines.items())), *others)


def is_native(cmake_args: Sequence[str]) -> bool:
    value = "ON"  # llama.cpp's default when not given
    for arg in cmake_args:
        split = _split_define(arg)
        if split and split[0] == "GGML_NATIVE":
            value = split[1]
    return value.upper() in ("ON", "1", "TRUE", "YES", "Y")


def build_key(
    version: str, backend: str, cmake_args: Sequence[str], os_name: str | None = None, arch: str | None = None
) -> str:
    """The cache key of a local build: hash of (llama-cpp-python version, backend, sorted args, os, arch,
    the source patches for the backend)."""
    host_os, host_arch = host_platform()
    patches = [p.label for p in patches_for(backend)]
    parts: list[Any] = ["build", version, backend, sorted(cmake_args), os_name or host_os, arch or host_arch]
    parts.append(patches)
    if backend == "cuda":  # which nvcc built it; the artifact carries its runtime libraries
        parts.append("system" if system_toolkit() is not None else f"pypi-{toolkit_key()}")
        parts.append("runtime-bundled")
    data = json.dumps(parts).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def source_key(spec: ArtifactSpec, os_name: str, arch: str) -> str:
    data = json.dumps(
        [spec.kind, spec.sha256, spec.subdir, spec.protocol, spec.backend, os_name, arch, spec.native,
         list(spec.cmake_args), spec.llama_cpp_commit]
    ).encode()  # fmt: skip
    return hashlib.sha256(data).hexdigest()[:16]


def local_server_binary(version: str | None = None, backend: str = "cpu") -> Path:
    """The server of the `backend` artifact built from llama-cpp-python `version` (default: the installed
    one), built on first use and unpacked once into `$RPCFLEET_HOME/artifacts/<id>/`."""
    artifact = default_artifact(backend) if version is None else build_artifact(backend, version=version)
    target = artifacts_dir() / artifact.id
    binary = target / artifact.manifest.server_path
    if (target / ".complete").exists() and binary.exists():
        return binary
    staging = Path(tempfile.mkdtemp(prefix=f".{artifact.id}-", dir=artifacts_dir()))
    try:
        unpack_artifact(artifact, staging)
        (staging / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        try:
            staging.replace(target)
        except OSError:
            if not (target / ".complete").exists():  # else another process unpacked it meanwhile
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return binary


def cached_build(
    backend: str = "cpu", cmake_args: Sequence[str] = (), *, version: str | None = None
) -> Artifact | None:
    """The cached artifact for this build request, or None (fast: no hashing, no subprocess)."""
    args = effective_cmake_args(backend, cmake_args)
    return recall(build_key(version or llama_cpp_python_version(), backend, args))


def default_artifact(backend: str = "cpu") -> Artifact:
    """The locally built artifact matching the installed llama-cpp-python (built on first use)."""
    return cached_build(backend) or build_artifact(backend)


def server_target(llama_dir: Path) -> str:
    """The server's cmake target in a vendored llama.cpp: `ggml-rpc-server`, or `rpc-server` in older
    sources (e.g. llama-cpp-python 0.3.16's, protocol 2.0.0)."""
    for folder in ("tools/rpc", "examples/rpc"):
        try:
            text = (llama_dir / folder / "CMakeLists.txt").read_text(errors="replace")
        except OSError:
            continue
        match = re.search(r"set\(\s*TARGET\s+([A-Za-z0-9_.-]+)\s*\)", text)
        if match:
            return match.group(1)
    return SERVER_NAME


def build_artifact(
    backend: str = "cpu",
    cmake_args: Sequence[str] = (),
    *,
    version: str | None = None,
    progress: Progress | None = None,
) -> Artifact:
    """Build ggml-rpc-server from the llama.cpp vendored by llama-cpp-python `version` (default: the
    installed one, so that server and binding match) and store it in the cache; returns the cached
    artifact at once when this request was built before. Only the server target is built."""
    args = effective_cmake_args(backend, cmake_args)
    version = version or llama_cpp_python_version()
    key = build_key(version, backend, args)
    cached = recall(key)
    if cached is not None:
        return cached
    say = progress or (lambda _line: None)
    workdir = rpcfleet_home() / "build" / key
    workdir.mkdir(parents=True, exist_ok=True)
    with _locked(workdir / ".lock"):
        cached = recall(key)  # another process may have built it while we waited
        if cached is not None:
            return cached
        sdist = ensure_sdist(version, say)
        source = extract_source(sdist, workdir / "src", say)
        llama = source / "vendor" / "llama.cpp"
        patched = apply_patches(llama, patches_for(backend, version))
        if patched:
            say(f"patched the source: {', '.join(patched)}")
        protocol = read_protocol_version(llama / "ggml" / "include" / "ggml-rpc.h")
        build_dir = workdir / "build"
        log_path = workdir / "build.log"
        env = backend_environment(backend, args, say)
        cuda_version = toolkit_release(cuda_toolkit().nvcc) if backend == "cuda" else None
        with log_path.open("w") as log:
            say(f"configuring llama.cpp ({backend}) in {build_dir}")
            _run_logged(
                ["cmake", "-S", str(llama), "-B", str(build_dir), *args],
                log,
                say,
                CONFIGURE_TIMEOUT_S,
                env=env,
                what=f"configuring llama.cpp ({backend})",
            )
            target = server_target(llama)
            say(f"building {target} (log: {log_path})")
            jobs = str(os.cpu_count() or 1)
            _run_logged(
                ["cmake", "--build", str(build_dir), "--target", target, "-j", jobs],
                log,
                say,
                BUILD_TIMEOUT_S,
                env=env,
            )
        os_name, arch = host_platform()
        with tempfile.TemporaryDirectory(dir=workdir, prefix="stage-") as tmp:
            stage = Path(tmp)
            collect_server(build_dir / "bin", stage / "bin", target)
            if backend == "cuda":
                bundled = bundle_runtime(stage / "bin", cuda_toolkit().lib_dir)
                say(f"carries the CUDA runtime it links: {', '.join(bundled)} "
                    f"({sum(bundled.values()) / 1e6:.0f} MB)")  # fmt: skip
            _check_runpath(stage / "bin")
            manifest = Manifest(
                protocol=protocol,
                backend=backend,
                os=os_name,
                arch=arch,
                native=is_native(args),
                files=scan_files(stage),
                cmake_args=args,
                llama_cpp_commit=read_llama_cpp_commit(source / "CHANGELOG.md"),
                ggml_version=read_ggml_version(llama / "ggml" / "CMakeLists.txt"),
                llama_cpp_python_version=version,
                source=f"build:llama-cpp-python=={version}",
                patches=patched,
                cuda_version=cuda_version,
            )
            artifact = store(stage, manifest)
        remember(key, artifact)
        say(f"stored {artifact.id}")
        get_logger().info("artifact_built", id=artifact.id, key=key)
        return artifact


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def backend_environment(backend: str, args: Sequence[str], say: Progress) -> dict[str, str] | None:
    """The build's environment: a CUDA build finds its toolkit (the system's nvcc, else PyPI's) and
    must name its architectures, since no GPU may be there to detect them; others inherit ours."""
    if backend != "cuda":
        return None
    if not any((_split_define(a) or ("", ""))[0] == "CMAKE_CUDA_ARCHITECTURES" for a in args):
        raise ArtifactChoiceError(
            "a cuda build needs its GPU architectures",
            hint="rpcfleet artifact build --backend cuda --cuda-arch 89 (the compute capability without "
            "its dot, as `nvidia-smi --query-gpu=compute_cap --format=csv` prints it)",
        )
    toolkit = cuda_toolkit(say)
    say(f"CUDA toolkit: {toolkit.root} ({toolkit.source.split(':')[0]})")
    return toolkit.environment()


def _run_logged(
    command: list[str],
    log: Any,
    say: Progress,
    timeout: float,
    *,
    what: str = "building the rpc-server",
    env: dict[str, str] | None = None,
) -> None:
    """Run `command`, copying its output to `log` and cmake's `[ NN%]` lines to `say`."""
    log.write(f"$ {shlex.join(command)}\n")
    log.flush()
    tail: list[str] = []
    deadline = time.monotonic() + timeout
    with open_child(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail = [*tail[-40:], line]
            if re.match(r"^\[\s*\d+%\]", line):
                say(line.rstrip())
            if time.monotonic() > deadline:
                proc.kill()
                raise ArtifactError(f"timed out after {timeout:.0f} s", command=shlex.join(command))
        status = proc.wait()
    if status != 0:
        raise ArtifactError(
            f"{what} failed",
            command=shlex.join(command),
            exit_status=status,
            stderr="".join(tail),
            hint=f"full log: {log.name}",
        )


def _is_shared_lib(name: str) -> bool:
    return bool(re.search(r"\.so(\.\d+)*$|\.dylib$", name))


def collect_server(src: Path, dest: Path, server_name: str, *, dest_name: str = SERVER_NAME) -> None:
    """Copy the server binary and the shared libraries beside it (symlinks kept when they stay inside)."""
    dest.mkdir(parents=True, exist_ok=True)
    binary = src / server_name
    if not binary.is_file():
        raise ArtifactError(f"no {server_name} in {src}")
    shutil.copy2(binary, dest / dest_name)
    for path in sorted(src.iterdir()):
        if not _is_shared_lib(path.name) or (dest / path.name).exists() or (dest / path.name).is_symlink():
            continue
        if path.is_symlink():
            target = str(path.readlink())
            if "/" not in target and (src / target).exists():
                (dest / path.name).symlink_to(target)
                continue
        if path.is_file():
            shutil.copy2(path, dest / path.name)


def _check_runpath(bin_dir: Path) -> None:
    """Refuse binaries whose RUNPATH/RPATH holds anything but $ORIGIN (e.g. the build folder): they
    would work here and break on every node."""
    readelf = shutil.which("readelf")
    if readelf is None or sys.platform != "linux":
        return
    for path in sorted(bin_dir.iterdir()):
        if path.is_symlink() or not path.is_file():
            continue
        out = run_child(
            [readelf, "-d", str(path)], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        for match in re.finditer(r"\((?:RUNPATH|RPATH)\).*?\[(.*)\]", out):
            bad = [p for p in match.group(1).split(":") if p and not p.startswith("$ORIGIN")]
            if bad:
                raise ArtifactError(
                    f"{path.name} has RUNPATH {match.group(1)}: it would only run from the build folder",
                    hint="build with -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN'",
                )


# llama.cpp's own programs built for this machine from the same vendored source as the binding and the
# nodes' servers: `llama-server` (serve's engine) and `llama-fit-params` (a benchmark tool).
TOOL_TARGETS = ("llama-server", "llama-fit-params")

# The web UI is left out: its assets come from npm or a Hugging Face download, neither offline; serve
# proxies the API only. HTTPS (OpenSSL) is not needed on loopback.
TOOL_DEFINES: dict[str, str] = {
    **BASE_DEFINES,
    "LLAMA_BUILD_COMMON": "ON",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_OPENSSL": "OFF",
}


def tool_patches(version: str) -> tuple[SourcePatch, ...]:
    """The source patches of the tools build: the clients' (`patches.client_patches`), as the binding's
    wheel takes them (scripts/setup.sh), so llama-server looks its weights' hashes up the same way."""
    return client_patches(version)


def tools_key(
    sdist_sha256: str, targets: Sequence[str] = TOOL_TARGETS, patches: Sequence[SourcePatch] | None = None
) -> str:
    """The cache key of the tools build: the source's sha256, the targets, the flags, os and arch, and
    the labels (name@digest) of the source patches (default: those of the pinned version's build)."""
    os_name, arch = host_platform()
    flags = sorted(f"-D{k}={v}" for k, v in TOOL_DEFINES.items())
    chosen = tool_patches(DEFAULT_LLAMA_CPP_PYTHON_VERSION) if patches is None else patches
    labels = [p.label for p in chosen]
    data = json.dumps(["tools", sdist_sha256, sorted(targets), flags, os_name, arch, labels]).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def tools_dir(key: str) -> Path:
    """Where the tools of build `key` are kept, once complete."""
    return rpcfleet_home() / "engine" / key


def cached_tools(version: str | None = None) -> Path | None:
    """The folder holding llama-server (and llama-fit-params) built from llama-cpp-python `version`'s
    source, or None when not built yet (fast: the sdist's pinned sha256, no hashing)."""
    from orchestrator.artifacts.source import SDIST_SHA256

    version = version or llama_cpp_python_version()
    sha = SDIST_SHA256.get(version)
    if sha is None:
        return None
    key = tools_key(sha, patches=tool_patches(version))
    # A build is immutable and named by its source and flags: one in the default cache serves another
    # $RPCFLEET_HOME too (a test's, a demo's) rather than a second 10-minute build; the user's own home
    # from the password database counts too, when $HOME points elsewhere (a test's empty home).
    # RPCFLEET_ENGINE_CACHE=own looks in $RPCFLEET_HOME only, as on a fresh machine (bench/firsthour.py
    # --cold-setup times the build that way).
    homes = [Path.home(), Path(pwd.getpwuid(os.getuid()).pw_dir)]
    if os.environ.get("RPCFLEET_ENGINE_CACHE") == "own":
        homes = []
    defaults = [home / ".cache" / "rpcfleet" / "engine" / key for home in homes]
    for folder in dict.fromkeys([tools_dir(key), *defaults]):
        if (folder / ".complete").is_file():
            return folder
    return None


def build_llama_tools(*, version: str | None = None, progress: Progress | None = None) -> Path:
    """Build llama-server and llama-fit-params (once per source and flags) and return their folder:
    `<folder>/llama-server`, with the shared libraries beside it (RUNPATH $ORIGIN)."""
    from orchestrator.artifacts.source import SDIST_SHA256

    version = version or llama_cpp_python_version()
    found = cached_tools(version)
    if found is not None:
        return found
    say = progress or (lambda _line: None)
    sdist = ensure_sdist(version, say)
    patches = tool_patches(version)
    key = tools_key(SDIST_SHA256[version], patches=patches)
    target_dir = tools_dir(key)
    workdir = rpcfleet_home() / "build" / f"tools-{key}"
    workdir.mkdir(parents=True, exist_ok=True)
    with _locked(workdir / ".lock"):
        if (target_dir / ".complete").is_file():  # another process built it while we waited
            return target_dir
        source = extract_source(sdist, workdir / "src", say)
        llama = source / "vendor" / "llama.cpp"
        patched = apply_patches(llama, patches)
        if patched:
            say(f"patched the source: {', '.join(patched)}")
        build_dir = workdir / "build"
        log_path = workdir / "build.log"
        args = sorted(f"-D{k}={v}" for k, v in TOOL_DEFINES.items())
        started = time.monotonic()
        with log_path.open("w") as log:
            say(f"configuring llama.cpp for {', '.join(TOOL_TARGETS)} in {build_dir}")
            _run_logged(
                ["cmake", "-S", str(llama), "-B", str(build_dir), *args],
                log,
                say,
                CONFIGURE_TIMEOUT_S,
                what="configuring llama.cpp",
            )
            say(f"building {', '.join(TOOL_TARGETS)} (log: {log_path})")
            jobs = str(os.cpu_count() or 1)
            _run_logged(
                ["cmake", "--build", str(build_dir), "--target", *TOOL_TARGETS, "-j", jobs],
                log,
                say,
                BUILD_TIMEOUT_S,
                what=f"building {', '.join(TOOL_TARGETS)}",
            )
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target_dir.parent))
        try:
            for name in TOOL_TARGETS:
                collect_server(build_dir / "bin", staging, name, dest_name=name)
            _check_runpath(staging)
            info = {
                "llama_cpp_python_version": version,
                "sdist_sha256": SDIST_SHA256[version],
                "llama_cpp_commit": read_llama_cpp_commit(source / "CHANGELOG.md"),
                "cmake_args": args,
                "targets": list(TOOL_TARGETS),
                "patches": list(patched),
                "build_seconds": round(time.monotonic() - started, 1),
            }
            (staging / "build.json").write_text(json.dumps(info, indent=1) + "\n")
            (staging / ".complete").touch()
            shutil.rmtree(target_dir, ignore_errors=True)
            staging.replace(target_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        say(f"built {', '.join(TOOL_TARGETS)} into {target_dir}")
        get_logger().info("tools_built", key=key, folder=str(target_dir))
        return target_dir


def llama_server_binary(version: str | None = None, progress: Progress | None = None) -> Path:
    """The llama-server built from the installed binding's source (built on first use)."""
    return build_llama_tools(version=version, progress=progress) / "llama-server"
