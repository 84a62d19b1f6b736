"""Request fields Spindle does not implement: refused with a 400 naming the field, never ignored.

A field is refused only when it would change the result: present with a value other than its
"off" value. Fields that only annotate a request (`user`, `metadata`, `store`, `service_tier`,
`safety_identifier`, `prompt_cache_key`, ...) and unknown fields are accepted. docs/api.md lists
these refusals beside the other bad inputs.
"""
from __future__ import annotations

from typing import Any

from services.frontend.errors import invalid_request

# name -> values that mean "feature off" (and are therefore accepted).
_OFF = (None, False, [], {}, "")
_COMMON = {
    # vLLM's older structured-output fields (use `structured_outputs`) and other extensions.
    "guided_json": _OFF, "guided_regex": _OFF, "guided_choice": _OFF, "guided_grammar": _OFF,
    "guided_decoding_backend": _OFF, "use_beam_search": _OFF, "bad_words": _OFF, "allowed_token_ids": _OFF,
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "logits_processors": _OFF,
    "return_tokens_as_token_ids": _OFF, "length_penalty": (None, 1, 1.0),
}
_CHAT = {
    **_COMMON,
    "functions": _OFF, "audio": _OFF, "prediction": _OFF, "web_search_options": _OFF,
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "verbosity": (None,), "moderation": _OFF,
    # vLLM's chat-template controls: the template is applied one fixed way.
    "chat_template": _OFF, "chat_template_kwargs": _OFF, "continue_final_message": _OFF, "documents": _OFF,
    "add_generation_prompt": (None, True), "echo": _OFF,
}
_COMPLETION = {**_COMMON, "suffix": _OFF}


def refuse_unsupported_chat_fields(body: dict[str, Any]) -> None:
    _refuse(body, _CHAT)


def refuse_unsupported_completion_fields(body: dict[str, Any]) -> None:
    _refuse(body, _COMPLETION)


def _refuse(body: dict[str, Any], fields: dict[str, tuple]) -> None:
    for name, off_values in fields.items():
        value = body.get(name)
        if not any(value == off and type(value) is type(off) or value is off for off in off_values):
            hint = " Use 'structured_outputs'." if name.startswith("guided_") else ""
            raise invalid_request(f"'{name}' is not supported (got {_short(value)}).{hint}", param=name)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
