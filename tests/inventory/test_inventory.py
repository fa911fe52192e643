"""Inventory: formats, ranges, precedence, defaults, validation errors (text, location), --limit patterns."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.core.errors import InventoryError
from orchestrator.inventory.load import InventoryErrors, detect_format, load_inventory, load_inventory_text
from orchestrator.inventory.model import Host, HostPatternError, host_to_dict, select_hosts
from orchestrator.inventory.ranges import MAX_RANGE_HOSTS, expand_host_range
from orchestrator.inventory.variables import DEFAULT_INSTALL_DIR, VARIABLES

DATA = Path(__file__).parents[1] / "data" / "inventory"
EXAMPLES = Path(__file__).parents[2] / "inventory"


def load(text: str, name: str = "inv.yml") -> Any:
    return load_inventory_text(text, Path(name))


# ----------------------------------------------------------------------------------------------- formats

FLEET = ["fleet_ansible.yml", "fleet_ansible.ini", "fleet_native.yml"]

# (host, address, connection, endpoint, backend, groups, rpc_devices, memory_reserve, rpc_threads, ssh_port)
FLEET_EXPECTED = [
    ("bastion", "192.0.2.10", "local", "192.0.2.10:50052", "cpu", ("ungrouped",), (), 0, None, 22),
    ("a100-01", "a100-01", "ssh", "a100-01:50060", "cuda", ("gpu", "rack_east", "gpu_a100"),
     ("CUDA0", "CUDA1"), 2 << 30, None, 22),
    ("a100-02", "a100-02", "ssh", "a100-02:50052", "cuda", ("gpu", "gpu_a100"), ("CUDA0", "CUDA1"), 2 << 30,
     None, 22),
    ("a100-03", "a100-03", "ssh", "a100-03:50052", "cuda", ("gpu", "gpu_a100"), ("CUDA0", "CUDA1"), 2 << 30,
     None, 22),
    ("mia", "mia", "ssh", "mia:50052", "rocm", ("gpu", "gpu_rocm"), ("ROCm0",), 1 << 30, None, 2222),
    ("mib", "mib", "ssh", "mib:50052", "rocm", ("gpu", "gpu_rocm"), ("ROCm0",), 1 << 30, None, 2222),
    ("epyc01", "10.1.3.1", "ssh", "10.1.3.1:50060", "cpu", ("cpu", "rack_east"), (), 0, 32, 22),
    ("epyc02", "10.1.3.2", "ssh", "10.1.3.2:50053", "cpu", ("cpu",), (), 0, 32, 22),
]  # fmt: skip


@pytest.mark.parametrize("name", FLEET)
def test_real_world_fleet_resolves_identically_in_every_format(name: str) -> None:
    inventory = load_inventory(DATA / name)
    got = [
        (h.name, h.address, h.connection, h.endpoint, h.rpc_backend, h.groups, h.rpc_devices,
         h.memory_reserve, h.rpc_threads, h.ssh_port)
        for h in inventory.hosts
    ]  # fmt: skip
    assert got == FLEET_EXPECTED
    assert inventory.warnings == ()
    for host in inventory.hosts:
        assert host.ssh_user == "deploy"
        assert host.ssh_key == "~/.ssh/deploy_ed25519"
        assert host.vars["ansible_python_interpreter"] == "/usr/bin/python3"  # unknown vars are kept
    assert inventory.host("epyc01").memory_limit == 96 << 30
    assert inventory.host("epyc01").vars["datacenter"] == "east"
    assert inventory.host("a100-02").rpc_cache is True
    assert inventory.host("bastion").rpc_cache is False
    assert set(inventory.groups) == {"all", "ungrouped", "gpu", "gpu_a100", "gpu_rocm", "cpu", "rack_east"}
    assert sorted(inventory.groups["all"].children) == ["cpu", "gpu", "rack_east", "ungrouped"]
    assert sorted(inventory.groups["gpu"].children) == ["gpu_a100", "gpu_rocm"]
    assert inventory.groups["gpu_a100"].hosts == ("a100-01", "a100-02", "a100-03")


def test_the_three_formats_give_equal_hosts() -> None:
    dumps = [[host_to_dict(h) for h in load_inventory(DATA / name).hosts] for name in FLEET]
    assert dumps[0] == dumps[1] == dumps[2]


@pytest.mark.parametrize("name", ["example.yml", "ansible.yml", "ansible.ini"])
def test_shipped_examples_load_cleanly(name: str) -> None:
    inventory = load_inventory(EXAMPLES / name)
    assert inventory.warnings == ()
    assert len(inventory.hosts) >= 8
    assert {"gpu", "cpu"} <= set(inventory.groups)
    assert any(g.children for name, g in inventory.groups.items() if name != "all")  # groups of groups
    assert {h.rpc_backend for h in inventory.hosts} >= {"cpu", "cuda"}


@pytest.mark.parametrize(
    ("text", "path", "expected"),
    [
        ("[g]\nh\n", None, "ini"),
        ("hosts:\n  a:\n", None, "yaml"),
        ("a\nb\n", None, "ini"),  # bare host names: INI without sections
        ("# c\n\n[g:vars]\nx=1\n", None, "ini"),
        ("hosts: {}\n", Path("hosts.ini"), "ini"),  # the extension wins
        ("[g]\nh\n", Path("x.yaml"), "yaml"),
        ("all:\n  hosts:\n", Path("hosts"), "yaml"),
        ("", None, "yaml"),
    ],
)
def test_detect_format(text: str, path: Path | None, expected: str) -> None:
    assert detect_format(text, path) == expected


@pytest.mark.parametrize(
    "text",
    [
        "all:\n  hosts:\n    a:\n    b:\n",
        "ungrouped:\n  hosts:\n    a:\n    b:\n",  # Ansible YAML without `all:`
        "web:\n  hosts: {a: , b: }\n",
        "hosts:\n  a:\n  b:\n",  # native
        "a\nb\n",  # INI, no section
        "[web]\na\nb\n",
    ],
)
def test_minimal_inventories(text: str) -> None:
    inventory = load_inventory_text(text, None)
    assert inventory.host_names() == ("a", "b")
    assert [h.address for h in inventory.hosts] == ["a", "b"]


def test_ansible_yaml_hosts_may_be_a_list_and_groups_repeat_in_several_places() -> None:
    inventory = load(
        "all:\n  children:\n    web:\n      hosts: [w1, w2]\n    dc1:\n      children:\n        web:\n"
        "          vars: {rpc_port: 6000}\n"
    )
    assert inventory.host_names() == ("w1", "w2")
    assert inventory.groups["web"].hosts == ("w1", "w2")
    assert inventory.host("w1").groups == ("dc1", "web")
    assert inventory.host("w1").rpc_port == 6000


def test_a_host_listed_in_several_places_is_one_host_with_merged_vars() -> None:
    inventory = load("[a]\nh1 rpc_port=6000\n[b]\nh1 backend=cuda\nh2\n", "inv.ini")
    assert inventory.host_names() == ("h1", "h2")
    h1 = inventory.host("h1")
    assert (h1.rpc_port, h1.rpc_backend, h1.groups) == (6000, "cuda", ("a", "b"))


def test_yaml_anchors_and_merge_keys() -> None:
    inventory = load(
        "vars: {}\nhosts:\n  a: &gpu {backend: cuda, rpc_devices: CUDA0}\n"
        "  b:\n    <<: *gpu\n    rpc_port: 6000\n"
    )
    assert inventory.host("b").rpc_backend == "cuda"
    assert inventory.host("b").rpc_port == 6000


def test_empty_inventory_warns() -> None:
    inventory = load("# nothing yet\n")
    assert inventory.hosts == ()
    assert inventory.warnings == ("inv.yml: the inventory is empty",)


def test_ini_values_comments_and_ports() -> None:
    inventory = load(
        "; comment\n# comment\n[g]\n"
        "h1:2201 rpc_cache=True rpc_threads='8' install_dir=\"/opt/rpc fleet\"  # trailing comment\n"
        "[g:vars]\nrpc_debug = yes   # inline comment\nnote = 'a # not a comment'\nmemory_limit=8GiB\n",
        "inv.ini",
    )
    h1 = inventory.host("h1")
    assert (h1.ssh_port, h1.rpc_cache, h1.rpc_threads, h1.install_dir) == (2201, True, 8, "/opt/rpc fleet")
    assert (h1.rpc_debug, h1.memory_limit) == (True, 8 << 30)
    assert h1.vars["note"] == "a # not a comment"


# ------------------------------------------------------------------------------------------------ ranges

RANGES = [
    ("node[01:04]", ["node01", "node02", "node03", "node04"]),
    ("node[1:3]", ["node1", "node2", "node3"]),
    ("node[8:11]", ["node8", "node9", "node10", "node11"]),
    ("n[0:6:3]", ["n0", "n3", "n6"]),
    ("n[a:c]", ["na", "nb", "nc"]),
    ("r[1:2]-u[a:b]", ["r1-ua", "r1-ub", "r2-ua", "r2-ub"]),
    ("[1:2].example.com", ["1.example.com", "2.example.com"]),
    ("n[:2]", ["n0", "n1", "n2"]),
    ("plain", ["plain"]),
]


@pytest.mark.parametrize(("pattern", "expected"), RANGES)
def test_expand_host_range(pattern: str, expected: list[str]) -> None:
    assert expand_host_range(pattern) == expected


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("n[3:1]", "host range in 'n[3:1]' ends before it starts"),
        ("n[01:100]", "zero-padded host range in 'n[01:100]' needs start and end of equal length"),
        ("n[a:3]", "invalid host range [a:3] in 'n[a:3]'"),
        ("n[1:]", "host range in 'n[1:]' has no end"),
        ("n[1:4:0]", "host range step in 'n[1:4:0]' must be >= 1"),
        ("n[1:4:x]", "host range step 'x' in 'n[1:4:x]' is not an integer"),
        ("n[1]", "invalid host range in 'n[1]' (expected [start:end] or [start:end:step])"),
    ],
)
def test_bad_host_ranges(pattern: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        expand_host_range(pattern)
    assert str(info.value) == message


def test_huge_host_ranges_are_refused_before_expanding() -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"names 100000000 hosts \(at most 10000\)"):
        expand_host_range("node[0:99999999]")
    with pytest.raises(ValueError, match="names 100000 hosts"):
        expand_host_range("r[0:99]n[0:999]")  # several ranges multiply
    assert time.monotonic() - started < 5.0  # counted, never built (that takes minutes); headroom for load
    assert len(expand_host_range("n[1:10000]")) == MAX_RANGE_HOSTS  # the limit itself is fine
    with pytest.raises(InventoryError) as info:
        load("hosts:\n  ok: {}\n  node[0:99999999]:\n")
    assert str(info.value).startswith("inv.yml:3:3: host range 'node[0:99999999]' names 100000000 hosts")


@given(
    prefix=st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
    start=st.integers(0, 300),
    count=st.integers(1, 40),
    step=st.integers(1, 5),
    width=st.integers(1, 4),
)
def test_numeric_ranges_property(prefix: str, start: int, count: int, step: int, width: int) -> None:
    end = start + count - 1
    width = max(width, len(str(end)))
    begin_text = str(start).zfill(width)
    pattern = f"{prefix}[{begin_text}:{str(end).zfill(width)}:{step}]"
    names = expand_host_range(pattern)
    numbers = list(range(start, end + 1, step))
    assert len(names) == len(numbers) == len(set(names))
    padded = len(begin_text) > 1 and begin_text.startswith("0")
    assert names == [prefix + (str(n).zfill(width) if padded else str(n)) for n in numbers]
    if padded:
        assert sorted(names) == names  # zero padding keeps the lexical order = numeric order


# -------------------------------------------------------------------------------------------- precedence

PRECEDENCE = [
    # (description, inventory text, host, variable, expected value, expected source)
    (
        "host beats every group",
        "vars: {rpc_port: 1001}\nhosts: {h: {rpc_port: 1004}}\n"
        "groups: {p: {children: [c], vars: {rpc_port: 1002}}, c: {hosts: [h], vars: {rpc_port: 1003}}}\n",
        "h", "rpc_port", 1004, "host",
    ),
    (
        "child group beats parent",
        "vars: {rpc_port: 1001}\nhosts: {h: }\n"
        "groups: {p: {children: [c], vars: {rpc_port: 1002}}, c: {hosts: [h], vars: {rpc_port: 1003}}}\n",
        "h", "rpc_port", 1003, "group c",
    ),
    (
        "parent group beats all",
        "vars: {rpc_port: 1001}\nhosts: {h: }\n"
        "groups: {p: {children: [c], vars: {rpc_port: 1002}}, c: {hosts: [h]}}\n",
        "h", "rpc_port", 1002, "group p",
    ),
    (
        "all beats the default",
        "vars: {rpc_port: 1001}\nhosts: {h: }\n", "h", "rpc_port", 1001, "all",
    ),
    (
        "the default",
        "hosts: {h: }\n", "h", "rpc_port", 50052, "default",
    ),
    (
        "siblings at one depth merge alphabetically (the later name wins)",
        "[beta]\nh\n[alpha]\nh\n[alpha:vars]\nbackend=cuda\n[beta:vars]\nbackend=rocm\n",
        "h", "rpc_backend", "rocm", "group beta",
    ),
    (
        "depth beats the alphabet",
        "[zeta]\nh\n[p:children]\na_child\n[a_child]\nh\n[zeta:vars]\nbackend=rocm\n[a_child:vars]\n"
        "backend=vulkan\n",
        "h", "rpc_backend", "vulkan", "group a_child",
    ),
    (
        "depth is the longest path from all",
        "[top]\nh\n[x:children]\ny\n[y:children]\nmid\n[mid]\nh\n[top:children]\nmid\n"
        "[top:vars]\nrpc_port=1\n[mid:vars]\nrpc_port=2\n",
        "h", "rpc_port", 2, "group mid",
    ),
    (
        "an alias on the host overrides the native name on a group",
        "all:\n  vars: {address: 10.0.0.1}\n  hosts:\n    h: {ansible_host: 10.0.0.2}\n",
        "h", "address", "10.0.0.2", "host",
    ),
    (
        "a native name on a child overrides an alias on its parent",
        "[p:children]\nc\n[c]\nh\n[p:vars]\nansible_user=root\n[c:vars]\nssh_user=ops\n",
        "h", "ssh_user", "ops", "group c",
    ),
    (
        "null means the default",
        "vars: {rpc_port: 6000}\nhosts: {h: {rpc_port: null}}\n", "h", "rpc_port", 50052, "default",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "host", "variable", "value", "source"),
    [case[1:] for case in PRECEDENCE],
    ids=[case[0] for case in PRECEDENCE],
)
def test_precedence(text: str, host: str, variable: str, value: Any, source: str) -> None:
    name = "inv.ini" if text.startswith("[") else "inv.yml"
    resolved = load(text, name).host(host)
    assert getattr(resolved, variable) == value
    assert resolved.var_sources[variable] == source


# ------------------------------------------------------------------------------- defaults and variables


def test_defaults() -> None:
    host = load("hosts: {h1: }\n").host("h1")
    assert host == Host(name="h1", address="h1", rpc_host="h1", groups=("ungrouped",), vars=host.vars)
    assert host.vars["rpc_port"] == 50052  # vars hold every resolved variable
    assert (host.ssh_port, host.connection, host.rpc_port, host.rpc_backend) == (22, "ssh", 50052, "cpu")
    assert (host.install_dir, host.memory_reserve, host.memory_limit) == (DEFAULT_INSTALL_DIR, 0, None)
    assert (host.ssh_known_hosts, host.ssh_host_key_checking, host.ssh_connect_timeout) == (None, True, 10.0)
    assert (host.rpc_artifact, host.allow_public_bind, host.rpc_debug, host.keep_versions) == (
        None,
        False,
        False,
        3,
    )
    assert host.endpoint == "h1:50052"
    assert host.location is not None and (host.location.line, host.location.column) == (1, 9)


def test_variable_table_matches_host_fields() -> None:
    host_fields = {f.name: f for f in dataclasses.fields(Host)}
    for variable in VARIABLES:
        assert variable.name in host_fields
        if variable.name != "address":
            assert host_fields[variable.name].default == variable.default, variable.name
    extra = set(host_fields) - {v.name for v in VARIABLES}
    assert extra == {"name", "groups", "vars", "location", "var_sources", "server"}


ALL_VARIABLES_TEXT = """\
[g]
h ansible_host=10.9.0.1 ansible_user=ops ansible_port=2022 ansible_ssh_private_key_file=~/.ssh/k
[g:vars]
rpc_host=0.0.0.0
rpc_port=6000
rpc_devices=CUDA0,CUDA1
rpc_threads=12
rpc_server_per_gpu=no
rpc_env={"GGML_VK_VISIBLE_DEVICES":"0,1"}
rpc_cache=yes
backend=vulkan
install_dir=/opt/rpcfleet
memory_reserve=512MiB
memory_limit=1.5G
ssh_known_hosts=/etc/rpcfleet/known_hosts
ansible_host_key_checking=False
ssh_connect_timeout=2.5
rpc_artifact=llama-b1234-vulkan
allow_public_bind=true
rpc_debug=on
keep_versions=5
"""


def test_every_variable_is_parsed_and_typed() -> None:
    host = load(ALL_VARIABLES_TEXT, "inv.ini").host("h")
    assert host == Host(
        name="h",
        address="10.9.0.1",
        ssh_user="ops",
        ssh_port=2022,
        ssh_key="~/.ssh/k",
        connection="ssh",
        rpc_host="0.0.0.0",
        rpc_port=6000,
        rpc_devices=("CUDA0", "CUDA1"),
        rpc_threads=12,
        rpc_server_per_gpu=False,
        rpc_env=(("GGML_VK_VISIBLE_DEVICES", "0,1"),),
        rpc_cache=True,
        rpc_backend="vulkan",
        install_dir="/opt/rpcfleet",
        memory_reserve=512 << 20,
        memory_limit=int(1.5 * (1 << 30)),
        ssh_known_hosts="/etc/rpcfleet/known_hosts",
        ssh_host_key_checking=False,
        ssh_connect_timeout=2.5,
        rpc_artifact="llama-b1234-vulkan",
        allow_public_bind=True,
        rpc_debug=True,
        keep_versions=5,
        groups=("g",),
        vars=host.vars,
    )
    assert host.endpoint == "10.9.0.1:6000"  # a wildcard bind is reached at the address


@pytest.mark.parametrize(
    ("text", "address", "rpc_host", "endpoint"),
    [
        ("hosts: {h: {connection: local}}\n", "127.0.0.1", "127.0.0.1", "127.0.0.1:50052"),
        ("hosts: {'my box!': {connection: local, rpc_port: 6001}}\n", "127.0.0.1", "127.0.0.1",
         "127.0.0.1:6001"),
        ("hosts: {h: {address: 10.0.0.5, rpc_host: ''}}\n", "10.0.0.5", "10.0.0.5", "10.0.0.5:50052"),
        ("hosts: {h: {address: 10.0.0.5, rpc_host: 10.1.0.5}}\n", "10.0.0.5", "10.1.0.5", "10.1.0.5:50052"),
        ("hosts: {h: {address: 'fd00::5'}}\n", "fd00::5", "fd00::5", "[fd00::5]:50052"),
        ("hosts: {h: {address: gpu1.example.com.}}\n", "gpu1.example.com.", "gpu1.example.com.",
         "gpu1.example.com.:50052"),
        ("hosts: {web_01: }\n", "web_01", "web_01", "web_01:50052"),
        ("hosts: {h: {ansible_host: '{{ inventory_hostname }}.lan'}}\n", "h.lan", "h.lan", "h.lan:50052"),
        ("hosts: {h.dc1: {ansible_host: '{{inventory_hostname_short}}.mgmt'}}\n", "h.mgmt", "h.mgmt",
         "h.mgmt:50052"),
    ],
)  # fmt: skip
def test_address_defaults(text: str, address: str, rpc_host: str, endpoint: str) -> None:
    (host,) = load(text).hosts
    assert (host.address, host.rpc_host, host.endpoint) == (address, rpc_host, endpoint)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("rpc_devices: [CUDA0, CUDA1]", ("CUDA0", "CUDA1")),
        ("rpc_devices: 'CUDA0, CUDA1'", ("CUDA0", "CUDA1")),
        ("rpc_devices: ''", ()),
        ("memory_limit: 1073741824", 1 << 30),
        ("memory_limit: 512MB", 512_000_000),
        ("ssh_port: '2200'", 2200),
        ("rpc_cache: 'no'", False),
        ("connection: smart", "ssh"),
        ("ansible_connection: paramiko", "ssh"),
        ("backend: CUDA", "cuda"),
        ("ssh_connect_timeout: 3", 3.0),
    ],
)
def test_value_coercion(raw: str, expected: Any) -> None:
    key = raw.split(":")[0]
    field_name = {"ansible_connection": "connection", "backend": "rpc_backend"}.get(key, key)
    host = load(f"hosts:\n  h:\n    {raw}\n").host("h")
    assert getattr(host, field_name) == expected


def test_unknown_variables_are_kept_with_did_you_mean_warnings() -> None:
    inventory = load(
        "vars:\n  rpc_prot: 6000\n  rack: r1\n  ansible_ssh_pass: x\n  ansible_timeout: 5\n"
        "hosts:\n  a: {adress: 10.0.0.1}\n  b: {adress: 10.0.0.2}\n"
    )
    assert inventory.warnings == (
        "inv.yml:2:13: unknown variable 'rpc_prot' is kept as is (did you mean 'rpc_port'?)",
        "inv.yml:7:15: unknown variable 'adress' is kept as is (did you mean 'address'?)",
        "inv.yml:8:15: unknown variable 'adress' is kept as is (did you mean 'address'?)",
    )
    a = inventory.host("a")
    assert (a.rpc_port, a.address, a.vars["adress"], a.vars["rpc_prot"], a.vars["rack"]) == (
        50052,
        "a",
        "10.0.0.1",
        6000,
        "r1",
    )
    assert a.var_sources["adress"] == "host"
    assert a.var_sources["rack"] == "all"


def test_other_warnings() -> None:
    inventory = load("all:\n  hots:\n    a:\n  hosts:\n    a:\n    b:\n  vars: {x: 1, x: 2}\n")
    assert inventory.warnings == (
        "inv.yml:2:3: unexpected key 'hots' in group 'all' is ignored (only hosts, children and vars)"
        " (did you mean 'hosts'?)",
        "inv.yml:7:16: duplicate key 'x' in vars of group 'all'; the last one wins",
    )
    assert inventory.host("a").vars["x"] == 2


# ------------------------------------------------------------------------------------ validation errors

ERRORS = [
    # (id, file name, text, exact error text)
    ("bad yaml", "inv.yml", "hosts:\n  a:\n   b: 1\n  c: d: e\n",
     "inv.yml:4:7: invalid YAML: mapping values are not allowed here\n    c: d: e"),
    ("bad yaml flow", "inv.yml", "hosts:\n  a:\ngroups:\n  g: {hosts: [n[1:2]]}\n",
     "inv.yml:4:16: invalid YAML: while parsing a flow sequence: expected ',' or ']', but got '['\n"
     "    g: {hosts: [n[1:2]]}"),
    ("two documents", "inv.yml", "hosts: {a: }\n---\nhosts: {b: }\n",
     "inv.yml:2:1: invalid YAML: expected a single document in the stream, but found another document\n"
     "    ---"),
    ("tab", "inv.yml", "hosts:\n\ta:\n",
     "inv.yml:2:1: invalid YAML: while scanning for the next token: found character '\\t' that cannot start"
     " any token\n    a:"),
    ("not a mapping", "inv.yml", "- a\n- b\n",
     "inv.yml:1:1: an inventory must be a mapping (vars/hosts/groups, or Ansible's all:), got a list\n"
     "    - a"),
    ("port type", "inv.yml", "hosts:\n  a:\n    rpc_port: abc\n",
     "inv.yml:3:15: rpc_port: expected an integer, got 'abc'\n    rpc_port: abc"),
    ("port range", "inv.yml", "hosts:\n  a:\n    rpc_port: 70000\n",
     "inv.yml:3:15: rpc_port: port 70000 is out of range (1-65535)\n    rpc_port: 70000"),
    ("ssh port zero", "inv.yml", "all:\n  hosts:\n    a:\n      ansible_port: 0\n",
     "inv.yml:4:21: ansible_port: port 0 is out of range (1-65535)\n    ansible_port: 0"),
    ("bool port", "inv.yml", "hosts: {a: {rpc_port: true}}\n",
     "inv.yml:1:23: rpc_port: expected an integer, got a boolean True\n    hosts: {a: {rpc_port: true}}"),
    ("bad address", "inv.yml", "hosts:\n  a: {address: 'bad host'}\n",
     "inv.yml:2:16: address: invalid address 'bad host' (expected an IPv4/IPv6 address or a hostname)\n"
     "    a: {address: 'bad host'}"),
    ("bad ipv4", "inv.yml", "hosts:\n  a: {address: 300.1.1.1}\n",
     "inv.yml:2:16: address: invalid address '300.1.1.1' (expected an IPv4/IPv6 address or a hostname)\n"
     "    a: {address: 300.1.1.1}"),
    ("label too long", "inv.yml", f"hosts:\n  a: {{address: {'x' * 64}.lan}}\n",
     f"inv.yml:2:16: address: invalid address '{'x' * 64}.lan' (expected an IPv4/IPv6 address or a hostname)"
     f"\n    a: {{address: {'x' * 64}.lan}}"),
    ("host name as address", "inv.yml", "hosts:\n  bad_name!:\n",
     "inv.yml:2:3: host 'bad_name!': invalid address 'bad_name!' (expected an IPv4/IPv6 address or a "
     "hostname); set address (ansible_host) for it\n    bad_name!:"),
    ("rpc_host hostname", "inv.yml", "hosts:\n  a: {rpc_host: localhost}\n",
     "inv.yml:2:17: rpc_host: 'localhost' is not an IPv4 address (ggml-rpc-server binds only IPv4 literals"
     " such as 0.0.0.0)\n    a: {rpc_host: localhost}"),
    ("size", "inv.yml", "hosts:\n  a: {memory_limit: 8 gigs}\n",
     "inv.yml:2:21: memory_limit: expected a size such as 8GiB, 512MiB or 1.5G, got '8 gigs'\n"
     "    a: {memory_limit: 8 gigs}"),
    ("size ini", "inv.ini", "[g]\nh\n[g:vars]\nmemory_reserve=lots\n",
     "inv.ini:4:16: memory_reserve: expected a size such as 8GiB, 512MiB or 1.5G, got 'lots'\n"
     "    memory_reserve=lots"),
    ("backend", "inv.yml", "hosts:\n  a: {backend: cdua}\n",
     "inv.yml:2:16: backend: expected one of auto, cpu, cuda, rocm, vulkan, metal, got 'cdua' (did you mean"
     " 'cuda'?)\n    a: {backend: cdua}"),
    ("connection", "inv.yml", "hosts:\n  a: {ansible_connection: winrm}\n",
     "inv.yml:2:27: ansible_connection: expected one of ssh, local, got 'winrm'\n"
     "    a: {ansible_connection: winrm}"),
    ("bool", "inv.yml", "hosts:\n  a: {rpc_cache: maybe}\n",
     "inv.yml:2:18: rpc_cache: expected a boolean (true/false, yes/no, on/off), got 'maybe'\n"
     "    a: {rpc_cache: maybe}"),
    ("threads", "inv.yml", "hosts:\n  a: {rpc_threads: 0}\n",
     "inv.yml:2:20: rpc_threads: expected an integer >= 1, got 0\n    a: {rpc_threads: 0}"),
    ("keep_versions", "inv.yml", "hosts:\n  a: {keep_versions: 0}\n",
     "inv.yml:2:22: keep_versions: expected an integer >= 1, got 0\n    a: {keep_versions: 0}"),
    ("timeout", "inv.yml", "hosts:\n  a: {ssh_connect_timeout: -1}\n",
     "inv.yml:2:28: ssh_connect_timeout: expected a positive number of seconds, got -1\n"
     "    a: {ssh_connect_timeout: -1}"),
    ("string type", "inv.yml", "hosts:\n  a: {ssh_user: [a, b]}\n",
     "inv.yml:2:17: ssh_user: expected a string, got a list ['a', 'b']\n    a: {ssh_user: [a, b]}"),
    ("devices", "inv.yml", "hosts:\n  a: {rpc_devices: 'CUDA 0'}\n",
     "inv.yml:2:20: rpc_devices: expected a device name such as CUDA0, Vulkan1 or CPU, got 'CUDA 0'\n"
     "    a: {rpc_devices: 'CUDA 0'}"),
    ("template", "inv.yml", "hosts:\n  a: {address: '{{ foo }}'}\n",
     "inv.yml:2:16: address: template '{{ foo }}' is not supported (only {{ inventory_hostname }} is)\n"
     "    a: {address: '{{ foo }}'}"),
    ("alias conflict", "inv.yml", "hosts:\n  a: {address: 10.0.0.1, ansible_host: 10.0.0.2}\n",
     "inv.yml:2:40: 'ansible_host' and 'address' both set 'address' here; keep one\n"
     "    a: {address: 10.0.0.1, ansible_host: 10.0.0.2}"),
    ("shared endpoint", "inv.yml", "hosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.1}\n",
     "inv.yml:3:3: hosts 'a' and 'b' share the rpc endpoint 10.0.0.1:50052 (give one another rpc_port or"
     " address)\n    b: {address: 10.0.0.1}"),
    ("shared endpoint local", "inv.ini", "a ansible_connection=local\nb ansible_connection=local\n",
     "inv.ini:2:1: hosts 'a' and 'b' share the rpc endpoint 127.0.0.1:50052 (give one another rpc_port or"
     " address)\n    b ansible_connection=local"),
    ("cycle native", "inv.yml", "hosts: {a: }\ngroups:\n  x: {children: [y]}\n  y: {children: [x]}\n",
     "inv.yml:4:18: group cycle: x -> y -> x\n    y: {children: [x]}"),
    ("cycle ansible", "inv.yml",
     "all:\n  children:\n    x:\n      children:\n        y:\n          children:\n            x:\n",
     "inv.yml:7:13: group cycle: x -> y -> x\n    x:"),
    ("cycle ini", "inv.ini", "[x:children]\ny\n[y:children]\nz\n[z:children]\nx\n",
     "inv.ini:6:1: group cycle: x -> y -> z -> x\n    x"),
    ("self child", "inv.ini", "[x:children]\nx\n",
     "inv.ini:2:1: group 'x' lists itself as a child (cycle: x -> x)\n    x"),
    ("all as child", "inv.ini", "[x:children]\nall\n",
     "inv.ini:2:1: group 'all' cannot be a child of another group\n    all"),
    ("undefined child ini", "inv.ini", "[gpu]\nh\n[fleet:children]\ngpus\n",
     "inv.ini:4:1: group 'fleet' has undefined child group 'gpus' (did you mean 'gpu'?)\n    gpus"),
    ("undefined child native", "inv.yml", "groups:\n  g: {children: [nope]}\n",
     "inv.yml:2:18: group 'g' has undefined child group 'nope'\n    g: {children: [nope]}"),
    ("undefined host native", "inv.yml", "groups:\n  g: {hosts: [nope]}\nhosts: {nop: }\n",
     "inv.yml:2:15: group 'g' lists undefined host 'nope' (did you mean 'nop'?)\n    g: {hosts: [nope]}"),
    ("vars for undefined group", "inv.ini", "[a:vars]\nx=1\n",
     "inv.ini:1:1: [a:vars] is for a group that is not defined\n    [a:vars]"),
    ("bad section", "inv.ini", "[a:foo]\nx=1\n",
     "inv.ini:1:1: invalid section [a:foo] (expected [group], [group:vars] or [group:children])\n"
     "    [a:foo]"),
    ("ini no value", "inv.ini", "[a]\nh1 rpc_port\n",
     "inv.ini:2:4: expected key=value after the host name, got 'rpc_port'\n    h1 rpc_port"),
    ("ini vars no equals", "inv.ini", "[a]\nh\n[a:vars]\n  rpc_port 5\n",
     "inv.ini:4:3: expected key=value in [a:vars]\n    rpc_port 5"),
    ("ini two children a line", "inv.ini", "[a]\nh\n[p:children]\na b\n",
     "inv.ini:4:1: expected one group name per line in [p:children]\n    a b"),
    ("ini quote", "inv.ini", "[a]\nh x='open\n",
     "inv.ini:2:1: cannot split host line: No closing quotation\n    h x='open"),
    ("ini port value", "inv.ini", "[a]\nh1 rpc_port=abc\n",
     "inv.ini:2:13: rpc_port: expected an integer, got 'abc'\n    h1 rpc_port=abc"),
    ("range", "inv.ini", "[a]\nh[05:01]\n",
     "inv.ini:2:1: host range in 'h[05:01]' ends before it starts\n    h[05:01]"),
    ("native unknown top key", "inv.yml", "hostz:\n  a:\n",
     "inv.yml:1:1: unknown top-level key 'hostz' (did you mean 'hosts'?) (a native inventory has vars, hosts"
     " and groups)\n    hostz:"),
    ("native unknown group key", "inv.yml", "hosts: {a: }\ngroups:\n  g: {hosts: [a], var: {}}\n",
     "inv.yml:3:19: unknown key 'var' in group 'g' (did you mean 'vars'?)\n    g: {hosts: [a], var: {}}"),
    ("native hosts list", "inv.yml", "hosts: [a, b]\n",
     "inv.yml:1:8: hosts must be a mapping, got a list\n    hosts: [a, b]"),
    ("host vars not a mapping", "inv.yml", "all:\n  hosts:\n    a: 10.0.0.1\n",
     "inv.yml:3:8: variables of host 'a' must be a mapping, got a string '10.0.0.1'\n    a: 10.0.0.1"),
    ("group not a mapping", "inv.yml", "all:\n  children:\n    web: [a, b]\n",
     "inv.yml:3:10: group 'web' must be a mapping of hosts/children/vars, got a list\n    web: [a, b]"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "message"), [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_validation_errors(name: str, text: str, message: str) -> None:
    with pytest.raises(InventoryError) as info:
        load(text, name)
    assert str(info.value) == message
    location = info.value.location
    assert location is not None and location.path == Path(name)
    line, column = message.split("\n")[0].split(":")[1:3]
    assert (location.line, location.column) == (int(line), int(column))


def test_all_errors_are_collected_once_each() -> None:
    text = "vars: {rpc_port: abc}\nhosts:\n  a: {ssh_port: 0}\n  b: {backend: tpu}\n  c:\n"
    with pytest.raises(InventoryErrors) as info:
        load(text)
    assert [str(err).split("\n")[0] for err in info.value.errors] == [
        "inv.yml:1:18: rpc_port: expected an integer, got 'abc'",  # reported once, not once per host
        "inv.yml:3:17: ssh_port: port 0 is out of range (1-65535)",
        "inv.yml:4:16: backend: expected one of auto, cpu, cuda, rocm, vulkan, metal, got 'tpu'",
    ]
    assert str(info.value) == "\n".join(str(err) for err in info.value.errors)
    assert info.value.location == info.value.errors[0].location


def test_rpc_run_as_is_a_user_name() -> None:
    assert load("hosts:\n  a: {rpc_run_as: root}\n").hosts[0].rpc_run_as == "root"
    assert load("hosts:\n  a:\n").hosts[0].rpc_run_as is None
    with pytest.raises(InventoryError) as info:
        load("hosts:\n  a: {rpc_run_as: 'root; reboot'}\n")
    assert str(info.value).startswith("inv.yml:2:19: rpc_run_as: "), str(info.value)
    assert "a user name" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"inventory file not found: .*nope\.yml"):
        load_inventory(tmp_path / "nope.yml")


def test_unknown_host_lookup_suggests() -> None:
    with pytest.raises(InventoryError) as info:
        load("hosts: {gpu01: , gpu02: }\n").host("gpu1")
    assert str(info.value) == "no host 'gpu1' in the inventory (did you mean 'gpu01'?)"


# -------------------------------------------------------------------------------------------- --limit


@pytest.fixture(scope="module")
def fleet() -> Any:
    return load_inventory(DATA / "fleet_ansible.yml")


LIMITS = [
    (None, ["bastion", "a100-01", "a100-02", "a100-03", "mia", "mib", "epyc01", "epyc02"]),
    ("all", ["bastion", "a100-01", "a100-02", "a100-03", "mia", "mib", "epyc01", "epyc02"]),
    ("*", ["bastion", "a100-01", "a100-02", "a100-03", "mia", "mib", "epyc01", "epyc02"]),
    ("epyc02", ["epyc02"]),
    ("epyc02,a100-01", ["a100-01", "epyc02"]),  # inventory order, not pattern order
    ("gpu", ["a100-01", "a100-02", "a100-03", "mia", "mib"]),  # through child groups
    ("gpu_rocm:cpu", ["mia", "mib", "epyc01", "epyc02"]),  # colon list
    ("gpu,!gpu_a100", ["mia", "mib"]),
    ("gpu:!a100-02", ["a100-01", "a100-03", "mia", "mib"]),
    ("gpu:&rack_east", ["a100-01"]),
    ("gpu,cpu,&rack_east", ["a100-01", "epyc01"]),
    ("!gpu", ["bastion", "epyc01", "epyc02"]),  # only exclusions: from all hosts
    ("a100-*", ["a100-01", "a100-02", "a100-03"]),
    ("gpu_*", ["a100-01", "a100-02", "a100-03", "mia", "mib"]),  # globs match group names too
    ("mi?", ["mia", "mib"]),
    ("~^epyc0[2-9]$", ["epyc02"]),
    ("ungrouped", ["bastion"]),
    (" gpu_rocm , epyc01 ", ["mia", "mib", "epyc01"]),
]


@pytest.mark.parametrize(("pattern", "expected"), LIMITS)
def test_select_hosts(fleet: Any, pattern: str | None, expected: list[str]) -> None:
    assert [h.name for h in select_hosts(fleet, pattern)] == expected
    assert [h.name for h in fleet.select(pattern)] == expected


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("gpus", "host pattern 'gpus' matches no host or group (did you mean 'gpu'?)"),
        ("gpu,nothing*", "host pattern 'nothing*' matches no host or group"),
        ("gpu:!epic01", "host pattern 'epic01' matches no host or group (did you mean 'epyc01'?)"),
        ("gpu:&cpu", "host pattern 'gpu:&cpu' selects no host"),
        ("gpu,!gpu", "host pattern 'gpu,!gpu' selects no host"),
        ("gpu,!", "empty term '!' in host pattern 'gpu,!'"),
        ("~[", "invalid regular expression in host pattern '~[': unterminated character set at position 0"),
    ],
)
def test_select_hosts_errors(fleet: Any, pattern: str, message: str) -> None:
    with pytest.raises(HostPatternError) as info:
        select_hosts(fleet, pattern)
    assert str(info.value) == message


def test_ansible_become_is_refused_with_the_way_out_not_ignored() -> None:
    """A login user with sudo would have run every step unprivileged while the inventory said root."""
    for text, name, where in [
        ("all:\n  hosts:\n    a:\n      ansible_become: true\n", "inv.yml", "inv.yml:4:23: "),
        ("[g]\na ansible_become=yes\n", "inv.ini", "inv.ini:2:18: "),
    ]:
        with pytest.raises(InventoryError) as info:
            load(text, name)
        assert str(info.value).startswith(where + "ansible_become: rpcfleet does not escalate"), info.value
        assert "ansible_user: root" in str(info.value)
    assert load("all:\n  hosts:\n    a:\n      ansible_become: false\n").hosts[0].name == "a"
