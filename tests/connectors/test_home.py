"""The autouse `empty_ssh_home` (tests/plugins/home.py): what every test sees of `~/.ssh`."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.ssh import SSHConnection
from orchestrator.connectors.tunnel import ssh_options
from orchestrator.core.paths import rpcfleet_home
from orchestrator.inventory.model import Host
from tests.plugins.home import REAL_HOME, RPCFLEET_HOME


def test_home_is_fresh_with_an_empty_ssh_folder_and_no_agent(empty_ssh_home: Path) -> None:
    assert Path.home() == empty_ssh_home != REAL_HOME
    assert list((Path.home() / ".ssh").iterdir()) == []
    assert (Path.home() / ".ssh").stat().st_mode & 0o777 == 0o700
    assert "SSH_AUTH_SOCK" not in os.environ


def test_the_caches_are_still_found() -> None:
    assert rpcfleet_home() == Path(RPCFLEET_HOME)


def test_the_connector_reads_the_ssh_config_of_this_home() -> None:
    """The connector's `~/.ssh/config` is the empty folder's: none, until a test writes one."""
    host = Host(name="n1", address="127.0.0.1")
    assert SSHConnection._client_options(host, ConnectOptions(), 1.0)["config"] is None
    config = Path.home() / ".ssh" / "config"
    config.write_text("Host *\n  User nobody\n")
    assert SSHConnection._client_options(host, ConnectOptions(), 1.0)["config"] == [str(config)]


def test_the_openssh_forwarder_reads_the_ssh_config_of_this_home_too() -> None:
    """ssh reads the passwd entry's home, not HOME: the forwarder names HOME's config (`-F`), or none."""
    host = Host(name="n1", address="127.0.0.1")
    argv = ssh_options(host, 1.0)
    assert argv[argv.index("-F") + 1] == "/dev/null"
    config = Path.home() / ".ssh" / "config"
    config.write_text("Host *\n  User nobody\n")
    argv = ssh_options(host, 1.0)
    assert argv[argv.index("-F") + 1] == str(config)
