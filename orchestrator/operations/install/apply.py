"""Applying an install: upload, verify by sha256, switch `current` atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shlex
from collections.abc import Sequence

from orchestrator.artifacts.manifest import Manifest
from orchestrator.connectors.base import Connection, Progress
from orchestrator.connectors.nodescript import NodeScript, Planned, parse_key_lines, run_script
from orchestrator.core.errors import InstallError, InstallScriptError, TransferError, tail
from orchestrator.operations.install.plan import APPLY_TIMEOUT, PREPARE_TIMEOUT, InstallChange


def verify_lines(manifest: Manifest | None, folder: str) -> list[str]:
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


def guarded_script(change: InstallChange, nonce: str, cleanup: Sequence[str], body: Sequence[str]) -> str:
    """A node-side script: header (D, ID, fail), `body`, then the switch, history and pruning."""
    q = shlex.quote
    lines = [
        f"D={q(change.install_dir)}",
        f"ID={q(change.version)}",
        # fail STAGE MESSAGE: remove what this attempt made, report, exit non-zero.
        f'fail() {{ rm -rf {" ".join(cleanup)} "$D/current.{nonce}" "$D/history.{nonce}"; '
        'echo "@error $1 failed while installing $ID: $2"; exit 3; }',
        *body,
        # On disk before the switch (a power cut must not leave `current` on files never written),
        # and the switch itself after it. `sync -f`: the file system of that path (coreutils 8.24).
        'sync -f "$D/versions/$ID" 2>/dev/null || sync',
        f'ln -s "versions/$ID" "$D/current.{nonce}" || fail switch "cannot create the link"',
        f'mv -T "$D/current.{nonce}" "$D/current" || fail switch "cannot switch current"',
        # History: the new id last, without duplicates; written aside and renamed.
        f'{{ grep -vxF "$ID" "$D/history" 2>/dev/null; echo "$ID"; }} > "$D/history.{nonce}"'
        f' && mv -f "$D/history.{nonce}" "$D/history" || echo "@warning history not updated"',
        'sync -f "$D/current" 2>/dev/null || sync',
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
        *verify_lines(change.artifact.manifest, '"$S"'),
        'rm -f "$A"',
        # A leftover folder of the same id (an earlier broken or forced install) is replaced.
        f'if [ -e "$D/versions/$ID" ]; then mv -T "$D/versions/$ID" {old} || fail move "cannot move"; fi',
        'mv -T "$S" "$D/versions/$ID" || fail move "cannot move the version into place"',
        f"rm -rf {old}",
    ]
    return guarded_script(change, nonce, ['"$S"', '"$A"'], body)


def switch_script(change: InstallChange, nonce: str) -> str:
    """Switch to a version already in versions/ (its files verified first when the manifest is known)."""
    manifest = change.artifact.manifest if change.artifact is not None else None
    body = [
        '[ -d "$D/versions/$ID" ] || fail switch "version $ID is not installed"',
        *verify_lines(manifest, '"$D/versions/$ID"'),
    ]
    return guarded_script(change, nonce, [], body)


def kept(change: InstallChange) -> str:
    """What stays when `change` fails (every install error says it)."""
    return f"{change.previous} stays installed" if change.previous else "nothing was installed"


def install_node_script(
    change: InstallChange, name: str, text: str, timeout: float = APPLY_TIMEOUT
) -> NodeScript:
    """`text` as one of `change`'s node scripts: its errors are InstallErrors saying what stays."""
    return NodeScript(
        name,
        text,
        timeout,
        f"installing {change.version}",
        InstallScriptError,
        consequence=kept(change),
        error_is_message=True,
    )


def parse_apply_output(stdout: str, change: InstallChange) -> list[str]:
    """Pure: the warnings of a successful apply (it said `@ok`); InstallError when it stopped without a
    result (a failed stage is the script's `@error`, raised by `run_script`)."""
    keys = parse_key_lines(stdout)
    if ("ok", "") not in keys:
        raise InstallScriptError(
            f"installing {change.version} stopped without a result: {tail(stdout, 3)!r}",
            host=change.host,
            script="install",
        )
    return [value for key, value in keys if key == "warning"]


def prepare_script(change: InstallChange) -> NodeScript:
    # Leftovers of interrupted uploads go first, so they never fill the disk.
    d = shlex.quote(change.install_dir)
    text = f"mkdir -p {d}/tmp {d}/versions && rm -rf {d}/tmp/*"
    script = install_node_script(change, "install-prepare", text, PREPARE_TIMEOUT)
    return dataclasses.replace(script, what=f"preparing {change.install_dir}", error_is_message=False)


def remote_archive(change: InstallChange, nonce: str) -> str:
    return f"{change.install_dir}/tmp/{change.version}.{nonce}.tar.gz.part"


def planned_install(change: InstallChange) -> list[NodeScript | Planned]:
    """Check mode: the commands `apply_install` would run for `change` (temporary names aside: each run
    draws its own random suffix)."""
    nonce = secrets.token_hex(4)
    if change.action == "switch":
        return [install_node_script(change, "install-switch", switch_script(change, nonce))]
    if change.action != "install" or change.artifact is None:
        return []
    archive = remote_archive(change, nonce)
    upload = f"# upload {change.artifact.archive} to {archive} (SFTP)"
    return [
        prepare_script(change),
        Planned(change.host, "install-upload", upload),
        install_node_script(change, "install", install_script(change, archive, nonce)),
    ]


async def apply_install(
    conn: Connection, change: InstallChange, *, progress: Progress | None = None
) -> list[str]:
    """Carry out `change` on the node; returns warnings. Raises InstallError, previous version kept."""
    if change.action == "none":
        return []
    nonce = secrets.token_hex(4)
    if change.action == "switch":
        return await run_install_script(conn, change, switch_script(change, nonce), "install-switch")
    assert change.artifact is not None
    await run_script(conn, prepare_script(change))
    archive = remote_archive(change, nonce)
    try:
        await conn.put(change.artifact.archive, archive, progress=progress)
    except TransferError as exc:
        with contextlib.suppress(Exception):  # the connection may be gone; the upload error is the news
            await conn.run(f"rm -f {shlex.quote(archive)}", timeout=PREPARE_TIMEOUT)
        raise InstallError(
            f"upload of {change.artifact.archive.name} failed: {exc.message}; {kept(change)}",
            host=change.host,
        ) from exc
    return await run_install_script(conn, change, install_script(change, archive, nonce))


async def run_install_script(
    conn: Connection, change: InstallChange, text: str, name: str = "install"
) -> list[str]:
    """Run an install or switch script (it exits 3 after `@error`; any status is read for `@ok`)."""
    script = dataclasses.replace(install_node_script(change, name, text), ok_exits=None)
    output = await run_script(conn, script)
    try:
        return parse_apply_output(output.stdout, change)
    except InstallScriptError as exc:
        raise script.failure(
            change.host, exc.message, exit_status=output.exit_status, stderr=output.stderr or None
        ) from None
