"""Installing a pinned rpc-server artifact on a host: read what is there, plan the change, apply it.

Layout on the node (`install_dir`, default `~/.local/lib/rpcfleet`):

    versions/<id>/         one unpacked artifact each (manifest.json, bin/ggml-rpc-server, libggml*.so)
    current -> versions/<id>   switched atomically (`ln -s` to a temporary name, then `mv -T`)
    history                ids in the order they were made current (most recent last): rollback, pruning
    tmp/                   uploads and unpacking in progress (emptied before each upload)
    run/, log/, cache/     the server's pid file, log and LLAMA_CACHE (see operations/server/)

Read, then change: `read_install_state` gathers `install_facts` (orchestrator.facts) in one round
trip and `install_state_from_facts` (pure) turns them into an `InstallState`; `plan_install` (pure)
compares it with the artifact and returns an `InstallChange` (what `--check` prints); `apply_install`
uploads to a temporary name, verifies the sha256 on the node, unpacks into a staging folder, verifies
every file, and only then moves it into `versions/` and switches `current`. Any failure before the
switch leaves the previous version in place.

A `build: on_node` spec (for a backend the controller cannot build) goes another way with the same end:
`plan_node_build` compares the node's versions with the build's id (derived from the sdist and the cmake
arguments, see artifacts.NodeBuild); `apply_node_build` uploads the sdist to `src/` once, runs the build
script in `build/<key>/` (kept for incremental rebuilds) with its output in `build/<key>/build.log`,
reporting the latest log line while it runs, lists and hashes the output on the node, writes the manifest,
and installs it into `versions/<id>/` through the same switch, history and pruning as an upload.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.artifacts.manifest import Artifact, Manifest
from orchestrator.artifacts.node_build import NodeBuild
from orchestrator.connectors.base import Connection
from orchestrator.core.errors import ArtifactError, InstallError
from orchestrator.core.units import format_size
from orchestrator.facts.base import Fact, gather
from orchestrator.facts.gpus import GpuRuntime, GpuRuntimeFact
from orchestrator.facts.server import (
    CurrentLinkFact,
    HistoryFact,
    InstallDirFact,
    InstalledManifest,
    InstalledManifestFact,
    VersionsFact,
)
from orchestrator.facts.system import FreeSpaceFact, OsFact, OsInfo
from orchestrator.inventory.model import Host

Action = Literal["none", "install", "switch"]


STATE_TIMEOUT = 20.0


PREPARE_TIMEOUT = 20.0


APPLY_TIMEOUT = 120.0


SPACE_MARGIN = 1 << 20  # bytes kept free beyond the archive and the unpacked files


# An on-node build needs the sdist, its extracted source (about 3x the sdist) and the build tree.
BUILD_SPACE_FACTOR = 4


BUILD_SPACE_EXTRA = 256 << 20


BUILD_POLL_INTERVAL = 1.0  # seconds between reads of the build log's last line


UPLOAD_CHECK_TIMEOUT = 60.0  # sha256 of the uploaded sdist on the node


def normalise_platform(uname_s: str, uname_m: str) -> tuple[str, str]:
    """(os, arch) in manifest spelling from `uname -s` / `uname -m`."""
    os_name = uname_s.strip().lower()
    machine = uname_m.strip().lower()
    arch = {"amd64": "x86_64", "x64": "x86_64"}.get(machine, machine)
    if arch == "arm64" and os_name != "darwin":
        arch = "aarch64"
    return os_name, arch


@dataclass(frozen=True)
class InstallState:
    """What is installed on one host, read in one command."""

    host: str
    install_dir: str  # absolute, as the node's shell expanded it
    os: str
    arch: str
    current: str | None  # the version id `current` points to
    versions: tuple[str, ...]  # version folders present
    history: tuple[str, ...]  # ids made current, oldest first (deduplicated, most recent last)
    free_bytes: int | None  # free space where the install lives (or would be created)
    manifest: Manifest | None  # current/manifest.json, when readable
    problems: tuple[str, ...] = ()  # e.g. a `current` link to a missing folder
    gpu_runtime: GpuRuntime | None = None  # the node's GPU runtimes (None: not read)

    @property
    def installed(self) -> bool:
        return self.current is not None and self.current in self.versions and self.manifest is not None

    @property
    def protocol(self) -> str | None:
        return self.manifest.protocol if self.manifest else None

    def previous(self) -> str | None:
        """The most recently current version other than `current` that is still installed (rollback)."""
        for version in reversed(self.history):
            if version != self.current and version in self.versions:
                return version
        return None


def install_facts(install_dir: str) -> list[Fact[Any]]:
    """The facts an `InstallState` is made of (gathered in one round trip)."""
    return [
        InstallDirFact(install_dir),
        OsFact(),
        CurrentLinkFact(install_dir),
        VersionsFact(install_dir),
        HistoryFact(install_dir),
        FreeSpaceFact(install_dir),
        InstalledManifestFact(install_dir),
        GpuRuntimeFact(),
    ]


def install_state_from_facts(host: str, values: Mapping[str, Any]) -> InstallState:
    """Pure: the values of `install_facts` (as `parse_gathered` returns them) -> `InstallState`."""
    install_dir: str | None = values.get(InstallDirFact.name)
    os_info: OsInfo | None = values.get(OsFact.name)
    if install_dir is None or os_info is None or os_info.system is None:
        missing = "the install folder" if install_dir is None else "`uname -s`"
        raise InstallError(f"the install state read from the host lacks {missing}", host=host)
    os_name, arch = normalise_platform(os_info.system, os_info.machine or "")
    versions: tuple[str, ...] = values.get(VersionsFact.name, ())
    problems: list[str] = []
    current: str | None = None
    link: str | None = values.get(CurrentLinkFact.name)
    if link is not None:
        # The link is relative (versions/<id>); an absolute one from elsewhere is reported as such.
        target = link.rstrip("/")
        current = target.rsplit("/", 1)[-1] if target.startswith("versions/") else None
        if current is None:
            problems.append(f"`current` points outside versions/: {target}")
        elif current not in versions:
            problems.append(f"`current` points to a missing version: {current}")
    manifest: Manifest | None = None
    found: InstalledManifest | None = values.get(InstalledManifestFact.name)
    if found is not None and found.error is not None:
        problems.append(f"unreadable current/manifest.json: {found.error}")
    elif found is not None:
        try:
            manifest = Manifest.from_dict(found.data)
        except (ValueError, ArtifactError) as exc:
            problems.append(f"unreadable current/manifest.json: {exc}")
    elif current is not None and current in versions:
        problems.append("current/manifest.json is missing")
    return InstallState(
        host=host,
        install_dir=install_dir,
        os=os_name,
        arch=arch,
        current=current,
        versions=versions,
        history=values.get(HistoryFact.name, ()),
        free_bytes=values.get(FreeSpaceFact.name),
        manifest=manifest,
        problems=tuple(problems),
        gpu_runtime=values.get(GpuRuntimeFact.name),
    )


async def read_install_state(conn: Connection, host: Host) -> InstallState:
    values = await gather(conn, install_facts(host.install_dir), timeout=STATE_TIMEOUT)
    return install_state_from_facts(host.name, values)


@dataclass(frozen=True)
class InstallChange:
    """What making `version` current on a host means: nothing, a switch to a present version, or an
    install (upload + unpack + switch). `artifact` is None for a rollback (the version is on the node)."""

    host: str
    action: Action
    version: str
    artifact: Artifact | None
    install_dir: str
    previous: str | None  # the version current before the change
    prune: tuple[str, ...] = ()  # versions removed after the switch
    reason: str = ""
    build: NodeBuild | None = None  # set for a `build: on_node` artifact (then `artifact` is None)
    built: Manifest | None = None  # the manifest an on-node build produced (after apply_node_build)

    @property
    def changed(self) -> bool:
        return self.action != "none"

    @property
    def manifest(self) -> Manifest | None:
        """The manifest of `version` when the controller knows it (None for a switch to a node build)."""
        return self.artifact.manifest if self.artifact is not None else self.built

    def describe(self) -> str:
        if self.action == "none":
            return f"{self.version} already installed"
        if self.action == "install" and self.build is not None:
            verb = "build on the node and install"
        else:
            verb = "install" if self.action == "install" else "switch to installed"
        text = f"{verb} {self.version}"
        if self.previous:
            text += f" (was {self.previous})"
        if self.prune:
            text += f"; remove {', '.join(self.prune)}"
        return text

    def to_json(self) -> dict[str, object]:
        return {
            "action": self.action,
            "version": self.version,
            "previous": self.previous,
            "prune": list(self.prune),
            "reason": self.reason,
            "build_on_node": self.build is not None,
        }


def _unpacked_size(artifact: Artifact) -> int:
    return sum(entry.size for entry in artifact.manifest.files) + len(artifact.manifest.to_bytes())


def prune_plan(
    history: Sequence[str], versions: Sequence[str], new: str, protect: Iterable[str], keep_versions: int
) -> tuple[str, ...]:
    """Pure: the versions to remove once `new` is current, keeping the `keep_versions` most recently
    current ones (`new` included) and every version in `protect` (the one still running)."""
    order = [v for v in history if v != new] + [new]
    recent = [v for v in reversed(order) if v in versions or v == new]
    kept = set(recent[: max(1, keep_versions)]) | set(protect)
    return tuple(sorted(v for v in versions if v not in kept))


def _require_space(state: InstallState, needed: int, what: str) -> None:
    """Refuse a change the install folder has no room for, before anything is written."""
    if state.free_bytes is not None and state.free_bytes < needed:
        kept = f"{state.current} stays installed" if state.current else "nothing was changed"
        raise InstallError(
            f"not enough disk space in {state.install_dir}: {format_size(state.free_bytes)} free, "
            f"about {format_size(needed)} needed to {what}; {kept}",
            host=state.host,
        )


def plan_install(
    state: InstallState, artifact: Artifact, *, keep_versions: int = 3, force: bool = False
) -> InstallChange:
    """Pure: the change that makes `artifact` current on the host described by `state`.

    Raises InstallError when the artifact does not fit the host (os/arch) or its disk.
    """
    manifest = artifact.manifest
    if (manifest.os, manifest.arch) != (state.os, state.arch):
        raise InstallError(
            f"artifact {artifact.id} is built for {manifest.os}/{manifest.arch}, "
            f"the host runs {state.os}/{state.arch}",
            host=state.host,
            hint="pin a matching artifact with the host variable rpc_artifact",
        )
    # The version current before the change may still be running: never pruned in the same step.
    protect = [state.current] if state.current else []
    prune = prune_plan(state.history, state.versions, artifact.id, protect, keep_versions)
    up_to_date = state.current == artifact.id and state.installed and state.manifest == manifest
    if up_to_date and not state.problems and not force:
        return InstallChange(state.host, "none", artifact.id, artifact, state.install_dir, state.current)
    if artifact.id in state.versions and not force:
        reason = "already unpacked in versions/"
        return InstallChange(
            state.host, "switch", artifact.id, artifact, state.install_dir, state.current, prune, reason
        )
    _require_space(state, artifact.size + _unpacked_size(artifact) + SPACE_MARGIN, f"install {artifact.id}")
    reason = "not installed" if state.current is None else f"current is {state.current}"
    return InstallChange(
        state.host, "install", artifact.id, artifact, state.install_dir, state.current, prune, reason
    )


def plan_node_build(
    state: InstallState, build: NodeBuild, *, keep_versions: int = 3, force: bool = False
) -> InstallChange:
    """Pure: the change that makes the on-node build `build` current: nothing when the node already
    runs this build (same id: same sdist, cmake arguments, backend, platform), a switch when it is in
    versions/, else a build. `force` rebuilds (incrementally) and reinstalls."""
    if (build.os, build.arch) != (state.os, state.arch):
        raise InstallError(
            f"the build {build.id} is planned for {build.os}/{build.arch}, "
            f"the host runs {state.os}/{state.arch}",
            host=state.host,
        )
    protect = [state.current] if state.current else []
    prune = prune_plan(state.history, state.versions, build.id, protect, keep_versions)
    if state.current == build.id and state.installed and not state.problems and not force:
        return InstallChange(
            state.host, "none", build.id, None, state.install_dir, state.current, build=build
        )
    if build.id in state.versions and not force:
        return InstallChange(
            state.host, "switch", build.id, None, state.install_dir, state.current, prune,
            "already built in versions/", build=build,
        )  # fmt: skip
    _require_space(state, build.info.size * BUILD_SPACE_FACTOR + BUILD_SPACE_EXTRA, "build on the node")
    reason = "not installed" if state.current is None else f"current is {state.current}"
    return InstallChange(
        state.host, "install", build.id, None, state.install_dir, state.current, prune, reason, build=build
    )


def plan_rollback(state: InstallState, *, to: str | None = None) -> InstallChange:
    """Pure: the switch back to the most recent other version (or `to`). Prunes nothing, so a roll
    forward is a switch again. Raises InstallError when there is nothing to roll back to."""
    target = to or state.previous()
    if target is None:
        raise InstallError("no previous version is installed to roll back to", host=state.host)
    if target not in state.versions:
        installed = ", ".join(state.versions) or "none"
        raise InstallError(f"version {target} is not installed (installed: {installed})", host=state.host)
    if target == state.current:
        return InstallChange(state.host, "none", target, None, state.install_dir, state.current)
    return InstallChange(state.host, "switch", target, None, state.install_dir, state.current, (), "rollback")
