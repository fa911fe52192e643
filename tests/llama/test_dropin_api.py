"""The drop-in Python API: `orchestrator.Llama(rpc_servers=...)` and the registry functions (issue 9).

Real loads run against the session's GGML_RPC_DEBUG servers (tests/plugins/llama.py): a test checks
that the servers received the layers (their allocation logs), not only that text came out. Failure
cases of the constructor run in a child process, so a native abort would show as a failed test.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import orchestrator
from orchestrator.core.errors import LoaderError, PlanError
from orchestrator.facts.system import MemInfo
from orchestrator.llama import dropin_plan
from orchestrator.llama.dropin_plan import measured_devices, parse_rpc_servers
from orchestrator.llama.errors import EndpointUnreachableError, UnknownArgumentError
from orchestrator.llama.native.libllama import registered_endpoints
from orchestrator.probe.host import HostFacts
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult
from tests.plugins.llama import DebugServer, GiB
from tests.plugins.servers import LocalServer, free_port

MiB = 1 << 20

# The drop-in spec's first example (llama-cpp-python-rpc.md), verbatim but for the import line; the
# model path and the server address are put in by `_example`.
DROPIN_EXAMPLE = """\
from orchestrator import Llama

llm = Llama(
    model_path="./model.gguf",
    rpc_servers=["127.0.0.1:50052"],
    rpc_local_devices=[],
    n_gpu_layers=-1,
    n_ctx=2048,
)
try:
    response = llm("The capital of France is", max_tokens=16)
    print(response["choices"][0]["text"])
finally:
    llm.close()
"""


def _example(code: str, model: Path, endpoint: str) -> str:
    return code.replace("./model.gguf", str(model)).replace("127.0.0.1:50052", endpoint)


def _received_weights(server: DebugServer, offset: int) -> list[int]:
    return server.allocations_since(offset).get(0, [])


# --- pure: endpoints and memory ----------------------------------------------------------------------


def test_rpc_servers_take_a_list_or_a_comma_string_and_dedupe() -> None:
    assert parse_rpc_servers("h1:50052,h2:50052, h1:50052,") == ["h1:50052", "h2:50052"]
    assert parse_rpc_servers(["b:2", "a:1", "b:2"]) == ["b:2", "a:1"]
    assert parse_rpc_servers(None) == []
    with pytest.raises(EndpointUnreachableError, match="rpc_servers: invalid endpoint 'nope'"):
        parse_rpc_servers(["nope"])


def _result(endpoint: str, *devices: tuple[int, int]) -> ProbeResult:
    mems = tuple(DeviceMemory(i, free, total) for i, (free, total) in enumerate(devices))
    return ProbeResult(endpoint, Outcome.OK, None, mems, "ok", 0.0)


def test_memory_rules_without_an_inventory() -> None:
    facts = HostFacts(memory=MemInfo(total=64 * GiB, available=40 * GiB), machine_id="this-machine")
    results = {
        "127.0.0.1:1": _result("127.0.0.1:1", (64 * GiB, 64 * GiB)),  # CPU here
        "127.0.0.1:2": _result("127.0.0.1:2", (64 * GiB, 64 * GiB)),  # another CPU server here
        "10.0.0.5:50052": _result("10.0.0.5:50052", (20 * GiB, 24 * GiB)),  # a remote GPU
        "10.0.0.6:50052": _result("10.0.0.6:50052", (128 * GiB, 128 * GiB)),  # a remote CPU
    }
    local = {"127.0.0.1:1": facts, "127.0.0.1:2": facts}
    measured = measured_devices(results, local, alignments={("10.0.0.5:50052", 0): 128})
    usable = {d.label: d.usable for d in measured.devices}
    # Loopback CPU servers share this machine's MemAvailable; the remote GPU keeps its own figure.
    assert usable["127.0.0.1:1#0"] == usable["127.0.0.1:2#0"] == 20 * GiB
    assert usable["10.0.0.5:50052#0"] == 20 * GiB
    assert measured.devices[2].alignment == 128
    # The remote CPU server's figure (its total RAM) was not measured: never used silently.
    assert measured.unmeasured == ("10.0.0.6:50052#0",)
    trusted = measured_devices(results, local, alignments={}, trust_rpc_memory=True)
    assert trusted.unmeasured == () and trusted.devices[3].usable == 128 * GiB
    explicit = measured_devices(results, local, alignments={}, rpc_memory={"10.0.0.6:50052": 16 * GiB})
    assert explicit.unmeasured == () and explicit.devices[3].usable == 16 * GiB
    # Without this machine's facts, loopback CPU servers are unmeasured too.
    assert measured_devices(results, {}, alignments={}).unmeasured == (
        "127.0.0.1:1#0",
        "127.0.0.1:2#0",
        "10.0.0.6:50052#0",
    )
    # The remote CPU server measured through its inventory host's facts (another machine).
    remote = HostFacts(memory=MemInfo(total=128 * GiB, available=100 * GiB), machine_id="node-6")
    inventoried = measured_devices(results, {**local, "10.0.0.6:50052": remote}, alignments={})
    assert inventoried.unmeasured == () and inventoried.devices[3].usable == 100 * GiB


def test_importing_orchestrator_imports_no_llama_cpp() -> None:
    code = (
        "import sys, orchestrator\n"
        "assert 'Llama' in dir(orchestrator) and 'query_all' in orchestrator.__all__\n"
        "orchestrator.query_all, orchestrator.supports_rpc\n"
        "assert 'llama_cpp' not in sys.modules\n"
        "import llama_cpp\n"
        "assert issubclass(orchestrator.Llama, llama_cpp.Llama)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# --- the drop-in spec's example, for real--------------------------------------------------------


@pytest.mark.llama
def test_the_dropin_example_runs_and_the_server_gets_the_layers(
    debug_rpc_servers: list[DebugServer], tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = debug_rpc_servers[0]
    offset = server.log_offset()
    namespace: dict[str, Any] = {}
    exec(_example(DROPIN_EXAMPLE, tiny_model, server.endpoint), namespace)
    assert capsys.readouterr().out.strip()  # some text came out
    llm = namespace["llm"]
    plan = llm.rpcfleet_plan
    assert [d.endpoint for d in plan.devices] == [server.endpoint]
    assert plan.layer_counts == (plan.n_layer + 1,) and plan.n_ctx == 2048
    placement = orchestrator.placement_of(llm)
    assert placement.layers_as_planned
    # The server allocated exactly the predicted weights and KV cache (GGML_RPC_DEBUG log).
    sizes = _received_weights(server, offset)
    assert plan.devices[0].memory.weights in sizes
    assert plan.devices[0].memory.kv in sizes


@pytest.mark.llama
def test_device_order_split_modes_and_tensor_split(
    debug_rpc_servers: list[DebugServer], tiny_model_factory: Callable[..., Path]
) -> None:
    a, b, _ = debug_rpc_servers
    model = tiny_model_factory(n_layer=7, n_embd=128, n_head=2, n_head_kv=2, n_ff=256)
    common: dict[str, Any] = {"rpc_local_devices": [], "n_gpu_layers": -1, "n_ctx": 256, "verbose": False}
    # A comma string, b first, a duplicate: two endpoints in rpc_servers order, planned by memory.
    offsets = [b.log_offset(), a.log_offset()]
    llm = orchestrator.Llama(str(model), rpc_servers=f"{b.endpoint},{a.endpoint},{b.endpoint}", **common)
    try:
        placement = orchestrator.placement_of(llm)
        assert [desc for _, desc in placement.used_devices] == [b.endpoint, a.endpoint]
        assert placement.layers_as_planned and sum(llm.rpcfleet_plan.layer_counts) == 8
        for server, offset, dev in zip((b, a), offsets, llm.rpcfleet_plan.devices, strict=True):
            assert dev.memory.weights in _received_weights(server, offset), dev.label
        # Text came out of the layers on the servers: the completion's first token is the greedy choice
        # of the logits that a plain evaluation through the same servers computes.
        out = llm("hello", max_tokens=2, temperature=0.0)
        prompt = llm.tokenize(b"hello")
        assert out["usage"]["prompt_tokens"] == len(prompt)
        assert out["usage"]["completion_tokens"] == 2 and out["choices"][0]["finish_reason"] == "length"
        llm.reset()
        llm.eval(prompt)
        import llama_cpp

        raw = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # the last position's, as llama.cpp computed
        logits = np.ctypeslib.as_array(raw, shape=(llm.n_vocab(),)).copy()
        assert np.isfinite(logits).all() and logits.std() > 0
        greedy = llm.detokenize([int(np.argmax(logits))], prev_tokens=prompt).decode(errors="replace")
        assert greedy and out["choices"][0]["text"].startswith(greedy), (out, greedy)
    finally:
        llm.close()
    # An explicit tensor_split: one value per device, layers exactly so.
    llm = orchestrator.Llama(str(model), rpc_servers=[a.endpoint, b.endpoint], tensor_split=[1, 3], **common)
    try:
        assert [len(d.actual_layers) for d in orchestrator.placement_of(llm).devices] == [2, 6]
    finally:
        llm.close()
    # Split mode NONE: everything on main_gpu, an index into the device order.
    offset = b.log_offset()
    llm = orchestrator.Llama(
        str(model), rpc_servers=[a.endpoint, b.endpoint], split_mode=0, main_gpu=1, **common
    )
    try:
        placement = orchestrator.placement_of(llm)
        assert [desc for _, desc in placement.used_devices] == [b.endpoint]
        assert llm.model_params.split_mode == 0
        assert [len(d.actual_layers) for d in placement.devices] == [8]
        assert llm.rpcfleet_plan.devices[0].memory.weights in _received_weights(b, offset)
    finally:
        llm.close()
    assert registered_endpoints()[a.endpoint] is not None


@pytest.mark.llama
def test_refusals_before_any_native_call(debug_rpc_servers: list[DebugServer], tiny_model: Path) -> None:
    ep = debug_rpc_servers[0].endpoint
    base: dict[str, Any] = {
        "rpc_servers": [ep],
        "rpc_local_devices": [],
        "n_gpu_layers": -1,
        "verbose": False,
    }
    with pytest.raises(UnknownArgumentError, match=r"n_gpu_layer.*did you mean 'n_gpu_layers'"):
        orchestrator.Llama(str(tiny_model), rpc_servers=[ep], n_gpu_layer=-1)
    with pytest.raises(TypeError):  # also a TypeError, as Python's own unknown-keyword error
        orchestrator.Llama(str(tiny_model), rpc_serverz=[ep])
    with pytest.raises(LoaderError, match="n_gpu_layers=0"):
        orchestrator.Llama(str(tiny_model), rpc_servers=[ep])
    with pytest.raises(PlanError, match="row split"):
        orchestrator.Llama(str(tiny_model), split_mode=2, **base)
    with pytest.raises(PlanError, match=r"tensor_split has 2 value\(s\) for 1 selected device"):
        orchestrator.Llama(str(tiny_model), tensor_split=[1, 1], **base)
    with pytest.raises(PlanError, match=r"local device 'CUDA0' not found \(local GPUs: none\)"):
        orchestrator.Llama(str(tiny_model), **{**base, "rpc_local_devices": ["CUDA0"]})
    with pytest.raises(PlanError, match="main_gpu 3 is out of range"):
        orchestrator.Llama(str(tiny_model), split_mode=0, main_gpu=3, **base)
    # Does not fit in what the server may use: the shortfall, before llama.cpp runs out of memory.
    with pytest.raises(PlanError, match=f"does not fit: {ep}#0 needs .* short by"):
        orchestrator.Llama(str(tiny_model), rpc_memory={ep: "300MiB"}, n_ctx=4096, **base)
    with pytest.raises(LoaderError, match=r"chat_handler_kwargs.*mmproj_path"):
        orchestrator.Llama(str(tiny_model), chat_handler_kwargs={"use_gpu": False}, **base)


@pytest.mark.llama
def test_unreadable_local_facts_refuse_loopback_cpu_servers_and_say_why(
    debug_rpc_servers: list[DebugServer],
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """This machine's facts time out (a deadline no command can meet): the loopback CPU server is refused
    as not measured, and the refusal and a warning name the cause instead of saying nothing."""
    from orchestrator.core.log import configure_logging

    ep = debug_rpc_servers[0].endpoint
    configure_logging("text", "WARNING")
    monkeypatch.setattr(dropin_plan, "FACTS_TIMEOUT_S", 1e-6)
    local = dropin_plan.read_local_facts()
    assert local.facts is None and local.error is not None and "time" in local.error.lower(), local
    with pytest.raises(PlanError) as refused:
        orchestrator.Llama(str(tiny_model), rpc_servers=[ep], rpc_local_devices=[], n_gpu_layers=-1)
    message = str(refused.value)
    assert f"the free memory of {ep}#0 was not measured" in message, message
    assert f"this machine's facts could not be read: {local.error}" in message, message
    assert "facts_failed" in capsys.readouterr().err
    # With the facts readable, the same server is measured and planned.
    monkeypatch.undo()
    measured = dropin_plan.read_local_facts()
    assert measured.error is None and measured.facts is not None and measured.facts.memory is not None


@pytest.mark.llama
def test_multimodal_handler_follows_the_dropin_api(
    debug_rpc_servers: list[DebugServer], tiny_model: Path, tmp_path: Path
) -> None:
    mmproj = tmp_path / "mmproj.gguf"
    mmproj.write_bytes(b"")  # MTMD opens it on the first multimodal request only (the drop-in spec's rule)
    base: dict[str, Any] = {"rpc_local_devices": [], "n_gpu_layers": -1, "n_ctx": 256, "verbose": False}
    ep = debug_rpc_servers[0].endpoint
    llm = orchestrator.Llama(
        str(tiny_model),
        mmproj_path=str(mmproj),
        rpc_servers=[ep],
        chat_handler_kwargs={"extra_template_arguments": {"enable_thinking": False}},
        **base,
    )
    try:
        handler = llm.chat_handler
        # No local GPU selected: the projector runs on the CPU; template arguments are kept.
        assert (handler.use_gpu, handler.clip_model_path) == (False, str(mmproj))
        assert handler.extra_template_arguments == {"enable_thinking": False}
    finally:
        llm.close()
    with pytest.raises(LoaderError, match=r"unknown key.*n_gpu"):
        orchestrator.Llama(str(tiny_model), mmproj_path=str(mmproj), rpc_servers=[ep],
                           chat_handler_kwargs={"n_gpu": 1}, **base)  # fmt: skip


CHILD = """
import json, sys
import orchestrator
from orchestrator import Llama
model, good, *bad = sys.argv[1:]
out = {}
for name, endpoint in zip(("stopped", "busy", "old"), bad):
    try:
        Llama(model_path=model, rpc_servers=[good, endpoint], rpc_local_devices=[], n_gpu_layers=-1,
              verbose=False)
        out[name] = "loaded?!"
    except orchestrator.EndpointProbeError as exc:
        out[name] = [type(exc).__name__, str(exc.outcome), exc.message, exc.host]
many = [f"127.0.0.1:{port}" for port in range(1, 18)]
try:
    Llama(model_path=model, rpc_servers=many, n_gpu_layers=-1, verbose=False)
except orchestrator.LoaderError as exc:
    out["limit"] = [type(exc).__name__, exc.message]
out["registered"] = sorted(orchestrator.llama.native.libllama.registered_endpoints())
llm = Llama(model_path=model, rpc_servers=good, rpc_local_devices=[], n_gpu_layers=-1, verbose=False)
out["after"] = llm("hi", max_tokens=2)["usage"]["completion_tokens"]
llm.close()
print(json.dumps(out))
"""


@pytest.mark.llama
def test_failures_raise_typed_errors_and_the_process_carries_on(
    start_rpc_server: Callable[..., LocalServer],
    hold_server: Callable[[str], Any],
    old_rpc_server: LocalServer,
    tiny_model: Path,
) -> None:
    good, busy = start_rpc_server(), start_rpc_server()
    hold_server(busy.endpoint)
    stopped = f"127.0.0.1:{free_port()}"
    argv = [str(tiny_model), good.endpoint, stopped, busy.endpoint, old_rpc_server.endpoint]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["stopped"][:2] == ["EndpointUnreachableError", "refused"] and out["stopped"][3] == stopped
    assert out["busy"][:2] == ["EndpointBusyError", "busy"]
    assert out["old"][:2] == ["ProtocolMismatchError", "version_mismatch"]
    assert "the server speaks 2.0.0, this client needs 7.0.x" in out["old"][2]
    assert out["limit"][0] == "EndpointLimitError" and "17 distinct endpoints" in out["limit"][1]
    # Nothing was registered for the refused loads (preflight first), and the process still loads.
    assert out["registered"] == []
    assert out["after"] == 2
    assert busy.alive() and old_rpc_server.alive()


# --- the registry ------------------------------------------------------------------------------------


@pytest.mark.llama
def test_registry_functions(debug_rpc_servers: list[DebugServer]) -> None:
    a, b, _ = debug_rpc_servers
    stopped = f"127.0.0.1:{free_port()}"
    assert orchestrator.supports_rpc()
    devices = orchestrator.add_rpc_server(a.endpoint)
    assert [(d.endpoint, d.index, d.description) for d in devices] == [(a.endpoint, 0, a.endpoint)]
    assert devices[0].name.startswith("RPC")
    both = orchestrator.add_rpc_servers(a.endpoint, b.endpoint, a.endpoint)
    assert [d.endpoint for d in both] == [a.endpoint, b.endpoint]
    assert both[0] == devices[0]  # the registration is reused
    assert {d.handle for d in both} <= set(orchestrator.rpc_device_handles())
    with pytest.raises(EndpointUnreachableError):
        orchestrator.add_rpc_servers(b.endpoint, stopped)
    assert stopped not in registered_endpoints()
    out = io.StringIO()
    orchestrator.print_summary(file=out)
    text = out.getvalue()
    assert "ggml backends:" in text and "RPC" in text and "CPU" in text
    assert f"{both[1].name}: {b.endpoint} device 0 " in text and "free of" in text
    memory = orchestrator.query_rpc_memory(a.endpoint)
    assert len(memory) == 1 and memory[0].free_bytes == memory[0].total_bytes > 0
    assert memory[0].used_bytes == 0  # a CPU server reports its total RAM as free
    with pytest.raises(EndpointUnreachableError):
        orchestrator.query_rpc_memory(stopped)


@pytest.mark.llama
def test_query_all_never_raises(debug_rpc_servers: list[DebugServer]) -> None:
    a, b, _ = debug_rpc_servers
    stopped = f"127.0.0.1:{free_port()}"
    info = orchestrator.query_all([a.endpoint, b.endpoint, a.endpoint])
    assert info is not None and info.server_count == 2 and info.free_bytes > 0
    assert info.total_bytes == info.free_bytes  # CPU servers: total RAM as free
    assert orchestrator.query_all(f"{a.endpoint},{b.endpoint}") == info
    assert orchestrator.query_all([]) == orchestrator.RpcMemoryInfo(0, 0, 0, 0)

    def exploding() -> Any:
        yield a.endpoint
        raise RuntimeError("boom")

    odd: list[Any] = [None, [None], "", "garbage", 5, b"x", object(), [a.endpoint, 7]]
    odd += [[a.endpoint, stopped], exploding(), [["nested"]], "[::1", float("nan")]
    for value in odd:
        assert orchestrator.query_all(value, timeout=0.5) is None, value
