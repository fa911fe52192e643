"""operations/install*.py: the install state built from facts and the plans (pure), then the node-side scripts
run for real (local shell)."""

from __future__ import annotations

import dataclasses
import getpass
import json
import shutil
from pathlib import Path

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.connectors.connect import connect
from orchestrator.connectors.nodescript import ScriptOutput
from orchestrator.core.errors import InstallError
from orchestrator.facts.server import InstalledManifest
from orchestrator.facts.system import OsInfo
from orchestrator.inventory.model import Host
from orchestrator.operations.install.apply import apply_install, install_node_script, parse_apply_output
from orchestrator.operations.install.ensure import ArtifactChooser, ensure_installed
from orchestrator.operations.install.plan import (
    InstallState,
    install_state_from_facts,
    normalise_platform,
    plan_install,
    plan_rollback,
    prune_plan,
    read_install_state,
)

# ---------------------------------------------------------------- pure


def test_normalise_platform() -> None:
    assert normalise_platform("Linux", "x86_64") == ("linux", "x86_64")
    assert normalise_platform("Linux\n", "arm64") == ("linux", "aarch64")
    assert normalise_platform("Darwin", "arm64") == ("darwin", "arm64")


def _values(
    cpu_artifact: Artifact | None = None,
    *,
    current: str | None = None,
    versions: tuple[str, ...] = (),
    history: tuple[str, ...] = (),
    manifest: InstalledManifest | None = None,
) -> dict[str, object]:
    """Parsed `install_facts` values, as `parse_gathered` returns them."""
    if manifest is None and cpu_artifact is not None and current in versions:
        manifest = InstalledManifest(json.loads(cpu_artifact.manifest.to_bytes()))
    return {
        "install_dir": "/home/lab/.local/lib/rpcfleet",
        "os": OsInfo("Linux", "x86_64", "debian", "12", None),
        "current_link": f"versions/{current}" if current else None,
        "versions": versions,
        "history": history,
        "free_space": 2 << 20,
        "installed_manifest": manifest,
    }


def test_install_state_of_nothing_installed() -> None:
    state = install_state_from_facts("n1", _values())
    home = "/home/lab/.local/lib/rpcfleet"
    assert state == InstallState("n1", home, "linux", "x86_64", None, (), (), 2 << 20, None)
    assert not state.installed and state.previous() is None


def test_install_state_of_an_installed_version(cpu_artifact: Artifact) -> None:
    state = install_state_from_facts(
        "n1", _values(cpu_artifact, current="b", versions=("a", "b"), history=("a", "b"))
    )
    assert state.current == "b" and state.versions == ("a", "b") and state.history == ("a", "b")
    assert state.manifest == cpu_artifact.manifest and state.protocol == cpu_artifact.manifest.protocol
    assert state.installed and state.previous() == "a" and not state.problems


def test_install_state_reports_a_dangling_current_and_a_bad_manifest(cpu_artifact: Artifact) -> None:
    dangling = install_state_from_facts("n", _values(cpu_artifact, current="gone", versions=("a",)))
    assert dangling.current == "gone" and not dangling.installed
    assert dangling.problems == ("`current` points to a missing version: gone",)
    outside = install_state_from_facts("n", {**_values(), "current_link": "/opt/other/"})
    assert outside.current is None and outside.problems == ("`current` points outside versions/: /opt/other",)
    missing = install_state_from_facts("n", _values(current="a", versions=("a",)))
    assert missing.problems == ("current/manifest.json is missing",) and not missing.installed
    for bad in (InstalledManifest({}, error="not JSON: Expecting value"), InstalledManifest({"files": 3})):
        state = install_state_from_facts("n", _values(current="a", versions=("a",), manifest=bad))
        assert state.manifest is None and state.problems[0].startswith("unreadable current/manifest.json: ")


def test_install_state_without_uname_or_folder_is_an_install_error() -> None:
    with pytest.raises(InstallError, match="install state read from the host lacks `uname -s`"):
        install_state_from_facts("n1", {**_values(), "os": OsInfo(None, None, None, None, None)})
    with pytest.raises(InstallError, match="lacks the install folder"):
        install_state_from_facts("n1", {**_values(), "install_dir": None})


def _state(cpu_artifact: Artifact, **fields: object) -> InstallState:
    base = InstallState("n1", "/i", "linux", "x86_64", None, (), (), 10**10, None)
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def test_plan_install_fresh_then_up_to_date(cpu_artifact: Artifact) -> None:
    fresh = plan_install(_state(cpu_artifact), cpu_artifact)
    assert fresh.action == "install" and fresh.changed and fresh.previous is None
    assert fresh.describe() == f"install {cpu_artifact.id}"
    done = _state(
        cpu_artifact,
        current=cpu_artifact.id,
        versions=(cpu_artifact.id,),
        history=(cpu_artifact.id,),
        manifest=cpu_artifact.manifest,
    )
    assert plan_install(done, cpu_artifact).action == "none"
    assert plan_install(done, cpu_artifact, force=True).action == "install"


def test_plan_switches_to_an_unpacked_version_and_prunes_old_ones(cpu_artifact: Artifact) -> None:
    state = _state(
        cpu_artifact,
        current="v3",
        versions=("v1", "v2", "v3", cpu_artifact.id),
        history=("v1", cpu_artifact.id, "v2", "v3"),
        manifest=cpu_artifact.manifest,
    )
    change = plan_install(state, cpu_artifact, keep_versions=2)
    assert change.action == "switch" and change.previous == "v3"
    assert change.prune == ("v1", "v2")  # v3 is the running one: kept although beyond keep_versions=2


def test_prune_plan_keeps_the_most_recent() -> None:
    assert prune_plan(["a", "b", "c"], ["a", "b", "c"], "d", [], 3) == ("a",)
    assert prune_plan(["a", "b", "c"], ["a", "b", "c", "stray"], "d", ["c"], 1) == ("a", "b", "stray")
    assert prune_plan([], [], "d", [], 1) == ()


def test_plan_refuses_another_platform_and_a_full_disk(cpu_artifact: Artifact) -> None:
    with pytest.raises(InstallError, match="the host runs linux/aarch64"):
        plan_install(_state(cpu_artifact, arch="aarch64"), cpu_artifact)
    full = _state(cpu_artifact, free_bytes=100 * 1024, current="old", versions=("old",))
    with pytest.raises(InstallError, match=r"not enough disk space .* old stays installed") as info:
        plan_install(full, cpu_artifact)
    assert info.value.host == "n1"


def test_plan_rollback(cpu_artifact: Artifact) -> None:
    state = _state(cpu_artifact, current="b", versions=("a", "b"), history=("a", "b"))
    change = plan_rollback(state)
    assert (change.action, change.version, change.previous, change.prune) == ("switch", "a", "b", ())
    assert plan_rollback(state, to="b").action == "none"
    with pytest.raises(InstallError, match="version zz is not installed"):
        plan_rollback(state, to="zz")
    with pytest.raises(InstallError, match="no previous version"):
        plan_rollback(_state(cpu_artifact, current="b", versions=("b",), history=("b",)))


def test_parse_apply_output(cpu_artifact: Artifact) -> None:
    change = plan_install(_state(cpu_artifact, current="old", versions=("old",)), cpu_artifact)
    assert parse_apply_output("@warning history not updated\n@ok\n", change) == ["history not updated"]
    # A failed stage is the script's `@error` line (raised by nodescript.run_script), an InstallError too.
    failed = ScriptOutput.parse(
        "n1", "install", 3, "@error checksum failed while installing new: archive sha256 on the node is 00\n"
    )
    with pytest.raises(InstallError, match=r"checksum failed .*: archive sha256 .*; old stays installed"):
        install_node_script(change, "install", "").check(failed)
    with pytest.raises(InstallError, match="stopped without a result"):
        parse_apply_output("", change)


# ---------------------------------------------------------------- for real, through a local shell


@pytest.fixture
def local_host(tmp_path: Path) -> Host:
    return Host(
        name="local1",
        address="127.0.0.1",
        connection="local",
        install_dir=str(tmp_path / "inst"),
        rpc_run_as=getpass.getuser(),
    )


def _exists(path: str | Path) -> bool:
    return Path(path).exists()


def _variant(artifact: Artifact, tag: str) -> Artifact:
    """The same archive under another id: a second version for tests."""
    return dataclasses.replace(artifact, id=f"{artifact.id}-{tag}")


async def test_install_then_nothing_to_do(local_host: Host, cpu_artifact: Artifact) -> None:
    conn = await connect(local_host)
    state = await read_install_state(conn, local_host)
    assert state.current is None and state.os == "linux"
    progress: list[tuple[int, int]] = []
    change = plan_install(state, cpu_artifact)
    assert await apply_install(conn, change, progress=lambda d, t: progress.append((d, t))) == []
    assert progress[-1] == (cpu_artifact.size, cpu_artifact.size)
    root = Path(local_host.install_dir)
    assert (root / "current").readlink() == Path("versions") / cpu_artifact.id
    assert (root / "current/bin/ggml-rpc-server").is_file()
    assert json.loads((root / "current/manifest.json").read_text())["protocol"] == cpu_artifact.protocol
    assert list((root / "tmp").iterdir()) == []  # the upload and the staging folder are gone
    again = await read_install_state(conn, local_host)
    assert again.installed and again.history == (cpu_artifact.id,)
    assert plan_install(again, cpu_artifact).action == "none"


async def test_a_corrupted_upload_leaves_the_previous_version(
    local_host: Host, cpu_artifact: Artifact, tmp_path: Path
) -> None:
    conn = await connect(local_host)
    await apply_install(conn, plan_install(await read_install_state(conn, local_host), cpu_artifact))
    bad_archive = tmp_path / "bad.tar.gz"
    data = bytearray(cpu_artifact.archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad_archive.write_bytes(bytes(data))
    bad = dataclasses.replace(_variant(cpu_artifact, "bad"), archive=bad_archive)
    change = plan_install(await read_install_state(conn, local_host), bad)
    with pytest.raises(
        InstallError, match=rf"checksum failed .*expected {bad.archive_sha256}.*stays installed"
    ):
        await apply_install(conn, change)
    after = await read_install_state(conn, local_host)
    assert after.current == cpu_artifact.id and after.versions == (cpu_artifact.id,)
    assert list((Path(local_host.install_dir) / "tmp").iterdir()) == []


async def test_tampered_files_are_refused_on_switch(local_host: Host, cpu_artifact: Artifact) -> None:
    conn = await connect(local_host)
    v2 = _variant(cpu_artifact, "v2")
    await apply_install(conn, plan_install(await read_install_state(conn, local_host), cpu_artifact))
    await apply_install(conn, plan_install(await read_install_state(conn, local_host), v2))
    lib = Path(local_host.install_dir) / "versions" / cpu_artifact.id / "bin" / "libggml.so.0.25.3"
    lib.write_bytes(b"tampered")
    change = plan_install(await read_install_state(conn, local_host), cpu_artifact)
    assert change.action == "switch"
    with pytest.raises(InstallError, match="files differ from the manifest"):
        await apply_install(conn, change)
    assert (await read_install_state(conn, local_host)).current == v2.id


async def test_versions_are_kept_pruned_and_rolled_back(local_host: Host, cpu_artifact: Artifact) -> None:
    conn = await connect(local_host)
    host = dataclasses.replace(local_host, keep_versions=2)
    ids = []
    for tag in ("a", "b", "c"):
        artifact = _variant(cpu_artifact, tag)
        ids.append(artifact.id)
        change = plan_install(
            await read_install_state(conn, host), artifact, keep_versions=host.keep_versions
        )
        await apply_install(conn, change)
    state = await read_install_state(conn, host)
    # keep_versions=2: c (new) and b (the one that was current, maybe still running) stay.
    assert state.current == ids[2] and state.versions == tuple(ids[1:])
    assert state.history == tuple(ids)
    back = plan_rollback(state)
    assert back.version == ids[1] and back.prune == ()
    await apply_install(conn, back)
    state = await read_install_state(conn, host)
    assert state.current == ids[1] and state.previous() == ids[2]
    forward = plan_install(state, _variant(cpu_artifact, "c"), keep_versions=2)
    assert forward.action == "switch" and forward.prune == ()
    await apply_install(conn, forward)
    d = _variant(cpu_artifact, "d")
    newest = plan_install(await read_install_state(conn, host), d, keep_versions=2)
    assert newest.action == "install" and newest.prune == (ids[1],)
    await apply_install(conn, newest)
    assert (await read_install_state(conn, host)).versions == (ids[2], d.id)


async def test_chooser_verifies_once_and_names_the_host(
    local_host: Host, cpu_artifact: Artifact, artifact_home: Path
) -> None:
    chooser = ArtifactChooser("no-such-artifact")
    state = InstallState("local1", "/x", "linux", "x86_64", None, (), (), None, None)
    with pytest.raises(InstallError, match="no artifact for this host") as info:
        await chooser(local_host, state)
    assert info.value.host == "local1"


async def test_ensure_installed_check_mode_changes_nothing(local_host: Host, cpu_artifact: Artifact) -> None:
    conn = await connect(local_host)
    chooser = ArtifactChooser(cpu_artifact.id)
    change = await ensure_installed(conn, local_host, chooser, check=True)
    assert change.action == "install"
    assert not _exists(local_host.install_dir)
    change = await ensure_installed(conn, local_host, chooser)
    assert change.action == "install" and (Path(local_host.install_dir) / "current").exists()
    assert (await ensure_installed(conn, local_host, chooser)).action == "none"
    shutil.rmtree(local_host.install_dir)


def test_the_version_is_on_disk_before_current_switches_to_it_and_the_switch_after() -> None:
    from orchestrator.operations.install.apply import switch_script
    from orchestrator.operations.install.plan import InstallChange

    change = InstallChange("n1", "switch", "v2", None, "/opt/rf", "v1")
    lines = switch_script(change, "n0nce").splitlines()
    first_sync = next(i for i, line in enumerate(lines) if line.startswith('sync -f "$D/versions/$ID"'))
    link = next(i for i, line in enumerate(lines) if line.startswith('ln -s "versions/$ID"'))
    switch = next(i for i, line in enumerate(lines) if 'mv -T "$D/current.n0nce" "$D/current"' in line)
    last_sync = next(i for i, line in enumerate(lines) if line.startswith('sync -f "$D/current"'))
    assert first_sync < link < switch < last_sync
