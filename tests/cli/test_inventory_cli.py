"""`rpcfleet inventory list|graph|show` through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import _output, main
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import host_to_dict

DATA = Path(__file__).parents[1] / "data" / "inventory"
FLEET = str(DATA / "fleet_ansible.yml")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    # tables are laid out for an 80-column pipe otherwise; the tests read whole cells
    monkeypatch.setattr(_output.console, "_width", 200)
    monkeypatch.setattr(_output.err_console, "_width", 300)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, " ".join(err.split())  # messages may be wrapped to the terminal


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "inventory", "list", "-i", FLEET)
    assert status == 0 and err == ""
    rows = [line.split() for line in out.splitlines() if line.strip() and not line.strip().startswith("─")]
    assert rows[0] == ["host", "address", "connection", "endpoint", "backend", "groups"]
    assert rows[1] == ["bastion", "192.0.2.10", "local", "192.0.2.10:50052", "cpu", "ungrouped"]
    # two GPUs in rpc_devices: a server of each, on rpc_port and the next
    assert rows[2] == [
        "a100-01", "a100-01", "ssh", "a100-01:50060", "(a100-01/cuda0:", "CUDA0),", "a100-01:50061",
        "(a100-01/cuda1:", "CUDA1)", "cuda", "gpu,", "rack_east,", "gpu_a100",
    ]  # fmt: skip
    assert [row[0] for row in rows[1:]] == [
        "bastion", "a100-01", "a100-02", "a100-03", "mia", "mib", "epyc01", "epyc02"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("limit", "names"),
    [
        ("gpu:&rack_east", ["a100-01"]),
        ("cpu,bastion", ["bastion", "epyc01", "epyc02"]),
        ("mi*", ["mia", "mib"]),
    ],
)
def test_list_json_with_limit(capsys: pytest.CaptureFixture[str], limit: str, names: list[str]) -> None:
    status, out, _ = run(capsys, "inventory", "list", "-i", FLEET, "--limit", limit, "--json")
    assert status == 0
    data = json.loads(out)
    assert [item["name"] for item in data] == names
    inventory = load_inventory(Path(FLEET))
    assert data == [json.loads(json.dumps(host_to_dict(inventory.host(name)))) for name in names]


def test_list_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "inventory", "list", "-i", FLEET, "-l", "a100-01", "--json")
    (item,) = json.loads(out)
    assert item["endpoint"] == "a100-01:50060"
    assert item["rpc_devices"] == ["CUDA0", "CUDA1"]
    assert item["memory_reserve"] == 2 << 30
    assert item["groups"] == ["gpu", "rack_east", "gpu_a100"]
    assert item["extra_vars"] == {"ansible_python_interpreter": "/usr/bin/python3", "datacenter": "east"}


GRAPH = """\
@all:
  |--@cpu:
  |  |--epyc01
  |  |--epyc02
  |--@gpu:
  |  |--@gpu_a100:
  |  |  |--a100-01
  |  |  |  |--a100-01:50060 (a100-01/cuda0: CUDA0)
  |  |  |  |--a100-01:50061 (a100-01/cuda1: CUDA1)
  |  |  |--a100-02
  |  |  |  |--a100-02:50052 (a100-02/cuda0: CUDA0)
  |  |  |  |--a100-02:50053 (a100-02/cuda1: CUDA1)
  |  |  |--a100-03
  |  |  |  |--a100-03:50052 (a100-03/cuda0: CUDA0)
  |  |  |  |--a100-03:50053 (a100-03/cuda1: CUDA1)
  |  |--@gpu_rocm:
  |  |  |--mia
  |  |  |--mib
  |--@rack_east:
  |  |--a100-01
  |  |  |--a100-01:50060 (a100-01/cuda0: CUDA0)
  |  |  |--a100-01:50061 (a100-01/cuda1: CUDA1)
  |  |--epyc01
  |--@ungrouped:
  |  |--bastion
"""


@pytest.mark.parametrize("name", ["fleet_ansible.yml", "fleet_ansible.ini", "fleet_native.yml"])
def test_graph(capsys: pytest.CaptureFixture[str], name: str) -> None:
    status, out, _ = run(capsys, "inventory", "graph", "-i", str(DATA / name))
    assert status == 0
    assert out == GRAPH


def test_graph_of_one_group_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "inventory", "graph", "-i", FLEET, "gpu")
    assert status == 0
    assert out == (
        "@gpu:\n"
        "  |--@gpu_a100:\n"
        "  |  |--a100-01\n"
        "  |  |  |--a100-01:50060 (a100-01/cuda0: CUDA0)\n"
        "  |  |  |--a100-01:50061 (a100-01/cuda1: CUDA1)\n"
        "  |  |--a100-02\n"
        "  |  |  |--a100-02:50052 (a100-02/cuda0: CUDA0)\n"
        "  |  |  |--a100-02:50053 (a100-02/cuda1: CUDA1)\n"
        "  |  |--a100-03\n"
        "  |  |  |--a100-03:50052 (a100-03/cuda0: CUDA0)\n"
        "  |  |  |--a100-03:50053 (a100-03/cuda1: CUDA1)\n"
        "  |--@gpu_rocm:\n"
        "  |  |--mia\n"
        "  |  |--mib\n"
    )
    status, out, _ = run(capsys, "inventory", "graph", "-i", FLEET, "gpu", "--json")
    assert json.loads(out) == {
        "name": "gpu",
        "hosts": [],
        "children": [
            {
                "name": "gpu_a100",
                "hosts": ["a100-01", "a100-02", "a100-03"],
                "children": [],
                "servers": {
                    f"a100-0{n}": [
                        f"a100-0{n}:{p} (a100-0{n}/cuda0: CUDA0)",
                        f"a100-0{n}:{p + 1} (a100-0{n}/cuda1: CUDA1)",
                    ]
                    for n, p in ((1, 50060), (2, 50052), (3, 50052))
                },
            },
            {"name": "gpu_rocm", "hosts": ["mia", "mib"], "children": []},
        ],
    }


def test_graph_unknown_group(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "inventory", "graph", "-i", FLEET, "gpus")
    assert status == 2
    assert "no group 'gpus' in the inventory" in err


def test_show(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "inventory", "show", "-i", FLEET, "a100-01")
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == (
        f"a100-01 ({FLEET}:24:13)  groups: gpu, rack_east, gpu_a100  endpoints: "
        "a100-01:50060 (a100-01/cuda0: CUDA0), a100-01:50061 (a100-01/cuda1: CUDA1)"
    )
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:] if line.strip()}
    assert rows["rpc_port"] == ["50060", "group", "rack_east"]
    assert rows["memory_reserve"] == ["2.00", "GiB", "(2147483648", "B)", "group", "gpu_a100"]
    assert rows["rpc_backend"] == ["cuda", "group", "gpu"]
    assert rows["rpc_servers"][-7:] == ["default", "(one", "server", "per", "GPU", "of", "rpc_devices)"]
    assert rows["ssh_user"] == ["deploy", "all"]
    assert rows["rpc_host"] == ["a100-01", "default", "(address)"]
    assert rows["keep_versions"] == ["3", "default"]
    assert rows["datacenter"] == ["east", "group", "rack_east"]


def test_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "inventory", "show", "-i", FLEET, "--json", "epyc02")
    assert status == 0
    data = json.loads(out)
    assert (data["name"], data["rpc_port"], data["rpc_threads"], data["memory_limit"]) == (
        "epyc02",
        50053,
        32,
        96 << 30,
    )
    assert data["sources"]["rpc_port"] == "host"
    assert data["sources"]["rpc_threads"] == "group cpu"
    assert data["location"] == f"{FLEET}:39:9"


def test_show_unknown_host(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "inventory", "show", "-i", FLEET, "epyc1")
    assert (status, out) == (2, "")
    assert "no host 'epyc1' in the inventory (did you mean 'epyc01'?)" in err


def test_warnings_go_to_stderr(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "inv.yml"
    path.write_text("hosts:\n  a: {rpc_prot: 6000}\n")
    status, out, err = run(capsys, "inventory", "list", "-i", str(path), "--json")
    assert status == 0
    assert [item["rpc_port"] for item in json.loads(out)] == [50052]
    assert f"{path}:2:17: unknown variable 'rpc_prot' is kept as is (did you mean 'rpc_port'?)" in err


def test_invalid_inventory_exits_2_with_location(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("[gpu]\ng1 rpc_port=abc\n")
    status, out, err = run(capsys, "inventory", "list", "-i", str(path))
    assert (status, out) == (2, "")
    assert f"{path}:2:13: rpc_port: expected an integer, got 'abc'" in err
    assert f"{path}:2:13: rpc_port: expected an integer, got 'abc' g1 rpc_port=abc" in err
    assert "Traceback" not in err


def test_limit_matching_nothing_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "inventory", "list", "-i", FLEET, "-l", "gpu,tpu")
    assert (status, out) == (2, "")
    assert "host pattern 'tpu' matches no host or group" in err


# --- secrets are never printed in clear -----------------------------------------------------------------

_SECRETS_INI = """\
[nodes]
n1 ansible_host=10.0.0.5 ansible_password=hunter2 ansible_become_pass=s3cr3t-become ansible_ssh_pass=p4ss
n1b ansible_host=10.0.0.6 ansible_ssh_private_key_file=/keys/id_ed25519

[nodes:vars]
vault_token=tok-123456
api_key=k-abcdef
ssh_public_key=ssh-ed25519-AAAAC3public
host_key_file=/etc/ssh/ssh_host_ed25519_key.pub
datacenter=east
"""
_SECRET_VALUES = ("hunter2", "s3cr3t-become", "p4ss", "tok-123456", "k-abcdef")


def test_list_json_and_show_mask_secrets(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text(_SECRETS_INI)
    status, out, _ = run(capsys, "inventory", "list", "-i", str(path), "--json")
    assert status == 0
    assert not [value for value in _SECRET_VALUES if value in out], out
    extra = json.loads(out)[0]["extra_vars"]
    masked = ("ansible_password", "ansible_become_pass", "ansible_ssh_pass", "vault_token", "api_key")
    assert {key: extra[key] for key in masked} == dict.fromkeys(masked, "********")
    # Paths to keys, public keys and ordinary variables are shown as they are.
    assert extra["ssh_public_key"] == "ssh-ed25519-AAAAC3public"
    assert extra["host_key_file"] == "/etc/ssh/ssh_host_ed25519_key.pub"
    assert extra["datacenter"] == "east"
    b = json.loads(out)[1]
    assert b["ssh_key"] == "/keys/id_ed25519"
    for argv in (["show", "n1"], ["show", "n1", "--json"]):
        status, out, _ = run(capsys, "inventory", *argv, "-i", str(path))
        assert status == 0
        assert not [value for value in _SECRET_VALUES if value in out], out
        assert "********" in out and "ssh-ed25519-AAAAC3public" in out and "east" in out


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("ansible_password", True),
        ("ansible_become_password", True),
        ("ansible_become_pass", True),
        ("ansible_ssh_pass", True),
        ("vault_token", True),
        ("apiKey", True),
        ("db-secret", True),
        ("ssh_private_key", True),
        ("ansible_ssh_private_key_file", False),  # a path to the key, not the key
        ("host_key_file", False),
        ("ssh_public_key", False),
        ("ssh_host_key_checking", False),
        ("ssh_key", False),  # rpcfleet's own: a file's path
        ("monkey", False),  # words, not substrings
        ("passenger", False),
        ("datacenter", False),
    ],
)
def test_which_variables_are_secrets(name: str, secret: bool) -> None:
    from orchestrator.inventory.variables import is_secret

    assert is_secret(name) is secret
