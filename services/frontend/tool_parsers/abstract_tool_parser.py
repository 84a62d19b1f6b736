"""What every tool-call parser returns, and the base classes the parsers share.

A parser reads the text a model wrote for one choice and splits it into content and tool calls, in
OpenAI's shapes: a call is `{id, name, arguments}` where `arguments` is JSON text of an object.
Non-streamed, `ToolParser.extract_tool_calls` reads the whole text at once. Streamed, one
`ToolCallStreamParser` per choice turns text deltas into `DeltaEvent`s as OpenAI streams them: a
call's first piece carries its index, id and name (arguments ""), the later pieces its index and a
fragment of the arguments. The fragments of a call join to exactly its final arguments text, the
same text the non-streamed parser returns; only certain text is sent, so nothing is taken back.
"""
from __future__ import annotations

import abc
import secrets
from dataclasses import dataclass
from typing import Iterable, Union


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as `json_stream.dumps_json` writes it


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # the text outside the tool calls; None when empty or whitespace only


@dataclass(frozen=True, slots=True)
class DeltaContent:
    text: str


@dataclass(frozen=True, slots=True)
class DeltaToolCall:
    index: int  # the call's place among this choice's calls, from 0
    id: str | None  # set on the call's first piece only
    name: str | None  # set on the call's first piece only, and always complete
    arguments: str  # the next fragment of the arguments text; "" on the first piece


DeltaEvent = Union[DeltaContent, DeltaToolCall]


def make_tool_call_id() -> str:
    """An id shaped like OpenAI's: `call_` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


def is_blank(text: str) -> bool:
    return not text.strip()


def collect_events(events: Iterable[DeltaEvent]) -> ExtractedToolCalls:
    """The non-streamed result that a stream of events adds up to."""
    content: list[str] = []
    calls: dict[int, list] = {}  # index -> [id, name, argument fragments]
    for event in events:
        if isinstance(event, DeltaContent):
            content.append(event.text)
        elif event.index not in calls:
            calls[event.index] = [event.id, event.name, [event.arguments]]
        else:
            calls[event.index][2].append(event.arguments)
    tool_calls = [ToolCall(id=call_id, name=name, arguments="".join(fragments))
                  for call_id, name, fragments in (calls[index] for index in sorted(calls))]
    text = "".join(content)
    return ExtractedToolCalls(tools_called=bool(tool_calls), tool_calls=tool_calls,
                              content=None if is_blank(text) else text)


class ToolCallStreamParser(abc.ABC):
    """Turns one choice's text deltas into content and tool-call events.

    `feed` takes the next delta and returns the events it makes certain; `finish` ends the choice and
    returns the rest. Text that may still turn out to be markup (the start of a tag) is held back
    until it is known. Content that is only whitespace so far is held back too, and dropped by
    `finish` if no other content follows, so that the events add up to the non-streamed result, whose
    content is None in that case.
    """

    def __init__(self) -> None:
        self._held_whitespace = ""
        self._has_content = False

    @abc.abstractmethod
    def feed(self, delta_text: str) -> list[DeltaEvent]:
        ...

    @abc.abstractmethod
    def finish(self) -> list[DeltaEvent]:
        ...

    def _add_content(self, events: list[DeltaEvent], text: str) -> None:
        if not text:
            return
        if not self._has_content:
            if is_blank(text):
                self._held_whitespace += text
                return
            text, self._held_whitespace, self._has_content = self._held_whitespace + text, "", True
        events.append(DeltaContent(text))


class ToolParser(abc.ABC):
    """One model family's tool-call format, as chosen by `--tool-call-parser`."""

    @abc.abstractmethod
    def create_stream_parser(self) -> ToolCallStreamParser:
        """A fresh parser for one streamed choice."""

    @abc.abstractmethod
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The content and tool calls of a whole (non-streamed) output."""
