"""Turns a chat choice's text into OpenAI's assistant message with `tool_calls`, whole or streamed.

Forced tool choices (`required`, a named function) were constrained to JSON (tool_choice.py), so
their text is parsed as that JSON; `auto` text goes through the server's `--tool-call-parser`.
A choice that called tools has `finish_reason: "tool_calls"` (when it stopped by itself) and, in a
full response, `content: null` unless the model also wrote text. Text that does not parse (a
`max_tokens` cut in the middle of a forced call) stays content, with its own finish reason.
"""
from __future__ import annotations

from typing import Any

from services.frontend.tool_choice import ToolChoice
from services.frontend.tool_parsers import (
    DeltaContent,
    DeltaEvent,
    ForcedToolCallStreamParser,
    ToolCall,
    ToolCallStreamParser,
    get_tool_parser,
    parse_forced_tool_calls,
)


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason_with_tools(finish_reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


class ChoiceToolOutput:
    """One choice's tool-call reading; `message` for a full response, `feed`/`finish` for a stream."""

    def __init__(self, tool_choice: ToolChoice | None, parser_name: str):
        self.tool_choice = tool_choice
        self.parser_name = parser_name
        self.is_active = tool_choice is not None and tool_choice.mode != "none"
        self._stream: ToolCallStreamParser | None = None
        self.has_called_tools = False

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a full response and the choice's finish reason."""
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if not self.is_active:
            return message, finish_reason
        calls: list[ToolCall] = []
        content: str | None = text
        if self.tool_choice.is_forced:
            try:
                calls = parse_forced_tool_calls(text, self.tool_choice.function_name)
                content = None
            except ValueError:  # cut short by max_tokens: the text stays what it is
                calls = []
        else:
            extracted = get_tool_parser(self.parser_name)().extract_tool_calls(text)
            if extracted.tools_called:
                calls, content = extracted.tool_calls, extracted.content
        if calls:
            message["content"] = content
            message["tool_calls"] = [tool_call_dict(c) for c in calls]
        return message, finish_reason_with_tools(finish_reason, bool(calls))

    def feed(self, delta_text: str, is_last: bool) -> list[dict[str, Any]]:
        """The chunk deltas for the next text delta of a stream (`is_last`: the choice's last)."""
        if not self.is_active:
            return [{"content": delta_text}] if delta_text else []
        if self._stream is None:
            self._stream = (ForcedToolCallStreamParser(self.tool_choice.function_name) if self.tool_choice.is_forced
                            else get_tool_parser(self.parser_name)().create_stream_parser())
        events = self._stream.feed(delta_text) if delta_text else []
        if is_last:
            events += self._stream.finish()
        return [self._delta(e) for e in events]

    def _delta(self, event: DeltaEvent) -> dict[str, Any]:
        if isinstance(event, DeltaContent):
            return {"content": event.text}
        self.has_called_tools = True
        piece: dict[str, Any] = {"index": event.index}
        if event.id is not None:
            piece.update(id=event.id, type="function", function={"name": event.name, "arguments": event.arguments})
        else:
            piece["function"] = {"arguments": event.arguments}
        return {"tool_calls": [piece]}
