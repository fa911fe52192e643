"""Tier 0: `rpc_transport` and `rpc_allow_from` as the inventory reads them, the bind policy, the
OpenSSH forwarder's command line, and the endpoint renaming between a plan and its forwards."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from orchestrator.connectors.tunnel import Tunnels, openssh_argv
from orchestrator.core.errors import InventoryError, ServiceError
from orchestrator.core.target import Target
from orchestrator.facts.server import FirewallRules
from orchestrator.inventory.load import load_inventory_text
from orchestrator.operations.firewall import CANNOT, firewall_script, rules_path, rules_script
from orchestrator.operations.server.process import server_argv
from orchestrator.operations.server.state import bind_policy, firewall_state
from orchestrator.operations.systemd import render_unit

INVENTORY = """\
vars:
  rpc_transport: ssh
hosts:
  a: {address: 10.0.0.5}
  b: {address: 10.0.0.6, rpc_transport: tcp, rpc_allow_from: [controller, 10.0.0.0/24, 192.168.1.7]}
  c: {address: 10.0.0.7, rpc_host: 10.0.0.7}
"""


def test_ssh_transport_binds_loopback_and_keeps_the_real_endpoint() -> None:
    hosts = {h.name: h for h in load_inventory_text(INVENTORY, Path("inv.yml")).hosts}
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    assert a.rpc_transport == "ssh" and a.rpc_host == "127.0.0.1" and a.tunneled
    assert a.endpoint == "10.0.0.5:50052"  # what plans and reports name
    assert not a.binds_own_loopback  # probed through its forward, not refused
    assert server_argv(a, "/i", "v")[1:3] == ["-H", "127.0.0.1"]
    assert a.var_sources["rpc_host"] == "default (rpc_transport: ssh)"
    assert b.rpc_transport == "tcp" and not b.tunneled and b.endpoint == "10.0.0.6:50052"
    assert b.rpc_allow_from == ("controller", "10.0.0.0/24", "192.168.1.7/32")
    assert a.rpc_allow_from is None
    assert bind_policy(a) is None
    with pytest.raises(ServiceError, match=r"rpc_transport: ssh with rpc_host 10\.0\.0\.7") as info:
        bind_policy(c)  # deploy refuses the contradiction before changing anything
    assert "remove rpc_host" in (info.value.hint or "")
    public = dataclasses.replace(c, rpc_host="8.8.8.8", allow_public_bind=True)
    with pytest.raises(ServiceError, match="rpc_transport: ssh"):
        bind_policy(public)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("rpc_transport: udp", "inv.yml:4:20: rpc_transport: expected one of tcp, ssh, got 'udp'"),
        (
            "rpc_allow_from: [10.0.0.300]",
            "inv.yml:4:21: rpc_allow_from: '10.0.0.300' is not an address or a network such as 10.0.0.0/24",
        ),
    ],
)
def test_bad_values_name_the_file_and_line(line: str, message: str) -> None:
    with pytest.raises(InventoryError) as info:
        load_inventory_text(f"hosts:\n  x:\n    address: 10.0.0.5\n    {line}\n", Path("inv.yml"))
    assert str(info.value).startswith(message), str(info.value)


def test_the_openssh_forward_verifies_host_keys_and_keeps_alive(tmp_path: Path) -> None:
    host = load_inventory_text(INVENTORY, Path("inv.yml")).host("a")
    host = dataclasses.replace(host, ssh_user="lab", ssh_key="/k", ssh_known_hosts=str(tmp_path / "kh"))
    argv = openssh_argv(host, tmp_path / "ctl", 40000, 10.0)
    joined = " ".join(argv)
    assert "StrictHostKeyChecking=yes" in joined and f"UserKnownHostsFile={tmp_path / 'kh'}" in joined
    assert "ServerAliveInterval=5" in joined and "ExitOnForwardFailure=yes" in joined
    assert "-L 127.0.0.1:40000:127.0.0.1:50052" in joined and "-tt" in argv
    unchecked = openssh_argv(dataclasses.replace(host, ssh_host_key_checking=False), tmp_path, 1, 1)
    assert "StrictHostKeyChecking=no" in " ".join(unchecked)


def test_a_tcp_host_is_dialed_at_its_own_endpoint_without_a_forward() -> None:
    host = load_inventory_text(INVENTORY, Path("inv.yml")).host("b")
    with Tunnels() as tunnels:
        assert tunnels.target(host) == Target(host.endpoint, host.endpoint)
        assert tunnels.targets([host]) == {host.endpoint: Target.direct(host.endpoint)}
        assert str(tunnels.target(host)) == host.endpoint  # nothing to say about a forward
    with pytest.raises(ValueError, match="forwarder"):
        Tunnels("socat")  # type: ignore[arg-type]


def test_firewall_script_tags_its_rules_and_resolves_the_controller() -> None:
    host = load_inventory_text(INVENTORY, Path("inv.yml")).host("b")
    script = firewall_script(host, "/home/u/rpcfleet", install=True)
    assert "CTL=${SSH_CONNECTION:-}; CTL=${CTL%% *}" in script and "@nocontroller" in script
    assert "F=/home/u/rpcfleet/firewall.sh" in script and 'exec sh "$F"' in script
    rules = rules_script(host, "/home/u/rpcfleet")
    assert "TAG='rpcfleet /home/u/rpcfleet 50052'" in rules
    lines = [line for line in rules.splitlines() if "-I INPUT" in line and "fail_closed; exit 1" in line]
    assert "--ctstate ESTABLISHED,RELATED -j ACCEPT" in lines[0]  # a live client is never reset
    assert '-s "$CTL" --dport 50052 -j ACCEPT' in lines[1]
    assert "-s 10.0.0.0/24 --dport 50052 -j ACCEPT" in lines[2]
    assert "--dport 50052 -j REJECT --reject-with tcp-reset" in lines[-1]
    assert "@noright" in rules and f"@notool; exit {CANNOT}" in rules  # the unit's start fails then
    removal = firewall_script(host, "/home/u/rpcfleet", install=False)
    assert "ACCEPT" not in removal and "-D INPUT" in removal


def test_a_system_unit_installs_the_rules_before_every_start() -> None:
    host = load_inventory_text(INVENTORY, Path("inv.yml")).host("b")
    argv = ["/opt/r/versions/v/bin/rpc-server", "-p", "50052"]
    text = render_unit(host, "/opt/r", argv, {}, user=False, firewall=rules_path(host, "/opt/r"))
    assert "ExecStartPre=+/bin/sh /opt/r/firewall.sh\n" in text
    assert "ExecStartPre" not in render_unit(host, "/opt/r", argv, {}, user=False)


@pytest.mark.parametrize(
    ("rules", "said"),
    [
        (None, "unknown"),
        (FirewallRules(0, 0), "missing"),
        (FirewallRules(2, 1), "partial"),
        (FirewallRules(5, 1), "ok"),
        (FirewallRules(6, 1), "partial"),
        (FirewallRules(4, 0), "open"),  # the accepts without their REJECT: open to everyone
        (FirewallRules(6, 2), "partial"),
    ],
)
def test_status_counts_the_rules_the_inventory_asks_for(rules: FirewallRules | None, said: str) -> None:
    host = load_inventory_text(INVENTORY, Path("inv.yml")).host("b")  # 3 sources: 5 rules
    assert firewall_state(host, rules) == said
    assert firewall_state(load_inventory_text(INVENTORY, Path("inv.yml")).host("a"), rules) is None
