"""The hash manifest (caches.manifest): written with the memo from the same hashes (none hashed twice),
exact for the file's device, inode, size, mtime and ctime; and the `hash-manifest` patch that makes the
RPC client read it, in all three builds rpcfleet makes (the rpc-server, llama-server and llama-fit-params,
the binding's wheel), each keyed by the patches' digests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.artifacts.build import build_key, cached_build, cached_tools, tool_patches, tools_key
from orchestrator.artifacts.manifest import DEFAULT_LLAMA_CPP_PYTHON_VERSION
from orchestrator.artifacts.patches import (
    CLIENT_BACKEND,
    HASH_MANIFEST,
    HASH_MANIFEST_ENV,
    PATCHES,
    SourcePatch,
    client_patches,
    patches_for,
)
from orchestrator.artifacts.source import SDIST_SHA256
from orchestrator.caches import manifest as hm
from orchestrator.caches.plan import RACY_NS, FileIdentity, TensorSlice, hash_tensors
from orchestrator.core import fnv
from orchestrator.core.paths import rpcfleet_home

ROOT = Path(__file__).resolve().parents[2]
CLIENT_PATCHES = [f"{HASH_MANIFEST}", f"{HASH_MANIFEST}-set-tensor", f"{HASH_MANIFEST}-set-tensor-async"]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(os.urandom(3 << 20))
    time.sleep(RACY_NS / 1e9 * 2)  # a stat right after the write is racy: no memo would be kept
    return path


def test_the_manifest_is_written_with_the_memo_from_the_same_hashes(tmp_path: Path, home: Path) -> None:
    path = _file(tmp_path)
    slices = [TensorSlice("a", path, 1 << 20, 1 << 20), TensorSlice("b", path, 4096, 100_000)]
    named = hash_tensors(slices)
    identity = dict(FileIdentity.of(path).fields)
    written = hm.manifest_path(identity)
    assert written.parent == home / "hashes" and written.name == f"{identity['dev']}-{identity['ino']}.fnv"
    text = written.read_text()
    found = hm.parse_manifest(text)
    assert found is not None and found.identity == identity
    expected = {(t.offset, t.size): fnv.hash_file_range(path, t.offset, t.size) for t in slices}
    assert found.hashes == expected and {c.file for c in named} == {f"{h:016x}" for h in expected.values()}
    lines = text.splitlines()
    assert lines[0] == hm.MAGIC and lines[-1] == "end"
    assert lines[2:-1] == [f"{o} {s} {h:016x}" for (o, s), h in sorted(expected.items())]  # by offset

    # A memo from before the manifest existed: the next look at it writes the manifest, hashing nothing.
    written.unlink()
    calls: list[tuple[Path, int, int]] = []

    def counted(p: Path, offset: int, size: int) -> int:
        calls.append((p, offset, size))
        return fnv.hash_file_range(p, offset, size)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("orchestrator.caches.plan.hash_file_range", counted)
        hash_tensors(slices)
    assert calls == [] and hm.parse_manifest(written.read_text()) == found


def test_a_changed_file_gets_no_entry_of_the_old_manifest(tmp_path: Path, home: Path) -> None:
    """`touch -r` puts the mtime back, never the ctime: the identity differs, the old manifest is not
    the file's any more (the client compares all five fields), and the new hashes get a new manifest."""
    path = _file(tmp_path)
    reference = tmp_path / "reference"
    reference.touch()
    subprocess.run(["touch", "-r", str(path), str(reference)], check=True)
    tensor = TensorSlice("a", path, 0, 1 << 20)
    hash_tensors([tensor])
    before = dict(FileIdentity.of(path).fields)
    with path.open("r+b") as fh:
        fh.seek(1000)
        fh.write(b"\xff")
    subprocess.run(["touch", "-r", str(reference), str(path)], check=True)
    after = dict(FileIdentity.of(path).fields)
    assert after["mtime_ns"] == before["mtime_ns"] and after["ctime_ns"] != before["ctime_ns"]
    assert not hm.has_manifest(after, {})
    time.sleep(RACY_NS / 1e9 * 2)
    (renamed,) = hash_tensors([tensor])
    assert int(renamed.file, 16) == fnv.hash_file_range(path, 0, 1 << 20)
    found = hm.parse_manifest(hm.manifest_path(after).read_text())
    assert found is not None and found.identity["ctime_ns"] == after["ctime_ns"]
    assert found.hashes == {(0, 1 << 20): int(renamed.file, 16)}


def test_a_manifest_cut_short_or_malformed_is_none() -> None:
    identity = dict.fromkeys(hm.IDENTITY_FIELDS, 7)
    text = hm.format_manifest(identity, {(10, 20): 0xAB, (0, 5): 0xCD})
    assert hm.parse_manifest(text) == hm.HashManifest(identity, {(0, 5): 0xCD, (10, 20): 0xAB})
    assert hm.parse_manifest(text.replace("end\n", "")) is None  # cut short
    assert hm.parse_manifest(text.replace("00000000000000ab", "ab")) is None
    assert hm.parse_manifest(text.replace("rpcfleet-fnv-manifest 1", "rpcfleet-fnv-manifest 2")) is None
    log = (
        "manifest exact 100 00000000000000ab\nhashed file-changed 100 00000000000000ab\nhashed no-entry 1 0\n"
    )
    assert hm.hash_log_counts(log) == {"manifest": 1, "hashed file-changed": 1, "hashed no-entry": 1}


def test_engines_get_the_manifests_folder(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hm.engine_environment() == {HASH_MANIFEST_ENV: str(home / "hashes")}
    assert HASH_MANIFEST_ENV == "GGML_RPC_HASH_MANIFESTS"
    # the in-process loader sets it unless the caller's environment has it (an empty value turns it off)
    monkeypatch.delenv(HASH_MANIFEST_ENV, raising=False)
    script = (
        "import os, orchestrator.llama.native.loader as l\n"
        "try:\n    l.load_llama(None, '/nonexistent')\nexcept Exception:\n    pass\n"
        f"print(os.environ.get({HASH_MANIFEST_ENV!r}))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == str(rpcfleet_home() / "hashes")


def test_the_client_patch_is_in_all_three_builds_and_their_keys() -> None:
    """The rpc-server artifact, llama-server/llama-fit-params and the binding's wheel take the hash-manifest
    patches; each build's cache key holds each patch's digest, so a changed patch rebuilds all three."""
    version = DEFAULT_LLAMA_CPP_PYTHON_VERSION
    client = [p for p in patches_for(CLIENT_BACKEND, version) if p.name in CLIENT_PATCHES]
    assert [p.name for p in client] == CLIENT_PATCHES and not any(p.optional for p in client)
    # by label (name and digest): the pinned version's copies are required, the plain ones may be optional
    assert all(
        p.label in {q.label for q in patches_for(b)} for p in client for b in ("cpu", "vulkan", "cuda")
    )
    assert [p.label for p in tool_patches(version)] == [p.label for p in client_patches()]
    changed = tuple(
        SourcePatch(p.name, p.path, p.anchor, p.replacement + "// other\n") if p.name == HASH_MANIFEST else p
        for p in tool_patches(version)
    )
    sha = SDIST_SHA256[version]
    assert tools_key(sha) == tools_key(sha, patches=tool_patches(version)) != tools_key(sha, patches=changed)
    with pytest.MonkeyPatch.context() as mp:  # the rpc-server's key
        args = ("-DGGML_RPC=ON",)
        before = build_key(version, "cpu", args)
        mp.setattr("orchestrator.artifacts.build.patches_for", lambda backend, version=None: changed)
        assert build_key(version, "cpu", args) != before

    # The wheel: setup.sh keys it by `python -m orchestrator.artifacts.patches labels`.
    labels = subprocess.run(
        [sys.executable, "-m", "orchestrator.artifacts.patches", "labels"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout.split()  # fmt: skip
    assert labels == [p.label for p in client_patches(version)]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '"$PYTHON" -m orchestrator.artifacts.patches labels' in setup
    assert 'flags_key=$(printf \'%s\\n%s\' "$LLAMA_CMAKE_ARGS" "$WHEEL_PATCHES"' in setup
    assert 'orchestrator.artifacts.patches apply "$tree/vendor/llama.cpp"' in setup

    # What set-up built: each build records the patches, and its client code holds the lookup.
    wanted = {p.label for p in client}
    artifact = cached_build("cpu")
    assert artifact is not None, "run `make setup`"
    assert wanted <= set(artifact.manifest.patches)
    tools = cached_tools()
    assert tools is not None, "run `make setup`"
    assert wanted <= set(json.loads((tools / "build.json").read_text())["patches"])
    assert HASH_MANIFEST_ENV.encode() in (tools / "libggml-rpc.so").read_bytes()
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-rpc.so"
    assert HASH_MANIFEST_ENV.encode() in lib.read_bytes(), f"{lib}: a stock wheel (run `make setup`)"


def test_every_patch_has_a_distinct_name() -> None:
    assert len({p.name for p in PATCHES}) == len(PATCHES)
