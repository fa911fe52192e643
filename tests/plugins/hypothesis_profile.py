"""Hypothesis on a shared machine: no per-example deadline (200 ms by default) and no "too slow" health
check. A busy 2-core machine trips both on correct code; a test that means a time bound asserts it."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("shared-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-machine")
