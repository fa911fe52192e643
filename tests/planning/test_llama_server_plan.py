"""A plan for llama-server (serve's engine, the exported pods, the llama-cli format) against what a real
llama-server allocates on a real GGML_RPC_DEBUG server: llama-server reserves logits for one output per
slot (its n_outputs_max, server-context.cpp), llama-cpp-python for n_batch of them; with Gemma's 262k-token
vocabulary that is 512 MiB of compute buffer the plan must not count for llama-server."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.artifacts.build import llama_server_binary
from orchestrator.planning.formats import llama_cli_args
from orchestrator.planning.memory import CUBLAS_WORKSPACE, cuda_runtime_bytes
from orchestrator.planning.plan import PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.rpc.client import probe_endpoint
from orchestrator.workflows.options import plan_options
from tests.plugins.llama import DebugServer
from tests.plugins.servers import free_port

MiB = 1 << 20


def probed_device(server: DebugServer) -> PlanDevice:
    endpoint = f"{server.host}:{server.port}"
    result = asyncio.run(probe_endpoint(endpoint))
    assert result.ok, result.message
    (dev,) = result.devices
    usable = 4 << 30  # a CPU server reports the host's RAM; the plan only needs room
    return PlanDevice(endpoint, 0, f"{endpoint}#0", total=usable, free=usable, usable=usable,
                      alignment=dev.alignment or 32, max_size=dev.max_size)  # fmt: skip


def load_with_llama_server(args: list[str], log: Path) -> None:
    """Start llama-server with `args`, wait until it has loaded (its /health), stop it."""
    port = free_port()
    with log.open("wb") as out:
        argv = [str(llama_server_binary()), *args, "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                        if reply.status == 200:
                            return
                except OSError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_plans_for_llama_server_count_one_logits_row_per_slot() -> None:
    """`plan_options(..., llama_server=True)` (serve, export, --format llama-cli) sets n_outputs_max to
    --parallel; run's options keep llama.cpp's default (n_batch)."""
    assert plan_options({"parallel": 3}, llama_server=True).n_outputs_max == 3
    assert plan_options({"parallel": 3}).n_outputs_max == 0


@pytest.mark.llama
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
def test_a_plan_for_llama_server_is_what_it_allocates(
    debug_rpc_servers: list[DebugServer], gemma_model: Path, tmp_path: Path, flash_attn: bool
) -> None:
    server = debug_rpc_servers[0]
    device = probed_device(server)
    profile = profile_model(gemma_model)
    options = PlanOptions(n_ctx=2048, parallel=2, flash_attn=flash_attn)
    for_python = make_plan([device], profile, options)
    plan = make_plan([device], profile, PlanOptions(**{**vars(options), "n_outputs_max": 2}))
    offset = server.log_offset()
    load_with_llama_server([*llama_cli_args(plan, gemma_model), "-b", "512"], tmp_path / "llama-server.log")
    weights, *kv, compute = server.allocations_since(offset)[0]
    planned = plan.devices[0].memory
    assert (planned.weights, planned.kv) == (weights, sum(kv))
    # Never under. Within 10 % with flash attention; without it the layers' part (which the logits hid
    # in every plan for llama-cpp-python on one device) is 23 % over: 26.5 MB planned, 21.5 allocated
    assert compute <= planned.compute <= (1.10 if flash_attn else 1.25) * compute, (planned.compute, compute)
    # llama-cpp-python's plan holds 512 logits rows of 262k floats, 20 times llama-server's whole buffer
    logits = profile.n_vocab * 512 * 4
    assert for_python.devices[0].memory.compute >= logits > 20 * planned.compute


def test_the_cuda_runtime_is_cublas_workspace_and_the_pool(gemma_model: Path) -> None:
    """What a CUDA server allocates beyond the plan's buffers: cuBLAS's workspace (32 MiB on Hopper, 4
    before) and ggml's pool, the widest f16 matrix's operands at -ub rows converted to f16 (Gemma's
    quantized weights have none: the workspace alone)."""
    profile = profile_model(gemma_model)
    options = PlanOptions(n_ubatch=512)
    assert cuda_runtime_bytes(profile, options, 9) == CUBLAS_WORKSPACE[True] == 32 * MiB
    assert cuda_runtime_bytes(profile, options, 8) == 4 * MiB
