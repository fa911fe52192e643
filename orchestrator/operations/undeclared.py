"""Servers of an install that the inventory no longer declares: a name dropped from a host's
`rpc_servers`, or the host's single server once it has `rpc_servers` (and the other way round). Nothing
else would ever look at them again, so they would run unseen: `status` and `deploy` find them on the
node (a live pid file of this install's server or supervisor loop whose name the host does not declare),
and `stop --undeclared` stops them through the operations layer (lock, busy check: a busy one is refused
unless --force)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from orchestrator.connectors.base import shell_path
from orchestrator.engine.executor import HostContext, StepOutcome
from orchestrator.facts.base import Fact, gather
from orchestrator.inventory.model import SERVER_SEPARATOR, Host, servers_of


@dataclass(frozen=True)
class LiveServer:
    """A server of the install with a live process: its name ("" for the host's only server), the pid of
    its rpc-server (None while its supervisor loop waits to restart it) and the port it was started with."""

    server: str
    pid: int | None
    port: int | None
    loop: int | None = None  # the process supervisor's loop pid, when it runs


@dataclass(frozen=True)
class LiveServersFact(Fact[tuple[LiveServer, ...]]):
    """Every `run/rpc-server[-NAME].pid` and `run/rpc-supervisor-NAME.pid` of the install whose process
    is alive and this install's (the server's binary under the install dir, the loop running the
    install's script: a recycled pid is not a server)."""

    install_dir: str
    name: ClassVar[str] = "live_servers"

    def command(self) -> str:
        return "\n".join(
            [
                f"D=$(cd {shell_path(self.install_dir)} 2>/dev/null && pwd) || exit 0",
                'cd "$D/run" 2>/dev/null || exit 0',
                "for f in rpc-server*.pid rpc-supervisor*.pid; do",
                '  [ -f "$f" ] || continue',
                '  pid=$(head -n 1 "$f" 2>/dev/null)',
                '  case "$pid" in ""|*[!0-9]*) continue;; esac',
                "  [ -r /proc/$pid/cmdline ] || continue",
                '  case "$(ps -o stat= -p "$pid" 2>/dev/null)" in ""|Z*) continue;; esac',
                "  argv=$(tr '\\0' '\\n' < /proc/$pid/cmdline 2>/dev/null)",
                '  case "$f" in',
                "    rpc-server*)",
                '      case "$(printf "%s\\n" "$argv" | head -n 1)" in "$D"/*) ;; *) continue;; esac',
                "      port=$(printf '%s\\n' \"$argv\" | sed -n '/^-p$/{n;p;q;}')",
                '      echo "server ${f#rpc-server} $pid ${port:--}";;',
                "    *)",
                '      n=${f#rpc-supervisor}; [ "$(printf "%s\\n" "$argv" | sed -n 2p)" = '
                '"$D/run/rpc-supervise${n%.pid}.sh" ] || continue',
                '      echo "loop $n $pid";;',
                "  esac",
                "done",
            ]
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> tuple[LiveServer, ...]:
        return parse_live_servers(stdout)


def parse_live_servers(stdout: str) -> tuple[LiveServer, ...]:
    """`server -NAME.pid PID PORT` and `loop -NAME.pid PID` lines (`.pid` alone: the unnamed server),
    one LiveServer per name, in the order first seen. Pure."""
    found: dict[str, LiveServer] = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) < 3 or words[0] not in ("server", "loop") or not words[2].isdigit():
            continue
        name = words[1].removesuffix(".pid").removeprefix("-")
        pid = int(words[2])
        known = found.get(name, LiveServer(name, None, None))
        if words[0] == "server":
            port = int(words[3]) if len(words) > 3 and words[3].isdigit() else None
            found[name] = replace(known, pid=pid, port=port)
        else:
            found[name] = replace(known, loop=pid)
    return tuple(found.values())


def undeclared(host: Host, live: tuple[LiveServer, ...]) -> tuple[LiveServer, ...]:
    """The live servers of `host`'s install that it does not declare. `host` is the machine as the
    inventory has it (with its `rpc_servers`), not one server's view. Pure."""
    declared = {server.server for server in servers_of(host)}
    return tuple(s for s in live if s.server not in declared)


def server_view(host: Host, live: LiveServer) -> Host:
    """An undeclared server as a host of its own, as `servers_of` makes a declared one: its files, its
    port (for the busy check), named `HOST/NAME` (the machine's name for the unnamed one)."""
    name = f"{host.name}{SERVER_SEPARATOR}{live.server}" if live.server else host.name
    return replace(
        host,
        name=name,
        server=live.server,
        rpc_servers=(),
        rpc_port=live.port if live.port is not None else host.rpc_port,
    )


async def undeclared_step(ctx: HostContext) -> StepOutcome[tuple[LiveServer, ...]]:
    """Read-only, on a machine: its install's servers the inventory does not declare."""
    conn = await ctx.connection()
    values = await gather(conn, [LiveServersFact(ctx.host.install_dir)], timeout=30)
    found = undeclared(ctx.host, values[LiveServersFact.name])
    return StepOutcome(found, message=", ".join(server_view(ctx.host, s).name for s in found))


def describe(host: Host, live: LiveServer) -> str:
    """One line for a warning: what runs, and the command that stops it."""
    pid = f"pid {live.pid}" if live.pid is not None else f"supervisor loop {live.loop}, restarting"
    port = f", port {live.port}" if live.port is not None else ""
    return (
        f"{server_view(host, live).name} runs ({pid}{port}) but the inventory does not declare it "
        f"(rpc_servers): `rpcfleet stop --undeclared -l {host.name}` stops it"
    )
