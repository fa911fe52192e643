"""Generated GGUF models (orchestrator.models.synth), written once per test session into a session
tmp dir, and the one real model, Gemma 3 270M, that `make setup` fetches into the cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.files import sha256_file
from orchestrator.models.catalogue import GEMMA3_270M, cached_path
from orchestrator.models.synth import write_sparse_70b_header, write_tiny_llama

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


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """Gemma 3 270M Q4_K_M from the cache (`make setup` fetches it; tests never download it), its sha256
    checked once per session."""
    path = cached_path(GEMMA3_270M)
    fetch = f"run `make setup` (or `rpcfleet model fetch {GEMMA3_270M.name}`)"
    if not path.is_file():
        pytest.fail(f"Gemma 3 270M is not in the cache ({path}): {fetch}", pytrace=False)
    if sha256_file(path) != GEMMA3_270M.sha256:
        again = f"rpcfleet model fetch {GEMMA3_270M.name} --verify"
        pytest.fail(
            f"{path} is not the catalogue's Gemma 3 270M (its sha256 differs): run `{again}`", pytrace=False
        )
    return path
