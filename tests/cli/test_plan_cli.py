"""`rpcfleet plan` against real servers on loopback, and the local GPUs offered to the planner."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.core.units import format_size
from orchestrator.planning.plan import Plan
from tests.plugins.servers import LocalServer, write_local_inventory

MiB = 1024 * 1024


def _inventory(tmp_path: Path, servers: list[LocalServer], limits: list[str]) -> Path:
    hosts = {
        f"node{i}": {"rpc_port": server.port, "memory_limit": limit}
        for i, (server, limit) in enumerate(zip(servers, limits, strict=True))
    }
    return write_local_inventory(tmp_path / "inventory.yml", hosts)


@pytest.fixture
def two_servers(start_rpc_server: Callable[..., LocalServer]) -> list[LocalServer]:
    return [start_rpc_server(), start_rpc_server()]


@pytest.mark.llama
def test_plan_json_round_trips_and_follows_the_limits(
    two_servers: list[LocalServer],
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = tiny_model_factory(n_layer=8)
    inventory = _inventory(tmp_path, two_servers, ["1000MiB", "3000MiB"])
    saved = tmp_path / "plan.json"
    status = main(
        ["plan", "-i", str(inventory), "-m", str(model), "--ctx", "1024", "--json", "-o", str(saved)]
    )
    out = capsys.readouterr().out
    assert status == 0
    plan = Plan.from_text(out)
    assert Plan.from_text(saved.read_text()) == plan
    assert plan.endpoints == tuple(s.endpoint for s in two_servers)
    # 9 offloadable layers (8 + output) split 1:3 on usable memory less the 256 MiB margin: 744:2744.
    assert plan.layer_counts == (2, 7) and plan.tensor_split == (2.0, 7.0)
    assert plan.fit.fits and plan.n_ctx == 1024


@pytest.mark.llama
def test_llama_cli_and_python_say_on_stderr_why_a_plan_fails(
    two_servers: list[LocalServer], tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: the arguments of a plan that does not fit, exit status 1, and not a word why (nor the notes).
    inventory = _inventory(tmp_path, two_servers, ["300MiB", "300MiB"])
    for fmt in ("llama-cli", "python"):
        argv = ["plan", "-i", str(inventory), "-m", str(tiny_model), "--ctx", "64k", "--format", fmt]
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert "--tensor-split" in out if fmt == "llama-cli" else "load_llama(plan" in out
        assert "does not fit: 127.0.0.1:" in err and "the largest context that fits:" in err, err
        assert "note: n_ctx 65536 per sequence exceeds the model's training context" in " ".join(err.split())


@pytest.mark.llama
def test_plan_renders_llama_cli_args_and_python(
    two_servers: list[LocalServer], tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = _inventory(tmp_path, two_servers, ["2GiB", "2GiB"])
    assert main(["plan", "-i", str(inventory), "-m", str(tiny_model), "--format", "llama-cli"]) == 0
    args = capsys.readouterr().out.split()
    assert args[args.index("--rpc") + 1] == ",".join(s.endpoint for s in two_servers)
    assert args[args.index("--device") + 1] == "RPC0,RPC1"
    assert "--tensor-split" in args and args[args.index("-ngl") + 1] == "5"
    assert main(["plan", "-i", str(inventory), "-m", str(tiny_model), "--format", "python"]) == 0
    snippet = capsys.readouterr().out
    ast.parse(snippet)
    assert "orchestrator.load_llama(plan" in snippet
    # Without -o no file was written: the snippet carries the plan itself.
    assert "plan.json" not in snippet and "from_path" not in snippet
    namespace: dict[str, object] = {}
    exec(snippet.split("llm = ")[0], namespace)  # the lines up to the load
    embedded = namespace["plan"]
    assert isinstance(embedded, Plan) and embedded.model_path == str(tiny_model)
    # With -o the snippet reads the file the plan was written to.
    saved = tmp_path / "my plan.json"
    base = ["plan", "-i", str(inventory), "-m", str(tiny_model), "--format", "python"]
    assert main([*base, "-o", str(saved)]) == 0
    snippet = capsys.readouterr().out
    assert f"Plan.from_path({str(saved)!r})" in snippet and "'plan.json'" not in snippet
    assert Plan.from_path(saved).model_path == str(tiny_model)


@pytest.mark.llama
def test_plan_that_does_not_fit_names_the_short_device(
    two_servers: list[LocalServer], tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = _inventory(tmp_path, two_servers, ["300MiB", "290MiB"])
    # -fa off: its larger compute buffer is what these 290 MiB lack (flash attention, the default, fits)
    base = ["plan", "-i", str(inventory), "-m", str(tiny_model), "--ctx", "4096", "-fa", "off"]
    assert main([*base, "--json"]) == 1
    plan = Plan.from_text(capsys.readouterr().out)
    assert not plan.fit.fits and plan.fit.shortfall > 0 and plan.fit.binding_device is not None
    short = plan.devices[plan.fit.binding_device]
    assert short.memory.headroom == -plan.fit.shortfall
    assert main(base) == 1
    out = capsys.readouterr().out
    assert f"does not fit: {short.label} is short by {format_size(plan.fit.shortfall)}" in out
    assert f"the largest context that fits: {plan.fit.largest_n_ctx}" in out
    assert plan.fit.largest_n_ctx < 4096


def test_plan_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("hosts:\n  a:\n    connection: local\n    rpc_host: 127.0.0.1\n")
    assert main(["plan", "-i", str(inventory), "-m", str(tmp_path / "missing.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["plan", "-i", str(inventory), "-m", str(inventory), "--margin", "lots"]) == 2
    assert "--margin" in capsys.readouterr().err
    for command in ("plan", "run", "report", "serve"):  # llama.cpp takes 1..LLAMA_MAX_SEQ sequences
        for bad in ("0", "257", "two"):
            assert main([command, "-i", str(inventory), "-m", str(inventory), "--parallel", bad]) == 2
            assert "--parallel" in capsys.readouterr().err
        assert main([command, "-i", str(inventory), "-m", str(inventory), "-fa", "yes"]) == 2
        assert "--flash-attn/-fa: unknown choice 'yes' (choose from on, off, auto)" in capsys.readouterr().err


@pytest.mark.llama
def test_local_gpus_are_only_gpus() -> None:
    from orchestrator.llama.native.libllama import get_native, local_gpus

    native = get_native()
    kinds = [native.dev_type(native.dev_get(i)) for i in range(native.dev_count())]
    gpus = local_gpus()
    assert len(gpus) == sum(k in (1, 2) for k in kinds) or (1 in kinds and 2 in kinds)
    assert all(g.endpoint is None and g.total >= g.free >= 0 for g in gpus)
    assert [g.index for g in gpus] == list(range(len(gpus)))


@pytest.mark.llama
def test_run_refuses_a_plan_that_does_not_fit_unless_forced(
    two_servers: list[LocalServer], tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = _inventory(tmp_path, two_servers, ["300MiB", "290MiB"])
    saved = tmp_path / "short.json"
    plan_argv = ["plan", "-i", str(inventory), "-m", str(tiny_model), "--ctx", "4096", "-fa", "off"]
    assert main([*plan_argv, "-o", str(saved)]) == 1  # -fa off: see the test above
    capsys.readouterr()
    plan = Plan.from_path(saved)
    short = plan.devices[plan.fit.binding_device or 0]
    run = ["run", "-m", str(tiny_model), "-p", "x", "-n", "1", "--plan", str(saved)]
    assert main(run) == 1
    err = capsys.readouterr().err
    assert f"{short.label} is short by {format_size(plan.fit.shortfall)}" in err
    assert "--force" in err and "--ctx" in err and "Traceback" not in err
    # The servers were not touched: both answer a probe at once (a loaded model would hold them).
    for server in two_servers:
        assert server.process.poll() is None
    # --force loads it anyway: only a warning, then the load itself runs (and here is refused: the
    # servers are stopped first, so nothing is allocated on them).
    for server in two_servers:
        server.process.kill()
        server.process.wait()
    assert main([*run, "--force"]) == 1
    err = capsys.readouterr().err
    assert "warning" in err and "(--force)" in err and "refused" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe{not utf-8", "is not UTF-8 text"),
        (b"{", "is not valid JSON"),
        (b"[]", "must be an object"),
        (None, "cannot read plan"),
    ],
)
def test_run_reports_a_bad_plan_file_by_name(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, message: str
) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_bytes(content)
    assert main(["run", "-m", str(tiny_model), "-p", "x", "--plan", str(path)]) == 2  # bad input
    err = capsys.readouterr().err
    assert str(path) in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("bad", ["nonsense", "h:x", "h:99999", "[::1"])
def test_a_saved_plan_with_a_bad_endpoint_is_an_input_error_naming_the_file(
    bad: str, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once a worker's load failure (exit 1, "EndpointError: ..."); now refused as the plan is read."""
    from orchestrator.planning.plan import PlanOptions
    from orchestrator.planning.profile import profile_model
    from orchestrator.planning.strategy import make_plan
    from tests.plugins.llama import plan_devices

    plan = make_plan(plan_devices(["127.0.0.1:1"]), profile_model(tiny_model), PlanOptions(n_ctx=256))
    saved = tmp_path / "plan.json"
    saved.write_text(plan.to_text().replace('"127.0.0.1:1"', f'"{bad}"'))
    status = main(["run", "--plan", str(saved), "-m", str(tiny_model), "-p", "x"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"{saved}: device 0: invalid endpoint '{bad}'" in err and "Traceback" not in err
