"""The peer comparisons of issue 45 (bench/peers_run.py, bench/peers_serve.py): what they read back from the
tools they time, and the verdicts they compute from the figures."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def peers_run() -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("peers_run")
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture
def peers_serve() -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("peers_serve")
    finally:
        sys.path.remove(str(ROOT / "bench"))


RUN_TAIL = """
 host                 CPU             plan      170.00    0.00     26.33     1.00   197.33
probe 0.60 s · plan 0.00 s · load 2.51 s · ready
llama.cpp's load 2.39 s · prompt 10 tokens in 0.080 s · 64 tokens generated, decoding at 29.1 tokens/s
"""


def test_run_output_gives_the_phases_and_the_decoding_speed(peers_run: ModuleType) -> None:
    phases, tokens, tps = peers_run.parse_run_output(RUN_TAIL)
    assert phases == {"probe": 0.60, "plan": 0.00, "load": 2.51}
    assert (tokens, tps) == (64, 29.1)


def test_one_token_has_no_decoding_speed(peers_run: ModuleType) -> None:
    one = (
        "probe 0.61 s · plan 0.01 s · load 0.08 s · ready\n"
        "llama.cpp's load 0.07 s · prompt 10 tokens in 0.020 s · 1 token generated "
        "(from the prompt's evaluation: no decoding step)\n"
    )
    phases, tokens, tps = peers_run.parse_run_output(one)
    assert phases["load"] == 0.08 and (tokens, tps) == (0, 0.0)


def test_run_output_without_a_phase_line_is_an_error(peers_run: ModuleType) -> None:
    with pytest.raises(ValueError, match="no phase line"):
        peers_run.parse_run_output("Traceback (most recent call last):\n")


def test_first_token_target_is_the_median_gap(peers_run: ModuleType) -> None:
    gap, met = peers_run.ttft_verdict([1.3, 1.4, 9.0], [0.2, 0.3, 0.4], extra=1.0)
    assert gap == pytest.approx(1.1) and not met  # one slow round does not move a median
    gap, met = peers_run.ttft_verdict([1.2, 1.25, 1.3], [0.3, 0.35, 0.4], extra=1.0)
    assert gap == pytest.approx(0.9) and met


def test_decoding_target_is_a_share_of_by_hand(peers_run: ModuleType) -> None:
    ratio, met = peers_run.decode_verdict([40.0, 38.0, 41.0], [42.0, 40.0, 44.0], share=0.95)
    assert ratio == pytest.approx(40 / 42) and met
    ratio, met = peers_run.decode_verdict([37.0], [43.5], share=0.95)
    assert ratio == pytest.approx(0.85, abs=0.01) and not met


def test_spread_is_the_median_and_the_range(peers_run: ModuleType) -> None:
    assert peers_run.spread([3.0, 1.0, 2.0]) == "2.00 (1.00-3.00)"


def run(tps: float, *ttft: float) -> dict[str, object]:
    return {"tps": tps, "ttft": list(ttft)}


def test_serve_within_5_percent_of_the_round_robin(peers_serve: ModuleType) -> None:
    tps, first, met = peers_serve.ratio_verdict([run(96.0, 0.3, 0.31)], [run(100.0, 0.3, 0.3)])
    assert tps == pytest.approx(0.96) and first == pytest.approx(0.305 / 0.3) and met
    # slower in tokens/s
    assert not peers_serve.ratio_verdict([run(90.0, 0.3)], [run(100.0, 0.3)])[2]
    # as fast, but its first tokens later
    assert not peers_serve.ratio_verdict([run(100.0, 0.4)], [run(100.0, 0.3)])[2]
    # the TTFT median is over every request of every round
    tps, first, _ = peers_serve.ratio_verdict(
        [run(50.0, 0.1, 0.2), run(150.0, 0.3)], [run(100.0, 0.2), run(100.0, 0.2, 0.2)]
    )
    assert tps == pytest.approx(1.0) and first == pytest.approx(1.0)


def test_the_rounds_spread_says_whether_1_is_inside(peers_serve: ModuleType) -> None:
    assert peers_serve.round_spread([0.9, 1.1]) == "0.90, 1.10 (1 inside: noise)"
    assert peers_serve.round_spread([0.5, 0.6]) == "0.50, 0.60 (1 outside)"
    assert peers_serve.round_spread([0.5]) == "one round: no spread"


def test_router_words_say_what_the_check_found(peers_serve: ModuleType) -> None:
    assert "passed `--rpc 10.0.0.1:50052` on" in peers_serve.router_words(1, 1, "10.0.0.1:50052")
    assert "did not pass `--rpc`" in peers_serve.router_words(1, 0, "10.0.0.1:50052")
    assert "could not be checked" in peers_serve.router_words(0, 0, "10.0.0.1:50052")


def test_the_round_robin_holds_every_engine_unbuffered(peers_serve: ModuleType, tmp_path: Path) -> None:
    conf = peers_serve.nginx_conf(tmp_path, 8080, [9001, 9002, 9003])
    upstream = conf.split("upstream engines {", 1)[1].split("}", 1)[0]
    assert [line.split()[1] for line in upstream.splitlines() if "server " in line] == [
        "127.0.0.1:9001;",
        "127.0.0.1:9002;",
        "127.0.0.1:9003;",
    ]
    assert "least_conn" not in conf and "proxy_buffering off;" in conf
    assert "listen 127.0.0.1:8080;" in conf and str(tmp_path) in conf


def test_an_engine_argv_moves_to_another_port(peers_serve: ModuleType) -> None:
    argv = ["llama-server", "-m", "m.gguf", "--port", "41000", "--alias", "bench"]
    assert peers_serve.on_port(argv, 5) == ["llama-server", "-m", "m.gguf", "--port", "5", "--alias", "bench"]


@pytest.fixture
def peers_affinity() -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("peers_affinity")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def verdicts(rr: dict[str, str], one: dict[str, str]) -> dict[str, dict[str, str]]:
    within = "within the spread"
    base = {"p50": within, "p95": within, "tps": within, "wall": within, "processed": within}
    return {"round robin": {**base, **rr}, "one engine": {**base, **one}}


def test_the_routers_gain_is_real_only_against_the_round_robins_cache(peers_affinity: ModuleType) -> None:
    better = {"processed": "affine better", "p50": "affine better"}
    assert peers_affinity.gain_target(verdicts(better, {})) == (True, [])
    # the one engine holds every history itself: affine need not beat it, only not lose to it
    met, misses = peers_affinity.gain_target(verdicts(better, {"processed": "affine worse"}))
    assert met and not misses
    met, misses = peers_affinity.gain_target(verdicts(better, {"tps": "affine worse"}))
    assert not met and misses == ["tps against the one engine"]
    # the engine's own cache did the router's work: no gain in prompt tokens
    met, misses = peers_affinity.gain_target(verdicts({"p50": "affine better"}, {}))
    assert not met and misses == ["processed against the round robin"]


@pytest.fixture
def peers_rolling() -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("peers_rolling")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_rolling_restart_at_most_10_percent_over_ansible(peers_rolling: ModuleType) -> None:
    ratio, met = peers_rolling.rolling_target([2.1, 2.2, 9.0], [2.0, 2.1, 2.3], extra=0.10)
    assert ratio == pytest.approx(2.2 / 2.1) and met
    ratio, met = peers_rolling.rolling_target([3.0], [2.0], extra=0.10)
    assert ratio == pytest.approx(1.5) and not met


def test_the_ansible_play_restarts_one_node_at_a_time_and_waits_for_the_port(
    peers_rolling: ModuleType,
) -> None:
    import yaml

    (play,) = yaml.safe_load(peers_rolling.PLAYBOOK.format(unit="rpcfleet-home-rpcfleet.service", port=50052))
    assert play["serial"] == 1 and play["gather_facts"] is False
    restart, wait = play["tasks"]
    assert restart["ansible.builtin.systemd"] == {
        "name": "rpcfleet-home-rpcfleet.service",
        "state": "restarted",
    }
    assert wait["ansible.builtin.wait_for"] == {"host": "{{ ansible_host }}", "port": 50052, "timeout": 30}


def test_a_failed_peer_run_names_the_error_and_the_engines_last_line(
    peers_affinity: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "one-engine.log").write_text("srv  load_model: loaded\nGGML_ASSERT(n_tokens > 0) failed\n\n")
    said = peers_affinity.failure(RuntimeError("Server disconnected"), tmp_path, "one engine")
    assert (
        said == "RuntimeError: Server disconnected; the engine's log ends: GGML_ASSERT(n_tokens > 0) failed"
    )
    assert peers_affinity.failure(OSError("refused"), tmp_path, "round robin") == "OSError: refused"
