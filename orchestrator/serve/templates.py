"""Which chat template serve's engine (llama-server) uses, and how to tell it (pure, but for the GGUF read).

- The GGUF's own template (`tokenizer.chat_template`), run by llama-server's jinja engine (`--jinja`).
- `--chat-template NAME|FILE`: one of llama-server's built-in names (its legacy formatter, `--no-jinja`:
  with `--jinja` a name would be taken for the template's text), or a jinja file (`--chat-template-file`).
- A GGUF without a template: its architecture's known template (gemma3 -> gemma), with a warning; for an
  architecture with no known one, llama-server's own default (chatml), with a warning too. Never silent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.errors import UsageError

# The built-in names of llama.cpp's chat formatter (`LLM_CHAT_TEMPLATES`, src/llama-chat.cpp of the pinned
# source), which `llama-server --chat-template NAME` accepts.
BUILTIN_TEMPLATES = (
    "chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1", "mistral-v3",
    "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "phi3", "phi4", "falcon3", "zephyr", "monarch",
    "gemma", "orion", "openchat", "vicuna", "vicuna-orca", "deepseek", "deepseek2", "deepseek3",
    "deepseek-ocr", "command-r", "llama3", "chatglm3", "chatglm4", "glmedge", "minicpm", "exaone3",
    "exaone4", "exaone-moe", "rwkv-world", "granite", "granite-4.0", "granite-4.1", "gigachat", "megrez",
    "yandex", "bailing", "bailing-think", "bailing2", "llama4", "smolvlm", "hunyuan-moe", "gpt-oss",
    "hunyuan-dense", "hunyuan-vl", "kimi-k2", "seed_oss", "grok-2",
)  # fmt: skip

# Architectures (general.architecture) whose chat format is unambiguous. `llama` is not among them: a
# llama GGUF may be Llama 2, 3 or any fine-tune.
ARCHITECTURE_TEMPLATES = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "phi3": "phi3",
    "qwen2": "chatml",
    "qwen3": "chatml",
    "command-r": "command-r",
    "cohere2": "command-r",
    "exaone": "exaone3",
    "granite": "granite",
    "deepseek2": "deepseek2",
    "chatglm": "chatglm4",
}


@dataclass(frozen=True)
class ChatTemplate:
    """How llama-server formats chat: its arguments, what it is (for /health), and a warning to show."""

    args: tuple[str, ...]
    source: str  # "gguf", "name:gemma", "file:/path", "default:chatml"
    warning: str | None = None


def resolve_chat_template(architecture: str, has_gguf_template: bool, override: str | None) -> ChatTemplate:
    """The template for a model of `architecture` (`has_gguf_template`: its GGUF carries one), or for the
    user's `override` (a built-in name or an existing file; UsageError otherwise)."""
    if override is not None:
        path = Path(override)
        if path.is_file():
            return ChatTemplate(("--jinja", "--chat-template-file", str(path)), f"file:{path}")
        if override in BUILTIN_TEMPLATES:
            return ChatTemplate(("--no-jinja", "--chat-template", override), f"name:{override}")
        raise UsageError(
            f"--chat-template {override}: neither a file nor one of llama-server's template names",
            hint=f"names: {', '.join(BUILTIN_TEMPLATES)}",
        )
    if has_gguf_template:
        return ChatTemplate(("--jinja",), "gguf")
    known = ARCHITECTURE_TEMPLATES.get(architecture)
    if known is not None:
        return ChatTemplate(
            ("--no-jinja", "--chat-template", known),
            f"name:{known}",
            f"the model has no chat template in its GGUF: chat uses {architecture}'s known template "
            f"'{known}' (--chat-template NAME|FILE chooses another)",
        )
    return ChatTemplate(
        ("--no-jinja", "--chat-template", "chatml"),
        "default:chatml",
        f"the model has no chat template in its GGUF and architecture {architecture!r} has no known one: "
        "chat uses llama-server's default 'chatml', which may not be the model's format (--chat-template "
        "NAME|FILE chooses one)",
    )


def model_chat_template(model: str | Path, override: str | None) -> ChatTemplate:
    """`resolve_chat_template` for a GGUF file, reading its architecture and template from its header."""
    from orchestrator.planning.profile import iter_metadata

    architecture, has_template = "", False
    for key, value in iter_metadata(model):
        if key == "general.architecture" and isinstance(value, str):
            architecture = value
        elif key == "tokenizer.chat_template" and isinstance(value, str) and value.strip():
            has_template = True
    return resolve_chat_template(architecture, has_template, override)
