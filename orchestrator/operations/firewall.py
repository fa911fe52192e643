"""`rpc_allow_from`: iptables rules on a node that let only the listed sources reach the RPC port.

The rules (tcp transport only) carry the comment `rpcfleet <install_dir> <port>`, so rpcfleet finds its
own rules and never touches anyone else's. `controller` in the list is this machine's address as the node
sees it (the first field of the SSH session's `SSH_CONNECTION`), resolved when rpcfleet applies them.

The rules live in a root-owned script in the install dir (`rules_file`), written by `apply_firewall`
with the sources resolved, and run before every start of the server: by the system unit's
`ExecStartPre=+` (so a reboot, which forgets every rule nobody saved, never opens the port before the
server listens) and by the process supervisor's launch. Running it is read-then-change: the node's tagged
rules are compared with the wanted ones and replaced only when they differ (a second deploy changes
nothing). `status` counts the tagged rules (`FirewallRulesFact`) and says `firewall: missing`.

The rules, first in INPUT, in order: ACCEPT for connections already established (a live client is
never reset when another operator's deploy replaces the list), ACCEPT from each source, then REJECT
(tcp-reset) from anyone else, so a refused client gets "connection refused" at once, not a timeout.
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
from orchestrator.operations.server.state import server_files

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


def rules_path(host: Host, install_dir: str) -> str:
    """The node's rules script for this server (root's: in the install dir, never in the server user's
    folders)."""
    return f"{install_dir.rstrip('/')}/{server_files(host.server).firewall}"


# Exit status of the rules script when it cannot install them: the unit's ExecStartPre fails, so the
# server does not start with its port open to all.
CANNOT = 3


def rules_script(host: Host, install_dir: str) -> str:
    """The rules script (POSIX sh, run as root): check the tool and the right, read our rules, and
    (re)write them when they differ. `$CTL` (the controller, when listed) is set by a line before it.

    Prints `@unchanged` or `@installed SOURCES`; `@notool` / `@noright USER` (exit CANNOT) when it cannot."""
    tag = rule_tag(host, install_dir)
    port = str(host.rpc_port)
    sources = ['"$CTL"' if src == CONTROLLER else shlex.quote(src) for src in host.rpc_allow_from or ()]
    specs = [
        f"-p tcp --dport {port} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        *(f"-p tcp -s {src} --dport {port} -j ACCEPT" for src in sources),
        f"-p tcp --dport {port} -j REJECT --reject-with tcp-reset",
    ]
    count = len(specs)
    lines = [
        *_read_lines(tag, missing=f"exit {CANNOT}"),
        "WANT=''",
        *(
            f'set -- {spec}; R=$("$IPT" -w -C INPUT "$@" -m comment --comment "$TAG" 2>/dev/null '
            '&& echo y || echo n); WANT="$WANT$R"'
            for spec in specs
        ),
        'N=$(printf "%s" "$CURRENT" | grep -c . || true)',
        f'if [ "$N" = {count} ] && [ "$WANT" = {"y" * count} ]; then echo @unchanged; exit 0; fi',
        _DELETE_OURS,
        *(
            f'set -- {spec}; "$IPT" -w -I INPUT {position} "$@" -m comment --comment "$TAG" || exit 1'
            for position, spec in enumerate(specs, start=1)
        ),
        f"echo @installed {' '.join(sources)}",
    ]
    return "\n".join(lines)


def _read_lines(tag: str, *, missing: str) -> list[str]:
    """Shell: find iptables and root (else print why and run `missing`), and read our rules as
    `iptables -S` prints them, numbered as in the chain, into $CURRENT (`ours` reads them again)."""
    return [
        "set -u",
        "IPT=$(command -v iptables || ls /usr/sbin/iptables /sbin/iptables 2>/dev/null | head -n 1) || true",
        f'if [ -z "$IPT" ]; then echo @notool; {missing}; fi',
        f'if [ "$(id -u)" != 0 ]; then echo "@noright $(id -un)"; {missing}; fi',
        f"TAG={shlex.quote(tag)}",
        f"LISTED={shlex.quote(listed_comment(tag))}",
        # a space closes the comment: one install dir's tag is never the start of another's
        'ours() { "$IPT" -w -S INPUT | grep -e "^-A " | sed "s/\\$/ /" | grep -n -F -e "$LISTED " || true; }',
        "CURRENT=$(ours)",
    ]


# Delete our rules, whatever they are, by their number in the chain (the first of ours in a fresh listing
# each time): the listed text, which holds install_dir, is never run as shell code.
_DELETE_OURS = (
    'while :; do N=$(ours | head -n 1 | cut -d: -f1); [ -n "$N" ] || break; '
    '"$IPT" -w -D INPUT "$N" || exit 1; done'
)


def firewall_script(host: Host, install_dir: str, *, install: bool) -> str:
    """What `apply_firewall` runs over SSH. Install: resolve the controller, write the rules script (as
    root, flushed before the rename that makes it current) and run it. Removal: delete our rules (the
    script stays for the unit, which runs it at its next start). Prints what `rules_script` prints, or
    `@removed` / `@none`, or `@nocontroller`."""
    if not install:
        return "\n".join(
            [
                *_read_lines(rule_tag(host, install_dir), missing="exit 0"),
                _DELETE_OURS,
                'if [ -n "$CURRENT" ]; then echo @removed; else echo @none; fi',
            ]
        )
    head = f"#!/bin/sh\n# Written by rpcfleet: rpc_allow_from's rules for port {int(host.rpc_port)}."
    resolve, build = [], f"new={shlex.quote(head)}"
    if CONTROLLER in (host.rpc_allow_from or ()):
        resolve = [
            "CTL=${SSH_CONNECTION%% *}",
            # an address only: it is written into a script root runs
            'case "$CTL" in ""|*[!0-9A-Fa-f.:]*) echo @nocontroller; exit 0;; esac',
        ]
        build += '"\nCTL=$CTL"'
    return "\n".join(
        [
            *resolve,
            'if [ "$(id -u)" != 0 ]; then echo "@noright $(id -un)"; exit 0; fi',
            f"F={shlex.quote(rules_path(host, install_dir))}",
            build + '"\n"' + shlex.quote(rules_script(host, install_dir)),
            'mkdir -p "$(dirname "$F")" || exit 1',
            'if [ "$(cat "$F" 2>/dev/null)" != "$new" ]; then',
            '  (umask 077; printf "%s\\n" "$new" > "$F.tmp") && { sync "$F.tmp" 2>/dev/null; '
            'mv -f "$F.tmp" "$F"; } || exit 1',
            "fi",
            'exec sh "$F"',
        ]
    )


async def apply_firewall(conn: Connection, host: Host, install_dir: str, *, install: bool) -> FirewallResult:
    """Install (`install=True`, when `rpc_allow_from` is set) or remove this server's rules.

    Without `rpc_allow_from` nothing is run on install; removal always looks for our rules, so a rule
    left from an earlier inventory goes with the server. Raises ServiceError when the node lacks
    iptables or the right to change it."""
    if install and not host.firewalled:
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
    if install and not host.firewalled:
        return []
    return [firewall_node_script(host, install_dir, install=install)]


def firewall_node_script(host: Host, install_dir: str, *, install: bool) -> NodeScript:
    text = firewall_script(host, install_dir, install=install)
    return NodeScript("firewall", text, FIREWALL_TIMEOUT, "changing the node's firewall", ServiceScriptError)
