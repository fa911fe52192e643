"""Build-time source patches: applied to the pinned llama.cpp exactly once, idempotent, keyed into the
build and recorded in the manifest; a source the patch does not fit is refused, not half-patched."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.artifacts.build import build_key, cached_build
from orchestrator.artifacts.manifest import DEFAULT_LLAMA_CPP_PYTHON_VERSION
from orchestrator.artifacts.patches import PATCHES, SourcePatch, apply_patches, patches_for
from orchestrator.artifacts.source import ensure_sdist, extract_source
from orchestrator.core.errors import ArtifactError


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("patched")
    return (
        extract_source(ensure_sdist(DEFAULT_LLAMA_CPP_PYTHON_VERSION, print), folder, print)
        / "vendor"
        / "llama.cpp"
    )


def test_the_pinned_source_takes_every_patch_once_and_again_changes_nothing(llama: Path) -> None:
    applied = apply_patches(llama, patches_for("vulkan"))
    assert [label.split("@")[0] for label in applied] == [
        "keepalive",
        "exit-status",
        "warm-wait",
        "vulkan-layer-settings",
    ]
    transport = (llama / "ggml/src/ggml-rpc/transport.cpp").read_text()
    assert transport.count("rpcfleet keepalive patch") == 1 and "TCP_USER_TIMEOUT" in transport
    assert "#ifdef VK_EXT_layer_settings" in (llama / "ggml/src/ggml-vulkan/ggml-vulkan.cpp").read_text()
    assert "    return 1;\n}" in (llama / "tools/rpc/rpc-server.cpp").read_text()  # exit-status
    assert (llama / "ggml/src/ggml-rpc/ggml-rpc.cpp").read_text().count("rpcfleet warm-wait patch") == 1
    assert apply_patches(llama, patches_for("vulkan")) == applied
    assert (llama / "ggml/src/ggml-rpc/transport.cpp").read_text() == transport
    assert [p.name for p in patches_for("cpu")] == ["keepalive", "exit-status", "warm-wait"]


def test_a_source_the_patch_does_not_fit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.cpp").write_text("x\nx\n")
    twice = SourcePatch("t", "a.cpp", "x\n", "y\n")
    with pytest.raises(ArtifactError, match="holds its anchor 2 times"):
        apply_patches(tmp_path, [twice])
    assert (tmp_path / "a.cpp").read_text() == "x\nx\n"
    missing = SourcePatch("m", "a.cpp", "z\n", "w\n")
    with pytest.raises(ArtifactError, match="holds its anchor 0 times"):
        apply_patches(tmp_path, [missing])
    assert apply_patches(tmp_path, [SourcePatch("o", "a.cpp", "z\n", "w\n", optional=True)]) == ()


def test_the_patches_are_part_of_the_build_key_and_the_artifact() -> None:
    args = ("-DGGML_RPC=ON",)
    assert build_key("0.3.36", "cpu", args) != build_key("0.3.36", "vulkan", args)
    artifact = cached_build("cpu")
    assert artifact is not None, "run `make setup`"
    keepalive = next(p for p in PATCHES if p.name == "keepalive")
    assert keepalive.label in artifact.manifest.patches and artifact.manifest.has_patch("keepalive")
