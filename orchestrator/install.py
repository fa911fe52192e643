"""Installing a pinned rpc-server artifact on a host: read what is there, plan the change, apply it.

Layout on the node (`install_dir`, default `~/.local/lib/rpcfleet`):

    versions/<id>/         one unpacked artifact each (manifest.json, bin/ggml-rpc-server, libggml*.so)
    current -> versions/<id>   switched atomically (`ln -s` to a temporary name, then `mv -T`)
    history                ids in the order they were made current (most recent last): rollback, pruning
    tmp/                   uploads and unpacking in progress (emptied before each upload)
    run/, log/, cache/     the server's pid file, log and LLAMA_CACHE (see service.py)

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

import asyncio
import contextlib
import dataclasses
import secrets
import shlex
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrator.artifacts import (
    Artifact,
    FileEntry,
    Manifest,
    NodeBuild,
    node_build,
    read_artifact_spec,
    resolve_artifact,
    verify_artifact,
)
from orchestrator.connection import Connection, Progress
from orchestrator.errors import ArtifactError, CommandTimeoutError, InstallError, TransferError, tail
from orchestrator.executor import HostContext, StepOutcome
from orchestrator.facts import (
    CurrentLinkFact,
    Fact,
    FreeSpaceFact,
    HistoryFact,
    InstallDirFact,
    InstalledManifest,
    InstalledManifestFact,
    OsFact,
    OsInfo,
    VersionsFact,
    gather,
)
from orchestrator.inventory import Host
from orchestrator.log import get_logger
from orchestrator.units import format_size

__all__ = [
    "ArtifactChooser",
    "BuildLogFactory",
    "InstallChange",
    "InstallState",
    "apply_install",
    "apply_node_build",
    "build_command",
    "ensure_installed",
    "install_facts",
    "install_script",
    "install_state_from_facts",
    "make_install_step",
    "normalise_platform",
    "parse_apply_output",
    "parse_build_output",
    "plan_install",
    "plan_node_build",
    "plan_rollback",
    "prune_plan",
    "read_install_state",
    "switch_script",
]

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
_MARK = "@"


def _lines(stdout: str) -> Iterable[tuple[str, str]]:
    """(key, value) of every `@key value` line a node-side script printed."""
    for line in stdout.splitlines():
        if line.startswith(_MARK):
            key, _, value = line[1:].partition(" ")
            yield key, value.strip()


def normalise_platform(uname_s: str, uname_m: str) -> tuple[str, str]:
    """(os, arch) in manifest spelling from `uname -s` / `uname -m`."""
    os_name = uname_s.strip().lower()
    machine = uname_m.strip().lower()
    arch = {"amd64": "x86_64", "x64": "x86_64"}.get(machine, machine)
    if arch == "arm64" and os_name != "darwin":
        arch = "aarch64"
    return os_name, arch


# ---------------------------------------------------------------- state


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
    )


async def read_install_state(conn: Connection, host: Host) -> InstallState:
    values = await gather(conn, install_facts(host.install_dir), timeout=STATE_TIMEOUT)
    return install_state_from_facts(host.name, values)


# ---------------------------------------------------------------- plan


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
    return sum(entry.size for entry in artifact.manifest.files) + len(artifact.manifest.to_json())


def prune_plan(
    history: Sequence[str], versions: Sequence[str], new: str, protect: Iterable[str], keep_versions: int
) -> tuple[str, ...]:
    """Pure: the versions to remove once `new` is current, keeping the `keep_versions` most recently
    current ones (`new` included) and every version in `protect` (the one still running)."""
    order = [v for v in history if v != new] + [new]
    recent = [v for v in reversed(order) if v in versions or v == new]
    kept = set(recent[: max(1, keep_versions)]) | set(protect)
    return tuple(sorted(v for v in versions if v not in kept))


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
    needed = artifact.size + _unpacked_size(artifact) + SPACE_MARGIN
    if state.free_bytes is not None and state.free_bytes < needed:
        kept = f"{state.current} stays installed" if state.current else "nothing was changed"
        raise InstallError(
            f"not enough disk space in {state.install_dir}: {format_size(state.free_bytes)} free, "
            f"{format_size(needed)} needed to install {artifact.id}; {kept}",
            host=state.host,
        )
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
    needed = build.info.size * BUILD_SPACE_FACTOR + BUILD_SPACE_EXTRA
    if state.free_bytes is not None and state.free_bytes < needed:
        kept = f"{state.current} stays installed" if state.current else "nothing was changed"
        raise InstallError(
            f"not enough disk space in {state.install_dir} to build on the node: "
            f"{format_size(state.free_bytes)} free, about {format_size(needed)} needed; {kept}",
            host=state.host,
        )
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


# ---------------------------------------------------------------- apply


def _verify_lines(manifest: Manifest | None, folder: str) -> list[str]:
    """Shell lines checking every regular file of `manifest` in `folder` with sha256sum."""
    if manifest is None:
        return [f'[ -x {folder}/bin/ggml-rpc-server ] || fail files "$ID has no bin/ggml-rpc-server"']
    sums = "".join(f"{e.sha256}  {e.path}\n" for e in manifest.files if e.sha256 is not None)
    return [
        f"sums={shlex.quote(sums)}",
        f'bad=$(cd {folder} && printf "%s" "$sums" | sha256sum --check --quiet 2>&1) || '
        'fail files "files differ from the manifest: $(echo "$bad" | head -n 3 | tr "\\n" " ")"',
        f'[ -x {folder}/bin/ggml-rpc-server ] || fail files "bin/ggml-rpc-server is missing"',
    ]


def _script(change: InstallChange, nonce: str, cleanup: Sequence[str], body: Sequence[str]) -> str:
    """A node-side script: header (D, ID, fail), `body`, then the switch, history and pruning."""
    q = shlex.quote
    lines = [
        f"D={q(change.install_dir)}",
        f"ID={q(change.version)}",
        # fail STAGE MESSAGE: remove what this attempt made, report, exit non-zero.
        f'fail() {{ rm -rf {" ".join(cleanup)} "$D/current.{nonce}" "$D/history.{nonce}"; '
        'echo "@fail $1 $2"; exit 3; }',
        *body,
        f'ln -s "versions/$ID" "$D/current.{nonce}" || fail switch "cannot create the link"',
        f'mv -T "$D/current.{nonce}" "$D/current" || fail switch "cannot switch current"',
        # History: the new id last, without duplicates; written aside and renamed.
        f'{{ grep -vxF "$ID" "$D/history" 2>/dev/null; echo "$ID"; }} > "$D/history.{nonce}"'
        f' && mv -f "$D/history.{nonce}" "$D/history" || echo "@warning history not updated"',
    ]
    for version in change.prune:
        lines.append(f'rm -rf "$D/versions/"{q(version)} || echo "@warning cannot remove {version}"')
    lines.append('echo "@ok"')
    return "\n".join(lines) + "\n"


def install_script(change: InstallChange, remote_archive: str, nonce: str) -> str:
    """After the upload: verify the archive's sha256, unpack aside, verify every file, move into
    versions/, switch `current`, prune. Nothing visible changes before the switch."""
    assert change.artifact is not None
    q = shlex.quote
    sha = change.artifact.archive_sha256
    old = f'"$D/tmp/$ID.old.{nonce}"'
    body = [
        f"A={q(remote_archive)}",
        f'S="$D/tmp/$ID.{nonce}.d"',
        'got=$(sha256sum "$A" | cut -d" " -f1) || fail checksum "cannot read the uploaded archive"',
        f'[ "$got" = {sha} ] || fail checksum "archive sha256 on the node is $got, expected {sha}"',
        'mkdir -p "$S" || fail unpack "cannot create $S"',
        'err=$(tar -xzf "$A" -C "$S" 2>&1) || fail unpack "tar: $(echo "$err" | tail -n 2 | tr "\\n" " ")"',
        *_verify_lines(change.artifact.manifest, '"$S"'),
        'rm -f "$A"',
        # A leftover folder of the same id (an earlier broken or forced install) is replaced.
        f'if [ -e "$D/versions/$ID" ]; then mv -T "$D/versions/$ID" {old} || fail move "cannot move"; fi',
        'mv -T "$S" "$D/versions/$ID" || fail move "cannot move the version into place"',
        f"rm -rf {old}",
    ]
    return _script(change, nonce, ['"$S"', '"$A"'], body)


def switch_script(change: InstallChange, nonce: str) -> str:
    """Switch to a version already in versions/ (its files verified first when the manifest is known)."""
    manifest = change.artifact.manifest if change.artifact is not None else None
    body = [
        '[ -d "$D/versions/$ID" ] || fail switch "version $ID is not installed"',
        *_verify_lines(manifest, '"$D/versions/$ID"'),
    ]
    return _script(change, nonce, [], body)


def parse_apply_output(stdout: str, change: InstallChange) -> list[str]:
    """Pure: the warnings of a successful apply; InstallError naming the failed stage otherwise."""
    warnings: list[str] = []
    for key, value in _lines(stdout):
        if key == "fail":
            stage, _, message = value.partition(" ")
            kept = f"{change.previous} stays installed" if change.previous else "nothing was installed"
            raise InstallError(
                f"{stage} failed while installing {change.version}: {message.strip()}; {kept}",
                host=change.host,
            )
        if key == "warning":
            warnings.append(value)
        if key == "ok":
            return warnings
    raise InstallError(
        f"installing {change.version} stopped without a result: {tail(stdout, 3)!r}", host=change.host
    )


async def apply_install(
    conn: Connection, change: InstallChange, *, progress: Progress | None = None
) -> list[str]:
    """Carry out `change` on the node; returns warnings. Raises InstallError, previous version kept."""
    if change.action == "none":
        return []
    nonce = secrets.token_hex(4)
    if change.action == "switch":
        return await _run_script(conn, change, switch_script(change, nonce))
    assert change.artifact is not None
    d = shlex.quote(change.install_dir)
    kept = f"{change.previous} stays installed" if change.previous else "nothing was installed"
    # Leftovers of interrupted uploads go first, so they never fill the disk.
    prepare = f"mkdir -p {d}/tmp {d}/versions && rm -rf {d}/tmp/*"
    result = await conn.run(prepare, timeout=PREPARE_TIMEOUT)
    if not result.ok:
        raise InstallError(
            f"cannot prepare {change.install_dir}: {tail(result.stderr, 2)}; {kept}",
            host=change.host,
            exit_status=result.exit_status,
        )
    remote_archive = f"{change.install_dir}/tmp/{change.version}.{nonce}.tar.gz.part"
    try:
        await conn.put(change.artifact.archive, remote_archive, progress=progress)
    except TransferError as exc:
        with contextlib.suppress(Exception):  # the connection may be gone; the upload error is the news
            await conn.run(f"rm -f {shlex.quote(remote_archive)}", timeout=PREPARE_TIMEOUT)
        raise InstallError(
            f"upload of {change.artifact.archive.name} failed: {exc.message}; {kept}", host=change.host
        ) from exc
    return await _run_script(conn, change, install_script(change, remote_archive, nonce))


async def _run_script(conn: Connection, change: InstallChange, script: str) -> list[str]:
    try:
        result = await conn.run(f"sh -c {shlex.quote(script)}", timeout=APPLY_TIMEOUT)
    except CommandTimeoutError as exc:
        raise InstallError(
            f"installing {change.version} did not finish within {APPLY_TIMEOUT:g} s", host=change.host
        ) from exc
    try:
        return parse_apply_output(result.stdout, change)
    except InstallError as exc:
        if result.stderr.strip():
            exc.stderr_tail = tail(result.stderr, 4)
        raise


# ---------------------------------------------------------------- building on the node

BuildLog = Callable[[str], None]  # the build log's latest line, as it is written


def _build_paths(install_dir: str, build: NodeBuild) -> tuple[str, str, str]:
    """(workdir, sdist on the node, log) for `build` under `install_dir` (absolute)."""
    workdir = f"{install_dir}/build/{build.key}"
    return workdir, f"{install_dir}/src/{build.sdist_name}", f"{workdir}/build.log"


def build_command(install_dir: str, build: NodeBuild) -> str:
    """Run the build script (already in `<workdir>/build.sh`) under `timeout`, output to the log, then
    print `@status N` and, on success, the protocol line and every output file (`@file path size mode
    sha256`, `@link path target`); on failure the log's last 40 lines as `@log ...`."""
    q = shlex.quote
    workdir, _, log = _build_paths(install_dir, build)
    limit = int(build.timeout)
    return "\n".join(
        [
            f"W={q(workdir)}",
            f"L={q(log)}",
            # Two deploys to one node never build in the same tree at once.
            'exec 9>"$W/.lock"',
            'if command -v flock >/dev/null 2>&1 && ! flock -n 9; then echo "@status busy"; exit 0; fi',
            f'timeout -k 10 {limit} bash "$W/build.sh" > "$L" 2>&1 </dev/null; s=$?',
            'echo "@status $s"',
            'if [ "$s" -ne 0 ]; then tail -n 40 "$L" | sed "s/^/@log /"; exit 0; fi',
            "grep '^RPCFLEET_PROTOCOL=' \"$L\" | tail -n 1 | sed 's/^RPCFLEET_PROTOCOL=/@protocol /'",
            'cd "$W/out" || exit 0',
            "find bin -mindepth 1 \\( -type f -o -type l \\) | LC_ALL=C sort | while IFS= read -r f; do",
            '  if [ -L "$f" ]; then echo "@link $f $(readlink "$f")";',
            '  else echo "@file $f $(stat -c \'%s %a\' "$f") $(sha256sum "$f" | cut -d\' \' -f1)"; fi',
            "done",
        ]
    )


def parse_build_output(stdout: str, change: InstallChange) -> tuple[str, tuple[FileEntry, ...]]:
    """Pure: (protocol, files) of a successful build; InstallError naming the failure otherwise (the
    first CMake/compiler error line of the log's tail, the tail itself as stderr)."""
    status = ""
    protocol = ""
    files: list[FileEntry] = []
    log: list[str] = []
    for key, value in _lines(stdout):
        if key == "status":
            status = value
        elif key == "protocol":
            protocol = value
        elif key == "log":
            log.append(value)
        elif key == "file":
            path, size, mode, sha = value.rsplit(" ", 3)
            executable = int(mode, 8) & 0o100
            files.append(FileEntry(path, sha, int(size), 0o755 if executable else 0o644))
        elif key == "link":
            path, _, target = value.partition(" ")
            files.append(FileEntry(path, None, 0, 0o777, target))
    kept = f"{change.previous} stays installed" if change.previous else "nothing was installed"
    where = change.build and _build_paths(change.install_dir, change.build)[2]
    hint = f"the full log is {where} on the node" if where else None
    if status == "busy":
        raise InstallError(
            f"another build of {change.version} is running on this node; {kept}", host=change.host
        )
    if status != "0":
        if status in ("124", "137"):
            limit = change.build.timeout if change.build else 0
            why = f"did not finish within {limit:g} s (build_timeout in the spec)"
        else:
            why = f"failed (exit status {status or 'unknown'})"
            problem = _first_error(log)
            if problem:
                why += f": {problem}"
        raise InstallError(
            f"building {change.version} on the node {why}; {kept}",
            host=change.host,
            stderr="\n".join(log) or stdout,
            hint=hint,
        )
    if not files or not any(f.path == "bin/ggml-rpc-server" for f in files):
        raise InstallError(
            f"the build of {change.version} left no bin/ggml-rpc-server; {kept}", host=change.host
        )
    return protocol, tuple(files)


def _first_error(log: Sequence[str]) -> str:
    """The line naming what went wrong: CMake's error (and the line after it), else a compiler error."""
    for i, line in enumerate(log):
        if "CMake Error" in line:
            detail = next((x.strip() for x in log[i + 1 : i + 4] if x.strip()), "")
            return f"{line.strip()} {detail}".strip()
    for line in log:
        if "error:" in line or "Error " in line or line.startswith("sha256sum:"):
            return line.strip()
    return next((line.strip() for line in reversed(log) if line.strip()), "")


def node_install_script(change: InstallChange, manifest: Manifest, nonce: str) -> str:
    """After a successful build: copy `<workdir>/out/bin` aside with the manifest, verify every file,
    move it into versions/, switch `current`, prune (the build tree stays for the next build)."""
    assert change.build is not None
    q = shlex.quote
    workdir, _, _ = _build_paths(change.install_dir, change.build)
    old = f'"$D/tmp/$ID.old.{nonce}"'
    body = [
        f"W={q(workdir)}",
        f'S="$D/tmp/$ID.{nonce}.d"',
        'mkdir -p "$S" || fail copy "cannot create $S"',
        'cp -P -R "$W/out/bin" "$S/bin" || fail copy "cannot copy the build output"',
        f'printf "%s" {q(manifest.to_json().decode())} > "$S/manifest.json" '
        '|| fail copy "cannot write the manifest"',
        *_verify_lines(manifest, '"$S"'),
        f'if [ -e "$D/versions/$ID" ]; then mv -T "$D/versions/$ID" {old} || fail move "cannot move"; fi',
        'mv -T "$S" "$D/versions/$ID" || fail move "cannot move the version into place"',
        f"rm -rf {old}",
    ]
    return _script(change, nonce, ['"$S"'], body)


async def _follow_log(conn: Connection, log: str, on_line: BuildLog) -> None:
    """Report the build log's latest line each second until cancelled (a failed read is skipped)."""
    last = ""
    while True:
        await asyncio.sleep(BUILD_POLL_INTERVAL)
        try:
            result = await conn.run(f"tail -n 1 {shlex.quote(log)} 2>/dev/null", timeout=10)
        except Exception:  # the build's own command reports a lost connection
            continue
        line = result.stdout.strip()
        if line and line != last:
            last = line
            on_line(line)


async def apply_node_build(
    conn: Connection,
    change: InstallChange,
    *,
    progress: Progress | None = None,
    on_line: BuildLog | None = None,
) -> InstallChange:
    """Build `change.build` on the node and install it; returns the change with the built manifest.
    Raises InstallError (the previous version stays installed and running) with the log's tail."""
    build = change.build
    assert build is not None and change.action == "install"
    q = shlex.quote
    d = q(change.install_dir)
    workdir, remote_sdist, log = _build_paths(change.install_dir, build)
    kept = f"{change.previous} stays installed" if change.previous else "nothing was installed"
    say = get_logger(host=change.host)
    # Prepare: folders, the build script, and the sha256 of an sdist uploaded by an earlier build.
    prepare = (
        f"mkdir -p {d}/tmp {d}/versions {d}/src {q(workdir)} && rm -rf {d}/tmp/* && "
        f"cat > {q(workdir)}/build.sh && "
        f"if [ -f {q(remote_sdist)} ]; then echo \"@have $(sha256sum {q(remote_sdist)} | cut -d' ' -f1)\"; fi"
    )
    script = build.script(workdir, remote_sdist)
    result = await conn.run(prepare, timeout=UPLOAD_CHECK_TIMEOUT, input=script)
    if not result.ok:
        raise InstallError(
            f"cannot prepare the build in {change.install_dir}: {tail(result.stderr, 2)}; {kept}",
            host=change.host,
            exit_status=result.exit_status,
        )
    have = dict(_lines(result.stdout)).get("have")
    if have != build.info.sha256:
        nonce = secrets.token_hex(4)
        part = f"{remote_sdist}.{nonce}.part"
        say.info("node_build_upload", sdist=str(build.sdist))
        try:
            await conn.put(build.sdist, part, progress=progress)
        except TransferError as exc:
            with contextlib.suppress(Exception):
                await conn.run(f"rm -f {q(part)}", timeout=PREPARE_TIMEOUT)
            raise InstallError(
                f"upload of {build.sdist.name} failed: {exc.message}; {kept}", host=change.host
            ) from exc
        check = (
            f"got=$(sha256sum {q(part)} | cut -d' ' -f1); "
            f'if [ "$got" = {build.info.sha256} ]; then mv -f {q(part)} {q(remote_sdist)} && echo @ok; '
            f'else rm -f {q(part)}; echo "@fail $got"; fi'
        )
        moved = dict(_lines((await conn.run(check, timeout=UPLOAD_CHECK_TIMEOUT)).stdout))
        if "ok" not in moved:
            raise InstallError(
                f"the uploaded {build.sdist.name} has sha256 {moved.get('fail', '?')} on the node, "
                f"expected {build.info.sha256}; {kept}",
                host=change.host,
            )
    say.info("node_build_started", id=change.version, workdir=workdir)
    follower = asyncio.create_task(_follow_log(conn, log, on_line)) if on_line else None
    try:
        done = await conn.run(build_command(change.install_dir, build), timeout=build.timeout + 60)
    except CommandTimeoutError as exc:
        raise InstallError(
            f"building {change.version} on the node did not finish within {build.timeout:g} s; {kept}",
            host=change.host,
        ) from exc
    finally:
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
    protocol, files = parse_build_output(done.stdout, change)
    manifest = build.manifest(files)
    if protocol and protocol != build.protocol:
        raise InstallError(
            f"the node built protocol {protocol}, the source's ggml-rpc.h says {build.protocol}; {kept}",
            host=change.host,
        )
    say.info("node_build_finished", id=change.version, seconds=round(done.duration, 1))
    nonce = secrets.token_hex(4)
    built = dataclasses.replace(change, built=manifest)
    await _run_script(conn, built, node_install_script(built, manifest, nonce))
    return built


# ---------------------------------------------------------------- choosing the artifact, the step


Source = Artifact | NodeBuild


class ArtifactChooser:
    """Picks (and verifies once) the artifact for each host: `override`, else the host's `rpc_artifact`,
    else the default one, for the host's backend and the node's os/arch. A `build: on_node` spec file
    gives a `NodeBuild` instead (with the host's `rpc_cmake_args`). Shared by all hosts of a run."""

    def __init__(self, override: str | None = None, *, verify: bool = True) -> None:
        self.override = override
        self.verify = verify
        self._cache: dict[tuple[str, str, str, str, tuple[str, ...]], asyncio.Future[Source]] = {}

    async def __call__(self, host: Host, state: InstallState) -> Source:
        spec = self.override or host.rpc_artifact or ""
        key = (spec, host.backend, state.os, state.arch, host.rpc_cmake_args)
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = asyncio.ensure_future(asyncio.to_thread(self._resolve, *key))
            self._cache[key] = future
        try:
            return await asyncio.shield(future)
        except ArtifactError as exc:
            raise InstallError(
                f"no artifact for this host: {exc.message}", host=host.name, hint=exc.hint
            ) from exc

    def _resolve(self, spec: str, backend: str, os_name: str, arch: str, extra: tuple[str, ...]) -> Source:
        path = Path(spec.strip()).expanduser()
        if spec.strip() and path.suffix.lower() in (".yml", ".yaml", ".json") and path.is_file():
            parsed = read_artifact_spec(path)
            if parsed.kind == "build":
                return node_build(parsed, backend=backend, os_name=os_name, arch=arch, extra_cmake_args=extra)
        artifact = resolve_artifact(spec, backend=backend, os=os_name, arch=arch)
        if self.verify:
            verify_artifact(artifact)  # a corrupted local cache is refused before any upload
        return artifact


ProgressFactory = Callable[[Host, InstallChange], Progress | None]
BuildLogFactory = Callable[[Host, InstallChange], BuildLog | None]


async def ensure_installed(
    conn: Connection,
    host: Host,
    choose: ArtifactChooser,
    *,
    state: InstallState | None = None,
    check: bool = False,
    force: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> InstallChange:
    """Read, plan, and (unless `check`) apply: the artifact for `host` becomes current (built on the
    node first for a `build: on_node` spec; the returned change then carries the built manifest)."""
    state = state or await read_install_state(conn, host)
    source = await choose(host, state)
    if isinstance(source, NodeBuild):
        change = plan_node_build(state, source, keep_versions=host.keep_versions, force=force)
        if change.action == "install" and not check:
            return await apply_node_build(
                conn,
                change,
                progress=progress(host, change) if progress else None,
                on_line=build_log(host, change) if build_log else None,
            )
    else:
        change = plan_install(state, source, keep_versions=host.keep_versions, force=force)
    if change.changed and not check:
        await apply_install(conn, change, progress=progress(host, change) if progress else None)
    return change


def make_install_step(
    choose: ArtifactChooser,
    *,
    check: bool = False,
    force: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> Callable[[HostContext], Awaitable[StepOutcome[InstallChange]]]:
    """The executor step of `rpcfleet install`."""

    async def install(ctx: HostContext) -> StepOutcome[InstallChange]:
        conn = await ctx.connection()
        change = await ensure_installed(
            conn, ctx.host, choose, check=check, force=force, progress=progress, build_log=build_log
        )
        return StepOutcome(change, change.changed, change.describe())

    return install
