"""Errors are immutable once built: `with_host`/`with_hint` make copies that keep everything else, and
`Target` words "the endpoint, dialed through a forward" the one way every message uses."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from orchestrator.core.errors import (
    CommandTimeoutError,
    InputError,
    InventoryError,
    RpcfleetError,
    SourceLocation,
    UnreachableError,
)
from orchestrator.core.target import Target, dial_addresses, targets_for
from orchestrator.inventory.load import InventoryErrors
from orchestrator.llama.worker.wire import NodeLostError, WorkerError, error_from_child
from orchestrator.rpc.errors import EndpointUnreachableError, error_for
from orchestrator.rpc.records import Outcome, ProbeResult
from orchestrator.serve.engine import EngineError


def _errors() -> list[RpcfleetError]:
    result = ProbeResult("10.0.0.5:50052", Outcome.REFUSED, None, (), "connection refused", 0.1)
    return [
        UnreachableError("gone", host="n1", command="true", exit_status=255, stderr="a\nb", hint="h"),
        CommandTimeoutError("slow", stdout="so far", stderr="err", host="n2"),
        InputError("bad", SourceLocation(Path("inv.yml"), 3, 4, "x: y"), hint="fix it"),
        error_for(result, "refused before loading"),
        NodeLostError("lost", endpoints=("a:1",), probes=(result,), stderr="log"),
        EngineError("died", lost=("a:1",), stderr="x"),
        InventoryErrors([InventoryError("one", SourceLocation(Path("i.yml"), 1)), InventoryError("two")]),
    ]


@pytest.mark.parametrize("name", ["message", "host", "hint", "command", "exit_status", "stderr_tail"])
def test_no_field_of_a_built_error_can_be_set(name: str) -> None:
    for err in _errors():
        before = str(err)
        with pytest.raises(AttributeError):
            setattr(err, name, "changed")
        assert str(err) == before


def test_a_subclass_field_cannot_be_set_or_added_after_the_build() -> None:
    timeout, bad, probe, lost, engine, several = _errors()[1:]
    for err, name in [
        (timeout, "stdout"),
        (bad, "location"),
        (probe, "result"),
        (lost, "endpoints"),
        (lost, "log_path"),
        (engine, "lost"),
        (several, "location"),
        (timeout, "anything_new"),
    ]:
        with pytest.raises(AttributeError, match=r"immutable|no setter"):
            setattr(err, name, None)
    timeout.add_note("notes and tracebacks are the interpreter's: still allowed")
    assert timeout.__notes__


def test_with_host_and_with_hint_copy_keeping_type_message_cause_and_fields() -> None:
    cause = OSError("the link went down")
    for err in _errors():
        try:
            raise err from cause
        except RpcfleetError as caught:
            raised = caught
        named = raised.with_host("node-7")
        hinted = raised.with_hint("try again")
        for made in (named, hinted):
            assert type(made) is type(raised) and made is not raised
            assert made.message == raised.message and made.args == raised.args
            assert made.__cause__ is cause and made.__traceback__ is raised.__traceback__
            assert made.command == raised.command and made.exit_status == raised.exit_status
            assert made.stderr_tail == raised.stderr_tail
            extra = {k: v for k, v in vars(raised).items() if k not in ("_host", "_target", "_hint")}
            assert {k: v for k, v in vars(made).items() if k in extra} == extra
        assert named.host == "node-7" and named.hint == raised.hint
        assert hinted.hint == "try again" and hinted.host == raised.host
        assert str(named).startswith("node-7: ")
        assert raised.host != "node-7"  # the original is untouched


def test_errors_survive_copy_and_pickle_whole() -> None:
    for err in _errors():
        for clone in (copy.copy(err), copy.deepcopy(err), pickle.loads(pickle.dumps(err))):
            assert type(clone) is type(err) and str(clone) == str(err) and clone.args == err.args
            with pytest.raises(AttributeError):
                clone.host = "x"  # type: ignore[misc]


def test_a_target_words_the_forward_once_and_errors_use_it() -> None:
    tunneled = Target("10.0.0.5:50052", "127.0.0.1:40001")
    direct = Target.direct("10.0.0.6:50052")
    assert str(tunneled) == "10.0.0.5:50052 (via 127.0.0.1:40001)" and tunneled.tunneled
    assert str(direct) == "10.0.0.6:50052" and not direct.tunneled
    assert targets_for(["10.0.0.5:50052", "10.0.0.6:50052"], {tunneled.endpoint: tunneled}) == [
        tunneled,
        direct,
    ]
    assert dial_addresses([tunneled, direct]) == {"10.0.0.5:50052": "127.0.0.1:40001"}
    err = RpcfleetError("refused", host=tunneled)
    assert err.host == "10.0.0.5:50052" and err.target == tunneled
    assert str(err) == "10.0.0.5:50052 (via 127.0.0.1:40001): refused"
    assert RpcfleetError("refused", host=direct).target is None  # the host says it all
    renamed = err.with_host("n1")
    assert renamed.target is None and str(renamed) == "n1: refused"
    result = ProbeResult(
        tunneled.endpoint, Outcome.TIMEOUT, None, (), "connect timed out", 2.0, dial=tunneled.dial
    )
    assert result.target == tunneled
    probe_err = error_for(result, "refused before loading")
    assert isinstance(probe_err, EndpointUnreachableError) and probe_err.host == tunneled.endpoint
    assert str(probe_err).startswith("10.0.0.5:50052 (via 127.0.0.1:40001): refused before loading: timeout")


def test_an_error_from_the_worker_child_keeps_its_target() -> None:
    tunneled = Target("10.0.0.5:50052", "127.0.0.1:40001")
    refused = error_from_child(
        {
            "type": "EndpointUnreachableError",
            "message": "refused",
            "host": tunneled.endpoint,
            "dial": tunneled.dial,
            "outcome": "refused",
        },
        None,
    )
    assert isinstance(refused, EndpointUnreachableError) and refused.target == tunneled
    assert str(refused).startswith(f"{tunneled}: refused")
    mismatch = error_from_child(
        {
            "type": "DeviceMismatchError",
            "message": "2 devices",
            "host": tunneled.endpoint,
            "dial": tunneled.dial,
        },
        Path("/tmp/w.log"),
    )
    assert mismatch.host == tunneled.endpoint and str(mismatch).startswith(f"{tunneled}: 2 devices")
    crashed = error_from_child({"type": "WorkerError", "message": "boom"}, Path("/tmp/w.log"))
    assert isinstance(crashed, WorkerError) and crashed.log_path == Path("/tmp/w.log")
    logged = crashed.with_log(Path("/tmp/other.log"))
    assert logged.log_path == Path("/tmp/other.log") and logged.hint == "the worker's log: /tmp/other.log"
    assert crashed.log_path == Path("/tmp/w.log") and crashed.hint is None
