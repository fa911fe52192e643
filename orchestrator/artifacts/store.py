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
folder pinned by sha256 (`import_artifact`), or a build on the node itself (`on_node_build_script`;
the SSH part lives in operations/node_build.py). `resolve_artifact` turns an inventory's `rpc_artifact`
value into one.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from orchestrator.artifacts.manifest import (
    CHUNK,
    ID_RE,
    MANIFEST_NAME,
    Artifact,
    ArtifactChoiceError,
    FileEntry,
    Manifest,
)
from orchestrator.core.errors import ArtifactError
from orchestrator.core.files import sha256_file, write_atomic
from orchestrator.core.log import get_logger
from orchestrator.core.paths import rpcfleet_home

Progress = Callable[[str], None]


def artifacts_dir() -> Path:
    return rpcfleet_home() / "artifacts"


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
        data = manifest.to_bytes()
        tar.addfile(_tarinfo(MANIFEST_NAME, size=len(data)), io.BytesIO(data))
        for entry in sorted(manifest.files, key=lambda e: e.path):
            if entry.link is not None:
                tar.addfile(_tarinfo(entry.path, mode=0o777, link=entry.link))
                continue
            path = root / entry.path
            with path.open("rb") as fh:
                tar.addfile(_tarinfo(entry.path, size=entry.size, mode=entry.mode), fh)


def store(root: Path, manifest: Manifest) -> Artifact:
    """Pack `root` into the cache under its content-derived id (idempotent)."""
    cache = artifacts_dir()
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".pack-", suffix=".tar.gz", dir=cache)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            pack_artifact(root, manifest, fh)
        sha = sha256_file(tmp)
        artifact_id = (
            f"rpc-server-{manifest.protocol}-{manifest.backend}-{manifest.os}-{manifest.arch}-{sha[:8]}"
        )
        archive = cache / f"{artifact_id}.tar.gz"
        tmp.replace(archive)
    finally:
        tmp.unlink(missing_ok=True)
    artifact = Artifact(artifact_id, archive, manifest, sha)
    sidecar = {"id": artifact_id, "archive_sha256": sha, "manifest": manifest.to_dict()}
    write_atomic(cache / f"{artifact_id}.json", json.dumps(sidecar, indent=2) + "\n")
    return artifact


def remember(key: str, artifact: Artifact) -> None:
    write_atomic(artifacts_dir() / "keys" / key, artifact.id + "\n", parents=True)


def recall(key: str) -> Artifact | None:
    """The artifact remembered under `key`, if its files are still in the cache (no re-hashing: fast)."""
    try:
        artifact_id = (artifacts_dir() / "keys" / key).read_text().strip()
        return load_artifact(artifact_id)
    except (OSError, ArtifactError):
        return None


def load_artifact(artifact_id: str) -> Artifact:
    """The cached artifact `artifact_id` (reads its sidecar; does not re-hash, see `verify_artifact`)."""
    if not ID_RE.match(artifact_id):
        raise ArtifactChoiceError(f"invalid artifact id {artifact_id!r}")
    cache = artifacts_dir()
    sidecar, archive = cache / f"{artifact_id}.json", cache / f"{artifact_id}.tar.gz"
    if not sidecar.is_file() or not archive.is_file():
        raise ArtifactChoiceError(
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
    actual = sha256_file(artifact.archive)
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
    while chunk := fh.read(CHUNK):
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
