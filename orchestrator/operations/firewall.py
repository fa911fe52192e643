"""`rpc_allow_from`: iptables rules on a node that let only the listed sources reach the RPC port.

The rules (tcp transport only) carry the comment `rpcfleet <install_dir> <port>`, so rpcfleet finds its
own rules and never touches anyone else's. `controller` in the list is this machine's address as the node
sees it (the first field of the SSH session's `SSH_CONNECTION`), resolved when rpcfleet applies them.

The rules live in a root-owned script in the install dir (`rules_file`), written by `apply_firewall`
with the sources resolved, and run before every start of the server: by the system unit's
`ExecStartPre=+` (so a reboot, which forgets every rule nobody saved, never opens the port before the
server listens) and by the process supervisor's launch. Running it is read-then-change: the node's tagged
rules are compared with the wanted ones and replaced only when they differ (a second deploy changes
nothing). `status` counts the tagged rules and the tagged REJECTs (`FirewallRulesFact`).

The rules, first in INPUT, in order: ACCEPT for connections already established (a live client is
never reset when another operator's deploy replaces the list), ACCEPT from each source, then REJECT
(tcp-reset) from anyone else, so a refused client gets "connection refused" at once, not a timeout.

It never fails open. A replacement inserts the new set at the top of INPUT first (positions 1..n) and
only then deletes the old one, now below it: at every moment one of the two REJECTs is in place (while
the new set goes in, the old list's sources still pass, as they did a moment before). If iptables refuses
a rule, the new rules inserted so far are deleted and, when none of ours is a REJECT any more, an
ESTABLISHED ACCEPT and a REJECT are put back: the port then rejects every new connection, and the script
exits non-zero (the unit's start fails). This keeps the rule layout `status` and the removal read; an
own chain swapped in with `iptables-restore --noflush` would be one step, but adds a chain per server to
create, jump to, count and clean up, and its restore file would have to carry install_dir in a comment.

IPv6: the server binds an IPv4 literal (`state.bind_policy`), so only IPv4 clients reach it and the rules
are iptables' (IPv4) alone. The inventory refuses an IPv6 source, and a `controller` that reaches the
node over IPv6 is refused here (the port closed as above), naming the host.

Root runs the rules script from the install dir at every start, so before writing it the script checks
that every directory above it (as written, and as resolved) is root's alone: owned by root and writable
by nobody else (a root-owned sticky directory such as /tmp excepted: no one else may rename root's
entries there). A user who could write one of them could swap the script that root runs.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from orchestrator.connectors.base import Connection
from orchestrator.connectors.nodescript import NodeScript, ScriptOutput, run_script
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


# How `iptables -S` ends our REJECT's line, as a grep pattern: anchored at the end (where the comment,
# which holds install_dir, never is: the target follows it); `ours` adds the space.
REJECT_LISTED = " -j REJECT --reject-with tcp-reset $"


def _specs(host: Host, sources: list[str]) -> list[str]:
    """The rules for `sources` (shell words), in order: established, each source, the REJECT."""
    port = str(int(host.rpc_port))
    return [
        _established(port),
        *(f"-p tcp -s {src} --dport {port} -j ACCEPT" for src in sources),
        _reject(port),
    ]


def _established(port: str) -> str:
    return f"-p tcp --dport {port} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"


def _reject(port: str) -> str:
    return f"-p tcp --dport {port} -j REJECT --reject-with tcp-reset"


def rules_script(host: Host, install_dir: str) -> str:
    """The rules script (POSIX sh, run as root): check the tool and the right, read our rules, and
    (re)write them when they differ: the new set first, then the old one deleted. `$CTL` (the
    controller, when listed) is set by a line before it.

    Prints `@unchanged` or `@installed SOURCES`; `@notool` / `@noright USER` (exit CANNOT) when it cannot;
    when iptables refuses a rule, what `fail_closed` prints, and exit 1."""
    tag = rule_tag(host, install_dir)
    sources = ['"$CTL"' if src == CONTROLLER else shlex.quote(src) for src in host.rpc_allow_from or ()]
    specs = _specs(host, sources)
    count = len(specs)
    lines = [
        *_read_lines(tag, missing=f"exit {CANNOT}"),
        *_fail_closed_lines(host),
        "WANT=''",
        *(
            f'set -- {spec}; R=$("$IPT" -w -C INPUT "$@" -m comment --comment "$TAG" 2>/dev/null '
            '&& echo y || echo n); WANT="$WANT$R"'
            for spec in specs
        ),
        'N=$(printf "%s" "$CURRENT" | grep -c . || true)',
        f'if [ "$N" = {count} ] && [ "$WANT" = {"y" * count} ]; then echo @unchanged; exit 0; fi',
        # The new set on top, the old one (REJECT included) still below it until the set is whole.
        *(
            f'set -- {spec}; "$IPT" -w -I INPUT {position} "$@" -m comment --comment "$TAG" '
            f"|| {{ fail_closed; exit 1; }}; K={position}"
            for position, spec in enumerate(specs, start=1)
        ),
        "K=0",  # whole: its REJECT stands in front of whatever of the old set a failure leaves
        # The old rules: ours after the new set's, each by its number in a fresh listing.
        f'while :; do N=$(ours | sed -n "{count + 1}p" | cut -d: -f1); [ -n "$N" ] || break; '
        '"$IPT" -w -D INPUT "$N" || { fail_closed; exit 1; }; done',
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


def _fail_closed_lines(host: Host) -> list[str]:
    """Shell (after `_read_lines`): `fail_closed` deletes the $K new rules inserted so far (the first K
    of ours) and, when none of ours left is a REJECT, inserts an ESTABLISHED ACCEPT and a REJECT at the
    top. Prints `@closed kept` (the old rules, their REJECT included, stay), `@closed reject` (only
    established connections pass) or `@open` (no REJECT could be put back)."""
    port = str(int(host.rpc_port))
    return [
        "K=0",
        f"rejecting() {{ ours | grep -q -e {shlex.quote(REJECT_LISTED)}; }}",
        "fail_closed() {",
        '  while [ "$K" -gt 0 ]; do N=$(ours | head -n 1 | cut -d: -f1); [ -n "$N" ] || break; '
        '"$IPT" -w -D INPUT "$N" || break; K=$((K - 1)); done',
        '  if rejecting; then echo "@closed kept"; return 0; fi',
        f'  set -- {_established(port)}; P=1; "$IPT" -w -I INPUT 1 "$@" -m comment --comment "$TAG" && P=2',
        f'  set -- {_reject(port)}; "$IPT" -w -I INPUT "$P" "$@" -m comment --comment "$TAG"',
        '  if rejecting; then echo "@closed reject"; else echo @open; fi',
        "}",
    ]


# Delete our rules, whatever they are, by their number in the chain (the first of ours in a fresh listing
# each time): the listed text, which holds install_dir, is never run as shell code.
_DELETE_OURS = (
    'while :; do N=$(ours | head -n 1 | cut -d: -f1); [ -n "$N" ] || break; '
    '"$IPT" -w -D INPUT "$N" || exit 1; done'
)


# Shell: print the first path from $1 up to / that someone other than root could change (not root's, or
# writable by its group or others without the sticky bit; a symbolic link's own mode means nothing).
_UNSAFE_IN_CHAIN = """\
unsafe_in() {
  P=$1
  while :; do
    S=$(stat -c '%u %a' -- "$P" 2>/dev/null) || { echo "$P"; return 0; }
    M=0${S#* }
    if [ "${S%% *}" != 0 ]; then echo "$P"; return 0; fi
    if [ ! -L "$P" ] && [ $((M & 022)) != 0 ] && [ $((M & 01000)) = 0 ]; then echo "$P"; return 0; fi
    case $P in /|.) return 0;; esac
    P=$(dirname -- "$P")
  done
}"""


def firewall_script(host: Host, install_dir: str, *, install: bool) -> str:
    """What `apply_firewall` runs over SSH. Install: resolve the controller, check the install dir's
    chain, write the rules script (as root, flushed before the rename that makes it current) and run it.
    Removal: delete our rules (the script stays for the unit, which runs it at its next start). Prints
    what `rules_script` prints, or `@removed` / `@none`, or `@nocontroller`; `@ipv6controller ADDR` or
    `@unsafe OWNER MODE PATH` after closing the port (`fail_closed`)."""
    tag = rule_tag(host, install_dir)
    if not install:
        return "\n".join(
            [
                *_read_lines(tag, missing="exit 0"),
                _DELETE_OURS,
                'if [ -n "$CURRENT" ]; then echo @removed; else echo @none; fi',
            ]
        )
    head = f"#!/bin/sh\n# Written by rpcfleet: rpc_allow_from's rules for port {int(host.rpc_port)}."
    resolve, build = [], f"new={shlex.quote(head)}"
    if CONTROLLER in (host.rpc_allow_from or ()):
        resolve = [
            "CTL=${SSH_CONNECTION:-}; CTL=${CTL%% *}",
            'case "$CTL" in ::ffff:*.*) CTL=${CTL#::ffff:};; esac',  # an IPv4 client of a dual-stack sshd
            # an address only: it is written into a script root runs
            'case "$CTL" in ""|*[!0-9A-Fa-f.:]*) echo @nocontroller; exit 0;; esac',
            # the server listens on IPv4 only: an IPv6 controller could never be let in
            'case "$CTL" in *:*) fail_closed; echo "@ipv6controller $CTL"; exit 0;; esac',
        ]
        build += '"\nCTL=$CTL"'
    return "\n".join(
        [
            *_read_lines(tag, missing="exit 0"),
            *_fail_closed_lines(host),
            *resolve,
            f"F={shlex.quote(rules_path(host, install_dir))}",
            build + '"\n"' + shlex.quote(rules_script(host, install_dir)),
            'D=$(dirname -- "$F")',
            'mkdir -p "$D" || exit 1',
            _UNSAFE_IN_CHAIN,
            'BAD=""; case $D in /*) BAD=$(unsafe_in "$D");; esac',
            # and as resolved: a symbolic link on the way leads elsewhere
            'if [ -z "$BAD" ]; then R=$(cd "$D" && pwd -P) || R=$D; BAD=$(unsafe_in "$R"); fi',
            'if [ -n "$BAD" ]; then W=$(stat -c \'%U %a\' -- "$BAD" 2>/dev/null) || W="? ?"; fail_closed; '
            'echo "@unsafe $W $BAD"; exit 0; fi',
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
    iptables or the right to change it, when the controller is IPv6 or the install dir's chain is not
    root's alone, or when iptables refused a rule (the port then closed: `fail_closed`)."""
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
    port = _port_note(out)
    if key == "ipv6controller":
        raise ServiceError(
            f"rpc_allow_from: controller, but this machine reaches the node over IPv6 ({value}); the "
            f"rpc-server listens on IPv4 only, so no rule can let it in{port}",
            host=host.name,
            hint="connect to the node over IPv4 (its IPv4 address as `address`), or list this machine's "
            "IPv4 address instead of controller",
        )
    if key == "unsafe":
        owner, _, rest = value.partition(" ")
        mode, _, path = rest.partition(" ")
        raise ServiceError(
            f"refusing to let root run {rules_path(host, install_dir)}: {path} (owner {owner}, mode {mode}) "
            f"is not root's alone, so another user could replace the script{port}",
            host=host.name,
            hint="use an install_dir whose every directory root owns and only root may write "
            "(such as /opt/rpcfleet), or rpc_transport: ssh (no firewall rule needed)",
        )
    if key in ("closed", "open"):
        raise script.failure(
            host.name,
            f"changing the node's firewall failed: iptables refused a rule{port}",
            exit_status=out.exit_status,
            stderr=out.stderr or out.stdout,
        )
    if out.exit_status != 0 or not key:
        raise script.failure(
            host.name,
            "changing the node's firewall failed",
            exit_status=out.exit_status,
            stderr=out.stderr or out.stdout,
        )
    return FirewallResult(key, tuple(value.split()))


def _port_note(out: ScriptOutput) -> str:
    """What `fail_closed` left, as the end of an error ("" when it did not run)."""
    if out.get("closed") == "kept":
        return "; the previous rules stay, their REJECT included"
    if out.get("closed") == "reject":
        return "; the port now rejects every new connection (established ones go on)"
    if "open" in out:
        return "; no REJECT could be put back: the port may be open to everyone (see `rpcfleet status`)"
    return ""


def planned_firewall(host: Host, install_dir: str, *, install: bool) -> list[NodeScript]:
    """Check mode: the script `apply_firewall` would run (none where it runs none)."""
    if install and not host.firewalled:
        return []
    return [firewall_node_script(host, install_dir, install=install)]


def firewall_node_script(host: Host, install_dir: str, *, install: bool) -> NodeScript:
    text = firewall_script(host, install_dir, install=install)
    return NodeScript("firewall", text, FIREWALL_TIMEOUT, "changing the node's firewall", ServiceScriptError)
