"""The table of inventory variables: name, aliases, parser, default."""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.core.units import parse_size
from orchestrator.core.yamlsource import (
    did_you_mean,
    type_name,
)

DEFAULT_RPC_PORT = 50052


DEFAULT_INSTALL_DIR = "~/.local/lib/rpcfleet"


LOCAL_ADDRESS = "127.0.0.1"


Backend = Literal["cpu", "cuda", "rocm", "vulkan", "metal"]


ConnectionKind = Literal["ssh", "local"]


BACKENDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "vulkan", "metal")


CONNECTIONS: tuple[str, ...] = ("ssh", "local")


Supervisor = Literal["auto", "systemd", "process"]


SUPERVISORS: tuple[str, ...] = ("auto", "systemd", "process")


def _parse_str(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected a string, got {type_name(value)} {value!r}")
    return str(value)


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ValueError(f"expected an integer, got {value!r}")


def _int_at_least(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        number = _parse_int(value)
        if number < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {number}")
        return number

    return parse


def _parse_port(value: Any) -> int:
    port = _parse_int(value)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range (1-65535)")
    return port


def _parse_seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"expected a positive number of seconds, got {value!r}")
    return seconds


_TRUE = frozenset({"true", "yes", "on", "1", "y"})


_FALSE = frozenset({"false", "no", "off", "0", "n"})


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def _parse_size(value: Any) -> int:
    if isinstance(value, float) and value >= 0:
        return int(value)
    try:
        return parse_size(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None


def _choice(allowed: Sequence[str], synonyms: Mapping[str, str] | None = None) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower() if isinstance(value, str) else value
        if isinstance(text, str) and synonyms and text in synonyms:
            return synonyms[text]
        if text not in allowed:
            hint = _did_you_mean(str(value), allowed)
            raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}{hint}")
        return str(text)

    return parse


def _parse_devices(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError(f"expected a device list such as CUDA0,CUDA1, got {value!r}")
    devices = tuple(str(item).strip() for item in items if str(item).strip())
    for device in devices:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", device):
            raise ValueError(f"invalid device name {device!r} (expected names such as CUDA0, Vulkan1, CPU)")
    return devices


def _parse_cmake_args(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError(f"expected cmake arguments such as [-DGGML_CUDA=ON], got {value!r}")


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _parse_address(value: Any) -> str:
    text = _parse_str(value).strip()
    if _is_ip(text):
        return text
    labels = text.rstrip(".").split(".")
    # all-numeric dotted text is an IPv4 literal or nothing (hostnames would resolve it anyway, wrongly)
    numeric = all(label.isdigit() for label in labels)
    if numeric or len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"invalid address {text!r} (expected an IPv4/IPv6 address or a hostname)")
    return text


def _parse_bind(value: Any) -> str:
    text = _parse_str(value).strip()
    if text == "":
        return text
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not an IPv4 address (ggml-rpc-server binds only IPv4 literals such as 0.0.0.0)"
        ) from None
    return text


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else parse(value)


@dataclass(frozen=True)
class Variable:
    """A variable rpcfleet understands: its `Host` field, Ansible aliases, parser and default."""

    name: str
    aliases: tuple[str, ...]
    parse: Callable[[Any], Any]
    default: Any
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable("address", ("ansible_host", "ansible_ssh_host"), _parse_address, None, "address to reach"),
    Variable("ssh_user", ("ansible_user", "ansible_ssh_user"), _optional(_parse_str), None, "SSH login"),
    Variable("ssh_port", ("ansible_port", "ansible_ssh_port"), _parse_port, 22, "SSH port"),
    Variable(
        "ssh_key",
        ("ansible_ssh_private_key_file", "ansible_private_key_file"),
        _optional(_parse_str),
        None,
        "SSH private key file",
    ),
    Variable(
        "connection",
        ("ansible_connection",),
        _choice(CONNECTIONS, {"smart": "ssh", "paramiko": "ssh", "paramiko_ssh": "ssh"}),
        "ssh",
        "ssh or local",
    ),
    Variable("rpc_host", (), _parse_bind, "", "rpc-server bind address (default: address)"),
    Variable("rpc_port", (), _parse_port, DEFAULT_RPC_PORT, "rpc-server port"),
    Variable("rpc_devices", (), _parse_devices, (), "rpc-server devices (-d)"),
    Variable("rpc_threads", (), _optional(_int_at_least(1)), None, "rpc-server CPU threads (-t)"),
    Variable("rpc_cache", (), _parse_bool, False, "rpc-server tensor cache (-c)"),
    Variable("backend", (), _choice(BACKENDS), "cpu", "ggml backend of the artifact"),
    Variable("install_dir", (), _parse_str, DEFAULT_INSTALL_DIR, "where artifacts are installed"),
    Variable("memory_reserve", (), _parse_size, 0, "memory kept free per device"),
    Variable("memory_limit", (), _optional(_parse_size), None, "most memory used per device"),
    Variable("ssh_known_hosts", (), _optional(_parse_str), None, "known_hosts file"),
    Variable(
        "ssh_host_key_checking", ("ansible_host_key_checking",), _parse_bool, True, "check SSH host keys"
    ),
    Variable("ssh_connect_timeout", ("ansible_ssh_timeout",), _parse_seconds, 10.0, "SSH connect timeout"),
    Variable("rpc_artifact", (), _optional(_parse_str), None, "pinned artifact name/id"),
    Variable("allow_public_bind", (), _parse_bool, False, "allow rpc_host on a public address"),
    Variable("rpc_debug", (), _parse_bool, False, "rpc-server debug output"),
    Variable("keep_versions", (), _int_at_least(1), 3, "installed versions kept"),
    Variable("rpc_cmake_args", (), _parse_cmake_args, (), "extra cmake args for on-node builds"),
    Variable("supervisor", (), _choice(SUPERVISORS), "auto", "systemd, process or auto (systemd if usable)"),
)


VARIABLES_BY_NAME: Mapping[str, Variable] = {var.name: var for var in VARIABLES}


_CANONICAL: Mapping[str, str] = {alias: var.name for var in VARIABLES for alias in (var.name, *var.aliases)}


# Ansible's own variables that look like ours: never flagged as typos.
_ANSIBLE_VARS = frozenset(
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


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    return did_you_mean(word, candidates, cutoff=0.75)  # variable and group names: only near misses
