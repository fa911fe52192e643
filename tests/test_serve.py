"""Tier 1 for `rpcfleet serve`: the Prometheus text, the refusals made before anything is served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.serve.metrics import Metrics, Recovery
from tests.plugins.servers import free_port, write_local_inventory


def _serve(*argv: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RPCFLEET_HOME": str(home)},
    )


def test_the_metrics_are_prometheus_text_with_every_family() -> None:
    metrics = Metrics()
    metrics.record_request("/v1/completions", 200)
    metrics.record_request("/v1/completions", 200)
    metrics.record_request("/v1/completions", 429)
    metrics.record_done(5, 16, 42.5, 0.25)
    metrics.record_recovery(Recovery(("10.0.0.2:50052",), 0.1, 0.3, 1.5, 1.9, 0.0))
    text = metrics.render({"10.0.0.1:50052": True, '10.0.0.2:50052"': False}, "degraded")
    assert 'rpcfleet_requests_total{route="/v1/completions",code="200"} 2' in text
    assert 'rpcfleet_requests_total{route="/v1/completions",code="429"} 1' in text
    assert 'rpcfleet_tokens_total{kind="completion"} 16' in text
    assert (
        "rpcfleet_time_to_first_token_seconds_sum 0.25\nrpcfleet_time_to_first_token_seconds_count 1" in text
    )
    assert 'rpcfleet_endpoint_up{endpoint="10.0.0.2:50052\\""} 0' in text  # a quote in a label is escaped
    assert 'rpcfleet_state{state="degraded"} 1' in text and 'rpcfleet_state{state="ready"} 0' in text
    assert 'rpcfleet_recovery_seconds{phase="total"} 1.9' in text
    for line in text.splitlines():  # every sample line: name{labels} value
        assert line.startswith("#") or (len(line.rsplit(" ", 1)) == 2 and float(line.rsplit(" ", 1)[1]) >= 0)


def test_a_public_bind_without_a_key_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    done = _serve("-m", str(tiny_model), "--host", "0.0.0.0", home=tmp_path)
    assert done.returncode == 2 and "without an API key is refused" in done.stderr, done.stderr
    key = tmp_path / "empty.key"
    key.write_text("\n")
    done = _serve("-m", str(tiny_model), "--api-key-file", str(key), home=tmp_path)
    assert done.returncode == 2 and f"{key}:1: the first line is empty" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_fleet_that_cannot_hold_the_model_is_an_error_at_start(tiny_model: Path, tmp_path: Path) -> None:
    inventory = write_local_inventory(tmp_path / "inv.yml", {"gone": {"rpc_port": free_port()}})
    done = _serve("-i", str(inventory), "-m", str(tiny_model), "--port", str(free_port()), home=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "cannot serve" in done.stderr and "no node answers" in done.stderr and "refused" in done.stderr
    assert "Traceback" not in done.stderr
