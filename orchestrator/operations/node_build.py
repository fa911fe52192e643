"""Builds on the node (`build: on_node`): run, follow and parse the build, then install it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import shlex
from collections.abc import Callable, Sequence

from orchestrator.artifacts.manifest import FileEntry, Manifest
from orchestrator.artifacts.node_build import NodeBuild
from orchestrator.connectors.base import Connection, Progress
from orchestrator.connectors.nodescript import parse_key_lines, run_script
from orchestrator.core.errors import InstallError, TransferError
from orchestrator.core.log import get_logger
from orchestrator.operations.install.apply import (
    guarded_script,
    install_node_script,
    kept,
    run_install_script,
    verify_lines,
)
from orchestrator.operations.install.plan import (
    BUILD_POLL_INTERVAL,
    PREPARE_TIMEOUT,
    UPLOAD_CHECK_TIMEOUT,
    InstallChange,
)

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
    status = protocol = ""
    files: list[FileEntry] = []
    log: list[str] = []
    for key, value in parse_key_lines(stdout):
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
    stays = kept(change)
    where = change.build and _build_paths(change.install_dir, change.build)[2]
    hint = f"the full log is {where} on the node" if where else None
    if status == "busy":
        raise InstallError(
            f"another build of {change.version} is running on this node; {stays}", host=change.host
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
            f"building {change.version} on the node {why}; {stays}",
            host=change.host,
            stderr="\n".join(log) or stdout,
            hint=hint,
        )
    if not files or not any(f.path == "bin/ggml-rpc-server" for f in files):
        raise InstallError(
            f"the build of {change.version} left no bin/ggml-rpc-server; {stays}", host=change.host
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
        f'printf "%s" {q(manifest.to_bytes().decode())} > "$S/manifest.json" '
        '|| fail copy "cannot write the manifest"',
        *verify_lines(manifest, '"$S"'),
        f'if [ -e "$D/versions/$ID" ]; then mv -T "$D/versions/$ID" {old} || fail move "cannot move"; fi',
        'mv -T "$S" "$D/versions/$ID" || fail move "cannot move the version into place"',
        f"rm -rf {old}",
    ]
    return guarded_script(change, nonce, ['"$S"'], body)


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
    stays = kept(change)
    say = get_logger(host=change.host)
    # Prepare: folders, the build script (on stdin), and the sha256 of an sdist an earlier build uploaded.
    prepare = (
        f"mkdir -p {d}/tmp {d}/versions {d}/src {q(workdir)} && rm -rf {d}/tmp/* && "
        f"cat > {q(workdir)}/build.sh && "
        f"if [ -f {q(remote_sdist)} ]; then echo \"@have $(sha256sum {q(remote_sdist)} | cut -d' ' -f1)\"; fi"
    )
    prepared = dataclasses.replace(
        install_node_script(
            change, "build-prepare", build.script(workdir, remote_sdist), UPLOAD_CHECK_TIMEOUT
        ),
        command=prepare,
        what=f"preparing the build in {change.install_dir}",
        error_is_message=False,
    )
    have = (await run_script(conn, prepared)).get("have")
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
                f"upload of {build.sdist.name} failed: {exc.message}; {stays}", host=change.host
            ) from exc
        check = (
            f"got=$(sha256sum {q(part)} | cut -d' ' -f1); "
            f'if [ "$got" = {build.info.sha256} ]; then mv -f {q(part)} {q(remote_sdist)} && echo @ok; '
            f'else rm -f {q(part)}; echo "@fail $got"; fi'
        )
        verify = dataclasses.replace(
            install_node_script(change, "build-upload-check", check, UPLOAD_CHECK_TIMEOUT),
            what=f"checking the uploaded {build.sdist.name}",
            error_is_message=False,
            ok_exits=None,
        )
        moved = await run_script(conn, verify)
        if "ok" not in moved:
            raise InstallError(
                f"the uploaded {build.sdist.name} has sha256 {moved.get('fail', '?')} on the node, "
                f"expected {build.info.sha256}; {stays}",
                host=change.host,
            )
    say.info("node_build_started", id=change.version, workdir=workdir)
    follower = asyncio.create_task(_follow_log(conn, log, on_line)) if on_line else None
    building = dataclasses.replace(
        install_node_script(change, "build", build_command(change.install_dir, build), build.timeout + 60),
        what=f"building {change.version} on the node",
        error_is_message=False,
        ok_exits=None,  # its outcome is its `@status` line
    )
    try:
        done = await run_script(conn, building)
    finally:
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
    protocol, files = parse_build_output(done.stdout, change)
    manifest = build.manifest(files)
    if protocol and protocol != build.protocol:
        raise InstallError(
            f"the node built protocol {protocol}, the source's ggml-rpc.h says {build.protocol}; {stays}",
            host=change.host,
        )
    say.info("node_build_finished", id=change.version, seconds=round(done.duration, 1))
    nonce = secrets.token_hex(4)
    built = dataclasses.replace(change, built=manifest)
    await run_install_script(conn, built, node_install_script(built, manifest, nonce), "build-install")
    return built
