"""Preflight: every endpoint probed in pure Python before any native call (`probe_for_load`), a plan's
devices checked against the servers, and the process-wide endpoint limit."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from orchestrator.artifacts.local_protocol import local_protocol_version
from orchestrator.core.target import Target, targets_for
from orchestrator.engine.runtime import run_sync
from orchestrator.llama.errors import DeviceMismatchError, EndpointLimitError, EndpointUnreachableError
from orchestrator.llama.native.libllama import LIVE, LOCK, REGISTRY, get_native
from orchestrator.planning.plan import Plan
from orchestrator.rpc.client import probe_endpoints
from orchestrator.rpc.errors import error_for
from orchestrator.rpc.records import (
    DeviceMemory,
    EndpointError,
    Outcome,
    ProbeResult,
    ProtocolVersion,
    parse_endpoint,
)

# ggml-rpc itself has no limit on servers, but every registration lives until the process exits (a
# socket and a device per server): the adapter's documented policy is 16 distinct endpoints per process.
MAX_ENDPOINTS = 16


LLAMA_CPP_PROTOCOL = {"0.3.36": "7.0.0"}


@functools.cache
def expected_protocol() -> ProtocolVersion:
    """The RPC protocol of the installed llama-cpp-python (known per release), else the local default."""
    # llama_cpp.__version__, not importlib.metadata: the latter scans every distribution on
    # sys.path (22 ms, half of load_llama's own overhead). Importing llama_cpp loads its
    # libraries but calls nothing that can abort.
    import llama_cpp

    known = LLAMA_CPP_PROTOCOL.get(str(getattr(llama_cpp, "__version__", "")))
    return ProtocolVersion.parse(known) if known else local_protocol_version()


def check_plan_devices(plan: Plan, device_counts: Mapping[str, int]) -> None:
    """Refuse a plan whose devices do not match the servers (pure): every RPC device's index must exist
    on its server, no device twice, and one tensor_split value per device."""
    if len(plan.tensor_split) != len(plan.devices):
        raise DeviceMismatchError(
            f"the plan has {len(plan.devices)} device(s) but {len(plan.tensor_split)} tensor_split value(s)",
            hint="re-create the plan (rpcfleet plan)",
        )
    seen: set[tuple[str | None, int | str]] = set()
    for dev in plan.devices:
        key: tuple[str | None, int | str] = (
            (dev.endpoint, dev.index) if dev.endpoint is not None else (None, dev.name)
        )
        if key in seen:
            raise DeviceMismatchError(f"device {dev.label} appears twice in the plan")
        seen.add(key)
        if dev.endpoint is None:
            continue
        count = device_counts.get(dev.endpoint)
        if count is None:
            raise DeviceMismatchError(f"no probe result for {dev.endpoint}", host=dev.endpoint)
        if not 0 <= dev.index < count:
            raise DeviceMismatchError(
                f"the plan uses device {dev.index} but the server has {count} device(s)",
                host=dev.endpoint,
                hint="the fleet changed since planning: probe and plan again",
            )


def check_endpoint_limit(endpoints: Sequence[str]) -> None:
    """Refuse endpoints that would take this process past `MAX_ENDPOINTS` distinct registrations."""
    with LOCK:
        total = len(set(REGISTRY) | set(endpoints))
    if total > MAX_ENDPOINTS:
        raise EndpointLimitError(
            f"loading would register {total} distinct endpoints; one process allows {MAX_ENDPOINTS} "
            "(registrations last until the process exits)",
            hint="restart Python to use other endpoints, or load in a child process",
        )


def _held_result(target: Target) -> ProbeResult:
    """An endpoint a live model of this process holds (a probe would only see our own connection as
    busy): its registered devices, with the memory ggml reports for them over that connection."""
    native = get_native()
    memories = [DeviceMemory(i, *native.memory(dev)) for i, dev in enumerate(REGISTRY[target.dial].devices)]
    return ProbeResult(
        target.endpoint,
        Outcome.OK,
        None,
        tuple(memories),
        "in use by a model of this process",
        0.0,
        dial=target.dial if target.tunneled else None,
    )


def probe_for_load(
    endpoints: Sequence[str],
    *,
    targets: Mapping[str, Target] | None = None,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
) -> dict[str, ProbeResult]:
    """Probe `endpoints` (pure Python, no native code): {endpoint as given: ok result}. `targets`: the
    address to dial for an endpoint (an SSH forward; default: the endpoint itself); results and errors
    name the endpoint (`str(target)` for the forward).

    Endpoints held by a live model of this process are not probed (`_held_result`). Raises the typed
    error (`rpc.errors`) of the first endpoint that is unreachable, busy or mismatched, with the others
    in its message, and a `DeviceMismatchError` when a registered server's device count changed.
    """
    wanted = targets_for(endpoints, targets)
    for target in wanted:
        try:
            parse_endpoint(target.dial)
        except EndpointError as exc:
            raise EndpointUnreachableError(
                ProbeResult(target.endpoint, Outcome.REFUSED, None, (), str(exc), 0.0),
                f"invalid endpoint {target.dial!r}: {exc}",
            ) from exc
    with LOCK:
        held = [t for t in wanted if LIVE.get(t.dial) and t.dial in REGISTRY]
    to_probe = [t for t in wanted if t not in held]
    results: list[ProbeResult] = []
    if to_probe:
        results = run_sync(
            probe_endpoints(
                to_probe,
                expected=expected or expected_protocol(),
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                deadline=deadline,
            )
        )
    bad = [r for r in results if not r.ok]
    if bad:
        others = "; ".join(f"{r.target}: {r.outcome}" for r in bad[1:])
        raise error_for(bad[0], "refused before loading", also=others or None)
    # Two spellings of one server are probed once: find each one's result by the address dialed.
    by_dial = {str(parse_endpoint(r.target.dial)): r for r in results}
    found = {t.endpoint: by_dial[str(parse_endpoint(t.dial))] for t in to_probe}
    found.update({t.endpoint: _held_result(t) for t in held})
    with LOCK:
        for target in wanted:
            reg, result = REGISTRY.get(target.dial), found[target.endpoint]
            if reg is not None and len(reg.devices) != len(result.devices):
                raise DeviceMismatchError(
                    f"the server now reports {len(result.devices)} device(s) but {len(reg.devices)} are "
                    "registered in this process",
                    host=target,
                    hint="restart Python to register the server again",
                )
    return {ep: found[ep] for ep in endpoints}


def preflight(
    plan: Plan,
    *,
    targets: Mapping[str, Target] | None = None,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
) -> dict[str, int]:
    """Probe every endpoint of the plan (`probe_for_load`) and check the plan's devices against them.

    Returns the device count per endpoint. Raises the typed error of the first endpoint that is
    unreachable, busy or mismatched (all problems are in the message), or a `DeviceMismatchError`.
    """
    results = probe_for_load(
        plan.endpoints,
        targets=targets,
        expected=expected,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        deadline=deadline,
    )
    counts = {ep: len(r.devices) for ep, r in results.items()}
    check_plan_devices(plan, counts)
    return counts
