"""Opening a connection to a host: SSH or local, by the host's `connection`."""

from __future__ import annotations

from orchestrator.connectors.base import Connection, ConnectOptions, local_home
from orchestrator.connectors.local import LocalConnection
from orchestrator.inventory.model import Host


async def connect(host: Host, options: ConnectOptions | None = None) -> Connection:
    """Open a connection to `host`: `SSHConnection` or `LocalConnection` per `host.connection`."""
    options = options or ConnectOptions()
    if host.connection == "local":
        return LocalConnection(host, options, home=local_home(host))
    # asyncssh takes a quarter of a second to import: only a command that opens SSH pays for it.
    from orchestrator.connectors.ssh import SSHConnection

    return await SSHConnection.open(host, options)
