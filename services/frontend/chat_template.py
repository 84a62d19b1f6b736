"""Which chat template renders a request, and how messages and tools reach it.

A `ChatTemplate` is chosen once at start-up:
- the operator's template (`--chat-template PATH`), when given, renders every request;
- else the model's own template renders requests without tool calling; requests with tool calling
  (`tools`, an assistant message's `tool_calls` or a `tool` message) go to the model's own template
  if it renders `tools`, else to its "tool_use" template if the tokenizer has named templates, else
  to the shipped ChatML template with Hermes-style tool calls (`default_tools_template()`), which
  is taken only when it renders plain conversations exactly as the model's own template does.

Messages are handed over as vLLM and transformers hand them to templates: an assistant message's
`tool_calls[].function.arguments`, a JSON string on the wire, becomes a dict that the template can
iterate or `tojson`.
"""
from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

DEFAULT_TOOLS_TEMPLATE_FILE = "chatml_tools.jinja"

# Conversations on which the shipped template must match a model's own template before it stands in
# for it: one to read the default system turn from, and the other roles and positions.
_PROBE_USER = {"role": "user", "content": "Hello"}
_PROBE_CONVERSATIONS = (
    [_PROBE_USER],
    [{"role": "system", "content": "Be brief."}, _PROBE_USER,
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}],
    [_PROBE_USER, {"role": "assistant", "content": "Hi."}, {"role": "system", "content": "Be brief."}],
)
_CHATML_SUFFIX = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
_CHATML_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*)<\|im_end\|>\n", re.DOTALL)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` (it marks assistant tokens for
    training) so that templates using it compile; the body renders as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


# Parses and compiles only; rendering goes through transformers, which configures its environment
# the same way (sandboxed, trimmed blocks, loop controls).
_ENVIRONMENT = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])


def load_chat_template(path: str) -> str:
    """The template in the file at `path`; ValueError if the file cannot be read, is empty or is
    not valid Jinja."""
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"Cannot read the chat template file {path!r}: {exc}") from None
    if not template.strip():
        raise ValueError(f"The chat template file {path!r} is empty.")
    try:
        _ENVIRONMENT.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"The chat template file {path!r} is not valid Jinja: {exc.message} "
                         f"(line {exc.lineno})") from None
    return template


@functools.cache
def default_tools_template() -> str:
    """The shipped ChatML template with Hermes-style tool calling: the tools listed as JSON within
    `<tools></tools>` in the system turn, assistant calls as `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>` blocks, tool results as `<tool_response>` blocks in a user turn. Without
    tool calling it renders as SmolLM2's own template; `default_system_message` (a template
    variable) replaces SmolLM2's default system turn, "" for none."""
    return (resources.files("services.frontend") / "templates" / DEFAULT_TOOLS_TEMPLATE_FILE).read_text("utf-8")


def template_renders_tools(template: str) -> bool:
    """Whether `template` reads the `tools` variable; ValueError if it is not valid Jinja."""
    try:
        parsed = _ENVIRONMENT.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"The chat template is not valid Jinja: {exc.message} (line {exc.lineno})") from None
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


@dataclass(frozen=True)
class ChatTemplate:
    """The templates requests are rendered with (see the module docstring for the choice)."""

    template: str | None  # None: the model has no chat template and none was given
    tool_template: str | None  # for requests with tool calling; None: this model cannot render them
    # Set when `tool_template` is the shipped one: the model's own default system turn.
    default_system_message: str | None = None

    @classmethod
    def build(cls, tokenizer: Any, chat_template_path: str | None) -> ChatTemplate:
        if chat_template_path:
            template = load_chat_template(chat_template_path)
            if not template_renders_tools(template):
                logger.warning("The chat template %s does not read `tools`: requests' tools will not reach "
                               "the prompt.", chat_template_path)
            return cls(template, template)
        model_template = tokenizer.chat_template
        named = model_template if isinstance(model_template, dict) else {}
        template = named.get("default") if named else model_template
        if not template:
            return cls(None, None)
        if template_renders_tools(template):
            return cls(template, template)
        if named.get("tool_use"):
            return cls(template, named["tool_use"])
        default_system = _chatml_default_system(tokenizer, template)
        if default_system is None:
            logger.warning("This model's chat template does not render tools and is not ChatML: requests "
                           "with tools will be refused unless a --chat-template renders them.")
            return cls(template, None)
        return cls(template, default_tools_template(), default_system)

    def render(self, tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text for `messages` (and `tools`), with the assistant's turn opened.

        ValueError: no template, tool calling this model's templates cannot render, an invalid
        `messages[i].tool_calls[j].function.arguments`, or the template refused the conversation.
        """
        if self.template is None:
            raise ValueError("This model has no chat template; use /v1/completions.")
        template_messages = _template_messages(messages)
        has_tool_calling = bool(tools) or any(
            m.get("role") == "tool" or m.get("tool_calls") for m in template_messages)
        template = self.tool_template if has_tool_calling else self.template
        if template is None:
            raise ValueError("This model's chat template cannot render tools or tool calls; the server "
                             "can be started with a --chat-template that does.")
        extra = {}
        if has_tool_calling and self.default_system_message is not None:
            extra["default_system_message"] = self.default_system_message
        try:
            return tokenizer.apply_chat_template(template_messages, tools=tools or None, chat_template=template,
                                                 add_generation_prompt=True, tokenize=False, **extra)
        except jinja2.TemplateError as exc:  # templates raise to refuse e.g. roles out of order
            raise ValueError(f"The chat template refused these messages: {exc}") from None


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` as templates read them: arguments as dicts, absent content as ""."""
    converted = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""  # an assistant turn holding only tool calls
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_tool_call(f"messages[{i}].tool_calls[{j}]", call)
                                     for j, call in enumerate(message["tool_calls"])]
        converted.append(message)
    return converted


def _template_tool_call(where: str, tool_call: Any) -> dict[str, Any]:
    function = tool_call.get("function") if isinstance(tool_call, dict) else None
    if not isinstance(function, dict):
        raise ValueError(f"'{where}.function' must be an object.")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'{where}.function.arguments' is not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"'{where}.function.arguments' must be a JSON object.")
    return {**tool_call, "function": {**function, "arguments": arguments}}


def _chatml_default_system(tokenizer: Any, template: str) -> str | None:
    """The default system message of a ChatML `template` ("" for none), or None when the shipped
    tools template does not render the probe conversations exactly as `template` does."""
    def render(chat_template: str, conversation: list[dict[str, str]], **extra: str) -> str:
        return tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                             add_generation_prompt=True, tokenize=False, **extra)

    try:
        first = render(template, _PROBE_CONVERSATIONS[0])
        if not first.endswith(_CHATML_SUFFIX):
            return None
        prefix = first[:-len(_CHATML_SUFFIX)]
        match = _CHATML_SYSTEM.fullmatch(prefix)
        if prefix and not match:
            return None
        default_system = match.group(1) if match else ""
        tools_template = default_tools_template()
        for conversation in _PROBE_CONVERSATIONS:
            if render(tools_template, conversation, default_system_message=default_system) != render(
                    template, conversation):
                return None
    except jinja2.TemplateError:
        return None
    return default_system
