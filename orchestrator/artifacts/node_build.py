"""`build: on_node` artifacts: the build script and the spec of a build on the node itself."""

from __future__ import annotations

import base64
import hashlib
import json
import shlex
import tarfile
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
from orchestrator.artifacts.patches import patch_texts, patches_for
from orchestrator.artifacts.source import SdistInfo, ensure_sdist, read_sdist_info
from orchestrator.core.errors import ArtifactError

NODE_BUILD_TIMEOUT_S = 1800.0  # an on-node build without `build_timeout:` in its spec


@dataclass(frozen=True)
class SourceEdit:
    """One file of the sdist's vendored llama.cpp as the source patches change it, made on the controller
    (`artifacts.patches`) and applied on the node with coreutils alone: bytes [offset, offset + cut) of
    the file whose sha256 is `before` become `insert`, which gives the file whose sha256 is `after`."""

    path: str  # relative to vendor/llama.cpp
    before: str
    after: str
    offset: int
    cut: int
    insert: bytes


def source_edit(path: str, before: bytes, after: bytes) -> SourceEdit:
    """Pure: the one edit (the span between the common prefix and suffix) that turns `before` into
    `after`."""
    head = 0
    limit = min(len(before), len(after))
    while head < limit and before[head] == after[head]:
        head += 1
    tail = 0
    while tail < limit - head and before[-1 - tail] == after[-1 - tail]:
        tail += 1
    return SourceEdit(
        path,
        hashlib.sha256(before).hexdigest(),
        hashlib.sha256(after).hexdigest(),
        head,
        len(before) - head - tail,
        after[head : len(after) - tail],
    )


_EDITS: dict[tuple[str, int, int, str, str], tuple[tuple[str, ...], tuple[SourceEdit, ...]]] = {}


def sdist_edits(sdist: Path, backend: str, version: str) -> tuple[tuple[str, ...], tuple[SourceEdit, ...]]:
    """The source patches of a `backend` build of llama-cpp-python `version` against the sdist's own
    files: (the labels its manifest lists, the edits the node applies). One pass over the archive,
    remembered per file for this process. A required patch the source does not take is an error."""
    patches = patches_for(backend, version)
    st = sdist.stat()
    memo = (str(sdist), st.st_size, st.st_mtime_ns, backend, version)
    if memo in _EDITS:
        return _EDITS[memo]
    wanted = {f"vendor/llama.cpp/{p.path}": p.path for p in patches}
    originals: dict[str, bytes] = {}
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                inner = member.name.partition("/")[2]  # below the sdist's top folder
                if inner in wanted and member.isfile():
                    fh = tar.extractfile(member)
                    originals[wanted[inner]] = fh.read() if fh else b""
                    if len(originals) == len(set(wanted.values())):
                        break
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ArtifactError(f"cannot read the source archive {sdist}: {exc}") from exc
    # surrogateescape: any byte survives the round trip, so `before` is the file's exact sha256.
    texts = {path: data.decode("utf-8", "surrogateescape") for path, data in originals.items()}
    changed, labels = patch_texts(texts, patches)
    edits = tuple(
        source_edit(path, originals.get(path, b""), text.encode("utf-8", "surrogateescape"))
        for path, text in sorted(changed.items())
    )
    _EDITS[memo] = (labels, edits)
    return labels, edits


def patch_lines(edits: Sequence[SourceEdit]) -> list[str]:
    """Bash (`$llama` set, `set -e`): apply `edits` to the extracted source, each file checked by sha256
    before (a file already patched is left alone: a rerun in the same tree) and after."""
    if not edits:
        return []
    lines = [
        "edit() {  # path before after offset cut insert(base64)",
        '  local f="$llama/$1" got',
        '  got=$(sha256sum "$f" | cut -d" " -f1)',
        '  if [ "$got" = "$3" ]; then return 0; fi',
        '  if [ "$got" != "$2" ]; then',
        '    echo "rpcfleet: $f is not the file its source patch was made for (sha256 $got)" >&2; exit 1',
        "  fi",
        '  { head -c "$4" "$f"; printf %s "$6" | base64 -d; tail -c +"$(($4 + $5 + 1))" "$f"; } \\',
        '    > "$f.rpcfleet"',
        '  got=$(sha256sum "$f.rpcfleet" | cut -d" " -f1)',
        '  if [ "$got" != "$3" ]; then',
        '    echo "rpcfleet: patching $f gave sha256 $got, not $3" >&2; rm -f "$f.rpcfleet"; exit 1',
        "  fi",
        '  mv -f "$f.rpcfleet" "$f"',
        '  echo "rpcfleet: patched $1"',
        "}",
    ]
    q = shlex.quote
    for e in edits:
        payload = base64.b64encode(e.insert).decode()
        lines.append(f"edit {q(e.path)} {e.before} {e.after} {e.offset} {e.cut} {payload}")
    return lines


def on_node_build_script(
    spec: ArtifactSpec,
    *,
    workdir: str = "rpcfleet-build",
    source_archive: str | None = None,
    jobs: int | None = None,
    edits: Sequence[SourceEdit] = (),
) -> str:
    """The bash script that builds ggml-rpc-server on a node from the uploaded llama-cpp-python sdist.

    The installer uploads the sdist to `source_archive` (default `<workdir>/llama_cpp_python-V.tar.gz`),
    runs this script with its output streamed, then collects `<workdir>/out/bin/`. The source is
    extracted once and the build folder kept, so a rerun is incremental; `edits` (`sdist_edits`: the
    source patches, as the controller's builds take them) are applied to it before cmake. The last line
    it prints is `RPCFLEET_PROTOCOL=<major.minor.patch>` read from the source's ggml-rpc.h.
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
        *patch_lines(edits),
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
    patches: tuple[str, ...] = ()  # the source patches' labels, as the manifest lists them
    edits: tuple[SourceEdit, ...] = ()  # how the node applies them (`sdist_edits`)

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
        return on_node_build_script(
            self.spec, workdir=workdir, source_archive=source_archive, edits=self.edits
        )

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
            patches=self.patches,
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
    patches, edits = sdist_edits(sdist, want_backend, version)
    key = hashlib.sha256(
        json.dumps(
            ["node-build", info.sha256, version, want_backend, list(args), os_name, arch, list(patches)]
        ).encode()
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
        patches=patches,
        edits=edits,
    )
