"""Slurm as an inventory source: the nodes of a job are the hosts, an overlay YAML gives their variables.

Where the nodes come from, first found wins:

1. a job named on the command line (`-i slurm:12345`, `--slurm-job 12345`): `scontrol show job` -> NodeList;
2. the overlay's `slurm:` section: `job: 12345`, or `nodelist: node[01-04]` (no job: these nodes);
3. inside an allocation: `$SLURM_JOB_NODELIST` (or `$SLURM_NODELIST`), else `$SLURM_JOB_ID` as in 1.

A node list is expanded by Slurm's own `scontrol show hostnames` when scontrol is there, else by
`hostlist.expand_hostlist` (the same syntax, in Python).

The overlay is a YAML file whose top level has `slurm:` (a mapping of `job`/`nodelist`, or nothing)
and, as a native inventory, `vars` (every node), `hosts` and `groups`; but it declares no host: its
`hosts:` keys and its groups' `hosts:` are *patterns* matched against the job's nodes (a name, a Slurm
hostlist such as `gpu[01-04]`, or a glob with `*`/`?`). A pattern that matches none of the nodes is a
warning (the same overlay serves jobs on other nodes). Variables resolve as in any inventory: all <
group < host; two host patterns that match one node apply in file order.

The stage starts no process: `read_slurm_inventory` asks scontrol through the runner its caller gives
(rpcfleet's command line passes one built on engine/children.py); everything else here is pure.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from orchestrator.core.errors import InventoryError, SourceLocation
from orchestrator.core.yamlsource import is_null, node_kind, node_value
from orchestrator.inventory.hostlist import HostlistError, expand_hostlist
from orchestrator.inventory.load import resolve
from orchestrator.inventory.model import Inventory
from orchestrator.inventory.readers import (
    Builder,
    RawHost,
    RawVar,
    compose_document,
    yaml_items,
    yaml_names,
    yaml_vars,
)
from orchestrator.inventory.variables import near_miss

SLURM_SCHEME = "slurm:"
_JOB_ID = re.compile(r"\d+(?:_\d+|\+\d+)?")  # 12345, an array task 12345_7, a het component 12345+1
# States in which a job holds its nodes; any other (PENDING, COMPLETED, CANCELLED, ...) does not.
HOLDING_STATES = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED"})
_OVERLAY_KEYS = ("slurm", "vars", "hosts", "groups")
_SETTINGS_KEYS = ("job", "nodelist")
_GROUP_KEYS = ("hosts", "vars", "children")


@dataclass(frozen=True)
class CommandOutput:
    """What a finished `scontrol` printed, and its exit status."""

    stdout: str
    stderr: str
    exit_status: int


# Runs `scontrol ARGS` to its end; raises InventoryError when it cannot (timeout, cannot start).
Scontrol = Callable[[Sequence[str]], CommandOutput]


@dataclass(frozen=True)
class SlurmSettings:
    """The overlay's `slurm:` section."""

    job: str | None = None
    nodelist: str | None = None
    location: SourceLocation | None = None  # of `nodelist`'s value, to point at it


@dataclass(frozen=True)
class SlurmNodes:
    """The nodes found, in Slurm's order, and where they come from (named in messages and locations)."""

    names: tuple[str, ...]
    origin: str  # "slurm job 12345", "$SLURM_JOB_NODELIST", "the nodelist at FILE:LINE:COLUMN"
    warnings: tuple[str, ...] = ()


def job_of_spec(spec: str) -> str | None:
    """`slurm:` -> None (the allocation's job), `slurm:12345` -> "12345"; InventoryError otherwise."""
    if not spec.startswith(SLURM_SCHEME):
        raise InventoryError(f"{spec!r} is not a Slurm source (slurm: or slurm:JOBID)")
    job = spec[len(SLURM_SCHEME) :].strip()
    return check_job_id(job, f"-i {spec}") if job else None


def check_job_id(job: str, what: str) -> str:
    """A Slurm job id as given (`12345`, `12345_7`, `12345+1`); InventoryError naming `what` otherwise."""
    if not _JOB_ID.fullmatch(job.strip()):
        raise InventoryError(f"{what}: {job!r} is not a Slurm job id (a number such as 12345)")
    return job.strip()


def is_slurm_document(text: str) -> bool:
    """Whether an inventory file is a Slurm overlay: YAML with a top-level `slurm:` that is not an
    Ansible group (no `all:` beside it; its value empty or without hosts/children/vars)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return False
    if not isinstance(root, yaml.MappingNode):
        return False
    top = {str(node_value(key)): value for key, value in root.value if isinstance(key, yaml.ScalarNode)}
    if "slurm" not in top or "all" in top:
        return False
    body = top["slurm"]
    if not isinstance(body, yaml.MappingNode):
        return True
    keys = {str(node_value(key)) for key, _ in body.value if isinstance(key, yaml.ScalarNode)}
    return not keys & set(_GROUP_KEYS)


def read_settings(text: str, path: Path | None) -> SlurmSettings:
    """The `slurm:` section of an overlay (`job`, `nodelist`); InventoryError pointing into the file."""
    builder = Builder(path, text.splitlines())
    root = compose_document(builder, text)
    if not isinstance(root, yaml.MappingNode):
        return SlurmSettings()
    section = next((v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "slurm"), None)
    if section is None or is_null(section):
        return SlurmSettings()
    found: dict[str, tuple[str, SourceLocation]] = {}
    for key, key_node, value in yaml_items(builder, section, "slurm"):
        location = builder.source.node(value)
        if key not in _SETTINGS_KEYS:
            raise InventoryError(
                f"unknown key {key!r} in slurm{near_miss(key, _SETTINGS_KEYS)} (it takes job or nodelist)",
                builder.source.node(key_node),
            )
        if not isinstance(value, yaml.ScalarNode) or is_null(value) or isinstance(node_value(value), bool):
            raise InventoryError(f"slurm {key} must be text, got {node_kind(value)}", location)
        found[key] = (str(node_value(value)), location)
    if len(found) == 2:
        raise InventoryError("slurm: give job or nodelist, not both", found["nodelist"][1])
    if "job" in found:
        job, location = found["job"]
        return SlurmSettings(job=check_job_id(job, str(location)))
    if "nodelist" in found:
        nodelist, location = found["nodelist"]
        return SlurmSettings(nodelist=nodelist, location=location)
    return SlurmSettings()


def parse_job(output: str, job: str) -> str:
    """The node list of a job from `scontrol show job JOB` (one record, or a het job's components, whose
    lists are joined: one allocation); InventoryError when the job holds no node, or when JOB is a job
    array's id (see `_refuse_array`)."""
    records = [record for record in re.split(r"(?m)^(?=JobId=)", output) if record.strip()]
    if not records:
        raise InventoryError(f"slurm job {job}: scontrol show job printed no job record")
    _refuse_array(records, job)
    lists: list[str] = []
    states: list[str] = []
    for record in records:
        state = _field(record, "JobState") or "UNKNOWN"
        states.append(state)
        if state not in HOLDING_STATES:
            continue
        nodelist = _field(record, "NodeList")
        if nodelist and nodelist != "(null)":
            lists.append(nodelist)
    if not lists:
        held = ", ".join(sorted(HOLDING_STATES))
        raise InventoryError(
            f"slurm job {job} holds no nodes (JobState={'/'.join(dict.fromkeys(states))}; nodes are read "
            f"from a job that is {held})"
        )
    return ",".join(lists)


def _refuse_array(records: Sequence[str], job: str) -> None:
    """InventoryError when `job` names a job array rather than one of its tasks: `scontrol show job` of
    the array's id prints every task, and each task is an allocation of its own (its nodes run another
    task's work), so joining them would make one fleet of unrelated allocations. One task's own id
    (`12345_7`, or its JobId) names one allocation; an array of one task is that task."""
    tasks = [
        (_field(record, "ArrayTaskId") or "?", _field(record, "JobState") or "UNKNOWN")
        for record in records
        if _field(record, "ArrayJobId") == job
    ]
    if not tasks or (len(records) == 1 and tasks[0][0].isdigit()):
        return
    # as Slurm writes them: `12345_7`, pending ones `12345_[8-20]`
    listed = ", ".join(
        f"{job}_{task if task.isdigit() else f'[{task}]'} {state}" for task, state in tasks[:8]
    )
    more = f" and {len(tasks) - 8} more" if len(tasks) > 8 else ""
    example = next((task for task, state in tasks if task.isdigit() and state in HOLDING_STATES), None)
    example = example or next((task for task, _ in tasks if task.isdigit()), "1")
    raise InventoryError(
        f"slurm job {job} is a job array ({listed}{more}): each task is an allocation of its own, and "
        "rpcfleet takes the nodes of one",
        hint=f"give one task's id, JOBID_TASK: -i slurm:{job}_{example} or --slurm-job {job}_{example}",
    )


def _field(record: str, name: str) -> str | None:
    """`NAME=value` of a record (whitespace-separated fields; `ReqNodeList=` is not `NodeList=`)."""
    match = re.search(rf"(?:^|\s){re.escape(name)}=(\S*)", record)
    return match.group(1) if match else None


def parse_hostnames(output: str, nodelist: str) -> list[str]:
    """The names `scontrol show hostnames LIST` printed, one a line; InventoryError on a line that is no
    host name (22.05 prints `n]` for `n[1-3`, with exit status 0)."""
    names = [line.strip() for line in output.splitlines() if line.strip()]
    for name in names:
        if re.search(r"[\[\],\s]", name):
            raise InventoryError(
                f"node list {nodelist!r}: scontrol show hostnames gave {name!r}, not a host name"
            )
    return names


def expand_nodelist(nodelist: str, origin: str, scontrol: Scontrol | None) -> tuple[list[str], str | None]:
    """A node list's names, and a warning when scontrol was there but could not answer: scontrol's
    names when it answers, else the Python expansion. InventoryError on a list that cannot be expanded."""
    warning = None
    if scontrol is not None:
        answer = scontrol(["show", "hostnames", nodelist])
        said = (answer.stderr + answer.stdout).strip()
        if "Invalid hostlist" in said:  # exit status 0 in 22.05: the message is what tells
            try:
                expand_hostlist(nodelist)
                reason = said.splitlines()[-1]
            except HostlistError as exc:  # the Python reading says what is wrong more precisely
                reason = str(exc)
            raise InventoryError(f"{origin}: node list {nodelist!r} cannot be expanded: {reason}")
        if answer.exit_status == 0:
            try:
                return parse_hostnames(answer.stdout, nodelist), None
            except InventoryError as exc:
                raise InventoryError(f"{origin}: {exc.message}") from None
        last = said.splitlines()[-1] if said else f"exit status {answer.exit_status}"
        warning = f"scontrol cannot expand node lists here ({last}); rpcfleet expanded {nodelist!r} itself"
    try:
        return expand_hostlist(nodelist), warning
    except HostlistError as exc:
        raise InventoryError(f"{origin}: {exc}") from None


def job_nodelist(job: str, scontrol: Scontrol | None) -> str:
    """A job's NodeList, asked from scontrol."""
    if scontrol is None:
        raise InventoryError(
            f"slurm job {job}: reading a job needs Slurm's scontrol, which is not on PATH",
            hint="run rpcfleet where Slurm's commands are, or name the nodes: `slurm: {nodelist: ...}`",
        )
    answer = scontrol(["show", "job", job])
    if answer.exit_status != 0:
        said = (answer.stderr or answer.stdout).strip() or f"exit status {answer.exit_status}"
        raise InventoryError(f"slurm job {job}: scontrol show job {job} failed: {said.splitlines()[-1]}")
    return parse_job(answer.stdout, job)


def find_nodes(
    *,
    job: str | None,
    settings: SlurmSettings,
    environ: Mapping[str, str],
    scontrol: Scontrol | None,
) -> SlurmNodes:
    """The nodes of the inventory, from the first source found (see the module's docstring)."""
    job = job or settings.job
    if job is None and settings.nodelist is not None:
        origin = f"the nodelist at {settings.location}" if settings.location else "the nodelist"
        return _nodes(settings.nodelist, origin, scontrol)
    if job is None:
        for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if environ.get(name, "").strip():
                return _nodes(environ[name], f"${name}", scontrol)
        job = environ.get("SLURM_JOB_ID", "").strip() or environ.get("SLURM_JOBID", "").strip() or None
        if job is None:
            raise InventoryError(
                "slurm: not inside a Slurm allocation ($SLURM_JOB_NODELIST and $SLURM_JOB_ID are unset)",
                hint="name the job: -i slurm:JOBID or --slurm-job JOBID (squeue --me lists yours)",
            )
        job = check_job_id(job, "$SLURM_JOB_ID")
    origin = f"slurm job {job}"
    return _nodes(job_nodelist(job, scontrol), origin, scontrol)


def _nodes(nodelist: str, origin: str, scontrol: Scontrol | None) -> SlurmNodes:
    names, warning = expand_nodelist(nodelist, origin, scontrol)
    if not names:
        raise InventoryError(f"{origin}: node list {nodelist!r} names no node")
    unique = tuple(dict.fromkeys(names))  # a node listed twice is one host
    return SlurmNodes(unique, origin, (warning,) if warning else ())


def build_inventory(nodes: SlurmNodes, text: str | None, path: Path | None) -> Inventory:
    """The inventory of `nodes` with the overlay's variables (`text`, the file at `path`; None: none)."""
    builder = Builder(path, (text or "").splitlines())
    where = SourceLocation(Path(nodes.origin))  # a node is "declared" by its source
    everyone = builder.group("all", None)
    for warning in nodes.warnings:
        builder.warn(warning, None)
    for name in nodes.names:
        builder.hosts[name] = RawHost(name, where)
    root = compose_document(builder, text) if text else None
    if root is not None and not is_null(root):
        if not isinstance(root, yaml.MappingNode):
            raise InventoryError(
                f"a Slurm overlay must be a mapping (slurm, vars, hosts, groups), got {node_kind(root)}",
                builder.source.node(root),
            )
        _overlay(builder, root, nodes.names, everyone.vars)
    return resolve(builder)


def _overlay(
    builder: Builder, root: yaml.MappingNode, names: Sequence[str], every: dict[str, RawVar]
) -> None:
    refs: list[tuple[str, str, SourceLocation]] = []  # (group, child, where)
    for key, key_node, value in yaml_items(builder, root, "the overlay"):
        if key == "slurm":
            continue  # read by read_settings
        if key == "vars":
            yaml_vars(builder, every, value, "vars")
        elif key == "hosts":
            for pattern, pattern_node, body in yaml_items(builder, value, "hosts"):
                for name in _matching(builder, pattern, names, builder.source.node(pattern_node)):
                    yaml_vars(builder, builder.hosts[name].vars, body, f"variables of {pattern!r}")
        elif key == "groups":
            for group_name, name_node, body in yaml_items(builder, value, "groups"):
                refs += _group(builder, group_name, name_node, body, names)
        else:
            builder.error(
                f"unknown top-level key {key!r}{near_miss(key, _OVERLAY_KEYS)}"
                " (a Slurm overlay has slurm, vars, hosts and groups)",
                builder.source.node(key_node),
            )
    for parent, child, location in refs:
        if child not in builder.groups or child in ("all", "ungrouped"):
            hint = near_miss(child, builder.groups)
            builder.error(f"group {parent!r} has undefined child group {child!r}{hint}", location)
        else:
            builder.add_child(builder.groups[parent], child, location)


def _group(
    builder: Builder, name: str, name_node: yaml.Node, body: yaml.Node, names: Sequence[str]
) -> list[tuple[str, str, SourceLocation]]:
    location = builder.source.node(name_node)
    if name in ("all", "ungrouped"):
        builder.error(f"group {name!r} is implicit; use top-level vars/hosts", location)
        return []
    group = builder.group(name, location)
    refs: list[tuple[str, str, SourceLocation]] = []
    for key, key_node, value in yaml_items(builder, body, f"group {name!r}"):
        what = f"{key} of group {name!r}"
        if key == "hosts":
            patterns = (
                [(str(node_value(value)), value)]
                if isinstance(value, yaml.ScalarNode) and not is_null(value)
                else list(yaml_names(builder, value, what))
            )
            for pattern, item in patterns:
                for host in _matching(builder, pattern, names, builder.source.node(item)):
                    if host not in group.hosts:
                        group.hosts.append(host)
        elif key == "vars":
            yaml_vars(builder, group.vars, value, what)
        elif key == "children":
            refs += [
                (name, child, builder.source.node(item)) for child, item in yaml_names(builder, value, what)
            ]
        else:
            builder.error(
                f"unknown key {key!r} in group {name!r}{near_miss(key, _GROUP_KEYS)}",
                builder.source.node(key_node),
            )
    return refs


def _matching(builder: Builder, pattern: str, names: Sequence[str], location: SourceLocation) -> list[str]:
    """The nodes a pattern names, in node order: a glob (`*`, `?`), else a Slurm hostlist."""
    if "*" in pattern or "?" in pattern:
        wanted = set(fnmatch.filter(names, pattern))
    else:
        try:
            wanted = set(expand_hostlist(pattern))
        except HostlistError as exc:
            builder.error(str(exc), location)
            return []
    matched = [name for name in names if name in wanted]
    if not matched:
        builder.warn(f"pattern {pattern!r} matches none of this job's nodes", location)
    return matched


def read_slurm_inventory(
    overlay: Path | None,
    *,
    job: str | None = None,
    environ: Mapping[str, str],
    scontrol: Scontrol | None,
) -> Inventory:
    """The Slurm inventory: the nodes (`find_nodes`) with the variables of the overlay file, if any."""
    text = None
    settings = SlurmSettings()
    if overlay is not None:
        try:
            text = overlay.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InventoryError(f"inventory file not found: {overlay}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InventoryError(f"cannot read inventory {overlay}: {exc}") from None
        settings = read_settings(text, overlay)
    nodes = find_nodes(job=job, settings=settings, environ=environ, scontrol=scontrol)
    return build_inventory(nodes, text, overlay)
