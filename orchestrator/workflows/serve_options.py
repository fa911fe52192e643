"""serve's own options, declared once as the planning options are (`orchestrator.workflows.options`:
`Option`): the models, the formations, the socket and its keys, the serving limits. `rpcfleet serve`'s
flags are made from `SERVE_OPTIONS` (`cli/_planning.py: add_options`), `plan` and `report` take --replicas
from here, and `serve_config` builds the serving limits (`ServeConfig`) from the options by name.

The defaults are serve's own (`orchestrator.serve.settings`, which `ServeConfig` and the engine read too:
one number each). Cheap to import (the command line reads it at start-up): `serve.states` (the engine's
defaults) is imported where the limits are built, the address parser where an address is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.core import fields
from orchestrator.planning import settings as planning_settings
from orchestrator.serve import settings
from orchestrator.workflows.options import PARALLEL, PLAN_OPTIONS, PROBE_OPTIONS, Option

if TYPE_CHECKING:
    from orchestrator.serve.states import ServeConfig

KEY_ENV = "RPCFLEET_API_KEY"  # the key from the environment: argv is world-readable (`ps`), this is not
ADMIN_KEY_ENV = "RPCFLEET_ADMIN_KEY"  # the admin routes' own key (`--admin-key-file`)


def replicas(value: Any) -> int | str:
    """--replicas: auto or a number of formations."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return fields.integer(minimum=1, maximum=1024)(value)


def seconds_or_zero(value: Any) -> float:
    """A number of seconds, or 0 (off)."""
    try:
        return 0.0 if float(value) == 0 else fields.seconds(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected 0 (never) or a positive number of seconds, got {value!r}") from None


def listen_address(value: Any) -> str:
    """An address to listen on: an IPv4/IPv6 address or a hostname, read as an inventory's `address` is
    (a `host:port` is refused here, not a failure to bind later)."""
    from orchestrator.inventory.variables import parse_address

    return parse_address(value)


def seed(value: Any) -> int:
    """--seed: an integer, negative ones too, as Python's `int` reads it."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid int value: {value!r}") from None


REPLICAS_HELP = (
    "formations of the model, each on its own nodes: auto = the fewest nodes it fits on, as many such "
    "groups as the nodes hold; N = N such groups"
)

MODEL = Option(
    "model",
    ("--model", "-m"),
    Path,
    None,
    "a GGUF model (first shard); several -m serve several models, each on its own servers",
    repeat=True,
)
MODELS = Option(
    "models",
    ("--models",),
    Path,
    None,
    "a YAML file of models to serve (model, name, context, parallel, replicas, hosts, groups, load, "
    "idle_unload, draft...)",
    metavar="FILE",
)
REPLICAS = Option(
    "replicas", ("--replicas",), replicas, "auto", f"{REPLICAS_HELP} (default: auto)", metavar="auto|N"
)
SPLIT = Option(
    "split",
    ("--split",),
    fields.boolean,
    False,
    "one formation over every selected node (the model split across all of them)",
    switch=True,
)
# llama-server's slots are the plan's sequences: the plan sizes their KV and compute
SERVE_PARALLEL = dataclasses.replace(PARALLEL, default=settings.DEFAULT_PARALLEL)
HOST = Option("host", ("--host",), listen_address, "127.0.0.1", "address to bind (default: 127.0.0.1)")
PORT = Option("port", ("--port",), fields.port, 8080, "port (default: 8080)")
API_KEY = Option(
    "api_key",
    ("--api-key",),
    str,
    None,
    "the key clients send as `Authorization: Bearer KEY` (visible in `ps`: prefer --api-key-file or "
    f"{KEY_ENV})",
)
API_KEY_FILE = Option(
    "api_key_file", ("--api-key-file",), Path, None, f"a file whose first line is the key (or set {KEY_ENV})"
)
ADMIN_KEY_FILE = Option(
    "admin_key_file",
    ("--admin-key-file",),
    Path,
    None,
    f"a file whose first line is the admin key (or set {ADMIN_KEY_ENV}): /admin/* then takes only it; "
    "without one the API key may reload, never with a rolling restart of the fleet",
)
KEYS = Option(
    "keys",
    ("--keys",),
    Path,
    None,
    "per-user keys, one a line: NAME KEY SCOPES [MODELS] (scopes: inference, metrics, admin; a key may be "
    "sha256:HEX); replaces the API and admin keys; SIGHUP then re-reads it (the old keys stay if it is "
    "bad) and reloads no engine: POST /admin/reload does",
    metavar="FILE",
)
MODEL_NAME = Option(
    "model_name", ("--model-name",), str, None, "the model's id in the API (default: the file's stem)"
)
CHAT_TEMPLATE = Option(
    "chat_template",
    ("--chat-template",),
    str,
    None,
    "the chat format: one of llama-server's template names (gemma, chatml, llama3...) or a jinja file "
    "(default: the GGUF's template; without one, its architecture's known template)",
    metavar="NAME|FILE",
)
# Speculative decoding (llama-server's --spec-type draft-simple): a draft model planned in each formation.
DRAFT = Option(
    "draft",
    ("--draft", "--model-draft", "-md", "--spec-draft-model"),
    Path,
    None,
    "a draft model for speculative decoding (llama-server's --spec-draft-model): a small GGUF with the "
    "model's vocabulary, planned in each formation's memory, its own KV and compute included",
    metavar="FILE",
)
DRAFT_MAX = Option(
    "draft_max",
    ("--draft-max", "--spec-draft-n-max"),
    fields.integer(minimum=1, maximum=256),
    planning_settings.DRAFT_N_MAX,
    f"tokens the draft proposes at most per step (llama-server's --spec-draft-n-max; default: "
    f"{planning_settings.DRAFT_N_MAX})",
    metavar="N",
)
DRAFT_MIN = Option(
    "draft_min",
    ("--draft-min", "--spec-draft-n-min"),
    fields.integer(minimum=0, maximum=256),
    planning_settings.DRAFT_N_MIN,
    f"fewest drafted tokens worth verifying (llama-server's --spec-draft-n-min; default: "
    f"{planning_settings.DRAFT_N_MIN})",
    metavar="N",
)
DEVICE_DRAFT = Option(
    "device_draft",
    ("--device-draft", "--spec-draft-device", "-devd"),
    fields.choice(planning_settings.DRAFT_DEVICES),
    planning_settings.DRAFT_DEVICES[0],
    "where the draft runs: none = this machine's CPU (llama-server's word: not offloaded; checked "
    "against its available memory), first = the formation's first device (taken from its memory before "
    "the model's layers are placed) (default: none)",
    choices=planning_settings.DRAFT_DEVICES,
)
QUEUE = Option(
    "queue",
    ("--queue",),
    fields.integer(minimum=0),
    settings.QUEUE_SIZE,
    "requests that may wait for a slot beyond the --parallel served; more get 429 "
    f"(default: {settings.QUEUE_SIZE})",
)
QUEUE_TIMEOUT = Option(
    "queue_timeout",
    ("--queue-timeout",),
    fields.seconds,
    settings.QUEUE_TIMEOUT,
    f"seconds a request may wait in the queue (default: {settings.QUEUE_TIMEOUT:g})",
    metavar="S",
)
RECOVER_TIMEOUT = Option(
    "recover_timeout",
    ("--recover-timeout",),
    fields.seconds,
    settings.RECOVER_TIMEOUT,
    "seconds to get serving again after a lost node before exiting with status 1 "
    f"(default: {settings.RECOVER_TIMEOUT:g})",
    metavar="S",
)
LINK_TIMEOUT = Option(
    "link_timeout",
    ("--link-timeout",),
    fields.seconds,
    settings.LINK_TIMEOUT,
    "seconds a cut link may stall llama-server before it is declared lost "
    f"(default: {settings.LINK_TIMEOUT:g})",
    metavar="S",
)
REJOIN_INTERVAL = Option(
    "rejoin_interval",
    ("--rejoin-interval",),
    seconds_or_zero,
    settings.REJOIN_INTERVAL,
    "while degraded, seconds between two probes of the nodes left out; one that answers again is taken "
    "back after the request being served (re-plan and load, as a reload); 0: never "
    f"(default: {settings.REJOIN_INTERVAL:g})",
    metavar="S",
)
RELOAD_ROLLING = Option(
    "reload_rolling",
    ("--reload-rolling",),
    fields.boolean,
    False,
    "a SIGHUP reload also restarts the fleet's servers one at a time (restart --rolling)",
    switch=True,
)
SEED = Option("seed", ("--seed",), seed, settings.SEED, f"default sampling seed (default: {settings.SEED})")
ROUTING = Option(
    "routing",
    ("--routing",),
    fields.choice(("affine", "least-loaded")),
    settings.ROUTING,
    "which formation of a model takes a request: affine = the one whose slots hold its prompt's prefix "
    "(its `user` field, else a hash of its first messages), the least-loaded when that one's slots are all "
    f"busy; least-loaded = always the least-loaded (default: {settings.ROUTING})",
    choices=("affine", "least-loaded"),
)
MODELS_MIN_RESIDENT = Option(
    "min_resident",
    ("--models-min-resident",),
    seconds_or_zero,
    settings.MIN_RESIDENT,
    "on-demand models: seconds a model stays loaded before another may take its nodes (twice its load "
    f"time when that is longer); 0: only twice its load time (default: {settings.MIN_RESIDENT:g})",
    metavar="S",
)
MODELS_SWAP_COOLDOWN = Option(
    "swap_cooldown",
    ("--models-swap-cooldown",),
    seconds_or_zero,
    settings.SWAP_COOLDOWN,
    "on-demand models: seconds after its last request before a model may be swapped out for another, "
    f"so that a user's next turn finds it loaded; 0: at once (default: {settings.SWAP_COOLDOWN:g})",
    metavar="S",
)
OBSERVE_INTERVAL = Option(
    "observe_interval",
    ("--observe-interval",),
    seconds_or_zero,
    15.0,
    "seconds between two probe rounds of the fleet exporter (the page at /, the fleet's series on "
    "/metrics); 0: off (default: 15)",
    metavar="S",
)

# serve's own options (the planning and probe ones are `options`'), in the command line's order.
OWN_OPTIONS = (
    MODEL,
    MODELS,
    REPLICAS,
    SPLIT,
    HOST,
    PORT,
    API_KEY,
    API_KEY_FILE,
    ADMIN_KEY_FILE,
    KEYS,
    MODEL_NAME,
    CHAT_TEMPLATE,
    DRAFT,
    DRAFT_MAX,
    DRAFT_MIN,
    DEVICE_DRAFT,
    QUEUE,
    QUEUE_TIMEOUT,
    RECOVER_TIMEOUT,
    LINK_TIMEOUT,
    REJOIN_INTERVAL,
    RELOAD_ROLLING,
    SEED,
    ROUTING,
    MODELS_MIN_RESIDENT,
    MODELS_SWAP_COOLDOWN,
    OBSERVE_INTERVAL,
)
# Every option of `rpcfleet serve`, in the command line's order: the models and formations, the planning
# and probe options (--parallel with serve's default: llama-server's slots), then serve's own.
SERVE_OPTIONS = (
    *OWN_OPTIONS[:4],
    *(SERVE_PARALLEL if option is PARALLEL else option for option in PLAN_OPTIONS),
    *PROBE_OPTIONS,
    *OWN_OPTIONS[4:],
)
# Options that exclude each other: one of each group at most.
EXCLUSIVE = ((REPLICAS.name, SPLIT.name), (API_KEY.name, API_KEY_FILE.name, KEYS.name))
# What --keys replaces besides (argparse puts a flag in one exclusive group: the CLI checks these).
KEYS_EXCLUDES = (ADMIN_KEY_FILE.name, RELOAD_ROLLING.name)
OPTIONS: Mapping[str, Option] = {option.name: option for option in SERVE_OPTIONS}

# The serving limits: `ServeConfig`'s field -> the option that sets it (`parallel` is each formation's,
# from its model's plan options).
LIMITS: Mapping[str, Option] = {
    "queue_size": QUEUE,
    "queue_timeout": QUEUE_TIMEOUT,
    "recover_timeout": RECOVER_TIMEOUT,
    "link_timeout": LINK_TIMEOUT,
    "rejoin_interval": REJOIN_INTERVAL,
    "seed": SEED,
    "routing": ROUTING,
    "min_resident": MODELS_MIN_RESIDENT,
    "swap_cooldown": MODELS_SWAP_COOLDOWN,
}


def serve_config(values: Mapping[str, Any]) -> ServeConfig:
    """The one builder of the serving limits (`ServeConfig`) from serve's options by name (the declared
    default for an absent or None one)."""
    from orchestrator.serve.states import ServeConfig

    def get(option: Option) -> Any:
        value = values.get(option.name)
        return option.default if value is None else value

    return ServeConfig(**{field: get(option) for field, option in LIMITS.items()})
