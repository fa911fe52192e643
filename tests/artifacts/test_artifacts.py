"""rpc-server artifacts: manifest, determinism, verification, running anywhere, sources, specs, CLI."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import os
import platform
import re
import shutil
import socket
import struct
import subprocess
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.artifacts.build import (
    build_artifact,
    build_key,
    cached_build,
    effective_cmake_args,
    local_server_binary,
)
from orchestrator.artifacts.buildenv import BUILD_REQUIREMENTS, ensure_build_env
from orchestrator.artifacts.imports import import_artifact
from orchestrator.artifacts.manifest import (
    Artifact,
    ArtifactSpec,
    ArtifactSpecError,
    Manifest,
    llama_cpp_python_version,
)
from orchestrator.artifacts.node_build import on_node_build_script
from orchestrator.artifacts.source import SDIST_SHA256, ensure_sdist, read_protocol_version, sdist_path
from orchestrator.artifacts.spec import read_artifact_spec, resolve_artifact
from orchestrator.artifacts.store import (
    artifacts_dir,
    list_artifacts,
    load_artifact,
    pack_artifact,
    unpack_artifact,
    verify_artifact,
)
from orchestrator.cli import main
from orchestrator.core.errors import ArtifactError
from tests.plugins.servers import free_port

SERVER = "bin/ggml-rpc-server"


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hello(port: int, timeout: float = 2.0) -> str:
    """HELLO over a plain socket: `0e | u64 24 | 24 zero bytes` -> `u64 28 | major minor patch ...`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"\x0e" + struct.pack("<Q", 24) + bytes(24))
        reply = b""
        while len(reply) < 36:
            chunk = sock.recv(36 - len(reply))
            assert chunk, "server closed the connection during HELLO"
            reply += chunk
    assert struct.unpack("<Q", reply[:8])[0] == 28
    return f"{reply[8]}.{reply[9]}.{reply[10]}"


def sdist_header(tmp_path: Path, version: str) -> Path:
    """ggml-rpc.h straight out of the llama-cpp-python sdist the artifact was built from."""
    name = f"llama_cpp_python-{version}/vendor/llama.cpp/ggml/include/ggml-rpc.h"
    with tarfile.open(sdist_path(version)) as tar:
        member = tar.extractfile(name)
        assert member is not None
        out = tmp_path / "ggml-rpc.h"
        out.write_bytes(member.read())
    return out


def archive_members(archive: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


# ---------------------------------------------------------------- the locally built artifact


def test_manifest_describes_the_build(cpu_artifact: Artifact, tmp_path: Path) -> None:
    m = cpu_artifact.manifest
    version = llama_cpp_python_version()
    assert m.protocol == read_protocol_version(sdist_header(tmp_path, version)) == "7.0.0"
    assert (m.backend, m.os, m.native) == ("cpu", "linux", False)
    assert m.arch == {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())
    assert "-DGGML_NATIVE=OFF" in m.cmake_args and "-DGGML_RPC=ON" in m.cmake_args
    assert m.llama_cpp_python_version == version
    assert m.llama_cpp_commit is not None and re.fullmatch(r"[0-9a-f]{7,40}", m.llama_cpp_commit)
    assert m.ggml_version is not None and re.fullmatch(r"\d+\.\d+\.\d+", m.ggml_version)
    if version == "0.3.36":
        assert (m.llama_cpp_commit, m.ggml_version) == ("0c1e57098", "0.25.3")

    # The id names the protocol, platform and the archive's hash, which is the file's real sha256.
    data = cpu_artifact.archive.read_bytes()
    assert cpu_artifact.archive_sha256 == sha256_of(data)
    assert cpu_artifact.id == f"rpc-server-7.0.0-cpu-linux-{m.arch}-{sha256_of(data)[:8]}"

    # Every file's sha256, size and mode in the manifest matches the archive; symlinks are kept.
    with tarfile.open(cpu_artifact.archive, "r:gz") as tar:
        names = tar.getnames()
        assert names[0] == "manifest.json"
        inner = tar.extractfile("manifest.json")
        assert inner is not None
        assert Manifest.from_dict(json.loads(inner.read())) == m
        assert sorted(names[1:]) == sorted(e.path for e in m.files) == names[1:]
        for entry in m.files:
            member = tar.getmember(entry.path)
            if entry.link is not None:
                assert member.issym() and member.linkname == entry.link
                continue
            fh = tar.extractfile(member)
            assert fh is not None
            content = fh.read()
            assert (sha256_of(content), len(content), member.mode) == (entry.sha256, entry.size, entry.mode)
    server = m.file(SERVER)
    assert server.mode == 0o755 and server.size > 100_000
    assert m.file("bin/libggml.so").link == "libggml.so.0"
    assert any(re.fullmatch(r"bin/libggml-cpu\.so\.\d+\.\d+\.\d+", e.path) for e in m.files)


def test_build_returns_the_cached_artifact_fast(cpu_artifact: Artifact) -> None:
    start = time.perf_counter()
    again = build_artifact("cpu")
    elapsed = time.perf_counter() - start
    assert again == cpu_artifact
    assert elapsed < 10, f"a cached build took {elapsed:.2f} s"  # not rebuilt (minutes); headroom for load
    # The same request spelled differently (an explicit default, other order) hits the same cache entry.
    assert cached_build("cpu", ["-DGGML_NATIVE=OFF", "-DGGML_RPC=ON"]) == cpu_artifact
    assert cached_build("cpu", ["-DGGML_NATIVE=ON"]) != cpu_artifact


def test_cmake_args_are_canonical_and_user_args_override() -> None:
    base = effective_cmake_args("cpu")
    assert "-DGGML_NATIVE=OFF" in base and "-DCMAKE_INSTALL_RPATH=$ORIGIN" in base
    native = effective_cmake_args("cuda", ["-DGGML_NATIVE:BOOL=ON", "-G", "Ninja"])
    assert "-DGGML_NATIVE=ON" in native and "-DGGML_NATIVE=OFF" not in native
    assert "-DGGML_CUDA=ON" in native and native[-2:] == ("-G", "Ninja")
    key = build_key("0.3.36", "cpu", ["-DA=1", "-DB=2"])
    assert key == build_key("0.3.36", "cpu", ["-DB=2", "-DA=1"])
    assert key != build_key("0.3.37", "cpu", ["-DA=1", "-DB=2"])
    assert key != build_key("0.3.36", "cpu", ["-DA=1", "-DB=2"], arch="aarch64")
    with pytest.raises(ArtifactError, match="unknown backend"):
        effective_cmake_args("opencl")


def test_read_protocol_version(tmp_path: Path) -> None:
    header = tmp_path / "ggml-rpc.h"
    header.write_text(
        "#pragma once\n#define RPC_PROTO_MAJOR_VERSION    8\n"
        "#define RPC_PROTO_MINOR_VERSION 1\n#  define RPC_PROTO_PATCH_VERSION 12 // note\n"
    )
    assert read_protocol_version(header) == "8.1.12"
    header.write_text("#define RPC_PROTO_MAJOR_VERSION 8\n#define RPC_PROTO_MINOR_VERSION 1\n")
    with pytest.raises(ArtifactError, match=r"ggml-rpc\.h: no RPC_PROTO_PATCH_VERSION"):
        read_protocol_version(header)


def test_archive_is_deterministic(cpu_artifact: Artifact, cpu_artifact_tree: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(cpu_artifact_tree, tree, symlinks=True)
    first = io.BytesIO()
    pack_artifact(tree, cpu_artifact.manifest, first)
    # New mtimes (and a new folder) must not change a byte.
    for path in tree.rglob("*"):
        if not path.is_symlink():
            os.utime(path, (1_700_000_000, 1_700_000_000))
    second = io.BytesIO()
    pack_artifact(tree, cpu_artifact.manifest, second)
    assert first.getvalue() == second.getvalue()
    assert sha256_of(first.getvalue()) == cpu_artifact.archive_sha256
    for member in archive_members(cpu_artifact.archive).values():
        assert (member.mtime, member.uid, member.gid, member.uname, member.gname) == (0, 0, 0, "", "")


def test_verify_accepts_the_cached_artifact(cpu_artifact: Artifact) -> None:
    verify_artifact(cpu_artifact)  # raises on any mismatch
    # What it vouched for holds: the archive hash, and every file of the manifest in the archive with
    # its recorded hash (symlinks with their target).
    assert sha256_of(cpu_artifact.archive.read_bytes()) == cpu_artifact.archive_sha256
    members = archive_members(cpu_artifact.archive)
    with tarfile.open(cpu_artifact.archive, "r:gz") as tar:
        for entry in cpu_artifact.manifest.files:
            member = members[entry.path]
            if entry.link is not None:
                assert member.issym() and member.linkname == entry.link
                continue
            data = tar.extractfile(member)
            assert data is not None and sha256_of(data.read()) == entry.sha256
            assert member.size == entry.size


def test_verify_detects_a_corrupted_archive(cpu_artifact: Artifact, tmp_path: Path) -> None:
    copy = tmp_path / cpu_artifact.archive.name
    data = bytearray(cpu_artifact.archive.read_bytes())
    data[len(data) // 2] ^= 0x01
    copy.write_bytes(data)
    with pytest.raises(ArtifactError, match=rf"archive {re.escape(copy.name)} has sha256"):
        verify_artifact(replace(cpu_artifact, archive=copy))


def test_verify_detects_a_corrupted_member(cpu_artifact: Artifact, tmp_path: Path) -> None:
    # Flip one byte inside a library's data in the uncompressed tar, recompress, and record the new
    # archive hash: the archive check passes, so only the member check can catch it.
    raw = bytearray(gzip.decompress(cpu_artifact.archive.read_bytes()))
    victim = next(e for e in cpu_artifact.manifest.files if e.link is None and "libggml-base" in e.path)
    member = archive_members(cpu_artifact.archive)[victim.path]
    raw[member.offset_data + member.size // 2] ^= 0x01
    copy = tmp_path / "corrupt.tar.gz"
    copy.write_bytes(gzip.compress(bytes(raw)))
    corrupt = replace(cpu_artifact, archive=copy, archive_sha256=sha256_of(copy.read_bytes()))
    with pytest.raises(ArtifactError, match=rf"{re.escape(victim.path)}: sha256"):
        verify_artifact(corrupt)


def test_unpacked_server_runs_from_any_folder(cpu_artifact: Artifact, tmp_path: Path) -> None:
    binary = unpack_artifact(cpu_artifact, tmp_path / "some where" / "else")
    # The build folder still exists on this machine, so running alone would not catch an absolute
    # RUNPATH: require $ORIGIN-only search paths in every ELF file, then run it.
    for path in binary.parent.iterdir():
        if path.is_symlink():
            continue
        dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
        runpaths = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", dynamic)
        assert runpaths == ["$ORIGIN"], f"{path.name}: {runpaths}"
    port = free_port()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["LLAMA_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.Popen(
        [str(binary), "-H", "127.0.0.1", "-p", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                assert hello(port) == "7.0.0"
                break
            except OSError:
                assert proc.poll() is None, f"server exited with status {proc.returncode}"
                assert time.monotonic() < deadline, "server did not answer HELLO within 10 s"
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(5)


def test_local_server_binary_is_the_unpacked_default(cpu_artifact: Artifact) -> None:
    binary = local_server_binary()
    assert binary == artifacts_dir() / cpu_artifact.id / SERVER
    assert os.access(binary, os.X_OK)
    assert sha256_of(binary.read_bytes()) == cpu_artifact.manifest.file(SERVER).sha256
    unpacked = binary.stat()
    assert local_server_binary() == binary
    again = binary.stat()
    assert (again.st_ino, again.st_ctime_ns) == (unpacked.st_ino, unpacked.st_ctime_ns)  # not unpacked again


# ---------------------------------------------------------------- other sources


@pytest.fixture
def release_zip(cpu_artifact_tree: Path, tmp_path: Path) -> Path:
    """A zip laid out like a llama.cpp release: binaries under build/bin/, no symlinks, extra files."""
    path = tmp_path / "www" / "llama-b9999-bin-ubuntu-x64.zip"
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as zf:
        for item in sorted((cpu_artifact_tree / "bin").iterdir()):
            # Release zips hold copies, not symlinks; read_bytes follows the link.
            info = zipfile.ZipInfo(f"build/bin/{item.name}", date_time=(2025, 1, 1, 0, 0, 0))
            info.external_attr = (item.stat().st_mode & 0o777) << 16
            zf.writestr(info, item.read_bytes())
        zf.writestr("build/bin/llama-cli", "not a server")
        zf.writestr("LICENSE", "MIT")
    return path


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """(base URL, request log) of an http.server on 127.0.0.1 serving tmp_path/www."""
    requests: list[str] = []
    www = tmp_path / "www"
    www.mkdir(exist_ok=True)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(www), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


def test_url_source_with_a_wrong_sha256_leaves_nothing(
    release_zip: Path, http_root: tuple[str, list[str]], artifact_home: Path
) -> None:
    base, requests = http_root
    spec = ArtifactSpec("url", f"{base}/{release_zip.name}", sha256="0" * 64, protocol="7.0.0")
    with pytest.raises(ArtifactError, match="sha256 is"):
        import_artifact(spec)
    assert requests == [f"/{release_zip.name}"]
    assert [p for p in artifact_home.rglob("*") if p.is_file()] == []


def test_url_source_is_fetched_once_and_repackaged(
    cpu_artifact: Artifact,
    release_zip: Path,
    http_root: tuple[str, list[str]],
    artifact_home: Path,
) -> None:
    base, requests = http_root
    sha = sha256_of(release_zip.read_bytes())
    # No protocol given: it is asked from the binary with HELLO on 127.0.0.1.
    spec = ArtifactSpec("url", f"{base}/{release_zip.name}", sha256=sha)
    artifact = import_artifact(spec)
    m = artifact.manifest
    assert artifact.archive.parent == artifact_home / "artifacts"
    assert (m.protocol, m.backend, m.os, m.source) == ("7.0.0", "cpu", "linux", f"url:{spec.value}")
    paths = {e.path for e in m.files}
    assert SERVER in paths and "bin/llama-cli" not in paths and "bin/LICENSE" not in paths
    assert m.file(SERVER).sha256 == cpu_artifact.manifest.file(SERVER).sha256
    # Libraries arrive as copies (zip has no symlinks) and every name the loader needs is there.
    assert {p for p in paths if p.startswith("bin/lib")} == {
        e.path for e in cpu_artifact.manifest.files if e.path.startswith("bin/lib")
    }
    verify_artifact(artifact)
    assert load_artifact(artifact.id) == artifact
    assert (artifact_home / "downloads" / sha).is_file()
    # A second request is answered from the cache, without fetching again.
    assert import_artifact(spec) == artifact
    assert requests == [f"/{release_zip.name}"]


def test_folder_source_through_a_spec_file(
    cpu_artifact: Artifact, cpu_artifact_tree: Path, tmp_path: Path, artifact_home: Path
) -> None:
    folder = tmp_path / "server"
    shutil.copytree(cpu_artifact_tree / "bin", folder, symlinks=True)
    binary_sha = sha256_of((folder / "ggml-rpc-server").read_bytes())
    spec_file = tmp_path / "pinned.yml"
    spec_file.write_text(f"path: server\nsha256: {binary_sha}\nprotocol: 7.0.0\nbackend: cpu\n")
    artifact = resolve_artifact(str(spec_file), backend="cpu")
    # The same files, the same manifest fields: the folder repacks into the built artifact's content.
    assert {e.path: e.sha256 for e in artifact.manifest.files} == {
        e.path: e.sha256 for e in cpu_artifact.manifest.files
    }
    assert artifact.manifest.protocol == "7.0.0"
    verify_artifact(artifact)
    spec_file.write_text(f"path: server\nsha256: {'1' * 64}\nprotocol: 7.0.0\n")
    with pytest.raises(ArtifactError, match="sha256 is"):
        resolve_artifact(str(spec_file), backend="cpu")


def test_an_artifact_archive_as_source_is_adopted_unchanged(
    cpu_artifact: Artifact, artifact_home: Path
) -> None:
    spec = ArtifactSpec("path", str(cpu_artifact.archive), sha256=cpu_artifact.archive_sha256)
    adopted = import_artifact(spec)
    assert (adopted.id, adopted.archive_sha256) == (cpu_artifact.id, cpu_artifact.archive_sha256)
    assert adopted.archive == artifact_home / "artifacts" / cpu_artifact.archive.name
    assert [a.id for a in list_artifacts()] == [cpu_artifact.id]


def test_resolve_by_id_checks_the_platform(cpu_artifact: Artifact) -> None:
    assert resolve_artifact(cpu_artifact.id, backend="cpu") == cpu_artifact
    assert resolve_artifact("default") == cpu_artifact
    with pytest.raises(ArtifactError, match="the host needs cuda/linux"):
        resolve_artifact(cpu_artifact.id, backend="cuda")
    with pytest.raises(ArtifactError, match=r"aarch64|x86_64"):
        resolve_artifact(cpu_artifact.id, arch="riscv64")
    with pytest.raises(ArtifactError, match="neither a cached artifact id nor a spec file"):
        resolve_artifact("rpc-server-0.0.0-cpu-linux-x86_64-deadbeef")


# ---------------------------------------------------------------- the pinned llama-cpp-python sdists

ROOT = Path(__file__).resolve().parents[2]


def test_the_sdists_are_pinned_and_setup_pins_the_same(tmp_path: Path) -> None:
    """Setup and the artifact builder pin the same bytes, and the files setup downloaded match them."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.findall(r"^SDIST_SHA256=([0-9a-f]{64})\b", setup, re.MULTILINE) == [SDIST_SHA256["0.3.36"]]
    assert re.search(r'verify_sdist "\$SDIST"', setup)  # checked before the wheel is built from it
    # setup's own check, run: the pinned file passes, other bytes stop setup with the reason.
    check = (
        'source <(sed -n "/^say()/p;/^die()/p;/^SDIST_SHA256=/p;/^verify_sdist()/,/^}/p" "$0"); '
        'verify_sdist "$1" cached "delete it"'
    )
    ok = subprocess.run(["bash", "-c", check, ROOT / "scripts" / "setup.sh", sdist_path("0.3.36")],
                        capture_output=True, text=True, check=False)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    other = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    other.write_bytes(b"other bytes")
    bad = subprocess.run(["bash", "-c", check, ROOT / "scripts" / "setup.sh", other],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert bad.returncode == 1
    assert f"has sha256 {sha256_of(b'other bytes')}, but {SDIST_SHA256['0.3.36']} is pinned" in bad.stderr
    assert "it is not used; delete it" in bad.stderr
    for version in ("0.3.36", "0.3.16"):
        assert sha256_of(sdist_path(version).read_bytes()) == SDIST_SHA256[version], version


def test_a_cached_sdist_that_does_not_match_its_pin_is_not_used(artifact_home: Path) -> None:
    sdist = sdist_path("0.3.36")
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(b"other bytes under the pinned name")
    actual = sha256_of(sdist.read_bytes())
    with pytest.raises(ArtifactError) as refused:
        ensure_sdist("0.3.36", lambda _line: None)
    message = str(refused.value)
    assert f"has sha256 {actual}, but rpcfleet pins {SDIST_SHA256['0.3.36']}: it is not used" in message
    assert f"delete {sdist}" in message
    with pytest.raises(ArtifactError, match=r"rpcfleet pins [0-9a-f]{64}: it is not used"):
        build_artifact("cpu", version="0.3.36")
    assert not list((artifact_home / "build").glob("*/src/*"))  # nothing was extracted, nothing built
    assert sdist.read_bytes() == b"other bytes under the pinned name"  # kept for a look, unused
    # A version without a pin is neither downloaded nor built.
    with pytest.raises(ArtifactError, match=r"llama-cpp-python 0\.3\.1: no pinned sha256"):
        ensure_sdist("0.3.1", lambda _line: None)


def _fake_sdist(folder: Path, version: str) -> Path:
    """A small sdist named like llama-cpp-python's: what a registry could serve instead. Its build
    backend is its own code (in the tree): importing it, as any build step does (metadata included),
    leaves a mark."""
    root = f"llama_cpp_python-{version}"
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        f'[project]\nname = "llama_cpp_python"\nversion = "{version}"\n',
        "PKG-INFO": f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n",
        # The mark says whether the pinned backend's environment is the one it runs in (not isolated).
        "backend.py": "import importlib.util, os, pathlib\n"
        "mark = os.environ.get('RPCFLEET_SDIST_RAN')\n"
        "pinned = importlib.util.find_spec('scikit_build_core') is not None\n"
        "if mark: pathlib.Path(mark).write_text(f'ran, pinned backend importable: {pinned}')\n"
        "def get_requires_for_build_wheel(config_settings=None): return []\n"
        "def prepare_metadata_for_build_wheel(directory, config_settings=None):\n"
        f"    info = pathlib.Path(directory) / 'llama_cpp_python-{version}.dist-info'\n"
        "    info.mkdir()\n"
        "    (info / 'METADATA').write_text(pathlib.Path('PKG-INFO').read_text())\n"
        "    return info.name\n"
        "def build_wheel(directory, config_settings=None, metadata_directory=None): raise SystemExit(1)\n"
        "def build_sdist(directory, config_settings=None): raise SystemExit(1)\n",
    }
    path = folder / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_download_that_does_not_match_its_pin_is_deleted(
    artifact_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip downloads from a local index (no network) a file whose bytes differ from the pin."""
    index = tmp_path / "index"
    index.mkdir()
    served = _fake_sdist(index, "0.3.36")
    ensure_build_env(artifact_home)  # the pinned backend's environment, from the registry
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    mark = tmp_path / "sdist-code-ran"
    monkeypatch.setenv("RPCFLEET_SDIST_RAN", str(mark))
    lines: list[str] = []
    with pytest.raises(ArtifactError) as refused:
        ensure_sdist("0.3.36", lines.append)
    assert not mark.exists()  # refused before any code of it ran (pip checks the hash, then builds)
    assert lines == ["downloading the llama-cpp-python 0.3.36 source with pip"]
    message = str(refused.value)
    assert f"the downloaded file has sha256 {sha256_of(served.read_bytes())}" in message, message
    assert f"but rpcfleet pins {SDIST_SHA256['0.3.36']}: " in message and "not used" in message
    assert "it was deleted" in message
    cache = sdist_path("0.3.36").parent
    assert list(cache.iterdir()) == []  # neither the file nor its download folder is left
    # The same bytes under a pin that matches them are taken (the check passes what it should).
    assert ensure_sdist("0.3.36", lines.append, sha256=sha256_of(served.read_bytes())) == sdist_path("0.3.36")
    assert sdist_path("0.3.36").read_bytes() == served.read_bytes()
    # pip's metadata step ran the file's code (the mark shows it would), in the pinned environment
    assert mark.read_text() == "ran, pinned backend importable: True"


def test_the_build_backend_is_pinned_by_hash_and_runs_without_isolation(artifact_home: Path) -> None:
    """pip's build isolation would install today's scikit-build-core: every pip step on the sdist runs
    the pinned one instead, from a build environment holding exactly build-requirements.txt."""
    pins = [line for line in BUILD_REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[a-z-]+==[0-9.]+ --hash=sha256:[0-9a-f]{64}", p) for p in pins), pins
    python = ensure_build_env(artifact_home)
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert {p.split()[0] for p in pins} <= {f.replace("_", "-").lower() for f in frozen}, frozen
    assert ensure_build_env(artifact_home) == python  # made once
    setup = (Path(__file__).parents[2] / "scripts" / "setup.sh").read_text()
    steps = [line for line in setup.splitlines() if "-m pip download" in line or "-m pip wheel" in line]
    assert len(steps) == 2 and all('"$BUILD_PYTHON"' in s and "--no-build-isolation" in s for s in steps)


# ---------------------------------------------------------------- spec files


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (
            "url: http://127.0.0.1/a.zip\nsha256: " + "a" * 64 + "\nbackned: cuda\n",
            3,
            "unknown key 'backned'",
        ),
        ("url: http://127.0.0.1/a.zip\nsha256: abc\n", 2, "sha256: expected 64 lowercase hex digits, got"),
        ("url: http://127.0.0.1/a.zip\nprotocol: 7\n", 1, "a url source needs its sha256"),
        (
            "path: x.tar.gz\nsha256: " + "a" * 64 + "\nprotocol: 7.0\n",
            3,
            "protocol: expected a protocol version major.minor.patch",
        ),
        ("build: on_node\nbackend: opencl\n", 2, "backend: expected one of"),
        ("build: yes_please\n", 1, "build must be 'on_node'"),
        ("url: ftp://x/a.zip\nsha256: " + "a" * 64 + "\n", 1, "url must be http"),
        ("url: http://h/a\npath: b\nsha256: " + "a" * 64 + "\n", 1, "exactly one of url, path or build"),
        ("build: on_node\ncmake_args:\n  nested: 1\n", 3, "cmake_args: expected a list of arguments"),
        ("url: [unclosed\n", 2, "not valid YAML/JSON"),
        ('{"url": "http://127.0.0.1/a.zip",\n "sha256": "xyz"}\n', 2, "sha256: expected 64"),
    ],
)
def test_spec_errors_name_file_and_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = tmp_path / "artifact.yml"
    path.write_text(text)
    with pytest.raises(ArtifactSpecError) as info:
        read_artifact_spec(path)
    assert f"{path}:{line}" in str(info.value)
    assert message in str(info.value)
    assert isinstance(info.value, ArtifactError)


def test_spec_file_parsing(tmp_path: Path) -> None:
    path = tmp_path / "cuda.json"
    path.write_text(
        json.dumps(
            {
                "url": "http://127.0.0.1:8000/llama-b1-bin-ubuntu-cuda-x64.zip",
                "sha256": "ab" * 32,
                "protocol": "7.0.0",
                "backend": "cuda",
                "subdir": "build/bin",
                "cmake_args": "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=86",
            }
        )
    )
    spec = read_artifact_spec(path)
    assert (spec.kind, spec.sha256, spec.backend, spec.subdir) == ("url", "ab" * 32, "cuda", "build/bin")
    assert spec.cmake_args == ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=86")
    relative = tmp_path / "sub" / "local.yaml"
    relative.parent.mkdir()
    relative.write_text(f"path: ../srv.tar.gz\nsha256: {'c' * 64}\n")
    assert read_artifact_spec(relative).value == str(tmp_path / "srv.tar.gz")


# ---------------------------------------------------------------- building on the node


def test_on_node_build_script_text() -> None:
    spec = ArtifactSpec(
        "build",
        "on_node",
        sha256="d" * 64,
        backend="cuda",
        cmake_args=("-DCMAKE_CUDA_ARCHITECTURES=86;89",),
        llama_cpp_python_version="0.3.36",
    )
    script = on_node_build_script(spec, workdir="/opt/rpc build", jobs=4)
    assert script.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in script
    assert "workdir='/opt/rpc build'" in script
    assert "source='/opt/rpc build/llama_cpp_python-0.3.36.tar.gz'" in script
    assert f"echo '{'d' * 64}  '\"$source\" | sha256sum --check" in script
    assert "'-DCMAKE_CUDA_ARCHITECTURES=86;89'" in script  # quoted: ';' never reaches the shell
    assert "-DGGML_CUDA=ON" in script and "-DGGML_NATIVE=OFF" in script
    assert "--target ggml-rpc-server -j 4" in script
    with pytest.raises(ArtifactError):
        on_node_build_script(ArtifactSpec("url", "http://x", sha256="a" * 64))


def test_on_node_build_script_runs(tmp_path: Path) -> None:
    """Run the script for real against a miniature 'sdist' (a tiny cmake project): seconds, not minutes."""
    top = tmp_path / "sdist" / "llama_cpp_python-9.9.9"
    llama = top / "vendor" / "llama.cpp"
    (llama / "ggml" / "include").mkdir(parents=True)
    (llama / "ggml" / "include" / "ggml-rpc.h").write_text(
        "#define RPC_PROTO_MAJOR_VERSION 7\n#define RPC_PROTO_MINOR_VERSION 1\n"
        "#define RPC_PROTO_PATCH_VERSION 2\n"
    )
    (llama / "main.c").write_text("int ggml_fake(void);\nint main(void) { return ggml_fake(); }\n")
    (llama / "lib.c").write_text("int ggml_fake(void) { return 0; }\n")
    (llama / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(mini C)\n"
        "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        "set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        "add_library(ggml SHARED lib.c)\nset_target_properties(ggml PROPERTIES VERSION 0.1.0 SOVERSION 0)\n"
        "add_executable(ggml-rpc-server main.c)\ntarget_link_libraries(ggml-rpc-server ggml)\n"
    )
    sdist = tmp_path / "work" / "llama_cpp_python-9.9.9.tar.gz"
    sdist.parent.mkdir()
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    spec = ArtifactSpec(
        "build", "on_node", sha256=sha256_of(sdist.read_bytes()), llama_cpp_python_version="9.9.9"
    )
    script = on_node_build_script(spec, workdir="work")
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "RPCFLEET_PROTOCOL=7.1.2"
    out = tmp_path / "work" / "out" / "bin"
    assert subprocess.run([str(out / "ggml-rpc-server")], cwd=tmp_path, timeout=10).returncode == 0
    assert (out / "libggml.so").is_symlink() and (out / "libggml.so.0.1.0").is_file()
    # A wrong pinned sha256 stops the script before anything is built.
    bad = on_node_build_script(replace(spec, sha256="0" * 64), workdir="work")
    assert subprocess.run(["bash", "-c", bad], cwd=tmp_path, capture_output=True, timeout=60).returncode != 0


# ---------------------------------------------------------------- the command line


def test_cli_list_show_verify(cpu_artifact: Artifact, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["artifact", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert cpu_artifact.id in [a["id"] for a in listed]

    assert main(["artifact", "show", cpu_artifact.id, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["archive_sha256"] == cpu_artifact.archive_sha256
    assert shown["manifest"]["protocol"] == "7.0.0"

    assert main(["artifact", "show", cpu_artifact.id]) == 0
    text = capsys.readouterr().out
    assert "protocol:" in text and "7.0.0" in text and SERVER in text

    assert main(["artifact", "verify", cpu_artifact.id]) == 0
    assert f"ok     {cpu_artifact.id}" in capsys.readouterr().out

    assert main(["artifact", "show", "rpc-server-0.0.0-nope"]) == 2  # an id that names nothing: bad input
    assert "no artifact" in capsys.readouterr().err


def test_cli_verify_fails_on_a_corrupted_cache(
    cpu_artifact: Artifact, artifact_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = artifact_home / "artifacts"
    cache.mkdir()
    shutil.copy(cpu_artifact.archive, cache)
    shutil.copy(cpu_artifact.archive.with_name(f"{cpu_artifact.id}.json"), cache)
    assert main(["artifact", "verify"]) == 0
    capsys.readouterr()
    archive = cache / cpu_artifact.archive.name
    data = bytearray(archive.read_bytes())
    data[-100] ^= 0xFF
    archive.write_bytes(data)
    assert main(["artifact", "verify"]) == 1
    assert f"FAILED {cpu_artifact.id}" in capsys.readouterr().out
