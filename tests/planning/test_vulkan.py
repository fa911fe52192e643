"""Plans on Vulkan devices against what real Vulkan servers allocate (Mesa's llvmpipe, a software Vulkan
device, stands in for a GPU: `make setup` builds the Vulkan artifact).

The loads run in a child process (one process registers at most 16 endpoints). The planner's devices
come from a real probe: each server's free memory is the device's own (llvmpipe's
2 GiB device-local heap, not the host's MemAvailable), its buffer alignment (16) and its largest buffer
(1 GiB) come over RPC (GET_ALIGNMENT, GET_MAX_SIZE). Weights and KV + recurrent state must equal the
GGML_RPC_DEBUG allocations to the byte; the compute buffer must be within 10 % and never under.

Each family gets servers of its own: on llvmpipe, a Vulkan server that ran one model's graphs can corrupt
its heap on the next client's (measured: `malloc(): unsorted double linked list corrupted` after a
graph without flash attention and then one with it), which is the device's bug, not the plan's.
The recurrent families do not run on this device at all (no ssm_scan pipeline): their plans say so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.build import local_server_binary
from orchestrator.llama.native.loader import load_llama
from orchestrator.llama.observed_placement import placement_of
from orchestrator.models.synth_arch import ARCHES, write_arch_model
from orchestrator.planning.architectures import VERIFIED_ON
from orchestrator.planning.plan import PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.rpc.client import probe_endpoint
from tests.plugins.llama import DebugServer, start_debug_server
from tests.plugins.servers import free_port

COMPUTE_TOLERANCE = 0.10
GiB = 1 << 30


@pytest.fixture(scope="session")
def vulkan_server_binary() -> Path:
    path = local_server_binary(backend="vulkan")
    assert path.exists(), f"no Vulkan ggml-rpc-server at {path}: run `make setup`"
    return path


@pytest.fixture(scope="module")
def vulkan_ports() -> list[int]:
    """The two servers' ports, the same for every test: a process registers at most 16 endpoints."""
    return [free_port(), free_port()]


@pytest.fixture
def vulkan_servers(
    vulkan_server_binary: Path, vulkan_ports: list[int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[DebugServer]]:
    """Two fresh GGML_RPC_DEBUG Vulkan servers on llvmpipe (GGML_VK_VISIBLE_DEVICES=0: ggml-vulkan skips a
    device of type CPU unless it is listed)."""
    log_dir = tmp_path_factory.mktemp("vulkan")
    servers: list[DebugServer] = []
    try:
        for port in vulkan_ports:
            servers.append(
                start_debug_server(
                    vulkan_server_binary, log_dir, env={"GGML_VK_VISIBLE_DEVICES": "0"}, port=port
                )
            )
        yield servers
    finally:
        for server in servers:
            server.stop()


def probed_devices(endpoints: list[str]) -> list[PlanDevice]:
    """The planner's devices as a probe reports them: the device's memory, alignment and largest buffer."""
    devices = []
    for endpoint in endpoints:
        result = asyncio.run(probe_endpoint(endpoint))
        assert result.ok, result.message
        (dev,) = result.devices
        assert dev.alignment is not None
        devices.append(
            PlanDevice(
                endpoint=endpoint,
                index=0,
                name=f"{endpoint}#0",
                total=dev.total,
                free=dev.free,
                usable=dev.free,
                alignment=dev.alignment,
                max_size=dev.max_size,
                backend="vulkan",
            )
        )
    return devices


def load_and_compare(
    servers: list[tuple[str, Path]], model: Path, prompt: bytes, **options: object
) -> tuple[tuple[int, ...], tuple[str, ...], str]:
    """Load `model` as planned on the Vulkan servers (endpoint, log), generate a few tokens, check weights
    and KV to the byte and compute within the tolerance and never under; return the plan's layer counts,
    its notes and the text. Run in a child process (`in_child`): one process registers 16 endpoints at
    most, and the suite's process has registered others before."""
    from orchestrator.llama.logs import model_allocations, parse_server_log

    devices = probed_devices([endpoint for endpoint, _ in servers])
    plan = make_plan(devices, profile_model(model), PlanOptions(**options))  # type: ignore[arg-type]
    assert not any("unverified" in note for note in plan.notes), plan.notes
    offsets = [log.stat().st_size for _, log in servers]
    llm = load_llama(plan, model)
    try:
        tokens = []
        for token in llm.generate(llm.tokenize(prompt), top_k=1, temp=0.0):
            tokens.append(token)
            if len(tokens) == 4:
                break
        text = llm.detokenize(tokens).decode(errors="replace")
        placement = placement_of(llm)
    finally:
        llm.close()
    allocations = []
    for (_, log), offset in zip(servers, offsets, strict=True):
        with log.open("rb") as f:
            f.seek(offset)
            allocations.append(
                model_allocations(parse_server_log(f.read().decode("utf-8", "replace"))).get(0, [])
            )
    assert placement.layers_as_planned
    for dev, sizes in zip(plan.devices, allocations, strict=True):
        weights, *cache, compute = sizes
        m = dev.memory
        label = f"{dev.label} layers {dev.layers} {sizes}"
        assert weights == m.weights, (label, m)
        assert sum(cache) == m.kv, (label, m)
        error = (m.compute - compute) / compute
        assert 0 <= error <= COMPUTE_TOLERANCE, (label, m.compute, compute, f"{error:+.1%}")
    return plan.layer_counts, plan.notes, text


@pytest.fixture(scope="module")
def in_child() -> Iterator[Callable[..., Any]]:
    """`in_child(servers, model, prompt, **options)`: `load_and_compare` in a process of its own (spawned
    once for the module), its assertion errors raised here."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:

        def run(servers: list[DebugServer], model: Path, prompt: bytes, **options: object) -> Any:
            targets = [(s.endpoint, s.log) for s in servers]
            return pool.submit(load_and_compare, targets, model, prompt, **options).result(timeout=600)

        yield run


@pytest.mark.llama
def test_a_vulkan_server_reports_the_device_memory_and_its_buffer_limits(
    vulkan_servers: list[DebugServer],
) -> None:
    (dev,) = probed_devices([vulkan_servers[0].endpoint])
    # llvmpipe's device-local heap, not the host's RAM; minStorageBufferOffsetAlignment; ggml-vulkan's
    # 1 GiB suballocation block
    assert (dev.total, dev.free, dev.alignment, dev.max_size) == (2 * GiB, 2 * GiB, 16, GiB)


@pytest.mark.llama
def test_gemma_on_vulkan_devices_is_planned_to_the_byte(
    vulkan_servers: list[DebugServer], gemma_model: Path, in_child: Callable[..., Any]
) -> None:
    counts, _, text = in_child(
        vulkan_servers, gemma_model, b"The capital of France is the city of", n_ctx=2048
    )
    assert len(counts) == 2 and min(counts) > 0  # split over both devices
    assert text.startswith(" Paris"), text


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vulkan-families")
    return {arch: write_arch_model(folder / f"{arch}.gguf", arch) for arch in ARCHES}


@pytest.mark.llama
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
@pytest.mark.parametrize("arch", sorted(VERIFIED_ON["vulkan"]))
def test_family_on_vulkan_devices_is_planned_to_the_byte(
    vulkan_servers: list[DebugServer],
    family_models: dict[str, Path],
    in_child: Callable[..., Any],
    arch: str,
    flash_attn: bool,
) -> None:
    in_child(vulkan_servers, family_models[arch], b"hello world", n_ctx=1024, flash_attn=flash_attn)


@pytest.mark.parametrize("arch", sorted(set(ARCHES) - VERIFIED_ON["vulkan"]))
def test_a_family_that_does_not_run_on_vulkan_is_planned_unverified_there(
    family_models: dict[str, Path], arch: str
) -> None:
    profile = profile_model(family_models[arch])
    gpu = PlanDevice(
        endpoint="10.0.0.1:50052", index=0, name="gpu", total=2 * GiB, free=2 * GiB, usable=2 * GiB
    )
    on_vulkan = make_plan([replace(gpu, backend="vulkan", alignment=16)], profile, PlanOptions(n_ctx=1024))
    assert [n for n in on_vulkan.notes if n.startswith("unverified on vulkan")], on_vulkan.notes
    on_cpu = make_plan([gpu], profile, PlanOptions(n_ctx=1024))
    assert not [n for n in on_cpu.notes if "unverified" in n], on_cpu.notes
