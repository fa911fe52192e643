"""llama-server (serve's engine) and llama-fit-params: built by setup from the same source as the binding
and the nodes' servers, cached by the source's sha256 and the flags, found from another RPCFLEET_HOME."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.artifacts.build import (
    TOOL_DEFINES,
    build_llama_tools,
    cached_tools,
    default_artifact,
    tools_key,
)
from orchestrator.artifacts.source import SDIST_SHA256


def test_the_tools_key_follows_the_source_and_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    sha = SDIST_SHA256["0.3.36"]
    assert tools_key(sha) == tools_key(sha) and tools_key(sha) != tools_key("0" * 64)
    monkeypatch.setitem(TOOL_DEFINES, "GGML_NATIVE", "ON")
    native = tools_key(sha)
    monkeypatch.setitem(TOOL_DEFINES, "GGML_NATIVE", "OFF")
    assert native != tools_key(sha)
    assert (
        TOOL_DEFINES["LLAMA_BUILD_UI"] == "OFF" and TOOL_DEFINES["LLAMA_USE_PREBUILT_UI"] == "OFF"
    )  # offline


def test_llama_server_is_built_from_the_bindings_source_and_found_from_another_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = build_llama_tools()  # at once: setup built it
    info = json.loads((folder / "build.json").read_text())
    rpc_server = default_artifact("cpu").manifest
    assert info["sdist_sha256"] == SDIST_SHA256["0.3.36"]
    assert info["llama_cpp_commit"] == rpc_server.llama_cpp_commit  # the nodes' servers: the same source
    version = subprocess.run(
        [str(folder / "llama-server"), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    said = version.stdout + version.stderr
    assert info["llama_cpp_commit"] and info["llama_cpp_commit"][:7] in said, said
    fit = subprocess.run(
        [str(folder / "llama-fit-params"), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert "usage" in (fit.stdout + fit.stderr).lower()
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path / "other-home"))
    assert cached_tools() == folder  # no second build for another RPCFLEET_HOME
    monkeypatch.setenv("RPCFLEET_ENGINE_CACHE", "own")
    assert cached_tools() is None  # as on a fresh machine: set-up builds it (the cold set-up's figure)
