"""The table of inventory variables: name, aliases, parser, default."""

from __future__ import annotations

import difflib
import ipaddress
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.core import fields
from orchestrator.core.yamlsource import did_you_mean

DEFAULT_RPC_PORT = 50052


DEFAULT_INSTALL_DIR = "~/.local/lib/rpcfleet"


LOCAL_ADDRESS = "127.0.0.1"


Backend = Literal["cpu", "cuda", "rocm", "vulkan", "metal"]


# `rpc_backend: auto` picks one of BACKENDS from the node's facts at deploy (operations.backend).
BackendChoice = Literal["auto", "cpu", "cuda", "rocm", "vulkan", "metal"]


ConnectionKind = Literal["ssh", "local"]


BACKENDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "vulkan", "metal")


BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKENDS)


CONNECTIONS: tuple[str, ...] = ("ssh", "local")


Supervisor = Literal["auto", "systemd", "process"]


SUPERVISORS: tuple[str, ...] = ("auto", "systemd", "process")
RpcTransport = Literal["tcp", "ssh"]


RPC_TRANSPORTS: tuple[str, ...] = ("tcp", "ssh")


CONTROLLER = "controller"  # rpc_allow_from: the controller's address as the node sees it


_DEVICES = fields.list_of(fields.matching(r"[A-Za-z0-9_.\-]+", "a device name such as CUDA0, Vulkan1 or CPU"))


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def parse_address(value: Any) -> str:
    text = fields.text(value).strip()
    if _is_ip(text):
        return text
    labels = text.rstrip(".").split(".")
    # all-numeric dotted text is an IPv4 literal or nothing (hostnames would resolve it anyway, wrongly)
    numeric = all(label.isdigit() for label in labels)
    if numeric or len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"invalid address {text!r} (expected an IPv4/IPv6 address or a hostname)")
    return text


def _parse_bind(value: Any) -> str:
    text = fields.text(value).strip()
    if text == "":
        return text
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not an IPv4 address (ggml-rpc-server binds only IPv4 literals such as 0.0.0.0)"
        ) from None
    return text


@dataclass(frozen=True)
class RpcServer:
    """One of several rpc-servers of a host (`rpc_servers`): its own port, devices and threads.

    `name` names its files and unit on the node and its endpoint in results (`h1/gpu0`); the port by
    default. Unset devices or threads fall back to the host's `rpc_devices`/`rpc_threads`."""

    port: int
    name: str
    devices: tuple[str, ...] | None = None
    threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "port": self.port}
        if self.devices is not None:
            data["devices"] = list(self.devices)
        if self.threads is not None:
            data["threads"] = self.threads
        return data


_SERVER_KEYS = ("port", "devices", "threads", "name")


_SERVER_NAME = fields.matching(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,31}", "a name of letters, digits, _ . -")


def _parse_server(item: Any, index: int) -> RpcServer:
    where = f"server {index + 1}"
    if (isinstance(item, int) and not isinstance(item, bool)) or (isinstance(item, str) and item.isdigit()):
        item = {"port": item}  # `rpc_servers: [50052, 50053]`: ports alone
    if not isinstance(item, Mapping):
        raise ValueError(
            f"{where}: expected a mapping such as {{port: 50052, devices: [CUDA0]}}, got {item!r}"
        )
    unknown = [str(key) for key in item if key not in _SERVER_KEYS]
    if unknown:
        hint = did_you_mean(unknown[0], _SERVER_KEYS, cutoff=0.6)
        raise ValueError(f"{where}: unknown key {unknown[0]!r}{hint} (known: {', '.join(_SERVER_KEYS)})")
    if item.get("port") is None:
        raise ValueError(f"{where}: port is missing")
    try:
        port = fields.port(item["port"])
        devices = _DEVICES(item["devices"]) if item.get("devices") not in (None, "") else None
        threads = fields.integer(minimum=1)(item["threads"]) if item.get("threads") is not None else None
        name = _SERVER_NAME(item["name"]) if item.get("name") is not None else str(port)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return RpcServer(port, name, devices, threads)


def parse_servers(value: Any) -> tuple[RpcServer, ...]:
    """`rpc_servers`: a list of servers (mappings, or ports alone), or that list as YAML/JSON text (an
    INI inventory). Ports, names and devices must differ between the servers of one host."""
    if isinstance(value, str):
        import yaml  # only for INI text: the CLI starts without yaml

        try:
            value = yaml.safe_load(value) if value.strip() else []
        except yaml.YAMLError:
            raise ValueError(
                f"{value!r} is not a YAML list such as [{{port: 50052}}, {{port: 50053}}]"
            ) from None
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"expected a list of servers such as [{{port: 50052}}, {{port: 50053}}], got {value!r}"
        )
    servers = tuple(_parse_server(item, index) for index, item in enumerate(value))
    seen_ports: dict[int, int] = {}
    seen_names: dict[str, int] = {}
    seen_devices: dict[str, int] = {}
    for index, server in enumerate(servers, start=1):
        if server.port in seen_ports:
            raise ValueError(f"servers {seen_ports[server.port]} and {index} both use port {server.port}")
        if server.name in seen_names:
            raise ValueError(f"servers {seen_names[server.name]} and {index} are both named {server.name!r}")
        seen_ports[server.port] = seen_names[server.name] = index
        for device in server.devices or ():
            if device.upper() in seen_devices:
                raise ValueError(
                    f"servers {seen_devices[device.upper()]} and {index} both use device {device} "
                    "(a device belongs to one server)"
                )
            seen_devices[device.upper()] = index
    return servers


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_env(value: Any) -> tuple[tuple[str, str], ...]:
    """`rpc_env`: the server's extra environment, a mapping of names to values (or that mapping as
    YAML/JSON text, from an INI inventory), kept sorted by name."""
    if isinstance(value, str):
        import yaml  # only for INI text: the CLI starts without yaml

        try:
            value = yaml.safe_load(value) if value.strip() else {}
        except yaml.YAMLError:
            value = None
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping such as {{GGML_VK_VISIBLE_DEVICES: '0'}}, got {value!r}")
    pairs: list[tuple[str, str]] = []
    for name, item in value.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name")
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise ValueError(f"{name}: expected a string or a number, got {item!r}")
        text = str(item)
        bad = control_character(text)
        if bad:  # it is written into the server's unit and launch line
            raise ValueError(f"{name}: a value cannot hold a control character ({bad})")
        pairs.append((name, text))
    return tuple(sorted(pairs))


def is_gpu_device(name: str) -> bool:
    """Whether a device name as llama.cpp spells it (CUDA0, Vulkan1, ROCm0, Metal) is a GPU, not the CPU."""
    return not name.strip().upper().startswith("CPU")


def _parse_source(value: Any) -> str:
    """One `rpc_allow_from` entry: an IPv4 address or network (CIDR), or `controller`. IPv6 is refused:
    the server binds an IPv4 literal, so no IPv6 client reaches it, and the rules are iptables' (IPv4)."""
    text = fields.text(value).strip()
    if text == CONTROLLER:
        return text
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(
            f"{text!r} is not an address or a network such as 10.0.0.0/24 (or `{CONTROLLER}`)"
        ) from None
    if network.version != 4:
        raise ValueError(
            f"{text!r} is IPv6: the rpc-server listens on an IPv4 address only, so the firewall takes "
            "IPv4 sources such as 10.0.0.0/24"
        )
    return str(network)


def control_character(text: str) -> str | None:
    """The first control character or line break of `text` as U+XXXX (None when it has none): such a
    value would end a systemd unit's line, or a shell script's, early."""
    for char in text:
        if unicodedata.category(char) in ("Cc", "Zl", "Zp"):
            return f"U+{ord(char):04X}"
    return None


def _parse_install_dir(value: Any) -> str:
    """`install_dir`, `model_path_on_nodes`: a path; no control character (it is written into a root-run
    unit, or a shell script)."""
    text = fields.text(value)
    bad = control_character(text)
    if bad:
        raise ValueError(f"a path cannot hold a control character ({bad})")
    return text


# iptables keeps a rule's comment to 255 bytes; the firewall's rules carry `rpcfleet <install_dir> <port>`
# and are found again by it, so a longer install_dir would leave rules rpcfleet cannot find.
INSTALL_DIR_MAX_BYTES = 255 - len("rpcfleet ") - len(" 65535")


def _parse_install_dir_of_rules(value: Any) -> str:
    """`install_dir`: a path (`_parse_install_dir`) short enough for the firewall rules' comment."""
    text = _parse_install_dir(value)
    size = len(text.encode())
    if size > INSTALL_DIR_MAX_BYTES:
        raise ValueError(
            f"a path of {size} bytes: at most {INSTALL_DIR_MAX_BYTES} (the firewall rules' comment, which "
            "iptables keeps to 255 bytes, holds it)"
        )
    return text


@dataclass(frozen=True)
class Variable:
    """A variable rpcfleet understands: its `Host` field, Ansible aliases, parser and default."""

    name: str
    aliases: tuple[str, ...]
    parse: Callable[[Any], Any]
    default: Any
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable("address", ("ansible_host", "ansible_ssh_host"), parse_address, None, "address to reach"),
    Variable(
        "ssh_user", ("ansible_user", "ansible_ssh_user"), fields.optional(fields.text), None, "SSH login"
    ),
    Variable("ssh_port", ("ansible_port", "ansible_ssh_port"), fields.port, 22, "SSH port"),
    Variable(
        "ssh_key",
        ("ansible_ssh_private_key_file", "ansible_private_key_file"),
        fields.optional(fields.text),
        None,
        "SSH private key file",
    ),
    Variable(
        "connection",
        ("ansible_connection",),
        fields.choice(CONNECTIONS, {"smart": "ssh", "paramiko": "ssh", "paramiko_ssh": "ssh"}),
        "ssh",
        "ssh or local",
    ),
    Variable("rpc_host", (), _parse_bind, "", "rpc-server bind address (default: address)"),
    Variable("rpc_port", (), fields.port, DEFAULT_RPC_PORT, "rpc-server port"),
    Variable(
        "rpc_transport",
        (),
        fields.choice(RPC_TRANSPORTS),
        "tcp",
        "tcp, or ssh: the server binds the node's loopback, reached through an SSH forward",
    ),
    Variable(
        "rpc_allow_from",
        (),
        fields.optional(fields.list_of(_parse_source)),
        None,
        "tcp transport: firewall the RPC port to these addresses/CIDRs (`controller`: this machine)",
    ),
    Variable("rpc_devices", (), _DEVICES, (), "rpc-server devices (-d)"),
    Variable(
        "rpc_servers",
        (),
        parse_servers,
        (),
        "several rpc-servers on this host: [{port, devices, threads, name}], each its own endpoint",
    ),
    Variable(
        "rpc_threads", (), fields.optional(fields.integer(minimum=1)), None, "rpc-server CPU threads (-t)"
    ),
    Variable(
        "rpc_server_per_gpu",
        (),
        fields.boolean,
        True,
        "with rpc_devices naming several GPUs: one server per device, each on its own port from rpc_port",
    ),
    Variable(
        "rpc_env",
        (),
        parse_env,
        (),
        "the server's extra environment ({GGML_VK_VISIBLE_DEVICES: '0'}, CUDA_VISIBLE_DEVICES...)",
    ),
    Variable("rpc_cache", (), fields.boolean, False, "rpc-server tensor cache (-c)"),
    Variable(
        "rpc_cache_max", (), fields.optional(fields.size), None, "most bytes the tensor cache keeps (LRU)"
    ),
    Variable(
        "rpc_backend",
        ("backend",),
        fields.choice(BACKEND_CHOICES),
        "cpu",
        "ggml backend of the server (auto: cuda with an NVIDIA driver, vulkan with a Vulkan GPU, else cpu)",
    ),
    Variable(
        "install_dir", (), _parse_install_dir_of_rules, DEFAULT_INSTALL_DIR, "where artifacts are installed"
    ),
    Variable(
        "model_path_on_nodes",
        (),
        fields.optional(_parse_install_dir),
        None,
        "a folder on the node holding the model's GGUF files under their own names (an NFS mount, a "
        "copy): a cache warm copies each tensor from there on the node, checked by its hash",
    ),
    Variable("memory_reserve", (), fields.size, 0, "memory kept free per device"),
    Variable("memory_limit", (), fields.optional(fields.size), None, "most memory used per device"),
    Variable("ssh_known_hosts", (), fields.optional(fields.text), None, "known_hosts file"),
    Variable(
        "ssh_host_key_checking", ("ansible_host_key_checking",), fields.boolean, True, "check SSH host keys"
    ),
    Variable("ssh_connect_timeout", ("ansible_ssh_timeout",), fields.seconds, 10.0, "SSH connect timeout"),
    Variable("rpc_artifact", (), fields.optional(fields.text), None, "pinned artifact name/id"),
    Variable("allow_public_bind", (), fields.boolean, False, "allow rpc_host on a public address"),
    Variable("rpc_debug", (), fields.boolean, False, "rpc-server debug output"),
    Variable("keep_versions", (), fields.integer(minimum=1), 3, "installed versions kept"),
    Variable("rpc_cmake_args", (), fields.arguments, (), "extra cmake args for on-node builds"),
    Variable(
        "supervisor", (), fields.choice(SUPERVISORS), "auto", "systemd, process or auto (systemd if usable)"
    ),
    Variable(
        "rpc_run_as",
        (),
        fields.optional(fields.matching(r"[a-z_][a-z0-9_-]{0,31}", "a user name such as rpcfleet or root")),
        None,
        "process supervisor: the user the server runs as (default: rpcfleet as root, else the login user)",
    ),
)


VARIABLES_BY_NAME: Mapping[str, Variable] = {var.name: var for var in VARIABLES}


CANONICAL: Mapping[str, str] = {alias: var.name for var in VARIABLES for alias in (var.name, *var.aliases)}


# Ansible's own variables that look like ours: never flagged as typos.
ANSIBLE_VARS = frozenset(
    {
        "ansible_password",
        "ansible_ssh_pass",
        "ansible_timeout",
        "ansible_become",
        "ansible_become_user",
        "ansible_become_pass",
        "ansible_become_password",
        "ansible_become_method",
        "ansible_python_interpreter",
        "ansible_shell_type",
        "ansible_ssh_common_args",
        "ansible_ssh_extra_args",
        "ansible_connection_timeout",
    }
)


def near_miss(word: str, candidates: Iterable[str]) -> str:
    return did_you_mean(word, candidates, cutoff=0.75)  # variable and group names: only near misses


def variable_hint(word: str) -> str:
    """The near miss of an unknown variable, unless a word of it is another word altogether: `ntp_server`
    is no typo of `rpc_servers` (ntp/rpc), `rcp_port` is one of `rpc_port`."""
    hint = near_miss(word, CANONICAL)
    close = hint.partition("'")[2].rpartition("'")[0]
    words, others = word.split("_"), close.split("_")
    if len(words) == len(others) and any(
        difflib.SequenceMatcher(None, a, b).ratio() < 0.5 for a, b in zip(words, others, strict=True)
    ):
        return ""
    return hint


# Secrets in variables rpcfleet does not know (Ansible's connection passwords, a vault token...): shown
# masked by `inventory list --json` and `inventory show`. A name is a secret when one of its words (split
# at `_`, `-`, `.` and case changes) is a secret word, unless its last word says it names a file, a path
# or a setting (`ansible_ssh_private_key_file`, `host_key_checking`) or a word says it is public
# (`ssh_public_key`). rpcfleet's own variables hold no secret: `ssh_key` is a file's path.
SECRET_WORDS = frozenset(
    {"password", "passwd", "pass", "passphrase", "pwd", "secret", "token", "key", "apikey", "credential",
     "credentials", "private"}
)  # fmt: skip
_NOT_SECRET_LAST_WORDS = frozenset({"file", "path", "dir", "checking", "name", "type", "user"})
_PUBLIC_WORDS = frozenset({"public", "pub"})
SECRET_MASK = "********"  # the same for every value: not even the length shows


def is_secret(name: str) -> bool:
    """Whether a variable named `name` holds a secret (the rule above)."""
    if name in VARIABLES_BY_NAME:
        return False
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    words = [word for word in re.split(r"[_\-.\s]+", spaced.lower()) if word]
    if not words or words[-1] in _NOT_SECRET_LAST_WORDS or _PUBLIC_WORDS.intersection(words):
        return False
    return bool(SECRET_WORDS.intersection(words))


def mask_secrets(value: Any) -> Any:
    """`value` with the value of every key named like a secret masked, through nested maps and lists."""
    if isinstance(value, Mapping):
        return {
            key: SECRET_MASK
            if isinstance(key, str) and is_secret(key) and item is not None
            else mask_secrets(item)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [mask_secrets(item) for item in value]
    return value
