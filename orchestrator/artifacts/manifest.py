"""An artifact's manifest: its files with sha256, backend, platform and protocol version."""

from __future__ import annotations

import json
import platform
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from orchestrator.core.errors import ArtifactError, InputError, SourceLocation
from orchestrator.core.files import sha256_file

Backend = Literal["cpu", "cuda", "rocm", "vulkan", "metal"]


BACKENDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "vulkan", "metal")


DEFAULT_LLAMA_CPP_PYTHON_VERSION = "0.3.36"


SERVER_NAME = "ggml-rpc-server"


# Older llama.cpp releases named the target `rpc-server`; it is stored as bin/ggml-rpc-server either way.
SERVER_NAMES = (SERVER_NAME, "rpc-server")


MANIFEST_NAME = "manifest.json"


SCHEMA = 1


ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


_PROTO_RE = re.compile(r"^\d+\.\d+\.\d+$")


CHUNK = 1 << 20


class ArtifactSpecError(InputError, ArtifactError):
    """An artifact spec file is invalid; the message names the file and line."""


class ArtifactChoiceError(InputError, ArtifactError):
    """An artifact id or a backend that names nothing rpcfleet has (the user's to correct)."""


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact: a regular file (sha256, size, mode) or a symlink (link target)."""

    path: str  # relative POSIX path inside the archive, e.g. "bin/ggml-rpc-server"
    sha256: str | None  # None for a symlink
    size: int
    mode: int  # permission bits (0o755 / 0o644); 0o777 for a symlink
    link: str | None = None  # symlink target, relative to the link's folder

    @property
    def is_link(self) -> bool:
        return self.link is not None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": self.path, "size": self.size, "mode": f"{self.mode:04o}"}
        if self.link is not None:
            data["link"] = self.link
        else:
            data["sha256"] = self.sha256
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FileEntry:
        try:
            link = data.get("link")
            return cls(
                path=str(data["path"]),
                sha256=None if link is not None else str(data["sha256"]),
                size=int(data["size"]),
                mode=int(str(data["mode"]), 8),
                link=None if link is None else str(link),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"malformed file entry in manifest: {data!r}") from exc


@dataclass(frozen=True)
class Manifest:
    """What an artifact is: provenance, protocol, platform and the sha256 of every file."""

    protocol: str  # RPC protocol "major.minor.patch", e.g. "7.0.0"
    backend: str
    os: str  # platform.system().lower(): linux, darwin
    arch: str  # normalised machine: x86_64, aarch64
    native: bool  # built with GGML_NATIVE=ON (only runs on CPUs like the build host's)
    files: tuple[FileEntry, ...]
    cmake_args: tuple[str, ...] = ()
    llama_cpp_commit: str | None = None
    ggml_version: str | None = None
    llama_cpp_python_version: str | None = None
    source: str = ""  # how it was made: "build:llama-cpp-python==0.3.36", "url:...", "path:..."
    patches: tuple[str, ...] = ()  # source patches applied at build time, `name@digest` (artifacts.patches)
    cuda_version: str | None = (
        None  # a cuda build's toolkit release ("13.5"): the node's driver must support it
    )
    schema: int = SCHEMA

    @property
    def protocol_major(self) -> int:
        return int(self.protocol.split(".")[0])

    @property
    def cuda_architectures(self) -> tuple[str, ...]:
        """The CUDA architectures a cuda build was compiled for (from its CMAKE_CUDA_ARCHITECTURES)."""
        for arg in self.cmake_args:
            name, _, value = arg.removeprefix("-D").partition("=")
            if name.partition(":")[0] == "CMAKE_CUDA_ARCHITECTURES":
                return tuple(a for a in re.split(r"[;,]", value) if a)
        return ()

    def has_patch(self, name: str) -> bool:
        return any(label.partition("@")[0] == name for label in self.patches)

    @property
    def server_path(self) -> str:
        return f"bin/{SERVER_NAME}"

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": self.schema,
            "protocol": self.protocol,
            "backend": self.backend,
            "os": self.os,
            "arch": self.arch,
            "native": self.native,
            "llama_cpp_commit": self.llama_cpp_commit,
            "ggml_version": self.ggml_version,
            "llama_cpp_python_version": self.llama_cpp_python_version,
            "cmake_args": list(self.cmake_args),
            "source": self.source,
            "files": [entry.to_dict() for entry in self.files],
        }
        # Written only when there is something to say, so the manifests (and archive bytes) of earlier
        # artifacts read back unchanged.
        if self.patches:
            data["patches"] = list(self.patches)
        if self.backend == "cuda":
            data["cuda_architectures"] = list(self.cuda_architectures)
            data["cuda_version"] = self.cuda_version
        return data

    def to_bytes(self) -> bytes:
        # Stable bytes: the manifest is inside the archive, whose sha256 must not depend on dict order.
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        try:
            manifest = cls(
                schema=int(data.get("schema", SCHEMA)),
                protocol=str(data["protocol"]),
                backend=str(data["backend"]),
                os=str(data["os"]),
                arch=str(data["arch"]),
                native=bool(data["native"]),
                llama_cpp_commit=_opt_str(data.get("llama_cpp_commit")),
                ggml_version=_opt_str(data.get("ggml_version")),
                llama_cpp_python_version=_opt_str(data.get("llama_cpp_python_version")),
                cmake_args=tuple(str(a) for a in data.get("cmake_args", ())),
                source=str(data.get("source", "")),
                patches=tuple(str(p) for p in data.get("patches", ())),
                cuda_version=_opt_str(data.get("cuda_version")),
                files=tuple(FileEntry.from_dict(f) for f in data["files"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"malformed artifact manifest: {exc}") from exc
        if not _PROTO_RE.match(manifest.protocol):
            raise ArtifactError(f"malformed protocol version in manifest: {manifest.protocol!r}")
        return manifest


@dataclass(frozen=True)
class Artifact:
    """An artifact in the cache (or anywhere): its id, archive file, manifest and the archive's sha256."""

    id: str
    archive: Path
    manifest: Manifest
    archive_sha256: str

    @property
    def protocol(self) -> str:
        return self.manifest.protocol

    @property
    def size(self) -> int:
        return self.archive.stat().st_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "archive": str(self.archive),
            "archive_sha256": self.archive_sha256,
            "manifest": self.manifest.to_dict(),
        }


@dataclass(frozen=True)
class ArtifactSpec:
    """A pinned artifact source read from a YAML/JSON spec file (or made in code).

    kind "url": fetch `value` (sha256 of the download required); "path": a local archive (its sha256) or
    folder (the sha256 of its ggml-rpc-server); "build": `value` "on_node", build on the node itself
    (`sha256`, if given, pins the llama-cpp-python sdist uploaded).
    """

    kind: Literal["url", "path", "build"]
    value: str
    sha256: str | None = None
    protocol: str | None = None
    backend: str | None = None
    os: str | None = None
    arch: str | None = None
    native: bool = False
    cmake_args: tuple[str, ...] = ()
    subdir: str | None = None  # folder inside the archive holding the binaries, e.g. "build/bin"
    llama_cpp_commit: str | None = None
    llama_cpp_python_version: str | None = None
    build_timeout: float | None = None  # seconds an on-node build may take (NODE_BUILD_TIMEOUT_S)
    location: SourceLocation | None = field(default=None, compare=False)


def host_platform() -> tuple[str, str]:
    """(os, arch) of this machine in manifest spelling: ("linux", "x86_64"), ("darwin", "arm64")."""
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64" if sys.platform != "darwin" else "arm64"}
    return platform.system().lower(), arch.get(machine, machine)


def llama_cpp_python_version() -> str:
    """The installed llama-cpp-python's version, else the version this project pins."""
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return DEFAULT_LLAMA_CPP_PYTHON_VERSION


def scan_files(root: Path) -> tuple[FileEntry, ...]:
    """Entries for every file and symlink under `root` (relative paths, sorted)."""
    entries = []
    for path in sorted(p for p in root.rglob("*") if p.is_symlink() or p.is_file()):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            target = str(path.readlink())
            entries.append(FileEntry(rel, None, 0, 0o777, target))
        else:
            mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
            entries.append(FileEntry(rel, sha256_file(path), path.stat().st_size, mode))
    return tuple(entries)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)
