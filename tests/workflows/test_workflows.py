"""The use-case layer (`orchestrator.workflows`): one builder of plan options for every front end, one fit
policy in each front end's words, and `plan_for_fleet`'s round over a real probe (a real rpc-server, and
an endpoint where none listens)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.cli import parse_args
from orchestrator.cli._planning import planning_args
from orchestrator.core.errors import PlanError, ProbeError
from orchestrator.core.units import format_size
from orchestrator.inventory.model import Host
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.playbooks.ops import REGISTRY
from orchestrator.workflows.fit import CLI_WORDS, DROPIN_WORDS, PLAYBOOK_WORDS, check_fit, misfit_error
from orchestrator.workflows.options import ProbeSettings, plan_options
from orchestrator.workflows.plan import plan_for_fleet
from tests.plugins.servers import LocalServer

MiB = 1 << 20

FLAGS = {
    "ctx": "8192",
    "type_k": "q8_0",
    "type_v": "q8_0",
    "ubatch": "256",
    "flash_attn": True,
    "swa_full": True,
    "parallel": "3",
    "kv_unified": True,
    "n_cpu_moe": "2",
    "margin": "128MiB",
    "strategy": "fewest",
}


def _argv(flags: dict[str, str | bool]) -> list[str]:
    argv: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def test_the_cli_and_a_playbook_build_the_same_plan_options() -> None:
    """Was: the playbook's own builder dropped n_ubatch (and knew no --parallel, --swa-full...)."""
    args = parse_args(["plan", "-m", "m.gguf", *_argv(FLAGS)])
    cli = planning_args(args).options
    op = REGISTRY["plan"]
    values = {a.name: a.default for a in op.args} | {"model": "m.gguf"}
    for name, raw in FLAGS.items():
        arg = op.arg(name)
        assert arg is not None, f"the playbook's plan step has no {name!r}"
        values[name] = arg.parse(raw)
    assert plan_options(values) == cli
    assert cli.n_ubatch == 256 and cli.parallel == 3 and cli.swa_full and cli.n_cpu_moe == 2
    # and with nothing given, both are the planner's defaults, flash attention as llama-server's -fa auto
    assert (
        plan_options({a.name: a.default for a in op.args})
        == planning_args(parse_args(["plan", "-m", "m.gguf"])).options
        == PlanOptions(flash_attn=True)
    )
    assert plan_options({"flash_attn": False}).flash_attn is False  # a playbook's YAML boolean
    assert plan_options({"flash_attn": "off"}).flash_attn is False


def _short_plan(tiny_model: Path) -> Plan:
    device = PlanDevice("127.0.0.1:1", 0, "127.0.0.1:1#0", usable=12 * MiB)
    return make_plan([device], profile_model(tiny_model), PlanOptions(n_ctx=4096, margin=0))


def test_one_fit_policy_in_each_front_ends_words(tiny_model: Path) -> None:
    plan = _short_plan(tiny_model)
    short = format_size(plan.fit.shortfall)
    for words, ctx, anyway in (
        (CLI_WORDS, "--ctx", "--force"),
        (PLAYBOOK_WORDS, "ctx", None),
        (DROPIN_WORDS, "n_ctx", "tensor_split"),
    ):
        error = misfit_error(plan, words)
        assert isinstance(error, PlanError) and error.host == "127.0.0.1:1"
        assert "does not fit: 127.0.0.1:1#0 needs " in error.message
        assert f"127.0.0.1:1#0 is short by {short}" in error.message
        assert error.hint is not None and f"a smaller {ctx} (the largest that fits: " in error.hint
        assert (anyway in error.hint) if anyway else "--force" not in error.hint
    with pytest.raises(PlanError):
        check_fit(plan)
    warning = check_fit(plan, force=True)
    assert warning is not None and warning.endswith("(--force)") and short in warning
    fits = make_plan(
        [PlanDevice("127.0.0.1:1", 0, "127.0.0.1:1#0", usable=512 * MiB)], profile_model(tiny_model)
    )
    assert misfit_error(fits) is None and check_fit(fits) is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host(name: str, port: int) -> Host:
    return Host(name=name, address="127.0.0.1", connection="local", rpc_host="127.0.0.1", rpc_port=port)


@pytest.mark.llama
def test_plan_for_fleet_skips_or_raises_on_a_node_that_is_down(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path
) -> None:
    server = start_rpc_server()
    up, down = _host("up", server.port), _host("down", _closed_port())
    profile = profile_model(tiny_model)
    probe = ProbeSettings(timeout=3.0)
    listed: list[int] = []

    def no_gpus() -> list[PlanDevice]:
        listed.append(1)
        return []

    serve_like = asyncio.run(
        plan_for_fleet(
            [up, down], profile, PlanOptions(n_ctx=256), probe=probe, failed="skip", local_gpus=no_gpus
        )
    )
    assert serve_like.fitting is not None and serve_like.misfit is None and serve_like.reason == ""
    assert serve_like.states == {up.endpoint: "ok", down.endpoint: "refused"}
    assert serve_like.fitting.endpoints == (up.endpoint,) and listed == [1]
    with pytest.raises(ProbeError, match="down"):
        asyncio.run(
            plan_for_fleet([up, down], profile, PlanOptions(n_ctx=256), probe=probe, local_devices=[])
        )
    none = asyncio.run(
        plan_for_fleet([down], profile, PlanOptions(n_ctx=256), probe=probe, failed="skip", local_devices=[])
    )
    assert none.plan is None and none.reason == "no node answers"
    # a plan that does not fit is made (`plan` prints it) but is not `fitting` (serve loads none): why
    capped = dataclasses.replace(up, name="capped", memory_limit=12 * MiB)
    short = asyncio.run(
        plan_for_fleet([capped], profile, PlanOptions(n_ctx=4096, margin=0), probe=probe, local_devices=[])
    )
    assert short.plan is not None and not short.plan.fit.fits and short.fitting is None
    assert short.misfit is not None and short.reason == short.misfit.message
    assert "is short by" in short.reason
    assert listed == [1]  # local_devices=[]: no listing at all


def test_the_planning_flags_are_read_once_and_never_written_back() -> None:
    """No blackboard: parsing the flags into typed options leaves argparse's namespace as it was (was:
    the probe's timeout, the facts flag and the selected hosts were written onto it between steps)."""
    args = parse_args(["run", "-m", "m.gguf", "-p", "x", "--endpoint", "10.0.0.9:50052"])
    before = dict(vars(args))
    request = planning_args(args, facts=False)
    assert vars(args) == before
    assert request.probe == ProbeSettings(timeout=3.0, facts=False, forks=args.forks)
    assert request.local_devices is None


def test_serves_round_takes_the_spares_the_recovery_rule_names(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ServeFleet.plan_round` follows `planning.recovery.next_spare`: while the plan does not fit, the
    pool's first spare joins and the round is made again (the report's N-1 follows the same rule); after
    the planner's refusal no spare is taken."""
    from orchestrator.serve.pool import SparePool
    from orchestrator.workflows import serving
    from orchestrator.workflows.plan import PlanRound

    fitting = make_plan(
        [PlanDevice("127.0.0.1:1", 0, "127.0.0.1:1#0", usable=512 * MiB)], profile_model(tiny_model)
    )
    planned: list[list[str]] = []
    refuse = False

    async def rounds(hosts: list[Host], *args: object, **kwargs: object) -> PlanRound:
        planned.append([h.name for h in hosts])
        if refuse:
            return PlanRound(None, {}, 0.0, 0.0, "refused", error=PlanError("refused"))
        return PlanRound(fitting if len(hosts) >= 3 else _short_plan(tiny_model), {}, 0.0, 0.0)

    monkeypatch.setattr(serving, "plan_for_fleet", rounds)
    spares = [_host(f"s{i}", 50100 + i) for i in range(3)]

    async def run(pool: SparePool) -> tuple[PlanRound, serving.ServeFleet]:
        fleet = serving.ServeFleet([_host("own", 50099)], str(tiny_model), PlanOptions(), spares=pool)
        got = await fleet.plan_round()
        assert fleet.shared is not None
        await fleet.shared.close()
        return got, fleet

    pool = SparePool(list(spares))
    got, fleet = asyncio.run(run(pool))
    assert got.fitting is fitting and planned == [["own"], ["own", "s0"], ["own", "s0", "s1"]]
    assert fleet.borrowed == spares[:2] and pool.snapshot() == spares[2:]
    refuse, planned = True, []
    pool = SparePool(list(spares))
    got, fleet = asyncio.run(run(pool))
    assert got.fitting is None and planned == [["own"]] and fleet.borrowed == [] and pool.snapshot() == spares
