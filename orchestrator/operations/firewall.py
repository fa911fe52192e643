"""`rpc_allow_from`: iptables rules on a node that let only the listed sources reach the RPC port.

The rules (tcp transport only) are installed when the server starts and removed when it stops; each
carries the comment `rpcfleet <install_dir> <port>`, so rpcfleet finds its own rules and never touches
anyone else's. Applying is read-then-change: the node's tagged rules are compared with the wanted ones
and replaced only when they differ (a second deploy changes nothing). `controller` in the list is this
machine's address as the node sees it (the first field of the SSH session's `SSH_CONNECTION`).

The rules, first in INPUT, in order: ACCEPT from each source, then REJECT (tcp-reset) from anyone else,
so a refused client gets "connection refused" at once rather than a timeout.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from orchestrator.connectors.base import Connection
from orchestrator.connectors.nodescript import NodeScript, run_script
from orchestrator.core.errors import ServiceError, ServiceScriptError
from orchestrator.inventory.model import Host
from orchestrator.inventory.variables import CONTROLLER

FIREWALL_TIMEOUT = 20.0


@dataclass(frozen=True)
class FirewallResult:
    """What applying did: "unchanged", "installed", "removed" or "none" (no rule wanted nor found)."""

    outcome: str
    sources: tuple[str, ...] = ()  # the resolved sources (controller replaced by its address)


def rule_tag(host: Host, install_dir: str) -> str:
    return f"rpcfleet {install_dir} {host.rpc_port}"


def listed_comment(tag: str) -> str:
    """`--comment TAG` as `iptables -S` prints it (libxtables' save_string): in double quotes, with `"`,
    `\\` and `'` escaped by a backslash, unless it holds only letters, digits, `_` and `-`."""
    if tag and all(c.isascii() and (c.isalnum() or c in "_-") for c in tag):
        return f"--comment {tag}"
    escaped = "".join("\\" + c if c in "\"\\'" else c for c in tag)
    return f'--comment "{escaped}"'


def wanted(host: Host) -> bool:
    return host.rpc_transport == "tcp" and host.rpc_allow_from is not None


def firewall_script(host: Host, install_dir: str, *, install: bool) -> str:
    """A POSIX sh script: check the tool and the right, read our rules, and (re)write or remove them.

    Prints `@unchanged`, `@installed SOURCES`, `@removed` or `@none`; `@notool` / `@noright USER` when
    it cannot."""
    tag = rule_tag(host, install_dir)
    port = str(host.rpc_port)
    sources = host.rpc_allow_from or ()
    lines = [
        "set -u",
        "IPT=$(command -v iptables || ls /usr/sbin/iptables /sbin/iptables 2>/dev/null | head -n 1) || true",
        'if [ -z "$IPT" ]; then echo @notool; exit 0; fi',
        'if [ "$(id -u)" != 0 ]; then echo "@noright $(id -un)"; exit 0; fi',
        f"TAG={shlex.quote(tag)}",
        f"LISTED={shlex.quote(listed_comment(tag))}",
        # our rules as `iptables -S` prints them, numbered as in the chain (a space closes the comment)
        'ours() { "$IPT" -w -S INPUT | grep -e "^-A " | sed "s/\\$/ /" | grep -n -F -e "$LISTED " || true; }',
        "CURRENT=$(ours)",
    ]
    if install:
        resolved = []
        for src in sources:
            if src == CONTROLLER:
                lines.append('CTL=${SSH_CONNECTION%% *}; [ -n "$CTL" ] || { echo @nocontroller; exit 0; }')
                resolved.append('"$CTL"')
            else:
                resolved.append(shlex.quote(src))
        specs = [f"-p tcp -s {src} --dport {port} -j ACCEPT" for src in resolved]
        specs.append(f"-p tcp --dport {port} -j REJECT --reject-with tcp-reset")
        lines.append("WANT=''")
        for spec in specs:
            lines.append(
                f'set -- {spec}; R=$("$IPT" -w -C INPUT "$@" -m comment --comment "$TAG" 2>/dev/null '
                '&& echo y || echo n); WANT="$WANT$R"'
            )
        count = len(specs)
        lines += [
            'N=$(printf "%s" "$CURRENT" | grep -c . || true)',
            f'if [ "$N" = {count} ] && [ "$WANT" = {"y" * count} ]; then echo @unchanged; exit 0; fi',
        ]
    lines += [
        # Delete our rules, whatever they are, by their number in the chain (the first of ours in a fresh
        # listing each time): the listed text, which holds install_dir, is never run as shell code.
        'while :; do N=$(ours | head -n 1 | cut -d: -f1); [ -n "$N" ] || break; '
        '"$IPT" -w -D INPUT "$N" || exit 1; done',
    ]
    if install:
        for position, spec in enumerate(specs, start=1):
            lines.append(
                f'set -- {spec}; "$IPT" -w -I INPUT {position} "$@" -m comment --comment "$TAG" || exit 1'
            )
        lines.append(f"echo @installed {' '.join(resolved)}")
    else:
        lines.append('if [ -n "$CURRENT" ]; then echo @removed; else echo @none; fi')
    return "\n".join(lines)


async def apply_firewall(conn: Connection, host: Host, install_dir: str, *, install: bool) -> FirewallResult:
    """Install (`install=True`, when `rpc_allow_from` is set) or remove this server's rules.

    Without `rpc_allow_from` nothing is run on install; removal always looks for our rules, so a rule
    left from an earlier inventory goes with the server. Raises ServiceError when the node lacks
    iptables or the right to change it."""
    if install and not wanted(host):
        return FirewallResult("none")
    script = firewall_node_script(host, install_dir, install=install)
    # The outcome is the last `@` line; a failure is judged below, after the refusals the script names.
    out = await run_script(conn, dataclasses.replace(script, ok_exits=None))
    key, value = out.last or ("", "")
    if key == "notool":
        if not install:
            return FirewallResult("none")
        raise ServiceError(
            "rpc_allow_from needs iptables on the node, and it has none",
            host=host.name,
            hint="install iptables there, or remove rpc_allow_from (and firewall the port yourself)",
        )
    if key == "noright":
        user = value or "the SSH user"
        if not install:
            return FirewallResult("none")
        raise ServiceError(
            f"rpc_allow_from needs root on the node to change its firewall; {user} is not root",
            host=host.name,
            hint="connect as root (ssh_user: root), or remove rpc_allow_from; rpc_transport: ssh needs "
            "no firewall rule (the server listens on the node's loopback only)",
        )
    if key == "nocontroller":
        raise ServiceError(
            "rpc_allow_from: controller, but the node does not see the controller's address "
            "(no SSH_CONNECTION)",
            host=host.name,
            hint="list the controller's address instead",
        )
    if out.exit_status != 0 or not key:
        raise script.failure(
            host.name,
            "changing the node's firewall failed",
            exit_status=out.exit_status,
            stderr=out.stderr or out.stdout,
        )
    return FirewallResult(key, tuple(value.split()))


def planned_firewall(host: Host, install_dir: str, *, install: bool) -> list[NodeScript]:
    """Check mode: the script `apply_firewall` would run (none where it runs none)."""
    if install and not wanted(host):
        return []
    return [firewall_node_script(host, install_dir, install=install)]


def firewall_node_script(host: Host, install_dir: str, *, install: bool) -> NodeScript:
    text = firewall_script(host, install_dir, install=install)
    return NodeScript("firewall", text, FIREWALL_TIMEOUT, "changing the node's firewall", ServiceScriptError)
