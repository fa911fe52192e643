"""Installing a pinned artifact on a node: choose, then apply an upload or an on-node build."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from orchestrator.artifacts.cuda import DRIVER_FIX, driver_too_old
from orchestrator.artifacts.manifest import Artifact
from orchestrator.artifacts.node_build import NodeBuild, node_build
from orchestrator.artifacts.spec import known_cuda_release, read_artifact_spec, resolve_artifact
from orchestrator.artifacts.store import verify_artifact
from orchestrator.connectors.base import Connection, Progress
from orchestrator.connectors.nodescript import Planned, would_run
from orchestrator.core.errors import ArtifactError, InstallError, NodeMismatchError
from orchestrator.core.log import get_logger
from orchestrator.engine.executor import HostContext, Step, StepOutcome
from orchestrator.engine.shared import Shared
from orchestrator.facts.gpus import GpuRuntime
from orchestrator.inventory.model import Host
from orchestrator.operations.install.apply import apply_install, planned_install
from orchestrator.operations.install.plan import (
    InstallChange,
    InstallState,
    plan_install,
    plan_node_build,
    read_install_state,
)
from orchestrator.operations.layer import DEFAULT_OPTIONS, OperationOptions, node_operation
from orchestrator.operations.node_build import BuildLog, apply_node_build

Source = Artifact | NodeBuild


class ArtifactChooser:
    """Picks (and verifies once) the artifact for each host: `override`, else the host's `rpc_artifact`,
    else the default one, for the host's backend and the node's os/arch. A `build: on_node` spec file
    gives a `NodeBuild` instead (with the host's `rpc_cmake_args`). Shared by all hosts of a run."""

    def __init__(self, override: str | None = None, *, verify: bool = True) -> None:
        self.override = override
        self.verify = verify
        # engine.shared's rule: one attempt per key for the run, a failure included (an artifact that
        # cannot be found or verified for one host is not looked for again for the next)
        self._chosen: Shared[tuple[str, str, str, str, tuple[str, ...]], Source] = Shared()

    async def __call__(self, host: Host, state: InstallState) -> Source:
        spec = self.override or host.rpc_artifact or ""
        key = (spec, server_backend(host, state), state.os, state.arch, host.rpc_cmake_args)
        try:
            return await self._chosen.get(key, lambda: asyncio.to_thread(self._resolve, *key))
        except ArtifactError as exc:
            raise InstallError(
                f"no artifact for this host: {exc.message}", host=host.name, hint=exc.hint
            ) from exc

    async def forget(self) -> None:
        """Choose anew from now on (an artifact imported or built meanwhile)."""
        await self._chosen.clear()

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


def server_backend(host: Host, state: InstallState) -> str:
    """The backend of the server `host` gets: its `rpc_backend`, or `auto`'s pick from the node's GPU
    facts. Raises NodeMismatchError, naming the host, where the inventory set it and the fix, when the
    node cannot run that backend or has no such device as `rpc_devices` names: nothing is switched then."""
    runtime = state.gpu_runtime

    def mismatch(message: str, hint: str | None = None) -> NodeMismatchError:
        source = host.var_sources.get("rpc_backend", "default")
        text = f"{message} (rpc_backend: {host.rpc_backend}, from {source})"
        return NodeMismatchError(text, host.location, hint=hint).with_host(host.name)

    if runtime is None:
        if host.rpc_backend == "auto":
            raise mismatch("rpc_backend auto: the node's GPU facts were not read")
        return host.rpc_backend
    try:
        backend, why = runtime.backend_for(host.rpc_backend)
    except ValueError as exc:
        raise mismatch(str(exc)) from None
    if host.rpc_backend == "auto":
        get_logger().info("backend_decided", host=host.name, backend=backend, why=why)
    env = dict(host.rpc_env)
    problem = runtime.cannot_run(backend, env)
    if problem is not None:
        raise mismatch(*problem)
    offered = runtime.device_names(backend, env)
    if offered is not None and runtime.error is None:
        known = {name.upper() for name in offered}
        unknown = [d for d in host.rpc_devices if d.upper() not in known]
        if unknown:
            raise mismatch(
                f"rpc_devices {','.join(unknown)}: no such device on this node for the {backend} backend "
                f"(it offers {', '.join(offered)})",
                "name devices as llama.cpp does (a wrong name makes ggml-rpc-server list its own)",
            )
    return backend


def _decided_backend(host: Host, runtime: GpuRuntime) -> str | None:
    try:
        return runtime.backend_for(host.rpc_backend)[0]
    except ValueError:  # `auto` on facts that could not be read: refused where the backend is decided
        return None


def _refuse_old_driver(host: Host, what: str, cuda_version: str | None, runtime: GpuRuntime) -> None:
    old = driver_too_old(cuda_version, runtime.nvidia_driver)
    if old is not None:
        raise NodeMismatchError(f"{what}: {old}", host.location, hint=DRIVER_FIX).with_host(host.name)


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
    runtime = state.gpu_runtime
    if runtime is not None and _decided_backend(host, runtime) == "cuda":
        # before choosing: the default cuda artifact may be built first (half an hour on 2 cores)
        _refuse_old_driver(host, "the cuda artifact", known_cuda_release(host.rpc_artifact), runtime)
    source = await choose(host, state)
    if isinstance(source, Artifact) and source.manifest.backend == "cuda" and runtime is not None:
        _refuse_old_driver(host, f"artifact {source.id}", source.manifest.cuda_version, runtime)
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
    if change.changed and check:
        if isinstance(source, NodeBuild) and change.action == "install":
            # Not listed command by command: what it runs depends on what the build's upload finds.
            would_run(
                host.name,
                [Planned(host.name, "build", f"# build {change.version} on the node, then install it")],
            )
        else:
            would_run(host.name, planned_install(change))
    if change.changed and not check:
        await apply_install(conn, change, progress=progress(host, change) if progress else None)
    return change


def make_install_step(
    choose: ArtifactChooser,
    options: OperationOptions = DEFAULT_OPTIONS,
    *,
    reinstall: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> Step[InstallChange]:
    """The executor step of `install`: the artifact becomes current; the running server is not touched."""

    async def install(ctx: HostContext, conn: Connection) -> StepOutcome[InstallChange]:
        change = await ensure_installed(
            conn,
            ctx.host,
            choose,
            check=options.check,
            force=reinstall,
            progress=progress,
            build_log=build_log,
        )
        return StepOutcome(change, change.changed, change.describe())

    return node_operation("install", install, options)
