"""GPU facts: nvidia-smi and rocm-smi, each a command plus a pure parser."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    pass
from orchestrator.facts.base import NOT_FOUND, TOOL_TIMEOUT_S, Fact, MiB, tail, with_tool


@dataclass(frozen=True)
class Gpu:
    vendor: Literal["nvidia", "amd"]
    index: int
    name: str
    total: int | None  # bytes
    free: int | None  # bytes


@dataclass(frozen=True)
class GpuReport:
    """What one GPU tool said. `present=False`: the tool is not installed (a normal answer)."""

    tool: str
    present: bool
    gpus: tuple[Gpu, ...] = ()
    error: str | None = None  # the tool ran but failed (driver not loaded, timed out...)


def _mib(text: str) -> int | None:
    text = text.strip()
    return int(text) * MiB if text.isdigit() else None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi_csv(text: str) -> tuple[Gpu, ...]:
    """`index, name, memory.total, memory.free` rows (csv, noheader, nounits; MiB)."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        name = ", ".join(fields[1:-2])  # a name could hold a comma; the numbers are the last two
        gpus.append(Gpu("nvidia", int(fields[0]), name, _mib(fields[-2]), _mib(fields[-1])))
    return tuple(gpus)


@dataclass(frozen=True)
class NvidiaGpuFact(Fact[GpuReport]):
    name: ClassVar[str] = "nvidia_gpus"
    QUERY: ClassVar[str] = "--query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits"

    def command(self) -> str:
        return with_tool("nvidia-smi", self.QUERY)

    def parse(self, stdout: str, stderr: str, exit_status: int) -> GpuReport:
        if exit_status == NOT_FOUND:
            return GpuReport("nvidia-smi", present=False)
        gpus = parse_nvidia_smi_csv(stdout) if exit_status == 0 else ()
        error = None
        if exit_status == 124:
            error = f"nvidia-smi timed out after {TOOL_TIMEOUT_S} s"
        elif exit_status != 0 or (not gpus and stdout.strip()):
            # nvidia-smi prints its failures on stdout ("NVIDIA-SMI has failed ...", "No devices were found").
            error = tail(stdout + "\n" + stderr) or f"exit status {exit_status}"
        return GpuReport("nvidia-smi", present=True, gpus=gpus, error=error)


_AMD_NAME_KEYS = ("Card Series", "Card series", "Device Name", "Card Model", "Card model", "Card SKU")


def parse_rocm_smi_json(text: str) -> tuple[Gpu, ...]:
    """`rocm-smi --showmeminfo vram --json`: {"card0": {"VRAM Total Memory (B)": "...", "VRAM Total
    Used Memory (B)": "..."}, ...}; warnings before the JSON and non-card keys are skipped."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in rocm-smi output")
    data, _ = json.JSONDecoder().raw_decode(text[start:])
    if not isinstance(data, dict):
        raise ValueError("rocm-smi JSON is not an object")
    gpus: list[Gpu] = []
    for key, card in data.items():
        match = re.fullmatch(r"card(\d+)", str(key))
        if match is None or not isinstance(card, dict):
            continue
        total = _int_or_none(card.get("VRAM Total Memory (B)"))
        used = _int_or_none(card.get("VRAM Total Used Memory (B)"))
        free = total - used if total is not None and used is not None else None
        name = next((str(card[k]) for k in _AMD_NAME_KEYS if card.get(k) not in (None, "", "N/A")), str(key))
        gpus.append(Gpu("amd", int(match.group(1)), name, total, free))
    return tuple(sorted(gpus, key=lambda g: g.index))


def _int_or_none(value: object) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class RocmGpuFact(Fact[GpuReport]):
    name: ClassVar[str] = "rocm_gpus"

    def command(self) -> str:
        return with_tool("rocm-smi", "--showmeminfo vram --json")

    def parse(self, stdout: str, stderr: str, exit_status: int) -> GpuReport:
        if exit_status == NOT_FOUND:
            return GpuReport("rocm-smi", present=False)
        if exit_status == 124:
            return GpuReport("rocm-smi", present=True, error=f"rocm-smi timed out after {TOOL_TIMEOUT_S} s")
        try:
            gpus = parse_rocm_smi_json(stdout)
        except ValueError:
            gpus = ()
            if exit_status != 0 or stdout.strip():
                return GpuReport(
                    "rocm-smi",
                    present=True,
                    error=tail(stdout + "\n" + stderr) or f"exit status {exit_status}",
                )
        error = None if exit_status == 0 else (tail(stderr) or f"exit status {exit_status}")
        return GpuReport("rocm-smi", present=True, gpus=gpus, error=error)
