"""The drop-in spec's multimodal example (llama-cpp-python-rpc.md, "Multimodal input") against a real
server.

No real model can be downloaded here, so both files are generated (orchestrator.models.synth and
synth_mm): a tiny llama text model with a Qwen3-style chat template (its `enable_thinking` switch) and
a tiny LLaVA-type projector whose output width is the text model's. The weights are random: the test
checks what ran where (mtmd's log, the server's GGML_RPC_DEBUG allocations and graph computes), not the
text. Failure cases run in a child process, so an abort would show as a failed test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import orchestrator
from orchestrator.core.errors import ModelError
from orchestrator.models.synth import write_tiny_llama
from orchestrator.models.synth_mm import CHAT_TEMPLATE, png_bytes, write_tiny_mmproj
from tests.plugins.llama import DebugServer

# The drop-in spec's second example, verbatim but for the import line; the file paths and the server
# address are put in by `_example`.
DROPIN_MULTIMODAL_EXAMPLE = """\
import base64
from pathlib import Path

from orchestrator import Llama

image = base64.b64encode(Path("./image.png").read_bytes()).decode("ascii")
image_url = f"data:image/png;base64,{image}"

llm = Llama(
    model_path="./Qwen3.5-9B-MTP-Q8_0.gguf",
    mmproj_path="./mmproj-Qwen3.5-9B-MTP-BF16.gguf",
    rpc_servers=["127.0.0.1:50052"],
    rpc_local_devices=[],
    n_gpu_layers=-1,
    n_ctx=2048,
    n_batch=256,
    chat_handler_kwargs={
        "extra_template_arguments": {"enable_thinking": False},
    },
)
try:
    response = llm.create_chat_completion(
        messages=[{
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": "What is in this image?"},
            ],
        }],
        max_tokens=64,
    )
    print(response["choices"][0]["message"]["content"])
finally:
    llm.close()
"""

N_EMBD = 256  # the text model's width (write_tiny_llama's default), the projector's output width


IMAGE_TOKENS = 16  # (image_size 32 / patch_size 8) ** 2


@pytest.fixture(scope="module")
def multimodal_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("multimodal")
    image = d / "image.png"
    image.write_bytes(png_bytes(48, 40))  # not square: mtmd pads and resizes it to 32 x 32
    return {
        "model": write_tiny_llama(d / "model.gguf", chat_template=CHAT_TEMPLATE),
        "mmproj": write_tiny_mmproj(d / "mmproj.gguf", n_embd_text=N_EMBD),
        "narrow": write_tiny_mmproj(d / "mmproj-128.gguf", n_embd_text=128),
        "image": image,
    }


def _example(files: dict[str, Path], endpoint: str) -> str:
    return (
        DROPIN_MULTIMODAL_EXAMPLE.replace("./image.png", str(files["image"]))
        .replace("./Qwen3.5-9B-MTP-Q8_0.gguf", str(files["model"]))
        .replace("./mmproj-Qwen3.5-9B-MTP-BF16.gguf", str(files["mmproj"]))
        .replace("127.0.0.1:50052", endpoint)
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}"


def test_projector_generator_refuses_shapes_mtmd_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="n_layer must be at least 2"):
        write_tiny_mmproj(tmp_path / "p.gguf", n_embd_text=N_EMBD, n_layer=1)
    with pytest.raises(ModelError, match="multiple of patch_size"):
        write_tiny_mmproj(tmp_path / "p.gguf", n_embd_text=N_EMBD, image_size=30)
    assert png_bytes(3, 2).startswith(b"\x89PNG\r\n\x1a\n") and png_bytes(3, 2) == png_bytes(3, 2)


@pytest.mark.llama
def test_the_dropin_multimodal_example_runs_the_projector_here_and_the_layers_on_the_server(
    debug_rpc_servers: list[DebugServer], multimodal_files: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    server = debug_rpc_servers[0]
    offset = server.log_offset()
    namespace: dict[str, Any] = {}
    exec(_example(multimodal_files, server.endpoint), namespace)
    err = capfd.readouterr().err
    llm, response = namespace["llm"], namespace["response"]
    # The template got the handler's extra arguments (Qwen's thinking switch off) and mtmd's marker.
    assert "<|im_start|>user\n<__media__>What is in this image?<|im_end|>" in err
    assert "<|im_start|>assistant\n<think>\n\n</think>" in err
    # The projector loaded and ran on this machine's CPU (no local GPU selected), its output as wide
    # as the text model: one embedding per patch, decoded into the language model.
    assert llm.chat_handler.use_gpu is False
    assert "CLIP using CPU backend" in err
    assert f"output embedding shape [{N_EMBD}, {IMAGE_TOKENS}, 1]" in err
    assert "image decoded (batch 1/1)" in err
    usage = response["usage"]
    assert usage["prompt_tokens"] > IMAGE_TOKENS and usage["completion_tokens"] > 0
    # The language model's layers went to the server: it allocated exactly the model's weights, KV
    # cache and compute buffer (nothing for the projector), and computed every decoding step.
    plan = llm.rpcfleet_plan
    assert [d.endpoint for d in plan.devices] == [server.endpoint]
    assert plan.layer_counts == (plan.n_layer + 1,) and plan.n_ctx == 2048 and plan.options.n_batch == 256
    assert orchestrator.placement_of(llm).layers_as_planned
    actual = orchestrator.placement_of(llm).devices[0].actual
    sizes = server.allocations_since(offset).get(0, [])
    assert plan.devices[0].memory.weights in sizes and plan.devices[0].memory.kv in sizes
    assert len(sizes) == 3, sizes
    (compute,) = set(sizes) - {plan.devices[0].memory.weights, plan.devices[0].memory.kv}
    assert _mib(compute) == _mib(actual.compute)
    log = server.log_since(offset)
    assert log.count("[graph_compute]") + log.count("[graph_recompute]") >= usage["completion_tokens"]


CHILD = """
import json, sys
from orchestrator import Llama
model, good, narrow, empty, image, endpoint = sys.argv[1:]
import base64
url = "data:image/png;base64," + base64.b64encode(open(image, "rb").read()).decode("ascii")
messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "hi"}]}]
out = {}
for name, mmproj in (("good", good), ("narrow", narrow), ("empty", empty)):
    llm = Llama(model_path=model, mmproj_path=mmproj, rpc_servers=[endpoint], rpc_local_devices=[],
                n_gpu_layers=-1, n_ctx=256, verbose=False)
    try:
        out[name] = llm.create_chat_completion(messages=messages, max_tokens=2)["usage"]
        sys.stderr.write("-- after " + name + "\\n")
    except ValueError as exc:
        out[name] = [type(exc).__name__, str(exc)]
    finally:
        llm.close()
llm = Llama(model_path=model, rpc_servers=[endpoint], rpc_local_devices=[], n_gpu_layers=-1, verbose=False)
out["after"] = llm("hi", max_tokens=2)["usage"]["completion_tokens"]
llm.close()
print(json.dumps(out))
"""


@pytest.mark.llama
def test_quiet_when_not_verbose_and_a_projector_that_does_not_load_names_mtmds_reason(
    debug_rpc_servers: list[DebugServer], multimodal_files: dict[str, Path], tmp_path: Path
) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    files = multimodal_files
    argv = [str(files[k]) for k in ("model", "mmproj", "narrow")] + [str(empty), str(files["image"])]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *argv, debug_rpc_servers[1].endpoint],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    # verbose=False: the image ran, and mtmd said nothing (stock 0.3.36 prints ~20 lines per image).
    assert out["good"]["prompt_tokens"] > IMAGE_TOKENS
    assert done.stderr.startswith("-- after good\n"), done.stderr[-3000:]
    # Stock 0.3.36 says only "Failed to load mtmd context" (and hides mtmd's log when not verbose).
    assert out["narrow"][0] == orchestrator.MultimodalError.__name__
    assert "mismatch between text model (n_embd = 256) and mmproj (n_embd = 128)" in out["narrow"][1]
    assert out["empty"][0] == "MultimodalError"
    assert f"failed to load CLIP model from {empty}" in out["empty"][1]
    assert out["after"] == 2  # the process carries on
