"""Version skew that names both versions (issue 9 §3), against a real protocol-2.0.0 rpc-server built
from llama-cpp-python 0.3.16's vendored llama.cpp (`old_rpc_server`), plus fakes for the retry rules."""

from __future__ import annotations

import asyncio
import hashlib
import json
import tarfile
from pathlib import Path

import pytest

from orchestrator.artifacts.manifest import ArtifactSpec
from orchestrator.llama.errors import ProtocolMismatchError
from orchestrator.llama.native.loader import load_llama
from orchestrator.planning.plan import PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome, ProtocolVersion
from tests.fakerpc import HELLO, FakeConnection, Handler, fake_rpc_server
from tests.plugins.llama import plan_devices
from tests.plugins.servers import LocalServer, write_local_inventory

MISMATCH = "the server speaks 2.0.0, this client needs 7.0.x: deploy the pinned artifact"


def legacy(version: tuple[int, int, int] = (2, 0, 0)) -> Handler:
    """A server older than protocol 3: it closes on a HELLO with a payload, answers the empty one."""

    async def handle(conn: FakeConnection) -> None:
        request = await conn.read_request()
        if request is None or request[0] != HELLO or request[1]:
            return
        await conn.reply(bytes(version))
        await conn.wait_client_close()

    return handle


def closes_on_hello() -> Handler:
    async def handle(conn: FakeConnection) -> None:
        await conn.read_request()

    return handle


async def test_a_reset_hello_is_asked_again_the_legacy_way() -> None:
    with fake_rpc_server(legacy()) as server:
        result = await probe_endpoint(server.endpoint, read_timeout=0.5)
        assert (result.outcome, result.version) == (Outcome.VERSION_MISMATCH, ProtocolVersion(2, 0, 0))
        assert MISMATCH in result.message
        await asyncio.to_thread(server.wait_idle)
        assert [c.commands for c in server.connections] == [[HELLO], [HELLO]]
        assert server.connections[1].ended == "eof"  # the legacy reply was read, then a clean close
    # A server that closes on both HELLOs stays `closed`, with the first connection's reason.
    with fake_rpc_server(closes_on_hello()) as server:
        result = await probe_endpoint(server.endpoint, read_timeout=0.5)
        assert result.outcome is Outcome.CLOSED and "HELLO" in result.message
        assert len(server.connections) == 2


@pytest.mark.llama
async def test_probe_names_the_old_servers_version(old_rpc_server: LocalServer) -> None:
    for _ in range(3):  # and the old server survives being asked
        result = await probe_endpoint(old_rpc_server.endpoint)
        assert (result.outcome, str(result.version)) == (Outcome.VERSION_MISMATCH, "2.0.0")
        assert MISMATCH in result.message
    assert old_rpc_server.alive()


@pytest.mark.llama
def test_cli_probe_reports_the_mismatch(
    old_rpc_server: LocalServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    inventory = write_local_inventory(tmp_path / "inv.yml", {"old": {"rpc_port": old_rpc_server.port}})
    assert main(["probe", "-i", str(inventory), "--json"]) == 1
    node = json.loads(capsys.readouterr().out)["nodes"][0]
    assert (node["state"], node["protocol"]) == ("version_mismatch", "2.0.0")
    assert MISMATCH in node["message"]
    assert main(["probe", "-i", str(inventory)]) == 1
    assert "2.0.0" in capsys.readouterr().out


@pytest.mark.llama
def test_an_old_server_is_named_even_when_this_process_has_no_registration_left(
    old_rpc_server: LocalServer, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's own problem first: an old server is never registered, so the process's endpoint limit
    (a Python session that already holds 16) is not what is wrong (a whole suite got EndpointLimitError)."""
    from orchestrator.llama.native import libllama
    from orchestrator.llama.native.preflight import MAX_ENDPOINTS
    from orchestrator.llama.native.registry import add_rpc_servers

    for i in range(MAX_ENDPOINTS):  # registrations this process holds (the dict is shared by reference)
        monkeypatch.setitem(libllama.REGISTRY, f"192.0.2.1:{50000 + i}", None)
    plan = make_plan(
        plan_devices([old_rpc_server.endpoint]), profile_model(tiny_model), PlanOptions(n_ctx=256)
    )
    with pytest.raises(ProtocolMismatchError, match=MISMATCH):
        load_llama(plan, tiny_model)
    with pytest.raises(ProtocolMismatchError, match=MISMATCH):
        add_rpc_servers(old_rpc_server.endpoint)


@pytest.mark.llama
def test_the_loader_refuses_an_old_server(old_rpc_server: LocalServer, tiny_model: Path) -> None:
    plan = make_plan(
        plan_devices([old_rpc_server.endpoint]), profile_model(tiny_model), PlanOptions(n_ctx=256)
    )
    with pytest.raises(ProtocolMismatchError, match=MISMATCH) as info:
        load_llama(plan, tiny_model)
    assert info.value.outcome is Outcome.VERSION_MISMATCH
    assert str(info.value.result.version) == "2.0.0"
    assert old_rpc_server.alive()


@pytest.mark.llama
def test_an_archive_with_the_old_binary_name_is_imported(
    old_rpc_server_binary: Path, tmp_path: Path, artifact_home: Path
) -> None:
    # A release archive of the older layout: `rpc-server` beside its libraries.
    archive = tmp_path / "llama-old-bin.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(old_rpc_server_binary.parent.iterdir()):
            name = "rpc-server" if path == old_rpc_server_binary else path.name
            tar.add(path, arcname=f"build/bin/{name}")
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    from orchestrator.artifacts.imports import import_artifact

    artifact = import_artifact(ArtifactSpec("path", str(archive), sha256=sha))
    # The protocol was asked from the binary itself, with the legacy HELLO.
    assert artifact.manifest.protocol == "2.0.0"
    assert artifact.manifest.server_path == "bin/ggml-rpc-server"
    assert any(e.path == "bin/ggml-rpc-server" for e in artifact.manifest.files)
