"""Gemma 3 270M, the real model `make setup` fetches: real text, and the plan against real allocations.

Gemma 3 is a sliding-window (iSWA) model: llama.cpp gives each device two KV buffers (the global layers'
and the sliding-window layers'), both full size with `swa_full` (llama-cpp-python's default), which
the planner predicts, and its compute buffers within 10 % (tests/test_families.py checks more contexts,
with flash attention on and off).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.lab.model import Lab
from orchestrator.llama.loader import load_llama
from orchestrator.llama.placement import Placement, placement_of
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from tests.plugins.llama import DebugServer, plan_devices

MiB = 1 << 20
PROMPT = "The capital of France is the city of"
COMPUTE_TOLERANCE = 0.15  # tests/test_loader.py's, for the generated llamas


@dataclass(frozen=True)
class GemmaLoad:
    plan: Plan
    placement: Placement
    text: str
    allocations: list[list[int]]  # per server, device 0: what it allocated for the model, in order


@pytest.fixture(scope="module")
def gemma_load(debug_rpc_servers: list[DebugServer], gemma_model: Path) -> Iterator[GemmaLoad]:
    """Gemma loaded over the three GGML_RPC_DEBUG servers at n_ctx 2048, greedy tokens generated."""
    servers = debug_rpc_servers
    plan = make_plan(plan_devices(servers), profile_model(gemma_model), PlanOptions(n_ctx=2048))
    offsets = [s.log_offset() for s in servers]
    llm = load_llama(plan, gemma_model)
    try:
        tokens: list[int] = []
        for token in llm.generate(llm.tokenize(PROMPT.encode()), top_k=1, temp=0.0):
            tokens.append(token)
            if len(tokens) == 4:
                break
        text = llm.detokenize(tokens).decode()
        allocations = [s.allocations_since(o)[0] for s, o in zip(servers, offsets, strict=True)]
        yield GemmaLoad(plan, placement_of(llm), text, allocations)
    finally:
        llm.close()


@pytest.mark.llama
def test_gemma_over_rpc_completes_the_prompt(gemma_load: GemmaLoad) -> None:
    assert gemma_load.text.startswith(" Paris"), gemma_load.text


@pytest.mark.llama
def test_gemma_weights_and_kv_are_predicted_to_the_byte(gemma_load: GemmaLoad) -> None:
    placement = gemma_load.placement
    assert placement.layers_as_planned and len(placement.devices) == 3
    assert gemma_load.plan.layer_counts == (7, 6, 6)  # 18 layers and the output layer on the last
    for dev, sizes in zip(placement.devices, gemma_load.allocations, strict=True):
        # weights, the global layers' KV, the sliding-window layers' KV, compute
        assert len(sizes) == 4, (dev.label, sizes)
        weights, kv_global, kv_swa, _compute = sizes
        assert weights == dev.predicted.weights, dev.label
        assert kv_global == 2 * MiB, dev.label  # one global layer each (every 6th), 2048 x 1 KiB
        assert kv_global + kv_swa == dev.predicted.kv == dev.actual.kv, dev.label
    host = placement.host
    assert round(host.actual_weights / MiB, 2) == round(host.predicted_weights / MiB, 2)  # the log's 0.01
    assert host.actual_kv == host.predicted_kv == 0


@pytest.mark.llama
def test_gemma_compute_buffers_are_predicted_within_the_tolerance(gemma_load: GemmaLoad) -> None:
    # The family compute model (planning/architectures.py): one KQ mask per kind of attention on a
    # device (Gemma's full and sliding-window layers), 4 input copies. It was 17.8 MiB (26 %) short.
    for dev, sizes in zip(gemma_load.placement.devices, gemma_load.allocations, strict=True):
        compute = sizes[-1]
        assert abs(compute - dev.predicted.compute) / compute <= 0.10, (
            dev.label,
            compute,
            dev.predicted.compute,
        )


@pytest.mark.lab
@pytest.mark.llama
def test_run_on_a_lab_completes_the_prompt_with_real_text(
    healthy_lab: Lab, gemma_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = ["-i", str(healthy_lab.inventory)]
    assert main(["deploy", *inventory]) == 0
    capsys.readouterr()
    argv = ["run", *inventory, "-m", str(gemma_model), "--ctx", "2048", "-p", PROMPT, "-n", "12", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["text"].startswith(" Paris"), data["text"]
    assert data["completion_tokens"] == 12 and data["plan"]["fits"]
    devices = data["placement"]["devices"]
    assert len(devices) == 3 and all(d["planned_layers"] == d["actual_layers"] for d in devices)
