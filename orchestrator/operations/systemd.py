"""The systemd supervisor: the unit (a pure generator), its install/remove scripts, the choice of supervisor.

One unit per server instance, named after the install dir (`unit_name`): a system unit in
/etc/systemd/system running as the dedicated user `rpcfleet` when rpcfleet connects as root, else a user
unit in ~/.config/systemd/user of the login user, with lingering enabled so it runs without a session and
starts at boot. The unit runs the same launch line and environment as the process supervisor
(`server_argv`, `LLAMA_CACHE`, `GGML_RPC_DEBUG`; SIGPIPE ignored: systemd's `IgnoreSIGPIPE=yes`, said
explicitly), hardened, restarted on failure within a start limit.

The servers rpcfleet builds exit 1 after a failed bind (`exit-status` patch): the unit says `failed`
(not a clean stop) and is not restarted for it (`RestartPreventExitStatus=1`: a port another program
holds is no loop); it starts after network-online.target, so a late address is waited for before.
Readiness is a HELLO (process.wait_ready), never `systemctl is-active`.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrator.core.errors import ServiceError
from orchestrator.facts.systemd import (
    SERVICE_USER,
    SYSTEM_UNITS,
    USER_ENV,
    USER_UNITS,
    SystemdInfo,
    UnitState,
)
from orchestrator.inventory.model import Host
from orchestrator.inventory.variables import DEFAULT_INSTALL_DIR, control_character

UNIT_PREFIX = "rpcfleet-"


# The comment (GECOS) of the user rpcfleet creates: the teardown removes only an account that has it.
SERVICE_USER_MARK = "rpcfleet rpc-server"


RESTART_SEC = 1  # kill -9 -> serving again within about a second (+ the server's start)


START_LIMIT_BURST = 5  # failures within START_LIMIT_INTERVAL and systemd gives up: `failed`


START_LIMIT_INTERVAL = 60


Supervision = Literal["systemd", "process"]


_PLAIN_PART = re.compile(r"[A-Za-z0-9_]+")


def unit_name(install_dir: str, server: str = "") -> str:
    """`rpcfleet-<install dir as words>.service`, from the inventory's install_dir (`~` is `home`):
    `~/rpcfleet` -> `rpcfleet-home-rpcfleet.service`, `/opt/rpc` -> `rpcfleet-opt-rpc.service`.

    Injective: two install dirs never share a unit. The words alone name a plain path (`~` or an absolute
    path outside /home, every part letters, digits and `_`) and the default install dir (its name from
    before); any other path gets `--` and a hash of the path: `/opt/a-b` -> `rpcfleet-opt-a_b--<hash>`
    apart from `/opt/a_b`, `/home/rpcfleet` apart from `~/rpcfleet`. The path is normalised first
    (`//`, `.`, a trailing `/`), so one directory written two ways is one unit.

    `server`: one of the install's several servers (`rpc_servers`), `...--server-<name>.service`; the
    words never hold `--`, so no install's unit is another's server's."""
    suffix = f"--server-{server}" if server else ""
    home = install_dir == "~" or install_dir.startswith("~/")
    parts = [p for p in (install_dir[1:] if home else install_dir).split("/") if p not in ("", ".")]
    words = [re.sub(r"[^A-Za-z0-9_.]", "_", p).lstrip(".") or "_" for p in parts]
    readable = "-".join(["home", *words] if home else words) or "root"
    normalised = ("~/" if home else "/" if install_dir.startswith("/") else "") + "/".join(parts)
    plain = bool(
        (home or (install_dir.startswith("/") and parts and parts[0] != "home"))
        and all(_PLAIN_PART.fullmatch(p) for p in parts)
        and readable != _DEFAULT_READABLE  # the default's words belong to the default
    )
    if plain or normalised == DEFAULT_INSTALL_DIR:
        return f"{UNIT_PREFIX}{readable}{suffix}.service"
    digest = hashlib.sha256(normalised.encode()).hexdigest()[:10]
    return f"{UNIT_PREFIX}{readable}--{digest}{suffix}.service"


_DEFAULT_READABLE = "home-local-lib-rpcfleet"  # unit_name(DEFAULT_INSTALL_DIR) without the prefix


def choose_supervisor(wanted: str, info: SystemdInfo | None, *, host: str) -> Supervision:
    """Pure: `auto` is systemd where rpcfleet may manage units, else process; `systemd` there or an error."""
    why_not = info.unusable() if info is not None else "systemd was not read"
    if wanted == "process" or (wanted == "auto" and why_not):
        return "process"
    if why_not:
        raise ServiceError(
            f"supervisor: systemd is not possible here: {why_not}",
            host=host,
            hint="use supervisor: process (or auto) for this host",
        )
    return "systemd"


def _exec_quote(arg: str) -> str:
    """One ExecStart= argument: systemd's own quoting (specifiers `%` and variables `$` doubled)."""
    text = arg.replace("%", "%%").replace("$", "$$")
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _env_quote(assignment: str) -> str:
    return _exec_quote(assignment)


def render_unit(
    host: Host,
    install_dir: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    user: bool,
    firewall: str | None = None,
) -> str:
    """Pure: the unit's text for the server started by `argv` with `env` (launch.server_argv and
    launch_env: the process supervisor's line) from `install_dir` (absolute, as the node expanded it).
    `user`: a user unit (no User=, wanted by default.target). `firewall`: rpc_allow_from's rules script
    (operations.firewall), run as root before every start, a boot's included; a start fails when it
    cannot install them, so the port is never open to all. Raises ServiceError for a value that holds a
    control character: a newline would start a directive of its own in a unit root runs."""
    values = [
        ("install_dir", install_dir),
        ("the address", host.rpc_host or host.address),
        *((f"the launch line (argument {i})", arg) for i, arg in enumerate(argv, start=1)),
        *((f"rpc_env's {key}", f"{key}={value}") for key, value in env.items()),
        ("the firewall script's path", firewall or ""),
    ]
    for what, value in values:
        bad = control_character(value)
        if bad:
            raise ServiceError(
                f"refusing to write a unit: {what} holds a control character ({bad})", host=host.name
            )
    cache = f"{install_dir}/cache"
    lines = [
        "# Written by rpcfleet: changes here are replaced by the next deploy.",
        "[Unit]",
        f"Description=ggml-rpc-server on {host.rpc_host or host.address}:{int(host.rpc_port)} (rpcfleet)",
        "After=network-online.target",
        "Wants=network-online.target",
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=exec",
        *([] if user else [f"User={SERVICE_USER}", f"Group={SERVICE_USER}"]),
        # `+`: with full privileges, outside the sandbox below (iptables needs root and netlink).
        *([f"ExecStartPre=+/bin/sh {_exec_quote(firewall)}"] if firewall else []),
        *(f"Environment={_env_quote(f'{key}={value}')}" for key, value in sorted(env.items())),
        # Line-buffered stdout, as the process supervisor's log: the journal gets each line at once.
        "ExecStart=" + " ".join(_exec_quote(a) for a in ["stdbuf", "-oL", *argv]),
        "Restart=on-failure",
        # Status 1 is a failed bind (the exit-status patch) or a bad flag: shown as `failed`, never looped
        # on (a port another program holds). A late address is network-online.target's to wait for.
        "RestartPreventExitStatus=1",
        f"RestartSec={RESTART_SEC}",
        "TimeoutStopSec=5",
        "IgnoreSIGPIPE=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        # Homes become an empty tmpfs with only the install dir in it (read-only) and its cache writable:
        # reachable even below a 0700 home, for the dedicated user too.
        "ProtectHome=tmpfs",
        f"BindReadOnlyPaths={_exec_quote(install_dir)}",
        f"BindPaths={_exec_quote(cache)}",
        f"ReadWritePaths={_exec_quote(cache)}",
        "PrivateTmp=yes",
        *([] if user else _system_hardening(argv[0])),
        "",
        "[Install]",
        f"WantedBy={'default.target' if user else 'multi-user.target'}",
    ]
    return "\n".join(lines) + "\n"


def _system_hardening(binary: str) -> list[str]:
    """A system unit's sandbox beyond the user unit's (a user manager cannot apply most of it without
    unprivileged user namespaces). No capabilities, the address families a server and its libraries use,
    the system calls of a service, no kernel tunables, modules, logs, clock or namespaces. W^X memory only
    for the CPU build: llvmpipe's Vulkan and CUDA's PTX compile code at run time. Devices stay visible:
    a GPU server needs /dev/dri or /dev/nvidia*. `systemd-analyze security` grades the result
    (bench/security.py)."""
    cpu_only = "-cpu-" in binary  # the artifact's id is in its path: versions/rpc-server-P-BACKEND-...
    return [
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "SystemCallFilter=@system-service",
        "SystemCallArchitectures=native",
        "LockPersonality=yes",
        *(["MemoryDenyWriteExecute=yes"] if cpu_only else []),
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "RemoveIPC=yes",
        "UMask=0077",  # the cache's files are the server's alone
    ]


@dataclass(frozen=True)
class UnitChange:
    """What installing the unit changes (`--check` shows it; a second deploy changes nothing)."""

    unit: str
    write: bool  # the file is new or differs: written, then daemon-reload
    enable: bool
    linger: bool = False  # a user unit's user gets lingering
    create_user: bool = False  # the dedicated user is made (system units)

    @property
    def changed(self) -> bool:
        return self.write or self.enable or self.linger or self.create_user

    def describe(self) -> str:
        parts = [
            *(["create user " + SERVICE_USER] if self.create_user else []),
            *(["enable lingering"] if self.linger else []),
            *([f"write {self.unit}"] if self.write else []),
            *([f"enable {self.unit}"] if self.enable else []),
        ]
        return ", ".join(parts) or f"{self.unit} up to date"


def plan_unit(state: UnitState, text: str, info: SystemdInfo) -> UnitChange:
    """Pure: the steps that make the installed unit `text` and enabled."""
    return UnitChange(
        unit=state.name,
        write=state.text != text,
        enable=not state.enabled,
        linger=not info.root and not info.linger,
        create_user=info.root and not info.service_user,
    )


def systemctl(user: bool) -> str:
    return "systemctl --user" if user else "systemctl"


def install_unit_script(name: str, install_dir: str, text: str, *, user: bool) -> str:
    """Idempotent on the node: the user (or lingering), the cache dir, the file (daemon-reload only when it
    changed), enabled. Prints `@created`, `@linger`, `@written`, `@enabled` for what it did."""
    q = shlex.quote
    path = f"{USER_UNITS if user else SYSTEM_UNITS}/{q(name)}"
    cache = q(f"{install_dir}/cache")
    ctl = systemctl(user)
    owner = [] if user else [f"chown {SERVICE_USER}:{SERVICE_USER} {cache} || exit 1"]
    account = (
        [
            USER_ENV,
            'if [ "$(loginctl show-user "$(id -un)" -p Linger --value 2>/dev/null)" != yes ]; then',
            '  loginctl enable-linger "$(id -un)" || { echo "@error cannot enable lingering"; exit 1; }',
            "  echo @linger",
            "fi",
        ]
        if user
        else [
            f"if ! id -u {SERVICE_USER} >/dev/null 2>&1; then",
            f"  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "
            f"--comment {shlex.quote(SERVICE_USER_MARK)} {SERVICE_USER} || exit 1",
            "  echo @created",
            "fi",
        ]
    )
    return "\n".join(
        [
            *account,
            f"mkdir -p {cache} || exit 1",
            *owner,
            f"f={path}",
            'mkdir -p "$(dirname "$f")" || exit 1',
            f"new={q(text)}",
            'if [ ! -f "$f" ] || [ "$(cat "$f")" != "$(printf %s "$new")" ]; then',
            '  printf %s "$new" > "$f.tmp" && mv -f "$f.tmp" "$f" || exit 1',
            f"  {ctl} daemon-reload || exit 1",
            "  echo @written",
            "fi",
            f"if ! {ctl} is-enabled --quiet {q(name)} 2>/dev/null; then",
            f"  {ctl} enable --quiet {q(name)} || exit 1",
            "  echo @enabled",
            "fi",
        ]
    )


def remove_unit_script(name: str, *, user: bool) -> str:
    """Stop, disable and delete the unit; the dedicated user goes with the last rpcfleet unit, if rpcfleet
    created it (its comment is `SERVICE_USER_MARK`: an account of that name made by someone else stays).
    Prints `@removed` when there was a unit, `@userdel` when the user went too; a failed stop or disable
    prints `@error ...`, exits 1 and leaves the unit file (the unit may still run)."""
    q = shlex.quote
    ctl = systemctl(user)
    userdel = (
        []
        if user
        else [
            f"if ! ls /etc/systemd/system/{UNIT_PREFIX}*.service >/dev/null 2>&1 "
            f'&& [ "$(getent passwd {SERVICE_USER} | cut -d: -f5)" = {q(SERVICE_USER_MARK)} ]; then',
            f"  userdel {SERVICE_USER} && echo @userdel",
            "fi",
        ]
    )
    return "\n".join(
        [
            USER_ENV if user else ":",
            f"f={USER_UNITS if user else SYSTEM_UNITS}/{q(name)}",
            'if [ -f "$f" ]; then',
            f"  {ctl} disable --now --quiet {q(name)} || "
            "{ echo '@error systemctl disable --now failed'; exit 1; }",
            '  rm -f "$f"',
            f"  {ctl} daemon-reload; {ctl} reset-failed {q(name)} 2>/dev/null",
            "  echo @removed",
            "fi",
            *userdel,
            "exit 0",
        ]
    )


def control_script(name: str, action: Literal["start", "stop", "restart"], *, user: bool) -> str:
    """`systemctl start|stop|restart` of the unit (stop waits for the exit; TimeoutStopSec, then SIGKILL);
    a start clears an earlier `failed` (start limit) first. Prints the new MainPID as `@pid N`."""
    name = shlex.quote(name)
    ctl = systemctl(user)
    return "\n".join(
        [
            USER_ENV if user else ":",
            *([f"{ctl} reset-failed {name} 2>/dev/null"] if action != "stop" else []),
            f"{ctl} {action} {name} || exit 1",
            f'echo "@pid $({ctl} show -p MainPID --value {name})"',
        ]
    )


def journal_command(name: str, lines: int, *, user: bool, drop: str = "") -> str:
    """The unit's journal, last `lines` lines (`rpcfleet logs`), leaving out first the lines whose message
    matches the extended regex `drop` (when given), so that `lines` are all kept."""
    scope = "--user" if user else "--system"
    name = shlex.quote(name)
    env = USER_ENV if user else ":"
    if not drop:
        return f"{env}; journalctl {scope} -u {name} -n {int(lines)} --no-pager -o short-iso"
    # short-iso prefixes each message with "date host unit[pid]: "
    pattern = shlex.quote(f": {drop.removeprefix('^')}")
    return (
        f"{env}; journalctl {scope} -u {name} --no-pager -o short-iso | grep -v -E -e {pattern} "
        f"| tail -n {int(lines)}"
    )
