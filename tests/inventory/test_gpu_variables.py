"""The inventory's GPU variables: rpc_backend (and its old name `backend`, and `auto`), rpc_env, and one
server per GPU of rpc_devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.core.errors import InventoryError
from orchestrator.inventory.load import load_inventory_text
from orchestrator.inventory.model import Inventory, servers_of


def load(text: str, name: str = "inv.yml") -> Inventory:
    return load_inventory_text(text, Path(name))


def test_rpc_backend_takes_auto_and_its_old_name() -> None:
    inventory = load("hosts:\n  a: {rpc_backend: auto}\n  b: {backend: vulkan}\n  c:\n")
    assert [h.rpc_backend for h in inventory.hosts] == ["auto", "vulkan", "cpu"]


def test_an_unknown_backend_names_the_file_line_and_the_choices() -> None:
    with pytest.raises(InventoryError) as info:
        load("hosts:\n  a: {rpc_backend: opencl}\n")
    assert "inv.yml:2:20: rpc_backend: expected one of auto, cpu, cuda, rocm, vulkan, metal" in str(
        info.value
    )


def test_several_gpus_get_a_server_each_on_consecutive_ports() -> None:
    host = load(
        "hosts:\n  g: {rpc_backend: cuda, rpc_port: 50060, rpc_devices: [CUDA0, CUDA1, CUDA2]}\n"
    ).host("g")
    servers = servers_of(host)
    assert [(s.name, s.rpc_port, s.rpc_devices) for s in servers] == [
        ("g/cuda0", 50060, ("CUDA0",)),
        ("g/cuda1", 50061, ("CUDA1",)),
        ("g/cuda2", 50062, ("CUDA2",)),
    ]
    assert host.var_sources["rpc_servers"] == "default (one server per GPU of rpc_devices)"


@pytest.mark.parametrize(
    ("variables", "servers"),
    [
        ("rpc_devices: [Vulkan0, CPU]", 1),  # one GPU and the CPU: one server with both devices
        ("rpc_devices: [CUDA0]", 1),
        ("rpc_devices: [CUDA0, CUDA1], rpc_server_per_gpu: false", 1),  # asked for one server
        ("rpc_devices: [CUDA0, CUDA1], rpc_servers: [{port: 7000, devices: [CUDA0, CUDA1]}]", 1),  # its own
    ],
)
def test_one_server_unless_several_gpus_and_no_servers_of_its_own(variables: str, servers: int) -> None:
    host = load(f"hosts:\n  g: {{{variables}}}\n").host("g")
    assert len(servers_of(host)) == servers


def test_rpc_env_is_the_servers_environment_sorted() -> None:
    host = load("hosts:\n  g: {rpc_env: {GGML_VK_VISIBLE_DEVICES: 0, A_FLAG: 'yes'}}\n").host("g")
    assert host.rpc_env == (("A_FLAG", "yes"), ("GGML_VK_VISIBLE_DEVICES", "0"))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[a, b]", "expected a mapping such as {GGML_VK_VISIBLE_DEVICES: '0'}"),
        ("{1X: a}", "'1X' is not an environment variable name"),
        ("{A: [1]}", "A: expected a string or a number"),
    ],
)
def test_bad_rpc_env_is_refused_at_its_line(value: str, message: str) -> None:
    with pytest.raises(InventoryError) as info:
        load(f"hosts:\n  g:\n    rpc_env: {value}\n")
    assert "inv.yml:3" in str(info.value) and message in str(info.value)
