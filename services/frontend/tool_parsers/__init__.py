"""Tool-call parsers for the chat API (`--tool-call-parser`): model text to OpenAI tool calls.

`get_tool_parser(name)` gives the `ToolParser` class for a format; an instance reads whole outputs
(`extract_tool_calls`) and makes one `ToolCallStreamParser` per streamed choice. Calls forced by
`tool_choice` (required, or a named function) are read by `parse_forced_tool_calls` and
`ForcedToolCallStreamParser` instead, whatever the format.
"""
from __future__ import annotations

from services.frontend.tool_parsers.abstract_tool_parser import (
    DeltaContent,
    DeltaEvent,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStreamParser,
    ToolParser,
    collect_events,
)
from services.frontend.tool_parsers.forced_tool_calls import ForcedToolCallStreamParser, parse_forced_tool_calls
from services.frontend.tool_parsers.hermes_tool_parser import HermesToolParser
from services.frontend.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for `--tool-call-parser NAME`; ValueError naming the valid ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; valid: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "TOOL_PARSERS",
    "DeltaContent",
    "DeltaEvent",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "ForcedToolCallStreamParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ToolCall",
    "ToolCallStreamParser",
    "ToolParser",
    "collect_events",
    "get_tool_parser",
    "parse_forced_tool_calls",
]
