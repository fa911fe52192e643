"""Tiny multimodal test data: a CLIP vision projector GGUF (`mmproj`) libmtmd loads and runs, a chat
template for the text model, and a PNG image, all generated (random weights; the output is noise).

The projector is the simplest type the vendored mtmd supports, LLaVA's `mlp`: a ViT (conv patch
embedding, position embeddings, pre-norm attention + GELU FFN blocks) whose features go through two
linear layers (`mm.0`, `mm.2`) into the text model's embedding width. mtmd refuses a projector whose
output width differs from the text model's `n_embd`, so `n_embd_text` must match the model it is used
with. Keys and tensor names: llama.cpp tools/mtmd/clip-impl.h; shapes: clip.cpp (`load_tensors`) and
models/llava.cpp. As in synth.py, a numpy array of shape (rows, cols) is a ggml tensor [cols, rows].
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import gguf
import numpy as np

from orchestrator.core.errors import ModelError

# A Qwen3-style chat template: ChatML turns, list contents joined from their text parts (the generic
# MTMD handler turns an image part into its media marker, a text part), and the `enable_thinking`
# switch of Qwen3 / Qwen3.5 (False: an empty think block opens the answer).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def write_tiny_mmproj(
    path: str | Path,
    *,
    n_embd_text: int,
    image_size: int = 32,
    patch_size: int = 8,
    n_embd: int = 64,
    n_head: int = 4,
    n_layer: int = 2,
    n_ff: int = 128,
    n_proj_hidden: int = 128,
    seed: int = 0,
) -> Path:
    """Write a LLaVA-type (`mlp`) vision projector with random f32 weights whose output width is
    `n_embd_text`; an image becomes (image_size / patch_size)² embeddings. Returns the path.

    The encoder runs n_layer - 1 blocks (LLaVA takes the features of the second-to-last layer), so
    `n_layer` must be at least 2. The same arguments give the same bytes.
    """
    if min(n_embd_text, image_size, patch_size, n_embd, n_head, n_ff, n_proj_hidden) <= 0:
        raise ModelError("all projector dimensions must be positive")
    if n_layer < 2:
        raise ModelError(f"n_layer must be at least 2 (LLaVA uses the second-to-last layer), got {n_layer}")
    if image_size % patch_size:
        raise ModelError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
    if n_embd % n_head:
        raise ModelError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    if n_ff == n_embd:
        # clip.cpp swaps up/down of old LLaVA exports when ffn_down's rows equal n_embd
        raise ModelError("n_ff must differ from n_embd")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_patches = (image_size // patch_size) ** 2

    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name(f"tiny-mmproj-mlp-{n_embd}d-to-{n_embd_text}d")
    writer.add_file_type(0)  # all f32
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.embedding_length", n_embd)
    writer.add_uint32("clip.vision.feed_forward_length", n_ff)
    writer.add_uint32("clip.vision.block_count", n_layer)
    writer.add_uint32("clip.vision.projection_dim", n_embd_text)
    writer.add_uint32("clip.vision.attention.head_count", n_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def tensor(name: str, *shape: int, scale: float = 0.02) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32))

    def norm(prefix: str, width: int) -> None:
        writer.add_tensor(f"{prefix}.weight", np.ones(width, dtype=np.float32))
        writer.add_tensor(f"{prefix}.bias", np.zeros(width, dtype=np.float32))

    tensor("v.patch_embd.weight", n_embd, 3, patch_size, patch_size)  # conv kernel [p, p, 3, n_embd]
    tensor("v.patch_embd.bias", n_embd)
    tensor("v.position_embd.weight", n_patches, n_embd)
    for il in range(n_layer):
        blk = f"v.blk.{il}"
        norm(f"{blk}.ln1", n_embd)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"{blk}.{name}.weight", n_embd, n_embd)
            tensor(f"{blk}.{name}.bias", n_embd)
        norm(f"{blk}.ln2", n_embd)
        tensor(f"{blk}.ffn_up.weight", n_ff, n_embd)
        tensor(f"{blk}.ffn_up.bias", n_ff)
        tensor(f"{blk}.ffn_down.weight", n_embd, n_ff)
        tensor(f"{blk}.ffn_down.bias", n_embd)
    tensor("mm.0.weight", n_proj_hidden, n_embd)
    tensor("mm.0.bias", n_proj_hidden)
    tensor("mm.2.weight", n_embd_text, n_proj_hidden)
    tensor("mm.2.bias", n_embd_text)

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def png_bytes(width: int, height: int, *, seed: int = 0) -> bytes:
    """An 8-bit RGB PNG of random pixels (zlib and struct only: no imaging library needed)."""
    if width <= 0 or height <= 0:
        raise ModelError("image dimensions must be positive")
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit truecolour
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
