"""Importing artifacts from a URL, a release archive or a folder holding a built server."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path

from orchestrator.artifacts.build import collect_server, source_key
from orchestrator.artifacts.manifest import (
    CHUNK,
    MANIFEST_NAME,
    SERVER_NAME,
    SERVER_NAMES,
    Artifact,
    ArtifactSpec,
    Manifest,
    host_platform,
    scan_files,
)
from orchestrator.artifacts.store import (
    artifacts_dir,
    recall,
    remember,
    store,
    verify_artifact,
)
from orchestrator.core.errors import ArtifactError
from orchestrator.core.files import atomic_path, sha256_file, write_atomic
from orchestrator.core.paths import rpcfleet_home
from orchestrator.core.poll import poll
from orchestrator.engine.children import open_child
from orchestrator.engine.runtime import run_sync
from orchestrator.rpc.client import probe_endpoint

FETCH_TIMEOUT_S = 60.0


def fetch_url(url: str, sha256: str, *, timeout: float = FETCH_TIMEOUT_S) -> Path:
    """Download `url` once into `$RPCFLEET_HOME/downloads/<sha256>`; a wrong sha256 leaves nothing behind."""
    sha256 = sha256.lower()
    downloads = rpcfleet_home() / "downloads"
    target = downloads / sha256
    if target.is_file():
        return target
    import httpx

    try:
        with atomic_path(target, parents=True) as tmp:
            digest = hashlib.sha256()
            with (
                tmp.open("wb") as out,
                httpx.stream("GET", url, timeout=timeout, follow_redirects=True) as response,
            ):
                response.raise_for_status()
                for chunk in response.iter_bytes(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != sha256:
                raise ArtifactError(f"{url}: sha256 is {digest.hexdigest()}, expected {sha256}")
    except (httpx.HTTPError, OSError) as exc:
        raise ArtifactError(f"cannot fetch {url}: {exc}") from exc
    finally:
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
    key = source_key(replace(spec, backend=want_backend), want_os, want_arch)
    cached = recall(key)
    if cached is not None:
        return cached
    if spec.kind == "url":
        source = fetch_url(spec.value, spec.sha256, timeout=timeout)
    else:
        source = Path(spec.value).expanduser()
        if not source.exists():
            raise ArtifactError(f"{source}: no such file or folder")
        actual = sha256_file(source) if source.is_file() else spec.sha256
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
                remember(key, existing)
                return existing
        server_dir, server_name = _find_server(unpacked, spec.subdir)
        if source.is_dir() and sha256_file(server_dir / server_name) != spec.sha256:
            raise ArtifactError(
                f"{server_dir / server_name}: sha256 is {sha256_file(server_dir / server_name)}, "
                f"expected {spec.sha256} (for a folder, the sha256 of its {SERVER_NAME})"
            )
        stage = work / "stage"
        collect_server(server_dir, stage / "bin", server_name)
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
            files=scan_files(stage),
            cmake_args=spec.cmake_args,
            llama_cpp_commit=spec.llama_cpp_commit,
            llama_cpp_python_version=spec.llama_cpp_python_version,
            source=f"{spec.kind}:{spec.value}",
        )
        artifact = store(stage, manifest)
    remember(key, artifact)
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
    sha = sha256_file(archive)
    artifact_id = f"rpc-server-{manifest.protocol}-{manifest.backend}-{manifest.os}-{manifest.arch}-{sha[:8]}"
    candidate = Artifact(artifact_id, archive, manifest, sha)
    verify_artifact(candidate)
    cache = artifacts_dir()
    cache.mkdir(parents=True, exist_ok=True)
    stored = cache / f"{artifact_id}.tar.gz"
    if not stored.exists():
        with atomic_path(stored) as tmp:
            shutil.copyfile(archive, tmp)
    sidecar = {"id": artifact_id, "archive_sha256": sha, "manifest": manifest.to_dict()}
    write_atomic(cache / f"{artifact_id}.json", json.dumps(sidecar, indent=2) + "\n")
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


def probe_protocol(binary: Path, *, timeout: float = 10.0) -> str:
    """Start `binary` on a free 127.0.0.1 port, ask HELLO (`rpc.client`, also the legacy one of servers
    older than protocol 3), stop it: the protocol version it speaks."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="rpcfleet-probe-") as cache:
        env = {**os.environ, "LLAMA_CACHE": cache}
        proc = open_child(
            [str(binary), "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        failures: list[str] = []

        def answer() -> str | None:
            # Any version is an answer here, also one this client cannot use (a mismatch).
            result = run_sync(probe_endpoint(f"127.0.0.1:{port}", hello_only=True))
            if result.version is not None:
                return str(result.version)
            if proc.poll() is not None:
                raise ArtifactError(f"{binary} exited with status {proc.returncode} before answering HELLO")
            failures.append(f"{result.outcome}: {result.message}")
            return None

        try:
            version = poll(answer, timeout=timeout, interval=0.05)
            if version is None:
                why = failures[-1] if failures else "no answer"
                raise ArtifactError(f"{binary} did not answer HELLO within {timeout:.0f} s ({why})")
            return version
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
