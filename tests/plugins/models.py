"""Generated GGUF models (orchestrator.synth), written once per test session into a session tmp dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.planning.synth import write_sparse_70b_header, write_tiny_llama

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_factory(models_dir: Path) -> TinyModelFactory:
    """`make(**kwargs) -> Path`: a tiny llama model for `write_tiny_llama(**kwargs)`, cached by arguments."""
    cache: dict[tuple[tuple[str, Any], ...], Path] = {}

    def make(**kwargs: Any) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            stem = "tiny-" + ("-".join(f"{k}_{v}" for k, v in key) or "default")
            cache[key] = write_tiny_llama(models_dir / stem / f"{stem}.gguf", **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory: TinyModelFactory) -> Path:
    """The default tiny model: 4 layers, n_embd 256, 4 heads, f16, about 5.6 MB."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def sparse_70b(models_dir: Path) -> Path:
    """A 70B-class q4_K GGUF (80 layers, 723 tensors, 128k vocab) whose data is a hole (~3 MB on disk)."""
    return write_sparse_70b_header(models_dir / "sparse-70b" / "llama-70b-q4_K.gguf")
