"""The llama-cpp-python source an artifact is built from: sdist, vendored versions, commit."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orchestrator.artifacts.buildenv import ensure_build_env
from orchestrator.artifacts.store import Progress
from orchestrator.core.errors import ArtifactError
from orchestrator.core.files import sha256_file
from orchestrator.core.paths import rpcfleet_home
from orchestrator.engine.children import run_child

PIP_TIMEOUT_S = 600.0

# The sha256 of each llama-cpp-python sdist rpcfleet builds from (the server every node runs comes from
# it): a file the registry serves later with other bytes is refused, never built. scripts/setup.sh pins
# 0.3.36 too (tests/artifacts/test_artifacts.py checks that they agree).
SDIST_SHA256 = {
    "0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "0.3.16": "34ed0f9bd9431af045bb63d9324ae620ad0536653740e9bb163a2e1fcb973be6",
}


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
    return _ggml_version_of(_text_or_nothing(cmakelists))


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
    return _commit_of(_text_or_nothing(changelog))


def _text_or_nothing(path: Path) -> str:
    """The file's text, or "" when it cannot be read (then nothing is found in it)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _commit_of(text: str) -> str | None:
    match = re.search(r"llama\.cpp@([0-9a-f]{7,40})\b", text)
    return match.group(1) if match else None


def ensure_sdist(version: str, say: Progress, *, sha256: str | None = None, pinned_by: str = "") -> Path:
    """The llama-cpp-python `version` sdist in the cache, downloaded with pip when missing, and checked
    against its pinned sha256 (`sha256`, pinned by `pinned_by` such as "the spec"; else `SDIST_SHA256`)
    before it is used. A download that does not match is deleted; a cached file that does not match is
    left for inspection, unused."""
    expected = sha256 or SDIST_SHA256.get(version)
    by = pinned_by if sha256 and pinned_by else "rpcfleet"
    if expected is None:
        raise ArtifactError(
            f"llama-cpp-python {version}: no pinned sha256 for its sdist, so it is not downloaded or built",
            hint=f"pinned versions: {', '.join(sorted(SDIST_SHA256))}; an on-node build spec can pin "
            "another version's sdist with sha256",
        )
    sdist = sdist_path(version)
    if sdist.is_file():
        _check_sdist(sdist, expected, by, downloaded=False)
        return sdist
    sdist.parent.mkdir(parents=True, exist_ok=True)
    say(f"downloading the llama-cpp-python {version} source with pip")
    # Into a folder of its own, moved into the cache only once its sha256 is right. pip checks the hash
    # itself (--require-hashes) as it downloads, before it prepares the sdist's metadata: other bytes never
    # reach a build backend, so none of their code runs.
    # Its metadata step runs the pinned build backend (buildenv), never one the registry offers now.
    try:
        python = ensure_build_env(rpcfleet_home())
    except RuntimeError as exc:
        hint = "pip's index must serve the wheels that build-requirements.txt pins"
        raise ArtifactError(str(exc), hint=hint) from exc
    with tempfile.TemporaryDirectory(prefix=".download-", dir=sdist.parent) as staging:
        requirements = Path(staging) / "requirements.txt"
        requirements.write_text(f"llama-cpp-python=={version} --hash=sha256:{expected.lower()}\n")
        command = [
            str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
            "--no-build-isolation", "--require-hashes", "-r", str(requirements), "-d", staging,
        ]  # fmt: skip
        try:
            done = run_child(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ArtifactError(f"pip download timed out after {PIP_TIMEOUT_S:.0f} s") from exc
        fetched = Path(staging) / sdist.name
        mismatch = re.search(r"Got\s+([0-9a-f]{64})", done.stderr)
        if done.returncode != 0 and mismatch is not None:
            got = mismatch.group(1)
            raise ArtifactError(
                f"{sdist.name}: the downloaded file has sha256 {got}, but {by} pins {expected}: not used",
                hint="the registry served other bytes (refused by pip before any build; it was deleted)",
            )
        if done.returncode != 0 or not fetched.is_file():
            raise ArtifactError(
                f"could not download the llama-cpp-python {version} sdist",
                command=shlex.join(command),
                exit_status=done.returncode,
                stderr=done.stderr,
                hint=f"put llama_cpp_python-{version}.tar.gz into {sdist.parent}",
            )
        _check_sdist(fetched, expected, by, downloaded=True)
        fetched.replace(sdist)
    return sdist


_VERIFIED: set[tuple[str, int, int, str]] = set()  # files checked in this process (path, size, mtime)


def _check_sdist(path: Path, expected: str, by: str, *, downloaded: bool) -> None:
    st = path.stat()
    memo = (str(path), st.st_size, st.st_mtime_ns, expected)
    if memo in _VERIFIED:
        return
    actual = sha256_file(path)
    if actual != expected.lower():
        if downloaded:
            where, hint = "the downloaded file", "the registry served other bytes (it was deleted)"
        elif by == "rpcfleet":
            where, hint = str(path), f"delete {path} to download it again"
        else:
            where, hint = str(path), "put the pinned llama-cpp-python sdist into the cache, or fix the sha256"
        raise ArtifactError(
            f"{path.name}: {where} has sha256 {actual}, but {by} pins {expected}: it is not used", hint=hint
        )
    _VERIFIED.add(memo)


def extract_source(sdist: Path, dest: Path, say: Progress) -> Path:
    """Extract the sdist once (a stamp holds its sha256) so cmake's build tree stays incremental."""
    stamp = dest / ".extracted"
    sha = sha256_file(sdist)
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
        sha256=sha256_file(sdist),
        size=st.st_size,
        protocol=_protocol_of(texts["header"], f"{sdist.name}: ggml-rpc.h"),
        llama_cpp_commit=_commit_of(texts.get("changelog", "")),
        ggml_version=_ggml_version_of(texts.get("cmake", "")),
    )
    _SDIST_INFO[memo] = info
    return info
