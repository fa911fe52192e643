"""Facts about systemd on a node: whether rpcfleet may manage units there, and one unit's state."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from orchestrator.facts.base import Fact
from orchestrator.facts.server import PROC_ARGV0, PS_STAT

# `systemctl --user` over SSH needs the user manager's runtime dir; pam_systemd sets it for a login
# session, a lingering user's manager has it too.
USER_ENV = 'export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/run/user/$(id -u)}"'


SERVICE_USER = "rpcfleet"  # the dedicated user system units run as


USER_UNITS = "~/.config/systemd/user"


SYSTEM_UNITS = "/etc/systemd/system"


@dataclass(frozen=True)
class SystemdInfo:
    """What decides the supervisor under `auto`: PID 1, the user, and (not root) the user manager."""

    pid1: str | None  # /proc/1/comm: "systemd" where systemd is PID 1
    uid: int | None
    user_manager: str | None = None  # `systemctl --user is-system-running` (None: unreachable or root)
    linger: bool | None = None  # logind's Linger for this user (None: logind does not know the user)
    logind: bool = False  # logind answers (it can enable lingering for the user itself)
    service_user: bool = False  # the dedicated user of system units exists (root only)
    login: str | None = None  # the name of the user rpcfleet connects as (`id -un`)

    @property
    def root(self) -> bool:
        return self.uid == 0

    def unusable(self) -> str | None:
        """Why rpcfleet cannot manage units here (None: it can, as system units or user units)."""
        if self.pid1 != "systemd":
            return f"PID 1 is {self.pid1 or 'unknown'}, not systemd"
        if self.root:
            return None
        if not self.user_manager:
            return "no systemd user manager answers for this user (`systemctl --user`)"
        if not self.linger and not self.logind:
            return "lingering is off and logind does not answer (user units would stop at logout)"
        return None


def _key_values(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" ")
        if sep and key.isidentifier():
            values.setdefault(key, value.strip())
    return values


@dataclass(frozen=True)
class SystemdFact(Fact[SystemdInfo]):
    name: ClassVar[str] = "systemd"

    def command(self) -> str:
        return "\n".join(
            [
                "printf 'pid1 %s\\n' \"$(cat /proc/1/comm 2>/dev/null)\"",
                "printf 'uid %s\\n' \"$(id -u)\"",
                "printf 'login %s\\n' \"$(id -un)\"",
                'if [ "$(id -u)" = 0 ]; then',
                f'  id -u {SERVICE_USER} >/dev/null 2>&1 && echo "service_user yes"; exit 0',
                "fi",
                "command -v systemctl >/dev/null 2>&1 || exit 0",
                USER_ENV,
                "printf 'user_manager %s\\n' \"$(systemctl --user is-system-running 2>/dev/null)\"",
                'printf \'linger %s\\n\' "$(loginctl show-user "$(id -un)" -p Linger --value 2>/dev/null)"',
                "loginctl --no-legend list-sessions >/dev/null 2>&1 && echo 'logind yes'",
                "exit 0",
            ]
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> SystemdInfo:
        values = _key_values(stdout)
        uid = values.get("uid", "")
        linger = values.get("linger")
        return SystemdInfo(
            pid1=values.get("pid1") or None,
            uid=int(uid) if uid.isdigit() else None,
            user_manager=values.get("user_manager") or None,
            linger={"yes": True, "no": False}.get(linger or ""),
            logind=values.get("logind") == "yes",
            service_user=values.get("service_user") == "yes",
            login=values.get("login") or None,
        )


UNIT_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "UnitFileState",
    "MainPID",
    "NRestarts",
    "Result",
    "ExecMainCode",
    "ExecMainStatus",
    "InvocationID",
)


_FILE_MARK = "@@rpcfleet-unit-file@@"


@dataclass(frozen=True)
class UnitState:
    """One unit as systemd and its file say. `text` is None when the unit file does not exist."""

    name: str
    text: str | None
    user: bool = False  # a user unit (the login user is not root)
    properties: Mapping[str, str] = field(default_factory=dict)
    stat: str | None = None  # ps STAT of MainPID ("" when it is gone), as ServerProcessFact
    argv0: str | None = None
    failed_bind: bool = False  # the journal of the current (or last) run says the bind failed
    exit_note: str = ""  # systemd's last "Main process exited, code=..., status=..." in the journal

    @property
    def installed(self) -> bool:
        return self.text is not None

    @property
    def active(self) -> str:
        return self.properties.get("ActiveState", "")

    @property
    def enabled(self) -> bool:
        return self.properties.get("UnitFileState") in ("enabled", "enabled-runtime")

    @property
    def main_pid(self) -> int | None:
        pid = self.properties.get("MainPID", "")
        return int(pid) if pid.isdigit() and pid != "0" else None

    @property
    def restarts(self) -> int:
        count = self.properties.get("NRestarts", "")
        return int(count) if count.isdigit() else 0

    def last_exit(self) -> str:
        """The last exit as systemd recorded it: `Result`, and how the main process ended (after an
        automatic restart, the journal's line about the run that ended: `code=killed, status=9/KILL`)."""
        result = self.properties.get("Result", "")
        if self.restarts and self.main_pid and self.exit_note:
            return self.exit_note.removeprefix("Main process exited, ").rstrip(".")
        code, status = self.properties.get("ExecMainCode", ""), self.properties.get("ExecMainStatus", "")
        how = {"1": "exited", "2": "killed", "3": "dumped core"}.get(code)
        if how is None:
            return result
        detail = f"{how} with status {status}" if how == "exited" else f"{how} by signal {status}"
        return f"{result}, {detail}" if result else detail


@dataclass(frozen=True)
class UnitFact(Fact[UnitState]):
    """The login user's unit `unit` (a system unit for root, else a user unit): its properties
    (`systemctl show`), its main process (`ps`, /proc), whether the journal of its last run has
    `bind_failed`, and its file's text."""

    unit: str
    bind_failed: str = "Failed to create server socket"
    name: ClassVar[str] = "unit"

    def command(self) -> str:
        q = shlex.quote
        scope = "$scope"
        props = ",".join(UNIT_PROPERTIES)
        return "\n".join(
            [
                "command -v systemctl >/dev/null 2>&1 || exit 0",
                f'if [ "$(id -u)" = 0 ]; then scope=--system; f={SYSTEM_UNITS}/{q(self.unit)}; else',
                f"  scope=--user; f={USER_UNITS}/{q(self.unit)}; {USER_ENV}; echo 'user yes'",
                "fi",
                f"systemctl {scope} show {q(self.unit)} -p {props} 2>/dev/null | sed 's/=/ /'",
                f"pid=$(systemctl {scope} show {q(self.unit)} -p MainPID --value 2>/dev/null)",
                'if [ -n "$pid" ] && [ "$pid" != 0 ]; then',
                f"  printf 'stat %s\\n' \"$({PS_STAT})\"",
                f"  printf 'argv0 %s\\n' \"$({PROC_ARGV0})\"",
                "fi",
                f"inv=$(systemctl {scope} show {q(self.unit)} -p InvocationID --value 2>/dev/null)",
                'if [ -n "$inv" ]; then',
                f'  journalctl {scope} -q -o cat _SYSTEMD_INVOCATION_ID="$inv" 2>/dev/null'
                f" | grep -qF {q(self.bind_failed)} && echo 'failed_bind yes'",
                "fi",
                # How the previous run ended (ExecMain* describe the current one after a restart).
                f"journalctl {scope} -u {q(self.unit)} -q -o cat -n 100 --no-pager 2>/dev/null"
                " | grep -o 'Main process exited, .*' | tail -n 1 | sed 's/^/exit_note /'",
                f'if [ -f "$f" ]; then echo {_FILE_MARK}; cat "$f"; fi',
                "exit 0",
            ]
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> UnitState:
        head, mark, text = stdout.partition(_FILE_MARK + "\n")
        values = _key_values(head)
        return UnitState(
            name=self.unit,
            text=text if mark else None,
            user=values.get("user") == "yes",
            properties={key: values[key] for key in UNIT_PROPERTIES if key in values},
            stat=values.get("stat"),
            argv0=values.get("argv0") or None,
            failed_bind=values.get("failed_bind") == "yes",
            exit_note=values.get("exit_note", ""),
        )
