"""The busy rule on the node (operations/server/process.py `busy_script`), run by a real shell against a
scripted `ss`: a model holds one connection for its whole life, probes come and go with new peer ports."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from orchestrator.operations.server.process import busy_script

FAKE_SS = """#!/bin/sh
# Sample N prints line N of $SS_PLAN (the last line repeats): peers separated by commas, "-" for none.
n=$(cat "$SS_COUNT" 2>/dev/null || echo 0); echo $((n+1)) > "$SS_COUNT"
line=$(sed -n "$((n+1))p" "$SS_PLAN"); [ -z "$line" ] && line=$(tail -n 1 "$SS_PLAN")
[ "$line" = "-" ] && exit 0
echo "$line" | tr ',' '\\n' | while read -r p; do echo "0 0 10.0.0.5:50052 $p"; done
"""


def run_busy(tmp_path: Path, samples: list[str], grace: float = 0.5) -> tuple[str, int, float]:
    """(output, samples taken, seconds) of the busy check against `ss` answers `samples`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ss").write_text(FAKE_SS)
    (bin_dir / "ss").chmod(0o755)
    plan, count = tmp_path / "plan", tmp_path / "count"
    plan.write_text("\n".join(samples) + "\n")
    count.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SS_PLAN": str(plan),
        "SS_COUNT": str(count),
    }
    started = time.monotonic()
    done = subprocess.run(
        ["sh", "-c", busy_script(50052, grace)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), int(count.read_text()), time.monotonic() - started


def test_a_connection_held_for_the_grace_is_busy(tmp_path: Path) -> None:
    out, samples, seconds = run_busy(tmp_path, ["10.0.0.1:4000"])
    # 5 samples 0.1 s apart (the grace); the upper bound only catches a loop that never ends.
    assert out == "@busy 10.0.0.1:4000" and samples == 5 and 0.4 < seconds < 20


def test_nothing_connected_is_decided_at_once(tmp_path: Path) -> None:
    out, samples, _ = run_busy(tmp_path, ["-"])
    assert out == "" and samples == 1


def test_a_stream_of_probes_is_never_busy(tmp_path: Path) -> None:
    """A monitor probing every few ms: always someone connected, never the same peer port twice."""
    probes = [f"10.0.0.1:{5000 + i}" for i in range(100)]
    out, samples, seconds = run_busy(tmp_path, probes)
    # Sampling ends after 3 x the grace (16 samples 0.1 s apart); the upper bound only catches a loop that
    # never ends (the fake's last answer repeats).
    assert out == "" and samples == 16 and seconds < 20


def test_a_model_among_probes_is_busy_and_named(tmp_path: Path) -> None:
    samples = [f"10.0.0.9:41000,10.0.0.1:{5000 + i}" for i in range(20)]
    out, _, _ = run_busy(tmp_path, samples)
    assert out == "@busy 10.0.0.9:41000"


def test_a_client_that_leaves_during_the_grace_is_not_busy(tmp_path: Path) -> None:
    out, _, _ = run_busy(tmp_path, ["10.0.0.9:41000", "10.0.0.9:41000", "-"])
    assert out == ""
