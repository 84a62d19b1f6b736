"""Loads the tokenizer and the facts about it the frontend needs (chat template)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from services.frontend.errors import invalid_request


def load_tokenizer(model_path: str | Path) -> Any:
    """A Hugging Face fast tokenizer from a model folder (never touches the network)."""
    from transformers import AutoTokenizer  # heavy import, kept out of module import time

    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Applies the chat template with the assistant's turn opened, then tokenizes."""
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise invalid_request("This model has no chat template; use /v1/completions.", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as exc:  # templates raise to refuse e.g. roles out of order
        raise invalid_request(f"The chat template refused these messages: {exc}", param="messages") from None
    # The template already wrote any BOS token it wants.
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Tokenizes a raw completion prompt, with the special tokens the model expects (e.g. BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=True))
