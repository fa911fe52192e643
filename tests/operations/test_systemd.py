"""The systemd supervisor's pure parts: unit names, the unit generator (checked by systemd's own
`systemd-analyze verify`), the unit plan, the choice of supervisor, the stop script's order."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.core.errors import ServiceError
from orchestrator.facts.server import Listener, PortOwner, ProcessState
from orchestrator.facts.system import OsInfo
from orchestrator.facts.systemd import SystemdInfo, UnitState
from orchestrator.inventory.model import Host
from orchestrator.operations.launch import launch_env, server_argv
from orchestrator.operations.server.process import UnitControl, busy_script, launch_drift, stop_script
from orchestrator.operations.server.state import NodeState, classify, node_state_from_facts
from orchestrator.operations.server.steps import plan_service
from orchestrator.operations.systemd import choose_supervisor, plan_unit, render_unit, unit_name

H = Host(name="n1", address="10.77.0.11", rpc_host="10.77.0.11")
ROOT = SystemdInfo(pid1="systemd", uid=0, service_user=True)
USER = SystemdInfo(pid1="systemd", uid=1000, user_manager="running", linger=True, logind=True)


def _unit(host: Host, install_dir: str = "/home/lab/rf", *, user: bool = False) -> str:
    return render_unit(
        host, install_dir, server_argv(host, install_dir, "v1"), launch_env(host, install_dir), user=user
    )


def _lines(text: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{key}=")]


def _sha(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()[:10]


@pytest.mark.parametrize(
    ("install_dir", "name"),
    [
        ("~/rpcfleet", "rpcfleet-home-rpcfleet.service"),
        ("~/.local/lib/rpcfleet", "rpcfleet-home-local-lib-rpcfleet.service"),
        ("/opt/rpc", "rpcfleet-opt-rpc.service"),
        ("/opt/rpc/", "rpcfleet-opt-rpc.service"),
        ("/opt//./rpc", "rpcfleet-opt-rpc.service"),
        ("/root", "rpcfleet-root.service"),
        ("/opt/rpc b;x", f"rpcfleet-opt-rpc_b_x--{_sha('/opt/rpc b;x')}.service"),
        ("/opt/a-b", f"rpcfleet-opt-a_b--{_sha('/opt/a-b')}.service"),
        ("/home/rpcfleet", f"rpcfleet-home-rpcfleet--{_sha('/home/rpcfleet')}.service"),
        ("~/local/lib/rpcfleet", f"rpcfleet-home-local-lib-rpcfleet--{_sha('~/local/lib/rpcfleet')}.service"),
        ("/", f"rpcfleet-root--{_sha('/')}.service"),
    ],
)
def test_unit_names_come_from_the_install_dir(install_dir: str, name: str) -> None:
    assert unit_name(install_dir) == name


def test_two_installs_on_one_host_get_two_units() -> None:
    """Names are injective: paths whose words agree (`-` vs `_`, `~` vs /home, a dot, `/` vs /root) get
    two units; one directory written two ways (a trailing slash, `//`, `.`) gets one."""
    assert unit_name("/opt/a") != unit_name("/opt/b")
    clashes = [
        ("/opt/a-b", "/opt/a_b", "/opt/a/b", "/opt/a.b", "/opt/a b"),
        ("~/rpcfleet", "/home/rpcfleet", "home/rpcfleet", "~"),
        (
            "~/.local/lib/rpcfleet",
            "~/local/lib/rpcfleet",
            "/home/local/lib/rpcfleet",
            "~/.local/.lib/rpcfleet",
        ),
        ("/", "/root", "root"),
        ("~/.rf", "~/rf", "~/_rf"),
    ]
    for paths in clashes:
        names = [unit_name(p) for p in paths]
        assert len(set(names)) == len(paths), dict(zip(paths, names, strict=True))
        assert all(re.fullmatch(r"rpcfleet-[A-Za-z0-9_.-]+\.service", n) for n in names), names
    assert unit_name("/opt/a-b/") == unit_name("/opt/a-b") == unit_name("/opt//a-b/.")


def test_the_unit_runs_the_process_supervisors_launch_line() -> None:
    host = dataclasses.replace(H, rpc_devices=("CPU",), rpc_threads=3, rpc_cache=True, rpc_debug=True)
    text = _unit(host)
    argv = server_argv(host, "/home/lab/rf", "v1")
    assert _lines(text, "ExecStart") == [" ".join(["stdbuf", "-oL", *argv])]
    assert _lines(text, "Environment") == sorted(
        f"{k}={v}" for k, v in launch_env(host, "/home/lab/rf").items()
    )
    assert "GGML_RPC_DEBUG=1" in _lines(text, "Environment")
    assert "GGML_RPC_DEBUG" not in _unit(H)
    assert _unit(host) == text  # the same inventory, the same text: a second deploy writes nothing


def test_system_and_user_units_differ_only_where_they_must() -> None:
    system, user = _unit(H), _unit(H, user=True)
    assert _lines(system, "User") == ["rpcfleet"] and _lines(system, "WantedBy") == ["multi-user.target"]
    assert _lines(user, "User") == [] and _lines(user, "WantedBy") == ["default.target"]
    for text in (system, user):
        assert _lines(text, "Restart") == ["on-failure"] and _lines(text, "IgnoreSIGPIPE") == ["yes"]
        assert _lines(text, "NoNewPrivileges") == ["yes"] and _lines(text, "ProtectSystem") == ["strict"]
        assert _lines(text, "PrivateTmp") == ["yes"] and _lines(text, "ProtectHome") == ["tmpfs"]
        assert _lines(text, "ReadWritePaths") == ["/home/lab/rf/cache"]
        assert _lines(text, "StartLimitBurst") == ["5"] and _lines(text, "StartLimitIntervalSec") == ["60"]


def test_odd_paths_are_quoted_for_systemd() -> None:
    text = _unit(H, "/srv/a b/100%$x")
    assert _lines(text, "BindReadOnlyPaths") == ['"/srv/a b/100%%$$x"']
    assert '"/srv/a b/100%%$$x/versions/v1/bin/ggml-rpc-server"' in _lines(text, "ExecStart")[0]


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None and os.geteuid() != 0, reason="systemd-analyze is not installed"
)
@pytest.mark.parametrize("user", [False, True])
def test_systemd_accepts_every_line_of_the_generated_unit(tmp_path: Path, user: bool) -> None:
    host = dataclasses.replace(H, rpc_devices=("CPU",), rpc_threads=3, rpc_cache=True, rpc_debug=True)
    install = tmp_path / "in stall"
    (install / "cache").mkdir(parents=True)
    unit = tmp_path / unit_name(str(install))
    unit.write_text(_unit(host, str(install), user=user))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],  # a user unit's keys are checked alike
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    complaints = [line for line in result.stderr.splitlines() if str(unit) in line or "bad unit file" in line]
    assert result.returncode == 0 and complaints == [], result.stderr
    # A broken line is caught by the same check: the check can fail.
    unit.write_text(_unit(host, str(install), user=user).replace("NoNewPrivileges", "NoNewPrivilege"))
    broken = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False
    )
    assert "Unknown key" in broken.stderr


def test_plan_unit_changes_only_what_differs() -> None:
    text = _unit(H)
    enabled = {"UnitFileState": "enabled"}
    same = plan_unit(UnitState("u.service", text, properties=enabled), text, ROOT)
    assert not same.changed and same.describe() == "u.service up to date"
    new = plan_unit(UnitState("u.service", None), text, dataclasses.replace(ROOT, service_user=False))
    assert (new.write, new.enable, new.create_user, new.linger) == (True, True, True, False)
    assert new.describe() == "create user rpcfleet, write u.service, enable u.service"
    edited = plan_unit(UnitState("u.service", text + "# edited\n", properties=enabled), text, ROOT)
    assert (edited.write, edited.enable) == (True, False)
    lonely = plan_unit(
        UnitState("u.service", text, True, enabled), text, dataclasses.replace(USER, linger=False)
    )
    assert lonely.linger and not lonely.write and lonely.describe() == "enable lingering"


@pytest.mark.parametrize(
    ("wanted", "info", "chosen"),
    [
        ("auto", ROOT, "systemd"),
        ("auto", USER, "systemd"),
        ("auto", SystemdInfo(pid1="sshd", uid=0), "process"),
        ("auto", SystemdInfo(pid1="systemd", uid=1000), "process"),  # no user manager
        ("auto", None, "process"),
        ("process", ROOT, "process"),
        ("systemd", USER, "systemd"),
    ],
)
def test_choose_supervisor(wanted: str, info: SystemdInfo | None, chosen: str) -> None:
    assert choose_supervisor(wanted, info, host="n1") == chosen


@pytest.mark.parametrize(
    ("info", "why"),
    [
        (SystemdInfo(pid1="sshd", uid=0), "PID 1 is sshd, not systemd"),
        (SystemdInfo(pid1="systemd", uid=1000), "no systemd user manager answers"),
        (SystemdInfo(pid1="systemd", uid=1000, user_manager="running"), "lingering is off"),
    ],
)
def test_supervisor_systemd_where_it_cannot_work_is_a_clear_error(info: SystemdInfo, why: str) -> None:
    with pytest.raises(ServiceError, match=why) as caught:
        choose_supervisor("systemd", info, host="n1")
    assert caught.value.host == "n1" and "supervisor: process" in (caught.value.hint or "")


def test_the_unit_stop_follows_the_same_busy_check_on_the_node() -> None:
    unit = UnitControl("rpcfleet-x.service", user=False)
    script = stop_script("/i", 50052, unit=unit)
    busy, stop = script.index(busy_script(50052)), script.index("systemctl stop rpcfleet-x.service ||")
    assert busy < stop < script.index("kill -TERM $targets")
    assert busy_script(50052) not in stop_script("/i", 50052, force=True, unit=unit)
    away = stop_script("/i", 50052, unit=dataclasses.replace(unit, user=True, disable=True))
    assert "systemctl --user disable --now --quiet rpcfleet-x.service ||" in away
    assert "systemctl" not in stop_script("/i", 50052)  # the process supervisor's stop knows no units


SERVER = "/home/lab/i/versions/v1/bin/ggml-rpc-server"


def _state(
    unit: UnitState, *, pid_file: ProcessState | None = None, listeners: tuple[Listener, ...] = ()
) -> NodeState:
    """A NodeState under `supervisor: systemd`, built from parsed facts as `read_node_state` builds it."""
    owners = tuple(PortOwner(lst.pid, SERVER if lst.process == "ggml-rpc-server" else "/usr/bin/python3")
                   for lst in listeners if lst.pid is not None)  # fmt: skip
    values = {
        "install_dir": "/home/lab/i",
        "os": OsInfo("Linux", "x86_64", "debian", "12", None),
        "current_link": "versions/v1",
        "versions": ("v1",),
        "history": ("v1",),
        "server_process": pid_file or ProcessState(None),
        "listeners": listeners,
        "rpc_clients": (),
        "port_owners": owners,
        "systemd": ROOT,
        "unit": unit,
    }
    return node_state_from_facts("n1", values, "systemd")


def _props(active: str, pid: int = 0, code: str = "0", status: str = "0") -> dict[str, str]:
    return {"ActiveState": active, "UnitFileState": "enabled", "MainPID": str(pid), "ExecMainCode": code,
            "ExecMainStatus": status, "Result": "success", "NRestarts": "2"}  # fmt: skip


def _host_unit(text: str | None, props: dict[str, str], stat: str | None = None) -> UnitState:
    return UnitState("rpcfleet-home-lab-i.service", text, False, props, stat, SERVER if stat else None)


def test_under_systemd_the_tracked_server_is_the_units_main_pid() -> None:
    text = _unit(H, "/home/lab/i")
    state = _state(
        _host_unit(text, _props("active", 812), "Ssl"), listeners=(Listener("a", "ggml-rpc-server", 812),)
    )
    status = classify(H, state, None)
    assert (status.state, status.pid, status.supervisor, status.restarts) == ("running", 812, "systemd", 2)
    assert launch_drift(H, state) == ()
    edited = _state(_host_unit(text + "# x\n", _props("active", 812), "Ssl"))
    assert launch_drift(H, edited) == ("unit rpcfleet-home-lab-i.service differs from the inventory's",)
    threads = dataclasses.replace(H, rpc_threads=2)
    assert launch_drift(threads, state) == ("unit rpcfleet-home-lab-i.service differs from the inventory's",)


def test_after_an_automatic_restart_the_last_exit_is_the_journals() -> None:
    note = "Main process exited, code=killed, status=9/KILL"
    running = _host_unit("x", {**_props("active", 812), "ExecMainCode": "0"}, "Ssl")
    assert dataclasses.replace(running, exit_note=note).last_exit() == "code=killed, status=9/KILL"
    assert running.last_exit() == "success"  # no journal line: what systemd's properties say
    stopped = dataclasses.replace(_host_unit("x", _props("inactive", code="2", status="15")), exit_note=note)
    assert (
        stopped.last_exit() == "success, killed by signal 15"
    )  # not restarted: the properties are the last run


def test_the_process_supervisors_server_is_an_orphan_under_systemd() -> None:
    state = _state(
        _host_unit(None, _props("inactive")),
        pid_file=ProcessState(4242, "Sl", SERVER),
        listeners=(Listener("a", "ggml-rpc-server", 4242),),
    )
    status = classify(H, state, None)
    assert (
        status.state == "orphan"
        and "run by the process supervisor, the inventory says systemd" in status.message
    )
    assert plan_service(status, "running", current="v1").action == "restart"


def test_a_unit_whose_server_exited_by_itself_on_a_taken_port_failed_to_bind() -> None:
    python = (Listener("10.77.0.11:50052", "python3", 77),)
    exited = classify(H, _state(_host_unit("x", _props("inactive", code="1")), listeners=python), None)
    assert (
        exited.state == "crashed"
        and "could not bind its port" in exited.message
        and "python3" in exited.message
    )
    by_itself = classify(H, _state(_host_unit("x", _props("inactive", code="1"))), None)
    assert by_itself.state == "crashed" and "exited with status 0" in by_itself.message
    stopped = classify(
        H, _state(_host_unit("x", _props("inactive", code="2", status="15")), listeners=python), None
    )
    assert stopped.state == "stopped"  # killed by systemctl stop's SIGTERM: not a failure
    gave_up = classify(H, _state(_host_unit("x", _props("failed", code="1", status="1"))), None)
    assert gave_up.state == "crashed" and "exited with status 1" in gave_up.message


def test_the_system_unit_is_sandboxed_and_wx_memory_is_denied_to_the_cpu_build_only() -> None:
    host = Host(name="n1", address="10.0.0.1")
    cpu = render_unit(
        host, "/opt/rf", ["/opt/rf/versions/rpc-server-7.0.0-cpu-linux-x86_64-1/bin/s"], {}, user=False
    )
    vulkan = render_unit(
        host, "/opt/rf", ["/opt/rf/versions/rpc-server-7.0.0-vulkan-linux-x86_64-1/bin/s"], {}, user=False
    )
    for key, value in [
        ("CapabilityBoundingSet", ""),
        ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
        ("SystemCallFilter", "@system-service"),
        ("LockPersonality", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("RestrictNamespaces", "yes"),
    ]:
        assert _lines(cpu, key) == [value] and _lines(vulkan, key) == [value], key
    assert _lines(cpu, "MemoryDenyWriteExecute") == ["yes"]
    assert _lines(vulkan, "MemoryDenyWriteExecute") == []  # llvmpipe and CUDA compile code at run time
    user_unit = render_unit(host, "/home/lab/rf", ["/home/lab/rf/versions/x-cpu-y/bin/s"], {}, user=True)
    assert _lines(user_unit, "CapabilityBoundingSet") == []  # a user manager cannot apply most of it
