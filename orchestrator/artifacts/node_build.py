"""`build: on_node` artifacts: the build script and the spec of a build on the node itself."""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.artifacts.build import effective_cmake_args, is_native
from orchestrator.artifacts.manifest import (
    SERVER_NAME,
    ArtifactSpec,
    FileEntry,
    Manifest,
    llama_cpp_python_version,
)
from orchestrator.artifacts.source import SdistInfo, ensure_sdist, read_sdist_info
from orchestrator.core.errors import ArtifactError

NODE_BUILD_TIMEOUT_S = 1800.0  # an on-node build without `build_timeout:` in its spec


def on_node_build_script(
    spec: ArtifactSpec,
    *,
    workdir: str = "rpcfleet-build",
    source_archive: str | None = None,
    jobs: int | None = None,
) -> str:
    """The bash script that builds ggml-rpc-server on a node from the uploaded llama-cpp-python sdist.

    The installer uploads the sdist to `source_archive` (default `<workdir>/llama_cpp_python-V.tar.gz`),
    runs this script with its output streamed, then collects `<workdir>/out/bin/`. The source is
    extracted once and the build folder kept, so a rerun is incremental. The last line it prints is
    `RPCFLEET_PROTOCOL=<major.minor.patch>` read from the source's ggml-rpc.h.
    """
    if spec.kind != "build":
        raise ArtifactError(f"not an on-node build spec: {spec.kind}: {spec.value}")
    version = spec.llama_cpp_python_version or llama_cpp_python_version()
    backend = spec.backend or "cpu"
    args = effective_cmake_args(backend, spec.cmake_args)
    source = source_archive or f"{workdir}/llama_cpp_python-{version}.tar.gz"
    q = shlex.quote
    jobs_arg = str(jobs) if jobs else '"$(nproc)"'
    lines = [
        "#!/usr/bin/env bash",
        f"# rpcfleet: build {SERVER_NAME} on this node from llama-cpp-python {version} ({backend})",
        "set -euo pipefail",
        f"workdir={q(workdir)}",
        f"source={q(source)}",
        'mkdir -p "$workdir"',
    ]
    if spec.sha256:
        lines.append(f'echo {q(spec.sha256 + "  ")}"$source" | sha256sum --check --quiet -')
    lines += [
        'sha=$(sha256sum "$source" | cut -d" " -f1)',
        'if [ "$(cat "$workdir/src/.extracted" 2>/dev/null)" != "$sha" ]; then',
        '  rm -rf "$workdir/src" && mkdir -p "$workdir/src"',
        '  tar -xzf "$source" -C "$workdir/src" --strip-components=1',
        '  echo "$sha" > "$workdir/src/.extracted"',
        "fi",
        'llama="$workdir/src/vendor/llama.cpp"',
        'cmake -S "$llama" -B "$workdir/build" ' + " ".join(q(a) for a in args),
        f'cmake --build "$workdir/build" --target {SERVER_NAME} -j {jobs_arg}',
        'rm -rf "$workdir/out" && mkdir -p "$workdir/out/bin"',
        f'cp -P "$workdir/build/bin/{SERVER_NAME}" "$workdir/out/bin/"',
        'find "$workdir/build/bin" -maxdepth 1 -name "lib*.so*" -exec cp -P {} "$workdir/out/bin/" \\;',
        'h="$llama/ggml/include/ggml-rpc.h"',
        'v() { sed -n "s/^#define RPC_PROTO_$1_VERSION *\\([0-9]*\\).*/\\1/p" "$h"; }',
        'echo "RPCFLEET_PROTOCOL=$(v MAJOR).$(v MINOR).$(v PATCH)"',
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class NodeBuild:
    """A `build: on_node` request made concrete for one kind of host: the sdist to upload, the cmake
    arguments, and the version id the result is installed under.

    The id is derived from what decides the binary (sdist sha256, llama-cpp-python version, backend,
    effective cmake arguments, os, arch), so the node tells whether it already has this build from its
    `versions/` alone; the protocol in the id comes from the sdist's ggml-rpc.h, read on the controller.
    """

    spec: ArtifactSpec  # backend, cmake_args (spec's + host's) and sha256 filled in
    sdist: Path
    info: SdistInfo
    version: str  # llama-cpp-python
    backend: str
    os: str
    arch: str
    cmake_args: tuple[str, ...]  # effective (what the script passes to cmake)
    key: str
    timeout: float

    @property
    def id(self) -> str:
        return f"rpc-server-{self.info.protocol}-{self.backend}-{self.os}-{self.arch}-node-{self.key[:8]}"

    @property
    def protocol(self) -> str:
        return self.info.protocol

    @property
    def sdist_name(self) -> str:
        return f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def source(self) -> str:
        return f"build-on-node:llama-cpp-python=={self.version}"

    def script(self, workdir: str, source_archive: str) -> str:
        return on_node_build_script(self.spec, workdir=workdir, source_archive=source_archive)

    def manifest(self, files: Sequence[FileEntry]) -> Manifest:
        return Manifest(
            protocol=self.info.protocol,
            backend=self.backend,
            os=self.os,
            arch=self.arch,
            native=is_native(self.cmake_args),
            files=tuple(sorted(files, key=lambda e: e.path)),
            cmake_args=self.cmake_args,
            llama_cpp_commit=self.info.llama_cpp_commit,
            ggml_version=self.info.ggml_version,
            llama_cpp_python_version=self.version,
            source=self.source,
        )


def node_build(
    spec: ArtifactSpec, *, backend: str, os_name: str, arch: str, extra_cmake_args: Sequence[str] = ()
) -> NodeBuild:
    """The on-node build of `spec` for a host (its backend unless the spec names one, its os/arch);
    `extra_cmake_args` (the host's) come after the spec's and override them by variable name.

    The sdist must be in the controller's cache (`sdist_path`, fetched with pip when missing) and match
    the spec's sha256 when it pins one.
    """
    if spec.kind != "build":
        raise ArtifactError(f"not an on-node build spec: {spec.kind}: {spec.value}")
    version = spec.llama_cpp_python_version or llama_cpp_python_version()
    want_backend = spec.backend or backend
    user_args = (*spec.cmake_args, *extra_cmake_args)
    args = effective_cmake_args(want_backend, user_args)
    sdist = ensure_sdist(version, lambda _line: None, sha256=spec.sha256, pinned_by="the spec")
    info = read_sdist_info(sdist)  # its sha256 is the spec's pin, else rpcfleet's (ensure_sdist)
    key = hashlib.sha256(
        json.dumps(["node-build", info.sha256, version, want_backend, list(args), os_name, arch]).encode()
    ).hexdigest()[:16]
    concrete = replace(
        spec, backend=want_backend, cmake_args=user_args, sha256=info.sha256, llama_cpp_python_version=version
    )
    return NodeBuild(
        spec=concrete,
        sdist=sdist,
        info=info,
        version=version,
        backend=want_backend,
        os=os_name,
        arch=arch,
        cmake_args=args,
        key=key,
        timeout=spec.build_timeout or NODE_BUILD_TIMEOUT_S,
    )
