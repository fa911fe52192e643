"""The server's launch line, from the inventory (pure): the process supervisor's command and the systemd
unit's ExecStart are the same line."""

from __future__ import annotations

from orchestrator.facts.server import Launch
from orchestrator.facts.systemd import SERVICE_USER, SystemdInfo
from orchestrator.inventory.model import Host
from orchestrator.operations.server.state import CACHE_DIR, SERVER_BINARY


def server_argv(host: Host, install_dir: str, version: str) -> list[str]:
    """The server's command line, from the inventory."""
    argv = [
        f"{install_dir}/versions/{version}/bin/{SERVER_BINARY}",
        "-H",
        host.rpc_host or host.address,
        "-p",
        str(int(host.rpc_port)),
    ]
    if host.rpc_devices:
        argv += ["-d", ",".join(host.rpc_devices)]
    if host.rpc_threads is not None:
        argv += ["-t", str(int(host.rpc_threads))]
    if host.rpc_cache:
        argv.append("-c")
    return argv


def launch_env(host: Host, install_dir: str) -> dict[str, str]:
    """The environment the launch line sets: the inventory's `rpc_env`, the cache folder, the debug log
    when asked."""
    env = {**dict(host.rpc_env), "LLAMA_CACHE": f"{install_dir}/{CACHE_DIR}"}
    if host.rpc_debug:
        env["GGML_RPC_DEBUG"] = "1"
    return env


def run_as_user(host: Host, info: SystemdInfo | None) -> str | None:
    """The user the process supervisor runs the server as (None: unknown, the login user's).

    `rpc_run_as` when the inventory says; else, as root (over SSH or `connection: local` under a
    controller that runs as root), the dedicated unprivileged user, as the systemd supervisor's system
    units: the RPC protocol has no authentication. Otherwise the login user, already unprivileged."""
    if host.rpc_run_as:
        return host.rpc_run_as
    if info is not None and info.root:
        return SERVICE_USER
    return info.login if info is not None else None


def desired_launch(host: Host, install_dir: str, version: str, user: str | None = None) -> Launch:
    """What the inventory says the running server's command line, environment and user should be."""
    return Launch(
        tuple(server_argv(host, install_dir, version)),
        tuple(sorted(launch_env(host, install_dir).items())),
        user,
    )


_VALUED_FLAGS = ("-H", "-p", "-d", "-t")


def _flags(argv: tuple[str, ...]) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    args = list(argv[1:])
    while args:
        arg = args.pop(0)
        found[arg] = args.pop(0) if arg in _VALUED_FLAGS and args else None
    return found


def launch_diff(desired: Launch, actual: Launch) -> tuple[str, ...]:
    """Pure: how the running server's launch differs from the inventory's, as short phrases
    ("-c added", "-t 4 -> 2", "GGML_RPC_DEBUG=1 removed"). The binary (the version) is compared elsewhere."""
    changes: list[str] = []
    want, have = _flags(desired.argv), _flags(actual.argv)
    for flag in [*want, *(f for f in have if f not in want)]:
        if flag not in have:
            changes.append(f"{flag} {want[flag]} added" if want[flag] is not None else f"{flag} added")
        elif flag not in want:
            changes.append(f"{flag} {have[flag]} removed" if have[flag] is not None else f"{flag} removed")
        elif want[flag] != have[flag]:
            changes.append(f"{flag} {have[flag]} -> {want[flag]}")
    want_env, have_env = dict(desired.env), dict(actual.env)
    for key in sorted({*want_env, *have_env}):
        if key not in have_env:
            changes.append(f"{key}={want_env[key]} added")
        elif key not in want_env:
            changes.append(f"{key}={have_env[key]} removed")
        elif want_env[key] != have_env[key]:
            changes.append(f"{key} {have_env[key]} -> {want_env[key]}")
    if desired.user and actual.user and desired.user != actual.user:
        changes.append(f"runs as {actual.user} -> {desired.user}")
    return tuple(changes)
