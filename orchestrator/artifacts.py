"""The pinned rpc-server artifact: a `ggml-rpc-server` build plus a manifest, cached locally.

An artifact is a deterministic `.tar.gz` holding `manifest.json` at its root and the server under `bin/`
(the binary and the libggml*.so it loads through `RUNPATH=$ORIGIN`). The manifest records where the build
came from (llama.cpp commit, ggml and llama-cpp-python versions, cmake arguments), what it speaks (the RPC
protocol version), where it runs (backend, os, arch, CPU-native or not) and the sha256 of every file; the
archive's own sha256 lives beside it in the cache, since it cannot be inside itself.

Cache layout (`$RPCFLEET_HOME`, default `~/.cache/rpcfleet`):

    artifacts/<id>.tar.gz     the archive
    artifacts/<id>.json       {"id", "archive_sha256", "manifest"}
    artifacts/<id>/bin/...    an unpacked copy (made on first use by `local_server_binary`)
    artifacts/keys/<key>      the id made from a build or source key, so a second request is instant
    src/llama_cpp_python-VERSION.tar.gz   the sdist the server is built from (same as the Python package)
    build/<key>/              the extracted source and the cmake build tree (incremental rebuilds)
    downloads/<sha256>        a fetched URL, kept once its sha256 matched

Sources: a local build from the llama-cpp-python sdist (`build_artifact`), a URL or a local archive or
folder pinned by sha256 (`import_artifact`), or a build on the node itself (`on_node_build_script`; the
SSH part lives in install.py). `resolve_artifact` turns an inventory's `rpc_artifact` value into one.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shlex
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal

from orchestrator.errors import ArtifactError, InputError, SourceLocation
from orchestrator.log import get_logger
from orchestrator.paths import rpcfleet_home

__all__ = [
    "BACKENDS",
    "DEFAULT_LLAMA_CPP_PYTHON_VERSION",
    "Artifact",
    "ArtifactSpec",
    "ArtifactSpecError",
    "FileEntry",
    "Manifest",
    "NodeBuild",
    "SdistInfo",
    "artifacts_dir",
    "build_artifact",
    "build_key",
    "cached_build",
    "default_artifact",
    "effective_cmake_args",
    "fetch_url",
    "host_platform",
    "import_artifact",
    "list_artifacts",
    "llama_cpp_python_version",
    "load_artifact",
    "local_server_binary",
    "node_build",
    "on_node_build_script",
    "pack_artifact",
    "probe_protocol",
    "read_artifact_spec",
    "read_ggml_version",
    "read_llama_cpp_commit",
    "read_protocol_version",
    "read_sdist_info",
    "resolve_artifact",
    "rpcfleet_home",
    "sdist_path",
    "unpack_artifact",
    "verify_artifact",
]

Backend = Literal["cpu", "cuda", "rocm", "vulkan", "metal"]
BACKENDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "vulkan", "metal")
DEFAULT_LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SERVER_NAME = "ggml-rpc-server"
# Older llama.cpp releases named the target `rpc-server`; it is stored as bin/ggml-rpc-server either way.
SERVER_NAMES = (SERVER_NAME, "rpc-server")
MANIFEST_NAME = "manifest.json"
SCHEMA = 1
Progress = Callable[[str], None]

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
PIP_TIMEOUT_S = 600.0
CONFIGURE_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 3600.0
NODE_BUILD_TIMEOUT_S = 1800.0  # an on-node build without `build_timeout:` in its spec
FETCH_TIMEOUT_S = 60.0
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_PROTO_RE = re.compile(r"^\d+\.\d+\.\d+$")
_CHUNK = 1 << 20


class ArtifactSpecError(InputError, ArtifactError):
    """An artifact spec file is invalid; the message names the file and line."""


# ---------------------------------------------------------------- data


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
    schema: int = SCHEMA

    @property
    def protocol_major(self) -> int:
        return int(self.protocol.split(".")[0])

    @property
    def server_path(self) -> str:
        return f"bin/{SERVER_NAME}"

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    def to_dict(self) -> dict[str, Any]:
        return {
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

    def to_json(self) -> bytes:
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


# ---------------------------------------------------------------- paths, platform, versions


def artifacts_dir() -> Path:
    return rpcfleet_home() / "artifacts"


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


def sdist_path(version: str) -> Path:
    return rpcfleet_home() / "src" / f"llama_cpp_python-{version}.tar.gz"


def read_protocol_version(header_path: Path) -> str:
    """ "major.minor.patch" from `RPC_PROTO_*_VERSION` in ggml-rpc.h."""
    try:
        text = Path(header_path).read_text(errors="replace")
    except OSError as exc:
        raise ArtifactError(f"cannot read {header_path}: {exc.strerror}") from exc
    return _protocol_of(text, str(header_path))


def _protocol_of(text: str, where: str) -> str:
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"^\s*#\s*define\s+RPC_PROTO_{name}_VERSION\s+(\d+)\b", text, re.MULTILINE)
        if match is None:
            raise ArtifactError(f"{where}: no RPC_PROTO_{name}_VERSION definition")
        parts.append(match.group(1))
    return ".".join(parts)


def read_ggml_version(cmakelists: Path) -> str | None:
    """ggml's version from `set(GGML_VERSION_MAJOR 0)` etc. in ggml/CMakeLists.txt (None if absent)."""
    try:
        text = cmakelists.read_text(errors="replace")
    except OSError:
        return None
    return _ggml_version_of(text)


def _ggml_version_of(text: str) -> str | None:
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"set\(\s*GGML_VERSION_{name}\s+(\d+)\s*\)", text)
        if match is None:
            return None
        parts.append(match.group(1))
    return ".".join(parts)


def read_llama_cpp_commit(changelog: Path) -> str | None:
    """The llama.cpp commit vendored by a llama-cpp-python sdist: the first `llama.cpp@<hash>` of its
    CHANGELOG.md (the sdist carries no git metadata)."""
    try:
        text = changelog.read_text(errors="replace")
    except OSError:
        return None
    return _commit_of(text)


def _commit_of(text: str) -> str | None:
    match = re.search(r"llama\.cpp@([0-9a-f]{7,40})\b", text)
    return match.group(1) if match else None


# ---------------------------------------------------------------- cmake arguments and keys


def _split_define(arg: str) -> tuple[str, str] | None:
    """("NAME", "VALUE") for "-DNAME=VALUE" or "-DNAME:TYPE=VALUE", else None."""
    match = re.match(r"^-D([A-Za-z_][A-Za-z0-9_]*)(?::[A-Za-z]+)?=(.*)$", arg)
    return (match.group(1), match.group(2)) if match else None


def effective_cmake_args(backend: str, cmake_args: Sequence[str] = ()) -> tuple[str, ...]:
    """The full cmake configure arguments: base defines + backend defines + the user's, in a canonical
    order (defines sorted by name, later ones overriding earlier; other arguments after, as given)."""
    if backend not in BACKENDS:
        raise ArtifactError(f"unknown backend {backend!r}", hint=f"one of: {', '.join(BACKENDS)}")
    defines = {**BASE_DEFINES, **BACKEND_DEFINES[backend]}
    others: list[str] = []
    for arg in cmake_args:
        split = _split_define(arg)
        if split is None:
            others.append(arg)
        else:
            defines[split[0]] = split[1]
    return (*(f"-D{k}={v}" for k, v in sorted(defines.items())), *others)


def _is_native(cmake_args: Sequence[str]) -> bool:
    value = "ON"  # llama.cpp's default when not given
    for arg in cmake_args:
        split = _split_define(arg)
        if split and split[0] == "GGML_NATIVE":
            value = split[1]
    return value.upper() in ("ON", "1", "TRUE", "YES", "Y")


def build_key(
    version: str, backend: str, cmake_args: Sequence[str], os_name: str | None = None, arch: str | None = None
) -> str:
    """The cache key of a local build: hash of (llama-cpp-python version, backend, sorted args, os, arch)."""
    host_os, host_arch = host_platform()
    data = json.dumps(
        ["build", version, backend, sorted(cmake_args), os_name or host_os, arch or host_arch]
    ).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _source_key(spec: ArtifactSpec, os_name: str, arch: str) -> str:
    data = json.dumps(
        [spec.kind, spec.sha256, spec.subdir, spec.protocol, spec.backend, os_name, arch, spec.native,
         list(spec.cmake_args), spec.llama_cpp_commit]
    ).encode()  # fmt: skip
    return hashlib.sha256(data).hexdigest()[:16]


# ---------------------------------------------------------------- hashing, packing


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _scan_files(root: Path) -> tuple[FileEntry, ...]:
    """Entries for every file and symlink under `root` (relative paths, sorted)."""
    entries = []
    for path in sorted(p for p in root.rglob("*") if p.is_symlink() or p.is_file()):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            target = str(path.readlink())
            entries.append(FileEntry(rel, None, 0, 0o777, target))
        else:
            mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
            entries.append(FileEntry(rel, _sha256_file(path), path.stat().st_size, mode))
    return tuple(entries)


def _tarinfo(name: str, *, size: int = 0, mode: int = 0o644, link: str | None = None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if link is not None:
        info.type, info.linkname, info.size = tarfile.SYMTYPE, link, 0
    return info


def pack_artifact(root: Path, manifest: Manifest, dest: BinaryIO) -> None:
    """Write the deterministic archive of `root` (whose files `manifest` lists) to `dest`: manifest.json
    first, then the files sorted, mtime 0, uid/gid 0, gzip without name or timestamp. Packing the same
    files twice gives the same bytes."""
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=dest, mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        data = manifest.to_json()
        tar.addfile(_tarinfo(MANIFEST_NAME, size=len(data)), io.BytesIO(data))
        for entry in sorted(manifest.files, key=lambda e: e.path):
            if entry.link is not None:
                tar.addfile(_tarinfo(entry.path, mode=0o777, link=entry.link))
                continue
            path = root / entry.path
            with path.open("rb") as fh:
                tar.addfile(_tarinfo(entry.path, size=entry.size, mode=entry.mode), fh)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _store(root: Path, manifest: Manifest) -> Artifact:
    """Pack `root` into the cache under its content-derived id (idempotent)."""
    cache = artifacts_dir()
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".pack-", suffix=".tar.gz", dir=cache)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            pack_artifact(root, manifest, fh)
        sha = _sha256_file(tmp)
        artifact_id = (
            f"rpc-server-{manifest.protocol}-{manifest.backend}-{manifest.os}-{manifest.arch}-{sha[:8]}"
        )
        archive = cache / f"{artifact_id}.tar.gz"
        tmp.replace(archive)
    finally:
        tmp.unlink(missing_ok=True)
    artifact = Artifact(artifact_id, archive, manifest, sha)
    sidecar = {"id": artifact_id, "archive_sha256": sha, "manifest": manifest.to_dict()}
    _write_atomic(cache / f"{artifact_id}.json", (json.dumps(sidecar, indent=2) + "\n").encode())
    return artifact


def _remember(key: str, artifact: Artifact) -> None:
    _write_atomic(artifacts_dir() / "keys" / key, (artifact.id + "\n").encode())


def _recall(key: str) -> Artifact | None:
    """The artifact remembered under `key`, if its files are still in the cache (no re-hashing: fast)."""
    try:
        artifact_id = (artifacts_dir() / "keys" / key).read_text().strip()
        return load_artifact(artifact_id)
    except (OSError, ArtifactError):
        return None


# ---------------------------------------------------------------- the cache


def load_artifact(artifact_id: str) -> Artifact:
    """The cached artifact `artifact_id` (reads its sidecar; does not re-hash, see `verify_artifact`)."""
    if not _ID_RE.match(artifact_id):
        raise ArtifactError(f"invalid artifact id {artifact_id!r}")
    cache = artifacts_dir()
    sidecar, archive = cache / f"{artifact_id}.json", cache / f"{artifact_id}.tar.gz"
    if not sidecar.is_file() or not archive.is_file():
        raise ArtifactError(
            f"no artifact {artifact_id!r} in {cache}", hint="`rpcfleet artifact list` shows the cached ones"
        )
    try:
        data = json.loads(sidecar.read_text())
        sha = str(data["archive_sha256"])
        manifest = Manifest.from_dict(data["manifest"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{sidecar}: unreadable artifact record: {exc}") from exc
    return Artifact(artifact_id, archive, manifest, sha)


def list_artifacts() -> list[Artifact]:
    """Every artifact in the cache, sorted by id (unreadable records are logged and skipped)."""
    cache = artifacts_dir()
    found = []
    for sidecar in sorted(cache.glob("*.json")) if cache.is_dir() else []:
        try:
            found.append(load_artifact(sidecar.name.removesuffix(".json")))
        except ArtifactError as exc:
            get_logger().warning("artifact_record_skipped", path=str(sidecar), error=str(exc))
    return found


def verify_artifact(artifact: Artifact) -> None:
    """Re-hash the archive and every member against the manifest; `ArtifactError` names what differs."""
    if not artifact.archive.is_file():
        raise ArtifactError(f"{artifact.id}: archive {artifact.archive} is missing")
    actual = _sha256_file(artifact.archive)
    if actual != artifact.archive_sha256:
        raise ArtifactError(
            f"{artifact.id}: archive {artifact.archive.name} has sha256 {actual}, "
            f"expected {artifact.archive_sha256}"
        )
    expected = {e.path: e for e in artifact.manifest.files}
    seen: set[str] = set()
    manifest_seen = False
    try:
        with tarfile.open(artifact.archive, "r:gz") as tar:
            for member in tar:
                name = member.name
                if name == MANIFEST_NAME:
                    inner = tar.extractfile(member)
                    assert inner is not None
                    if Manifest.from_dict(json.loads(inner.read())) != artifact.manifest:
                        raise ArtifactError(f"{artifact.id}: {MANIFEST_NAME} differs from the cached record")
                    manifest_seen = True
                    continue
                entry = expected.get(name)
                if entry is None:
                    raise ArtifactError(f"{artifact.id}: {name}: not listed in the manifest")
                seen.add(name)
                _verify_member(artifact.id, tar, member, entry)
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        raise ArtifactError(f"{artifact.id}: archive {artifact.archive.name} is unreadable: {exc}") from exc
    if not manifest_seen:
        raise ArtifactError(f"{artifact.id}: the archive holds no {MANIFEST_NAME}")
    missing = sorted(set(expected) - seen)
    if missing:
        raise ArtifactError(f"{artifact.id}: {missing[0]}: listed in the manifest but not in the archive")


def _verify_member(artifact_id: str, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: FileEntry) -> None:
    if entry.link is not None:
        if not member.issym() or member.linkname != entry.link:
            raise ArtifactError(f"{artifact_id}: {entry.path}: expected a symlink to {entry.link}")
        return
    fh = tar.extractfile(member) if member.isfile() else None
    if fh is None:
        raise ArtifactError(f"{artifact_id}: {entry.path}: expected a regular file")
    digest, size = hashlib.sha256(), 0
    while chunk := fh.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    if digest.hexdigest() != entry.sha256 or size != entry.size:
        raise ArtifactError(
            f"{artifact_id}: {entry.path}: sha256 {digest.hexdigest()} ({size} bytes), "
            f"expected {entry.sha256} ({entry.size} bytes)"
        )


def unpack_artifact(artifact: Artifact, dest: Path) -> Path:
    """Extract `artifact` into `dest` (created; must be empty or absent); returns the server binary."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(artifact.archive, "r:gz") as tar:
        # The "data" filter refuses absolute paths, links leaving `dest` and device files.
        tar.extractall(dest, filter="data")
    return dest / artifact.manifest.server_path


def local_server_binary() -> Path:
    """The server of the default CPU artifact, unpacked once into `$RPCFLEET_HOME/artifacts/<id>/`."""
    artifact = default_artifact("cpu")
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


# ---------------------------------------------------------------- building from the llama-cpp-python sdist


def cached_build(backend: str = "cpu", cmake_args: Sequence[str] = ()) -> Artifact | None:
    """The cached artifact for this build request, or None (fast: no hashing, no subprocess)."""
    args = effective_cmake_args(backend, cmake_args)
    return _recall(build_key(llama_cpp_python_version(), backend, args))


def default_artifact(backend: str = "cpu") -> Artifact:
    """The locally built artifact matching the installed llama-cpp-python (built on first use)."""
    return cached_build(backend) or build_artifact(backend)


def build_artifact(
    backend: str = "cpu", cmake_args: Sequence[str] = (), *, progress: Progress | None = None
) -> Artifact:
    """Build ggml-rpc-server from the same llama.cpp source as the installed llama-cpp-python and store
    it in the cache; returns the cached artifact at once when this request was built before."""
    args = effective_cmake_args(backend, cmake_args)
    version = llama_cpp_python_version()
    key = build_key(version, backend, args)
    cached = _recall(key)
    if cached is not None:
        return cached
    say = progress or (lambda _line: None)
    workdir = rpcfleet_home() / "build" / key
    workdir.mkdir(parents=True, exist_ok=True)
    with _locked(workdir / ".lock"):
        cached = _recall(key)  # another process may have built it while we waited
        if cached is not None:
            return cached
        sdist = _ensure_sdist(version, say)
        source = _extract_source(sdist, workdir / "src", say)
        llama = source / "vendor" / "llama.cpp"
        protocol = read_protocol_version(llama / "ggml" / "include" / "ggml-rpc.h")
        build_dir = workdir / "build"
        log_path = workdir / "build.log"
        with log_path.open("w") as log:
            say(f"configuring llama.cpp ({backend}) in {build_dir}")
            _run_logged(
                ["cmake", "-S", str(llama), "-B", str(build_dir), *args], log, say, CONFIGURE_TIMEOUT_S
            )
            say(f"building {SERVER_NAME} (log: {log_path})")
            jobs = str(os.cpu_count() or 1)
            _run_logged(
                ["cmake", "--build", str(build_dir), "--target", SERVER_NAME, "-j", jobs],
                log,
                say,
                BUILD_TIMEOUT_S,
            )
        os_name, arch = host_platform()
        with tempfile.TemporaryDirectory(dir=workdir, prefix="stage-") as tmp:
            stage = Path(tmp)
            _collect_server(build_dir / "bin", stage / "bin", SERVER_NAME)
            _check_runpath(stage / "bin")
            manifest = Manifest(
                protocol=protocol,
                backend=backend,
                os=os_name,
                arch=arch,
                native=_is_native(args),
                files=_scan_files(stage),
                cmake_args=args,
                llama_cpp_commit=read_llama_cpp_commit(source / "CHANGELOG.md"),
                ggml_version=read_ggml_version(llama / "ggml" / "CMakeLists.txt"),
                llama_cpp_python_version=version,
                source=f"build:llama-cpp-python=={version}",
            )
            artifact = _store(stage, manifest)
        _remember(key, artifact)
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


def _ensure_sdist(version: str, say: Progress) -> Path:
    sdist = sdist_path(version)
    if sdist.is_file():
        return sdist
    sdist.parent.mkdir(parents=True, exist_ok=True)
    say(f"downloading the llama-cpp-python {version} source with pip")
    command = [
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
        f"llama-cpp-python=={version}", "-d", str(sdist.parent),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ArtifactError(f"pip download timed out after {PIP_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0 or not sdist.is_file():
        raise ArtifactError(
            f"could not download the llama-cpp-python {version} sdist",
            command=shlex.join(command),
            exit_status=done.returncode,
            stderr=done.stderr,
            hint=f"put llama_cpp_python-{version}.tar.gz into {sdist.parent}",
        )
    return sdist


def _extract_source(sdist: Path, dest: Path, say: Progress) -> Path:
    """Extract the sdist once (a stamp holds its sha256) so cmake's build tree stays incremental."""
    stamp = dest / ".extracted"
    sha = _sha256_file(sdist)
    if stamp.is_file() and stamp.read_text().strip() == sha:
        return _single_child(dest)
    say(f"extracting {sdist.name}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    try:
        with tarfile.open(sdist, "r:*") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ArtifactError(f"cannot extract {sdist}: {exc}") from exc
    root = _single_child(dest)
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        raise ArtifactError(f"{sdist} holds no vendor/llama.cpp: not a llama-cpp-python sdist")
    stamp.write_text(sha + "\n")
    return root


def _single_child(folder: Path) -> Path:
    children = [p for p in folder.iterdir() if p.is_dir()]
    if len(children) != 1:
        raise ArtifactError(f"{folder}: expected one top-level folder in the source archive")
    return children[0]


def _run_logged(command: list[str], log: Any, say: Progress, timeout: float) -> None:
    """Run `command`, copying its output to `log` and cmake's `[ NN%]` lines to `say`."""
    log.write(f"$ {shlex.join(command)}\n")
    log.flush()
    tail: list[str] = []
    deadline = time.monotonic() + timeout
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
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
            "building the rpc-server failed",
            command=shlex.join(command),
            exit_status=status,
            stderr="".join(tail),
            hint=f"full log: {log.name}",
        )


def _is_shared_lib(name: str) -> bool:
    return bool(re.search(r"\.so(\.\d+)*$|\.dylib$", name))


def _collect_server(src: Path, dest: Path, server_name: str) -> None:
    """Copy the server binary and the shared libraries beside it (symlinks kept when they stay inside)."""
    dest.mkdir(parents=True, exist_ok=True)
    binary = src / server_name
    if not binary.is_file():
        raise ArtifactError(f"no {server_name} in {src}")
    shutil.copy2(binary, dest / SERVER_NAME)
    for path in sorted(src.iterdir()):
        if not _is_shared_lib(path.name):
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
        out = subprocess.run(
            [readelf, "-d", str(path)], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        for match in re.finditer(r"\((?:RUNPATH|RPATH)\).*?\[(.*)\]", out):
            bad = [p for p in match.group(1).split(":") if p and not p.startswith("$ORIGIN")]
            if bad:
                raise ArtifactError(
                    f"{path.name} has RUNPATH {match.group(1)}: it would only run from the build folder",
                    hint="build with -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN'",
                )


# ---------------------------------------------------------------- other sources: URL, archive, folder


def fetch_url(url: str, sha256: str, *, timeout: float = FETCH_TIMEOUT_S) -> Path:
    """Download `url` once into `$RPCFLEET_HOME/downloads/<sha256>`; a wrong sha256 leaves nothing behind."""
    sha256 = sha256.lower()
    downloads = rpcfleet_home() / "downloads"
    target = downloads / sha256
    if target.is_file():
        return target
    import urllib.error
    import urllib.request

    downloads.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".fetch-", dir=downloads)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise ArtifactError(f"{url}: sha256 is {digest.hexdigest()}, expected {sha256}")
        tmp.replace(target)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise ArtifactError(f"cannot fetch {url}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            downloads.rmdir()  # only if empty: a failed first fetch leaves no trace
    return target


def import_artifact(
    spec: ArtifactSpec,
    *,
    backend: str | None = None,
    os_name: str | None = None,
    arch: str | None = None,
    timeout: float = FETCH_TIMEOUT_S,
) -> Artifact:
    """Turn a URL or a local archive/folder (pinned by sha256) into a cached artifact.

    An archive already in artifact format (manifest.json at its root) is stored as it is, after
    verification. Anything else is repackaged: the folder holding ggml-rpc-server (or `spec.subdir`)
    gives the binary and the shared libraries beside it; the protocol comes from `spec.protocol` or, when
    the binary runs on this machine, from a HELLO to it on 127.0.0.1.
    """
    if spec.kind == "build":
        raise ArtifactError("a `build: on_node` spec is built on the node by the installer, not here")
    if spec.sha256 is None:
        raise ArtifactError(f"{spec.value}: a sha256 is required")
    host_os, host_arch = host_platform()
    want_backend = spec.backend or backend or "cpu"
    want_os, want_arch = spec.os or os_name or host_os, spec.arch or arch or host_arch
    key = _source_key(replace(spec, backend=want_backend), want_os, want_arch)
    cached = _recall(key)
    if cached is not None:
        return cached
    if spec.kind == "url":
        source = fetch_url(spec.value, spec.sha256, timeout=timeout)
    else:
        source = Path(spec.value).expanduser()
        if not source.exists():
            raise ArtifactError(f"{source}: no such file or folder")
        actual = _sha256_file(source) if source.is_file() else spec.sha256
        if actual != spec.sha256:
            raise ArtifactError(f"{source}: sha256 is {actual}, expected {spec.sha256}")
    with tempfile.TemporaryDirectory(prefix="rpcfleet-import-") as tmp:
        work = Path(tmp)
        if source.is_dir():
            unpacked = source
        else:
            unpacked = work / "unpacked"
            _extract_any(source, unpacked)
            existing = _adopt_if_artifact(source, unpacked)
            if existing is not None:
                _remember(key, existing)
                return existing
        server_dir, server_name = _find_server(unpacked, spec.subdir)
        if source.is_dir() and _sha256_file(server_dir / server_name) != spec.sha256:
            raise ArtifactError(
                f"{server_dir / server_name}: sha256 is {_sha256_file(server_dir / server_name)}, "
                f"expected {spec.sha256} (for a folder, the sha256 of its {SERVER_NAME})"
            )
        stage = work / "stage"
        _collect_server(server_dir, stage / "bin", server_name)
        found = _binary_platform(stage / "bin" / SERVER_NAME)
        if found is not None and found != (want_os, want_arch):
            raise ArtifactError(
                f"{spec.value}: the server is built for {found[0]}/{found[1]}, wanted {want_os}/{want_arch}"
            )
        protocol = spec.protocol
        if protocol is None:
            if (want_os, want_arch) != (host_os, host_arch):
                raise ArtifactError(
                    f"{spec.value}: no protocol given and the binary cannot run here to be asked",
                    hint='add `protocol: "7.0.0"` (RPC_PROTO_*_VERSION of its ggml-rpc.h) to the spec',
                )
            protocol = probe_protocol(stage / "bin" / SERVER_NAME)
        manifest = Manifest(
            protocol=protocol,
            backend=want_backend,
            os=want_os,
            arch=want_arch,
            native=spec.native,
            files=_scan_files(stage),
            cmake_args=spec.cmake_args,
            llama_cpp_commit=spec.llama_cpp_commit,
            llama_cpp_python_version=spec.llama_cpp_python_version,
            source=f"{spec.kind}:{spec.value}",
        )
        artifact = _store(stage, manifest)
    _remember(key, artifact)
    return artifact


def _extract_any(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    target = (dest / info.filename).resolve()
                    if not target.is_relative_to(dest.resolve()):
                        raise ArtifactError(f"{archive}: member {info.filename} leaves the archive folder")
                zf.extractall(dest)
                # zip keeps Unix permission bits in the high half of external_attr
                for info in zf.infolist():
                    mode = (info.external_attr >> 16) & 0o777
                    if mode and not info.is_dir():
                        (dest / info.filename).chmod(mode)
        else:
            with tarfile.open(archive, "r:*") as tar:
                tar.extractall(dest, filter="data")
    except (zipfile.BadZipFile, tarfile.TarError, OSError) as exc:
        raise ArtifactError(f"cannot unpack {archive}: {exc}") from exc


def _adopt_if_artifact(archive: Path, unpacked: Path) -> Artifact | None:
    """Store an archive that already is an rpcfleet artifact as it is (after verifying every member)."""
    manifest_path = unpacked / MANIFEST_NAME
    if not manifest_path.is_file() or not (unpacked / "bin" / SERVER_NAME).exists():
        return None
    manifest = Manifest.from_dict(json.loads(manifest_path.read_text()))
    sha = _sha256_file(archive)
    artifact_id = f"rpc-server-{manifest.protocol}-{manifest.backend}-{manifest.os}-{manifest.arch}-{sha[:8]}"
    candidate = Artifact(artifact_id, archive, manifest, sha)
    verify_artifact(candidate)
    cache = artifacts_dir()
    cache.mkdir(parents=True, exist_ok=True)
    stored = cache / f"{artifact_id}.tar.gz"
    if not stored.exists():
        tmp = cache / f".{artifact_id}.{os.getpid()}.tmp"
        shutil.copyfile(archive, tmp)
        tmp.replace(stored)
    sidecar = {"id": artifact_id, "archive_sha256": sha, "manifest": manifest.to_dict()}
    _write_atomic(cache / f"{artifact_id}.json", (json.dumps(sidecar, indent=2) + "\n").encode())
    return Artifact(artifact_id, stored, manifest, sha)


def _find_server(root: Path, subdir: str | None) -> tuple[Path, str]:
    """(folder, name) of the server binary: in `subdir` if given, else the one folder that holds it."""
    if subdir is not None:
        folder = root / subdir
        for name in SERVER_NAMES:
            if (folder / name).is_file():
                return folder, name
        raise ArtifactError(f"no {SERVER_NAME} in {subdir}/ of the archive")
    hits = sorted(p for name in SERVER_NAMES for p in root.rglob(name) if p.is_file())
    if not hits:
        raise ArtifactError(f"no {SERVER_NAME} (or rpc-server) in the archive")
    folders = {p.parent for p in hits}
    if len(folders) > 1:
        listed = ", ".join(str(f.relative_to(root)) for f in sorted(folders))
        raise ArtifactError(f"several server binaries ({listed})", hint="name one with `subdir:`")
    return hits[0].parent, hits[0].name


def _binary_platform(path: Path) -> tuple[str, str] | None:
    """(os, arch) read from an ELF or Mach-O header; None when the format is not recognised."""
    with path.open("rb") as fh:
        head = fh.read(64)
    if head[:4] == b"\x7fELF" and len(head) >= 20:
        endian = "<" if head[5] == 1 else ">"
        (machine,) = struct.unpack(endian + "H", head[18:20])
        elf_arch = {0x3E: "x86_64", 0xB7: "aarch64", 0x03: "i386", 0x28: "arm", 0xF3: "riscv64"}
        return "linux", elf_arch.get(machine, f"elf-{machine}")
    if head[:4] in (b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe") and len(head) >= 8:
        (cputype,) = struct.unpack("<i", head[4:8])
        macho_arch = {0x01000007: "x86_64", 0x0100000C: "arm64"}
        return "darwin", macho_arch.get(cputype, f"macho-{cputype}")
    return None


# ---------------------------------------------------------------- asking a server its protocol


def _hello(host: str, port: int, timeout: float) -> str:
    """Send HELLO (command 14, 24 zero bytes of capabilities); return "major.minor.patch"."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
        reply = b""
        while len(reply) < 8 + 28:
            chunk = sock.recv(8 + 28 - len(reply))
            if not chunk:
                raise ConnectionError("connection closed during HELLO")
            reply += chunk
        (size,) = struct.unpack("<Q", reply[:8])
        if size != 28:
            raise ConnectionError(f"unexpected HELLO reply size {size}")
        sock.shutdown(socket.SHUT_RDWR)
    return f"{reply[8]}.{reply[9]}.{reply[10]}"


def probe_protocol(binary: Path, *, timeout: float = 10.0) -> str:
    """Start `binary` on a free 127.0.0.1 port, ask HELLO, stop it: the protocol version it speaks."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="rpcfleet-probe-") as cache:
        env = {**os.environ, "LLAMA_CACHE": cache}
        proc = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    return _hello("127.0.0.1", port, 2.0)
                except OSError as exc:
                    if proc.poll() is not None:
                        raise ArtifactError(
                            f"{binary} exited with status {proc.returncode} before answering HELLO"
                        ) from exc
                    if time.monotonic() > deadline:
                        raise ArtifactError(f"{binary} did not answer HELLO within {timeout:.0f} s") from exc
                    time.sleep(0.05)
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# ---------------------------------------------------------------- spec files and resolution

_SPEC_KEYS = {
    "url", "path", "build", "sha256", "protocol", "backend", "os", "arch", "native", "cmake_args",
    "subdir", "llama_cpp_commit", "llama_cpp_python_version", "build_timeout",
}  # fmt: skip


def read_artifact_spec(path: Path) -> ArtifactSpec:
    """Parse a YAML/JSON artifact spec; errors name the file and line (`ArtifactSpecError`)."""
    import yaml

    from orchestrator.yamlsource import Source, compose, node_value

    try:
        text = path.read_text()
    except OSError as exc:
        raise ArtifactSpecError(
            f"cannot read the artifact spec: {exc.strerror}", SourceLocation(path)
        ) from exc
    try:
        node = compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = SourceLocation(path, mark.line + 1, mark.column + 1) if mark else SourceLocation(path)
        raise ArtifactSpecError(f"not valid YAML/JSON: {getattr(exc, 'problem', exc)}", where) from exc
    loc = Source.of_text(path, text).node
    if not isinstance(node, yaml.MappingNode):
        raise ArtifactSpecError(
            "an artifact spec must be a mapping (url/path/build + sha256)", SourceLocation(path, 1)
        )
    values: dict[str, tuple[Any, yaml.Node]] = {}
    for key_node, value_node in node.value:
        key = key_node.value
        if key not in _SPEC_KEYS:
            raise ArtifactSpecError(
                f"unknown key {key!r}", loc(key_node), hint=f"known: {', '.join(sorted(_SPEC_KEYS))}"
            )
        values[key] = (node_value(value_node), value_node)

    def text_of(key: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str | None:
        if key not in values:
            return None
        value, value_node = values[key]
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ArtifactSpecError(f"{key} must be a string", loc(value_node))
        value = str(value).strip()
        if pattern is not None and not pattern.match(value):
            raise ArtifactSpecError(f"{key} must be {what}, not {value!r}", loc(value_node))
        return value

    sources = [k for k in ("url", "path", "build") if k in values]
    if len(sources) != 1:
        raise ArtifactSpecError("an artifact spec needs exactly one of url, path or build", loc(node))
    kind = sources[0]
    value = text_of(kind) or ""
    sha = text_of("sha256", _SHA_RE, "64 lowercase hex digits")
    if kind == "build" and value != "on_node":
        raise ArtifactSpecError(f"build must be 'on_node', not {value!r}", loc(values["build"][1]))
    if kind == "url" and not re.match(r"^(https?|file)://", value):
        raise ArtifactSpecError(f"url must be http(s):// or file://, not {value!r}", loc(values["url"][1]))
    if kind != "build" and sha is None:
        raise ArtifactSpecError(f"a {kind} source needs its sha256", loc(node))
    if kind == "path":
        value = str((path.parent / Path(value).expanduser()).resolve())
    backend = text_of("backend")
    if backend is not None and backend not in BACKENDS:
        raise ArtifactSpecError(
            f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}", loc(values["backend"][1])
        )
    cmake_args: tuple[str, ...] = ()
    if "cmake_args" in values:
        raw, raw_node = values["cmake_args"]
        if isinstance(raw, str):
            raw = shlex.split(raw)
        if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
            raise ArtifactSpecError("cmake_args must be a list of strings", loc(raw_node))
        cmake_args = tuple(raw)
    native = False
    if "native" in values:
        native_value, native_node = values["native"]
        if not isinstance(native_value, bool):
            raise ArtifactSpecError("native must be true or false", loc(native_node))
        native = native_value
    build_timeout: float | None = None
    if "build_timeout" in values:
        timeout_value, timeout_node = values["build_timeout"]
        if (
            isinstance(timeout_value, bool)
            or not isinstance(timeout_value, int | float)
            or timeout_value <= 0
        ):
            raise ArtifactSpecError("build_timeout must be a positive number of seconds", loc(timeout_node))
        if kind != "build":
            raise ArtifactSpecError("build_timeout applies to `build: on_node` only", loc(timeout_node))
        build_timeout = float(timeout_value)
    return ArtifactSpec(
        kind=kind,
        value=value,
        sha256=sha,
        protocol=text_of("protocol", _PROTO_RE, "major.minor.patch"),
        backend=backend,
        os=text_of("os"),
        arch=text_of("arch"),
        native=native,
        cmake_args=cmake_args,
        subdir=text_of("subdir"),
        llama_cpp_commit=text_of("llama_cpp_commit"),
        llama_cpp_python_version=text_of("llama_cpp_python_version"),
        build_timeout=build_timeout,
        location=SourceLocation(path),
    )


def resolve_artifact(
    spec: str, *, backend: str = "cpu", os: str | None = None, arch: str | None = None
) -> Artifact:
    """An inventory's `rpc_artifact` value as an artifact for a host with this backend/os/arch.

    `spec` is an artifact id from the cache, a path to a YAML/JSON spec file, or "" / "default" for the
    locally built default. The artifact must match the host's backend, os and arch.
    """
    host_os, host_arch = host_platform()
    want_os, want_arch = os or host_os, arch or host_arch
    spec = spec.strip()
    if spec in ("", "default"):
        if (want_os, want_arch) != (host_os, host_arch):
            raise ArtifactError(
                f"the default artifact is built for {host_os}/{host_arch}, the host is {want_os}/{want_arch}",
                hint="pin rpc_artifact to a spec file (url/path, or build: on_node)",
            )
        artifact = default_artifact(backend)
    elif _ID_RE.match(spec) and (artifacts_dir() / f"{spec}.json").is_file():
        artifact = load_artifact(spec)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ArtifactError(
                f"rpc_artifact {spec!r} is neither a cached artifact id nor a spec file",
                hint="`rpcfleet artifact list` shows cached ids",
            )
        parsed = read_artifact_spec(path)
        if parsed.kind == "build":
            raise ArtifactError(f"{path}: `build: on_node` artifacts are built on the node during install")
        artifact = import_artifact(parsed, backend=backend, os_name=want_os, arch=want_arch)
    manifest = artifact.manifest
    wanted = (backend, want_os, want_arch)
    if (manifest.backend, manifest.os, manifest.arch) != wanted:
        raise ArtifactError(
            f"artifact {artifact.id} is for {manifest.backend}/{manifest.os}/{manifest.arch}, "
            f"the host needs {'/'.join(wanted)}"
        )
    return artifact


# ---------------------------------------------------------------- building on the node


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
class SdistInfo:
    """What a llama-cpp-python sdist says about the server it builds (read without extracting it)."""

    sha256: str
    size: int
    protocol: str
    llama_cpp_commit: str | None
    ggml_version: str | None


_SDIST_INFO: dict[tuple[str, int, int], SdistInfo] = {}


def read_sdist_info(sdist: Path) -> SdistInfo:
    """sha256, RPC protocol, llama.cpp commit and ggml version of a llama-cpp-python sdist: one pass
    over the archive (about half a second), remembered per file for this process."""
    try:
        st = sdist.stat()
    except OSError as exc:
        raise ArtifactError(f"cannot read {sdist}: {exc.strerror}") from exc
    memo = (str(sdist), st.st_size, st.st_mtime_ns)
    if memo in _SDIST_INFO:
        return _SDIST_INFO[memo]
    wanted = {
        "header": "/vendor/llama.cpp/ggml/include/ggml-rpc.h",
        "cmake": "/vendor/llama.cpp/ggml/CMakeLists.txt",
        "changelog": "/CHANGELOG.md",
    }
    texts: dict[str, str] = {}
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                for key, suffix in wanted.items():
                    # Only the sdist's top folder: <name>/CHANGELOG.md, not vendor/*/CHANGELOG.md.
                    depth_ok = member.name.count("/") == suffix.count("/")
                    if key not in texts and member.isfile() and depth_ok and member.name.endswith(suffix):
                        fh = tar.extractfile(member)
                        texts[key] = fh.read().decode(errors="replace") if fh else ""
                if len(texts) == len(wanted):
                    break
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ArtifactError(f"cannot read the source archive {sdist}: {exc}") from exc
    if "header" not in texts:
        raise ArtifactError(
            f"{sdist} holds no vendor/llama.cpp/ggml/include/ggml-rpc.h: not a llama-cpp-python sdist"
        )
    info = SdistInfo(
        sha256=_sha256_file(sdist),
        size=st.st_size,
        protocol=_protocol_of(texts["header"], f"{sdist.name}: ggml-rpc.h"),
        llama_cpp_commit=_commit_of(texts.get("changelog", "")),
        ggml_version=_ggml_version_of(texts.get("cmake", "")),
    )
    _SDIST_INFO[memo] = info
    return info


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
            native=_is_native(self.cmake_args),
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
    sdist = _ensure_sdist(version, lambda _line: None)
    info = read_sdist_info(sdist)
    if spec.sha256 is not None and spec.sha256 != info.sha256:
        raise ArtifactError(
            f"{sdist}: sha256 is {info.sha256}, the spec pins {spec.sha256}",
            hint="put the pinned llama-cpp-python sdist into the cache, or fix the spec's sha256",
        )
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


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)
