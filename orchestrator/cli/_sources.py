"""Where a command's inventory comes from: a file (native YAML, Ansible YAML or INI), or Slurm
(`-i slurm:`, `-i slurm:JOBID`, `--slurm-job JOBID`, or a file with a `slurm:` section: an overlay of
variables on a job's nodes). The Slurm reader is pure but for `scontrol`, which this edge runs (through
engine/children.py, the one starter of processes)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core.errors import InventoryError, UsageError

if TYPE_CHECKING:
    from orchestrator.inventory.model import Inventory
    from orchestrator.inventory.slurm import CommandOutput, Scontrol

SCONTROL_TIMEOUT = 30.0  # seconds; scontrol asks slurmctld, which may be slow or away


def read_inventory(args: argparse.Namespace, path: Path) -> Inventory:
    """The inventory `path` names (`-i`, or the default one) and `--slurm-job`, read."""
    from orchestrator.inventory.load import load_inventory
    from orchestrator.inventory.slurm import (
        SLURM_SCHEME,
        check_job_id,
        is_slurm_document,
        job_of_spec,
        read_slurm_inventory,
    )

    job = getattr(args, "slurm_job", None)
    if job is not None:
        job = check_job_id(job, "--slurm-job")
    spec = str(path)
    if spec.startswith(SLURM_SCHEME):
        named = job_of_spec(spec)
        if job is not None and named is not None and job != named:
            raise UsageError(f"-i {spec} and --slurm-job {job} name two jobs: give one")
        return read_slurm_inventory(None, job=job or named, environ=os.environ, scontrol=scontrol_runner())
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = ""  # load_inventory says what is wrong with the file
    if text and is_slurm_document(text):
        return read_slurm_inventory(path, job=job, environ=os.environ, scontrol=scontrol_runner())
    if job is not None:
        raise UsageError(
            f"--slurm-job needs a Slurm inventory, and {path} is not one",
            hint="use -i slurm:JOBID, or an overlay file with a `slurm:` section (docs/slurm.md)",
        )
    return load_inventory(path)


def scontrol_runner() -> Scontrol | None:
    """Runs Slurm's `scontrol` (the one on PATH), or None when there is none."""
    from orchestrator.engine.children import run_child
    from orchestrator.inventory.slurm import CommandOutput

    program = shutil.which("scontrol")
    if program is None:
        return None

    def run(arguments: Sequence[str]) -> CommandOutput:
        command = " ".join(["scontrol", *arguments])
        try:
            done = run_child(
                [program, *arguments],
                capture_output=True,
                text=True,
                timeout=SCONTROL_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise InventoryError(
                f"{command} did not answer in {SCONTROL_TIMEOUT:.0f} s", hint="is slurmctld reachable?"
            ) from None
        except OSError as exc:
            raise InventoryError(f"cannot run {command}: {exc}") from None
        return CommandOutput(done.stdout, done.stderr, done.returncode)

    return run
