"""The process of `rpcfleet run` and of `rpcfleet serve` never imports llama_cpp (issue 19, item 1).

llama.cpp runs in the worker child: a lost node aborts the child, and on a CUDA build only the child
holds a GPU context. The local GPUs the planner needs come from the child too (`Worker.local_gpus`,
`list_local_gpus`). Real commands over a real rpc-server and a real model; a `sitecustomize` on
PYTHONPATH records, in the parent only (the child carries `RPCFLEET_WORKER_PARENT`), the stack of any
import of llama_cpp into a file, at the moment it happens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.llama.worker.child import PARENT_ENV
from tests.plugins.servers import LocalServer, free_port, write_local_inventory

SPY = f"""
import os, sys, traceback

class _LlamaImportSpy:
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            with open(os.environ["RPCFLEET_TEST_IMPORT_SPY"], "a") as out:
                out.write(f"pid {{os.getpid()}} imports {{name}}:\\n" + "".join(traceback.format_stack()))
        return None

if os.environ.get("RPCFLEET_TEST_IMPORT_SPY") and not os.environ.get({PARENT_ENV!r}):
    sys.meta_path.insert(0, _LlamaImportSpy())
"""


def _spy_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    folder = tmp_path / "spy"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SPY)
    record = tmp_path / "llama-imports.txt"
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    env |= {
        "PYTHONPATH": os.pathsep.join([str(folder), root]),
        "RPCFLEET_TEST_IMPORT_SPY": str(record),
        "RPCFLEET_HOME": str(tmp_path / "home"),
    }
    return env, record


def test_the_spy_sees_an_import_of_llama_cpp(tmp_path: Path) -> None:
    """The check below can fail: a parent that imports llama_cpp, as the listing of local GPUs once did."""
    env, record = _spy_env(tmp_path)
    code = "from orchestrator.llama.native.libllama import local_gpus; local_gpus()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "imports llama_cpp" in record.read_text() and "local_gpus" in record.read_text()


@pytest.mark.llama
def test_run_loads_and_generates_with_no_llama_cpp_in_its_process(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path
) -> None:
    server = start_rpc_server()
    env, record = _spy_env(tmp_path)
    argv = [sys.executable, "-m", "orchestrator", "run", "--endpoint", server.endpoint, "-m", str(tiny_model)]
    argv += ["--ctx", "512", "-p", "hello", "-n", "4", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"completion_tokens": 4' in done.stdout  # it did load and generate, in its worker
    assert not record.exists(), record.read_text()


@pytest.mark.llama
def test_plan_lists_local_gpus_with_no_llama_cpp_in_its_process(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path
) -> None:
    """`plan` has no worker of its own: a child started for the listing alone (`list_local_gpus`)."""
    server = start_rpc_server()
    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": server.port}})
    env, record = _spy_env(tmp_path)
    argv = [sys.executable, "-m", "orchestrator", "plan", "-i", str(inventory), "-m", str(tiny_model)]
    done = subprocess.run([*argv, "--ctx", "512"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "n1" in done.stdout or server.endpoint in done.stdout  # it planned on the server
    assert not record.exists(), record.read_text()


def _health(base: str) -> str:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
            return str(answer.read())
    except (urllib.error.URLError, ConnectionError):
        return ""


@pytest.mark.llama
def test_serve_loads_with_no_llama_cpp_in_its_process(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path
) -> None:
    server = start_rpc_server()
    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": server.port}})
    env, record = _spy_env(tmp_path)
    env.pop("RPCFLEET_API_KEY", None)
    port = free_port()
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(tiny_model)]
    argv += ["--ctx", "512", "--port", str(port)]  # no --local-devices: every local GPU, so they are listed
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while '"ready"' not in _health(base):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"serve not ready in 120 s: {log.read_text()}"
            time.sleep(0.2)
        assert not record.exists(), record.read_text()
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
