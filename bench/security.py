"""The systemd unit's sandbox, graded by `systemd-analyze security` on a lab node that boots systemd.

rpcfleet deploys its CPU rpc-server there as root (a system unit running as the dedicated user), and
the node's own `systemd-analyze security UNIT` grades the unit (0 most exposed is 10, 0 is the least);
the same for a bare unit with the same launch line and none of the sandbox, in the same run, as the
baseline. The directives it still counts against the unit are listed with why they stay.

Target, computed: systemd's own word for the unit is OK or better (`systemd-analyze` calls an exposure
under 5.0 OK, under 1.0 SAFE; MEDIUM, EXPOSED and UNSAFE above), and every directive still counted against
it is one kept on purpose, with its reason (`KEPT`): one without a reason is hardening not yet done.

    python bench/security.py [--write BENCHMARKS.md]
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from _common import arg_parser, load_average, stamp, write_section

from orchestrator.artifacts.build import default_artifact
from orchestrator.engine.executor import Session
from orchestrator.inventory.load import load_inventory
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.netns import privileged
from orchestrator.lab.state import Lab
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.layer import OperationOptions
from orchestrator.operations.server.steps import make_deploy_step, make_service_step
from orchestrator.operations.systemd import unit_name

SECTION = "security"
LAB_NAME = "benchsec"
INSTALL = "/opt/rpcfleet"
EXPOSURE = re.compile(r"Overall exposure level for \S+: ([0-9.]+) (\S+)")
# Counted against the unit on purpose: a GPU server needs the devices, the RPC server needs the network
# and its own user's files; systemd-analyze weighs these whatever the service.
KEPT = {
    "PrivateDevices=": "a GPU server opens /dev/dri or /dev/nvidia*",
    "PrivateNetwork=": "the server's job is a TCP port",
    "IPAddressDeny=": "rpc_allow_from is the firewall's (a unit-level allow list would duplicate it)",
    "DeviceAllow=": "the same devices",
    "PrivateUsers=": "the dedicated user owns its cache on the host",
    "RootDirectory=/RootImage=": "the server runs from its install dir, not an image",
    "PrivateMounts=": "the cache is bound in from the host",
}


Grade = tuple[float, str, list[str]]  # exposure, systemd's word, the directives counted against it
GOOD_WORDS = ("OK", "SAFE", "PERFECT")  # systemd-analyze's words for an exposure under 5.0


def verdict(ours: Grade) -> tuple[bool, str]:
    """(met, why) of the target: systemd's word OK or better, and nothing open without a reason."""
    unexplained = [item for item in ours[2] if item not in KEPT]
    met = ours[1] in GOOD_WORDS and not unexplained
    why = f"systemd's word {ours[1]}, {len(unexplained)} directive(s) open without a reason"
    return met, why


def bare_unit(text: str) -> str:
    """The same unit with only [Unit], the launch line, the user and the restart policy."""
    keep = ("[", "#", "Description", "After", "Wants", "Type", "User", "Group", "Environment", "ExecStart",
            "Restart", "WantedBy", "StartLimit")  # fmt: skip
    return "\n".join(line for line in text.splitlines() if not line or line.startswith(keep)) + "\n"


def analyze(lab: Lab, unit: str) -> Grade:
    out = lab.node_exec(1, ["systemd-analyze", "security", "--no-pager", unit], check=False).stdout
    match = EXPOSURE.search(out)
    if match is None:
        raise SystemExit(f"systemd-analyze security {unit}: no exposure level in\n{out}")
    # Without a terminal each check is a line `+ Directive=...` (met) or `- Directive=... weight` (not).
    open_items = [line.split()[1] for line in out.splitlines() if line.startswith(("- ", "✗ "))]
    return float(match.group(1)), match.group(2), open_items


async def deploy(hosts: list[Any], chooser: ArtifactChooser) -> None:
    async with Session(forks=2) as session:
        run = await session.run(hosts, make_deploy_step(chooser), name="deploy")
        if not run.ok:
            raise SystemExit(f"deploy failed: {[str(r.error) for r in run.failed]}")


async def stop(hosts: list[Any]) -> None:
    async with Session(forks=2) as session:
        await session.run(hosts, make_service_step("stopped", OperationOptions(force=True)), name="stop")


class _Fixed(ArtifactChooser):
    def __init__(self) -> None:
        super().__init__()
        self.artifact = default_artifact()

    async def __call__(self, host: Any, state: Any) -> Any:
        return self.artifact


def main() -> int:
    args = arg_parser(__doc__).parse_args()
    if not privileged():
        print("bench/security.py needs root (network namespaces)", file=sys.stderr)
        return 2
    reap_stale()
    load = load_average()
    lab = lab_up(1, name=LAB_NAME, owner_pid=os.getpid(), init="systemd")
    try:
        base = load_inventory(Path(lab.inventory)).hosts[0]
        host = dataclasses.replace(base, ssh_user="root", supervisor="systemd", install_dir=INSTALL)
        asyncio.run(deploy([host], _Fixed()))
        unit = unit_name(INSTALL)
        text = lab.node_exec(1, ["cat", f"/etc/systemd/system/{unit}"]).stdout
        ours = analyze(lab, unit)
        bare = "rpcfleet-bare-baseline.service"
        path = f"/etc/systemd/system/{bare}"
        write = f"printf %s {shlex.quote(bare_unit(text))} > {path} && systemctl daemon-reload"
        lab.node_exec(1, ["sh", "-c", write])
        baseline = analyze(lab, bare)
        version = lab.node_exec(1, ["systemctl", "--version"]).stdout.splitlines()[0]
        asyncio.run(stop([host]))
    finally:
        lab_down(LAB_NAME)
    section = render(ours, baseline, version, load)
    print(section)
    if args.write is not None:
        write_section(args.write, SECTION, section)
    return 0


def render(ours: Grade, bare: Grade, version: str, load: float) -> str:
    kept = [f"`{item}` ({KEPT[item]})" for item in ours[2] if item in KEPT]
    other = [f"`{item}`" for item in ours[2] if item not in KEPT]
    met, why = verdict(ours)
    return "\n".join(
        [
            f"## {SECTION}",
            "",
            f"{stamp()}; load before: {load:.2f}. `python bench/security.py`: the CPU rpc-server deployed "
            f"as root on a lab node that boots systemd ({version}), its system unit graded by the node's "
            "`systemd-analyze security` (10 most exposed, 0 least), and the same launch line in a bare unit "
            "(user, restart policy, nothing else) as the baseline.",
            "",
            "| unit | exposure | systemd's word |",
            "|---|---|---|",
            f"| rpcfleet's system unit | {ours[0]:.1f} | {ours[1]} |",
            f"| bare unit, same launch line | {bare[0]:.1f} | {bare[1]} |",
            "",
            f"Still counted against it on purpose: {', '.join(kept) or 'nothing'}."
            + (f" Others, with no reason given: {', '.join(other)}." if other else ""),
            "",
            "Target (systemd's word for rpcfleet's unit OK or better, that is an exposure under 5.0, and "
            "every directive still counted against it kept on purpose, with its reason): "
            f"**{'met' if met else 'not met'}** ({why}).",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
