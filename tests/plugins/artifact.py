"""The cached CPU rpc-server artifact (built once by `make setup`, never rebuilt by tests) and a scratch
RPCFLEET_HOME for tests that add artifacts to a cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.artifacts.build import default_artifact
from orchestrator.artifacts.manifest import Artifact
from orchestrator.artifacts.store import unpack_artifact


@pytest.fixture(scope="session")
def cpu_artifact() -> Artifact:
    """The default CPU artifact from the real cache (returns at once when `make setup` has built it)."""
    return default_artifact("cpu")


@pytest.fixture(scope="session")
def cpu_artifact_tree(cpu_artifact: Artifact, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unpacked copy of the CPU artifact (manifest.json + bin/) in a session temp folder."""
    dest = tmp_path_factory.mktemp("cpu-artifact")
    unpack_artifact(cpu_artifact, dest)
    return dest


@pytest.fixture
def artifact_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty RPCFLEET_HOME for this test (request `cpu_artifact` first if the test needs it too)."""
    home = tmp_path / "rpcfleet-home"
    home.mkdir()
    monkeypatch.setenv("RPCFLEET_HOME", str(home))
    yield home
