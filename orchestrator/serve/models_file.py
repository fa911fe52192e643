"""serve's models file: the models one `serve` serves, each on its own servers (pure: text in, entries
out; errors name the file and line).

    models:
      - model: /models/gemma-3-270m.gguf   # required: the GGUF (first shard)
        name: gemma                        # its id in the API (default: the file's stem)
        context: 8k                        # --ctx (default: serve's)
        parallel: 2                        # --parallel, llama-server's slots (default: serve's)
        replicas: auto                     # auto, a number, or split (default: serve's --replicas/--split)
        hosts: "n1,n2"                     # a host pattern, as --limit (default: every selected server)
        groups: [gpu]                      # or inventory groups
        load: on-demand                    # always (default: loaded at start) or on-demand
        idle_unload: 10m                   # on-demand: unloaded after this long without a request

An on-demand model is loaded by the first request that names it, on the nodes that are free (or that an
idle on-demand model frees: `serve.on_demand`); without `idle_unload` it stays loaded until another
model needs its nodes.
        draft: /models/gemma-3-270m.gguf   # a draft model for speculative decoding (default: serve's --draft)
        draft-max: 4                       # --draft-max, --draft-min, --device-draft (default: serve's)

A list of such entries at the top level is read the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from orchestrator.core import fields
from orchestrator.core.errors import UsageError
from orchestrator.core.yamlsource import Source, compose, did_you_mean, node_kind, node_value
from orchestrator.planning.settings import DRAFT_DEVICES

KEYS = ("model", "name", "context", "parallel", "replicas", "hosts", "groups", "load", "idle_unload")
LOADS = ("always", "on-demand")
MIN_IDLE_UNLOAD = 1.0  # seconds
DRAFT_KEYS = ("draft", "draft-max", "draft-min", "device-draft")  # speculative decoding (serve's --draft...)


@dataclass(frozen=True)
class ModelEntry:
    """One model to serve; None: serve's flag applies. `replicas`: "auto", "split" or a number."""

    model: Path
    name: str | None = None
    context: int | None = None
    parallel: int | None = None
    replicas: str | int | None = None
    hosts: str | None = None  # a host pattern (groups are joined into one)
    line: int | None = None  # where it is declared
    on_demand: bool = False  # `load: on-demand`: loaded by its first request, not at start
    idle_unload: float | None = None  # seconds without a request before an on-demand model is unloaded
    draft: Path | None = None  # its draft model (relative to the file, as `model`)
    draft_max: int | None = None
    draft_min: int | None = None
    device_draft: str | None = None


def replicas_value(value: object) -> str | int:
    """auto, split or a number of formations (>= 1)."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "split"):
        return value.strip().lower()
    try:
        return fields.integer(minimum=1, maximum=1024)(value)
    except ValueError:
        raise ValueError(f"expected auto, split or a number of formations, got {value!r}") from None


def parse_models_file(path: Path, text: str) -> list[ModelEntry]:
    """The entries of a models file; UsageError naming the file and line (exit 2)."""
    source = Source.of_text(path, text)
    try:
        root = compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UsageError(f"not valid YAML: {getattr(exc, 'problem', exc)}", source.mark(mark)) from None
    if root is None:
        raise UsageError("the models file is empty", source.at(1))
    items = root
    if isinstance(root, yaml.MappingNode):
        keys = {node_value(k): v for k, v in root.value}
        if set(keys) != {"models"}:
            raise UsageError("expected a list of models, or `models:` with one", source.node(root))
        items = keys["models"]
    if not isinstance(items, yaml.SequenceNode) or not items.value:
        raise UsageError(f"expected a list of models, got {node_kind(items)}", source.node(items))
    entries: list[ModelEntry] = []
    names: dict[str, int] = {}
    for item in items.value:
        entry = _entry(item, source, path)
        name = entry.name or entry.model.stem
        if name in names:
            raise UsageError(
                f"the name {name!r} is already the model's of line {names[name]}", source.node(item)
            )
        names[name] = entry.line or 0
        entries.append(entry)
    return entries


def _entry(item: yaml.Node, source: Source, path: Path) -> ModelEntry:
    if not isinstance(item, yaml.MappingNode):
        raise UsageError(f"a model is a mapping (model: FILE, ...), got {node_kind(item)}", source.node(item))
    values: dict[str, object] = {}
    for key_node, value_node in item.value:
        key = node_value(key_node)
        if key not in KEYS + DRAFT_KEYS:
            known = KEYS + DRAFT_KEYS
            raise UsageError(
                f"unknown key {key!r}{did_you_mean(key, known)} (known: {', '.join(known)})",
                source.node(key_node),
            )
        try:
            values[key] = _field(key, node_value(value_node))
        except ValueError as exc:
            raise UsageError(f"{key}: {exc}", source.node(value_node)) from None
    if "model" not in values:
        raise UsageError("a model entry needs `model: FILE`", source.node(item))
    on_demand = values.get("load") == "on-demand"
    if "idle_unload" in values and not on_demand:
        raise UsageError("idle_unload is for a model with `load: on-demand`", source.node(item))
    if on_demand and values.get("replicas", 1) != 1:
        raise UsageError(
            "an on-demand model is loaded as one formation: leave out replicas (or give 1)", source.node(item)
        )
    model, draft = (_path(values[key], path) if key in values else None for key in ("model", "draft"))
    assert model is not None
    hosts = [str(values["hosts"])] if "hosts" in values else []
    groups = values.get("groups")
    if isinstance(groups, tuple):
        hosts += [str(g) for g in groups]
    return ModelEntry(
        model=model,
        name=values.get("name"),  # type: ignore[arg-type]
        context=values.get("context"),  # type: ignore[arg-type]
        parallel=values.get("parallel"),  # type: ignore[arg-type]
        replicas=values.get("replicas"),  # type: ignore[arg-type]
        hosts=",".join(hosts) or None,
        line=item.start_mark.line + 1,
        on_demand=on_demand,
        idle_unload=values.get("idle_unload"),  # type: ignore[arg-type]
        draft=draft,
        draft_max=values.get("draft-max"),  # type: ignore[arg-type]
        draft_min=values.get("draft-min"),  # type: ignore[arg-type]
        device_draft=values.get("device-draft"),  # type: ignore[arg-type]
    )


def _path(value: object, path: Path) -> Path:
    """A file named in the models file: relative to the file, as a playbook's paths are."""
    named = Path(str(value)).expanduser()
    return named if named.is_absolute() else path.parent / named


def _field(key: str, value: object) -> object:
    if key in ("model", "name", "hosts", "draft"):
        text = fields.text(value)
        if not text.strip():
            raise ValueError("is empty")
        return text.strip()
    if key == "context":
        return fields.context(value)
    if key == "parallel":
        return fields.integer(minimum=1, maximum=256)(value)
    if key == "replicas":
        return replicas_value(value)
    if key == "load":
        return fields.choice(LOADS, {"on_demand": "on-demand", "ondemand": "on-demand"})(value)
    if key == "idle_unload":
        seconds = fields.duration(value)
        if (
            seconds < MIN_IDLE_UNLOAD
        ):  # the idle watch looks at a quarter of the shortest, at most each second
            raise ValueError(f"at least {MIN_IDLE_UNLOAD:g} s, got {value!r}")
        return seconds
    if key in ("draft-max", "draft-min"):
        return fields.integer(minimum=1 if key == "draft-max" else 0, maximum=256)(value)
    if key == "device-draft":
        return fields.choice(DRAFT_DEVICES)(value)
    if isinstance(value, str):  # groups: one name or a list
        return (value,)
    return fields.list_of(fields.text)(value)
