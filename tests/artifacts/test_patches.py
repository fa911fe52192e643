"""Build-time source patches: applied to the pinned llama.cpp exactly once, idempotent, keyed into the
build and recorded in the manifest; a source the patch does not fit is refused, not half-patched."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.artifacts.build import build_key, cached_build
from orchestrator.artifacts.manifest import DEFAULT_LLAMA_CPP_PYTHON_VERSION
from orchestrator.artifacts.patches import (
    PATCHES,
    SourcePatch,
    apply_patches,
    client_patches,
    lacking,
    patches_for,
)
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
        "hash-manifest",
        "hash-manifest-set-tensor",
        "hash-manifest-set-tensor-async",
        "cache-read-declare",
        "cache-read-define",
        "cache-read",
        "vulkan-layer-settings",
    ]
    transport = (llama / "ggml/src/ggml-rpc/transport.cpp").read_text()
    assert transport.count("rpcfleet keepalive patch") == 1 and "TCP_USER_TIMEOUT" in transport
    assert "#ifdef VK_EXT_layer_settings" in (llama / "ggml/src/ggml-vulkan/ggml-vulkan.cpp").read_text()
    assert "    return 1;\n}" in (llama / "tools/rpc/rpc-server.cpp").read_text()  # exit-status
    assert (llama / "ggml/src/ggml-rpc/ggml-rpc.cpp").read_text().count("rpcfleet warm-wait patch") == 1
    assert apply_patches(llama, patches_for("vulkan")) == applied
    assert (llama / "ggml/src/ggml-rpc/transport.cpp").read_text() == transport
    assert [p.name for p in patches_for("cpu")] == [
        "keepalive",
        "exit-status",
        "warm-wait",
        "hash-manifest",
        "hash-manifest-set-tensor",
        "hash-manifest-set-tensor-async",
        "cache-read-declare",
        "cache-read-define",
        "cache-read",
    ]
    # the clients' builds (the binding's wheel, llama-server) never serve: the server's side is not theirs
    assert [p.name for p in client_patches()] == [
        p.name for p in patches_for("cpu") if "cache-read" not in p.name
    ]


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


def test_the_pinned_version_requires_the_servers_own_patches(tmp_path: Path) -> None:
    """keepalive and exit-status (and the client's hash-manifest patches, the server's cache-read ones)
    are required in the pinned source (a build without them is refused, never shipped without them),
    optional for the version-skew tests' 0.3.16 source; labels (and build keys) do not depend on it."""
    pinned = patches_for("cpu", DEFAULT_LLAMA_CPP_PYTHON_VERSION)
    required = {p.name for p in pinned if not p.optional}
    assert required == {
        "keepalive",
        "exit-status",
        *(n for n in required if n.startswith(("hash-", "cache-"))),
    }
    assert len(required) == 8  # and the client's three hash-manifest patches, the server's three cache-read
    assert all(p.optional for p in patches_for("cpu", "0.3.16"))
    assert [p.label for p in pinned] == [p.label for p in patches_for("cpu")]
    (tmp_path / "tools/rpc").mkdir(parents=True)
    (tmp_path / "tools/rpc/rpc-server.cpp").write_text("int main() { return 0; }\n")  # laid out otherwise
    with pytest.raises(ArtifactError, match=r"patch keepalive: .* holds its anchor 0 times"):
        apply_patches(tmp_path, pinned)
    assert apply_patches(tmp_path, patches_for("cpu", "0.3.16")) == ()
    assert lacking(()) == ("keepalive", "exit-status")
    assert lacking(p.label for p in pinned) == ()
