"""The declared options (`orchestrator.workflows.options`) agree with the planner they feed: the defaults
build the planner's own defaults, the choices are the planner's."""

from __future__ import annotations

from dataclasses import replace

from orchestrator.planning.plan import PlanOptions
from orchestrator.planning.profile import KV_CACHE_TYPES
from orchestrator.planning.settings import KV_CACHE_TYPE_NAMES, STRATEGIES
from orchestrator.probe.settings import DEFAULT_TIMEOUT
from orchestrator.workflows.options import OPTIONS, ProbeSettings, plan_options, probe_settings


def test_the_declared_defaults_are_the_planners() -> None:
    # flash attention: the declared default is llama-server's `auto`, which plans it on (PlanOptions: off)
    assert plan_options({}) == replace(PlanOptions(), flash_attn=True)
    assert probe_settings({}) == ProbeSettings() and ProbeSettings().timeout == DEFAULT_TIMEOUT


def test_the_declared_choices_are_the_planners() -> None:
    assert tuple(KV_CACHE_TYPES) == KV_CACHE_TYPE_NAMES
    assert OPTIONS["type_k"].choices == OPTIONS["type_v"].choices == KV_CACHE_TYPE_NAMES
    assert OPTIONS["strategy"].choices == STRATEGIES and OPTIONS["strategy"].default == PlanOptions().strategy


def test_a_flag_and_a_yaml_value_parse_alike() -> None:
    fa = OPTIONS["flash_attn"].parse
    assert [fa("on"), fa(True), fa(False), fa("yes"), fa(" Auto ")] == ["on", "on", "off", "on", "auto"]
    assert OPTIONS["local_devices"].parse("") == [] and OPTIONS["local_devices"].parse("CUDA0, CUDA1") == [
        "CUDA0",
        "CUDA1",
    ]
