"""Tier 2: speculative decoding in `rpcfleet serve` on a deployed one-node lab (real sshd, a real
rpc-server, llama-server): the real Gemma 3 270M served without a draft, then with itself as its draft on
this machine's CPU; at temperature 0 the answers are the same text, and llama-server's `timings` show
tokens drafted and accepted only with the draft.

Why short answers: llama-server verifies the drafted tokens in one batch, and a batch's float sums are not
a single token's, so a near-tie may go the other way tens of tokens in (bench/speculative.py counts how
often); the first 16 tokens of these prompts are no near-tie.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.lab.state import Lab
from tests.plugins.lab import own_lab
from tests.plugins.servers import free_port

pytestmark = [pytest.mark.lab, pytest.mark.llama]

KEY = "sp3culative"
PROMPTS = ("The history of the lighthouse begins", "Write a short story about a fox who")
TOKENS = 16


@pytest.fixture(scope="module")
def spec_lab(cpu_artifact: Artifact) -> Iterator[Lab]:
    with own_lab(1, "sp") as made:
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", "deploy", "-i", str(made.inventory)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield made


def _request(base: str, path: str, body: Any = None) -> Any:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(base + path, data, headers), timeout=300) as answer:
        return json.loads(answer.read())


def _answers(lab: Lab, model: Path, home: Path, *extra: str) -> tuple[list[dict[str, Any]], str]:
    """Serve `model` on the lab (`extra`: serve's flags), ask each prompt once at temperature 0, stop:
    each answer and serve's output."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = home / f"serve-{port}.log"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(lab.inventory), "-m", str(model)]
    argv += ["--port", str(port), "--ctx", "1024", "--parallel", "1", "--model-name", "gemma", *extra]
    env = {**os.environ, "RPCFLEET_HOME": str(home), "RPCFLEET_API_KEY": KEY}
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                if _request(base, "/health").get("status") == "ready":
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        body = {"model": "gemma", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        answers = [_request(base, "/v1/completions", {**body, "prompt": prompt}) for prompt in PROMPTS]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return answers, log.read_text()


def test_gemma_drafting_for_itself_gives_the_same_text_and_drafted_tokens_are_accepted(
    spec_lab: Lab, gemma_model: Path, tmp_path: Path
) -> None:
    plain, _ = _answers(spec_lab, gemma_model, tmp_path)
    drafted, output = _answers(
        spec_lab, gemma_model, tmp_path, "--draft", str(gemma_model), "--draft-max", "4"
    )
    assert "draft Gemma 3 270m on this machine's CPU" in output, output  # the formation's listing
    for prompt, without, with_draft in zip(PROMPTS, plain, drafted, strict=True):
        text = with_draft["choices"][0]["text"]
        assert with_draft["usage"]["completion_tokens"] == TOKENS
        assert text == without["choices"][0]["text"], (prompt, text, without["choices"][0]["text"])
        timings = with_draft["timings"]
        assert timings["draft_n"] > 0 and 0 < timings["draft_n_accepted"] <= timings["draft_n"], timings
        assert not without["timings"].get("draft_n"), without["timings"]
