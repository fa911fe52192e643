"""Tier 0: what the inventory refuses before a firewall or a unit is written (IPv6 sources, control
characters), the rules script's order (the new set before the old one goes), and `status`'s verdict on a
port no REJECT closes. The real iptables runs in tests/operations/test_firewall_lab.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.core.errors import InventoryError, ServiceError
from orchestrator.facts.server import FirewallRules
from orchestrator.inventory.load import load_inventory_text
from orchestrator.operations.firewall import firewall_script, rules_script
from orchestrator.operations.server.state import FIREWALL_OPEN, firewall_state
from orchestrator.operations.systemd import render_unit

INVENTORY = "hosts:\n  b: {address: 10.0.0.6, rpc_allow_from: [controller, 10.0.0.0/24]}\n"


@pytest.mark.parametrize("source", ["fd00::/64", "fd00::1", "::ffff:10.0.0.1"])
def test_an_ipv6_source_is_refused_naming_the_file_and_line(source: str) -> None:
    text = f"hosts:\n  x:\n    address: 10.0.0.5\n    rpc_allow_from: [10.0.0.0/24, '{source}']\n"
    with pytest.raises(InventoryError) as info:
        load_inventory_text(text, Path("inv.yml"))
    message = str(info.value)
    assert message.startswith(f"inv.yml:4:21: rpc_allow_from: '{source}' is IPv6"), message
    assert "IPv4 address only" in message


@pytest.mark.parametrize(
    ("line", "column", "what"),
    [
        ('install_dir: "/opt/r\\nExecStartPre=/bin/sh -c id"', 18, "U+000A"),
        ('install_dir: "/opt/r\\rx"', 18, "U+000D"),
        ('install_dir: "/opt/r\\u2028x"', 18, "U+2028"),
        ('rpc_env: {A: "1\\nExecStartPre=/bin/id"}', 14, "U+000A"),
        ('rpc_env: {A: "1\\tx"}', 14, "U+0009"),
    ],
)
def test_a_control_character_in_a_value_a_unit_holds_is_refused_naming_the_file_and_line(
    line: str, column: int, what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "inv.yml"
    path.write_text(f"hosts:\n  x:\n    address: 10.0.0.5\n    {line}\n")
    with pytest.raises(InventoryError) as info:
        load_inventory_text(path.read_text(), path)
    assert str(info.value).startswith(f"{path}:4:"), str(info.value)
    assert f"control character ({what})" in str(info.value)
    capsys.readouterr()
    assert main(["-i", str(path), "inventory", "list"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4:" in err and f"control character ({what})" in err, err
    assert "Traceback" not in err


def test_an_install_dir_longer_than_the_rules_comment_holds_is_refused_naming_the_file_and_line(
    tmp_path: Path,
) -> None:
    """The rules carry `rpcfleet <install_dir> <port>` in a comment, which iptables keeps to 255 bytes."""
    path = tmp_path / "inv.yml"
    fits = "/opt/" + "r" * 235
    path.write_text(f"hosts:\n  x:\n    address: 10.0.0.5\n    install_dir: {fits}\n")
    assert load_inventory_text(path.read_text(), path).host("x").install_dir == fits
    path.write_text(f"hosts:\n  x:\n    address: 10.0.0.5\n    install_dir: {fits}r\n")
    with pytest.raises(InventoryError) as info:
        load_inventory_text(path.read_text(), path)
    assert str(info.value).startswith(f"{path}:4:") and "a path of 241 bytes: at most 240" in str(info.value)


def test_a_unit_is_never_written_with_a_control_character() -> None:
    """Past the inventory (an install dir as the node expanded it, an artifact's name): the unit refuses."""
    host = load_inventory_text(INVENTORY, Path("inv.yml")).host("b")
    argv = ["/opt/r/versions/v/bin/rpc-server", "-p", "50052"]
    with pytest.raises(ServiceError, match=r"install_dir holds a control character \(U\+000A\)") as info:
        render_unit(host, "/opt/r\nExecStartPre=/bin/id", argv, {}, user=False)
    assert info.value.host == "b"
    with pytest.raises(ServiceError, match=r"argument 1\) holds a control character"):
        render_unit(host, "/opt/r", ["/opt/r/versions/v\n/bin/rpc-server"], {}, user=False)
    with pytest.raises(ServiceError, match="rpc_env's A holds"):
        render_unit(host, "/opt/r", argv, {"A": "1\x00"}, user=False)
    assert "ExecStartPre" not in render_unit(host, "/opt/r", argv, {"A": "1"}, user=False)


def test_the_new_rules_go_in_before_the_old_ones_go_and_every_failure_closes_the_port() -> None:
    host = load_inventory_text(INVENTORY, Path("inv.yml")).host("b")
    lines = rules_script(host, "/opt/r").splitlines()
    inserts = [i for i, line in enumerate(lines) if "-I INPUT" in line and "fail_closed; exit 1" in line]
    deletes = [i for i, line in enumerate(lines) if '-D INPUT "$N" || { fail_closed; exit 1; }' in line]
    assert [lines[i].split("-I INPUT ")[1].split()[0] for i in inserts] == ["1", "2", "3", "4"]
    assert len(deletes) == 1 and max(inserts) < deletes[0]  # the old set goes only after the new one is in
    assert 'sed -n "5p"' in lines[deletes[0]]  # ours after the new set's 4
    script = firewall_script(host, "/opt/r", install=True)
    # the controller over IPv6 and an install dir others may write close the port before anything runs
    assert script.index('*:*) fail_closed; echo "@ipv6controller $CTL"') < script.index("exec sh")
    assert script.index('fail_closed; echo "@unsafe $W $BAD"') < script.index('> "$F.tmp"')


@pytest.mark.parametrize(
    ("rules", "said"),
    [(FirewallRules(0, 0), "missing"), (FirewallRules(3, 0), "open"), (FirewallRules(2, 1), "partial")],
)
def test_a_port_no_reject_closes_is_exposed(rules: FirewallRules, said: str) -> None:
    host = load_inventory_text(INVENTORY, Path("inv.yml")).host("b")  # 2 sources: 4 rules
    assert firewall_state(host, rules) == said
    assert (said in FIREWALL_OPEN) == (rules.rejects == 0)
    unfirewalled = dataclasses.replace(host, rpc_allow_from=None)
    assert firewall_state(unfirewalled, rules) is None
