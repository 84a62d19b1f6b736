"""Tool-call parsers: non-streamed results, streamed events at every chunking, canonical JSON."""
from __future__ import annotations

import json
import random
import re

import pytest

from services.frontend.tool_parsers import (
    TOOL_PARSERS,
    DeltaContent,
    DeltaToolCall,
    ForcedToolCallStreamParser,
    HermesToolParser,
    Llama3JsonToolParser,
    get_tool_parser,
    parse_forced_tool_calls,
)
from services.frontend.tool_parsers.json_stream import JsonStream, dumps_json, loads_json

ID = re.compile(r"call_[0-9a-f]{24}")
HERMES, LLAMA = HermesToolParser(), Llama3JsonToolParser()


def chunkings(text: str):
    """Every split of `text` into two chunks, and one character at a time."""
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]
    yield list(text)


def assemble(events) -> tuple[str | None, list[tuple[str, str]]]:
    """(content or None, [(name, arguments)]) from events, checking the OpenAI streaming shape."""
    content, calls = [], {}
    for event in events:
        if isinstance(event, DeltaContent):
            assert event.text
            content.append(event.text)
            continue
        assert isinstance(event, DeltaToolCall)
        if event.index not in calls:
            assert event.index == len(calls)  # calls begin in order
            assert ID.fullmatch(event.id) and event.name and event.arguments == ""
            calls[event.index] = [event.name, ""]
        else:
            assert event.id is None and event.name is None and event.arguments
            calls[event.index][1] += event.arguments
    text = "".join(content)
    return (text if text.strip() else None), [tuple(calls[i]) for i in range(len(calls))]


def run_stream(parser, chunks):
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def extracted(result) -> tuple[str | None, list[tuple[str, str]]]:
    assert result.tools_called == bool(result.tool_calls)
    assert all(ID.fullmatch(call.id) for call in result.tool_calls)
    return result.content, [(call.name, call.arguments) for call in result.tool_calls]


def assert_streams_like_whole(tool_parser, text: str) -> None:
    """Streamed events add up to the non-streamed result; content never carries markup (not even a
    piece of a tag) unless the whole result keeps it as content."""
    expected = extracted(tool_parser.extract_tool_calls(text))
    content = expected[0] or ""
    markup = [m for m in ("<", "tool_call>", "python_tag") if m not in content]
    for chunks in chunkings(text):
        events = run_stream(tool_parser.create_stream_parser(), chunks)
        assert assemble(events) == expected, chunks
        for event in events:
            if isinstance(event, DeltaContent):
                assert not any(m in event.text for m in markup), chunks


# --- Hermes ---------------------------------------------------------------------------------------

HERMES_CASES = {
    "single": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
               None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "several_with_text": ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\nand\n'
                          '<tool_call>{"arguments": {}, "name": "b"}</tool_call>\nDone.',
                          "Let me check.\n\nand\n\nDone.", [("a", '{"x": 1}'), ("b", "{}")]),
    "no_calls": ("Just text, no calls.", "Just text, no calls.", []),
    "unicode": ('<tool_call>{"name": "translate", "arguments": {"text": "Grüße, 世界 😀", '
                '"escaped": "\\u00fc\\ud83d\\ude00 \\"q\\" \\\\ \\n"}}</tool_call>',
                None, [("translate", '{"text": "Grüße, 世界 😀", "escaped": "ü😀 \\"q\\" \\\\ \\n"}')]),
    "nested": ('<tool_call>{"name":"create","arguments":{ "user" : {"name":"Ann","tags":["a","b"],'
               '"meta":{"age":30,"score":9.50,"big":1e3,"active":true,"manager":null}},"ids":[[1,-2],[]]}}</tool_call>',
               None, [("create", '{"user": {"name": "Ann", "tags": ["a", "b"], "meta": {"age": 30, "score": 9.5, '
                                 '"big": 1000.0, "active": true, "manager": null}}, "ids": [[1, -2], []]}')]),
    "no_arguments_no_closing_tag": ('<tool_call>{"name": "now"}', None, [("now", "{}")]),
    "angle_brackets_in_content": ('a < b <tool_call>{"name": "f", "arguments": {"s": "<tool_call>"}}</tool_call> 1<2 <',
                                  "a < b  1<2 <", [("f", '{"s": "<tool_call>"}')]),
    "repeated_keys_keep_first": ('<tool_call>{"name": "f", "arguments": {"a": 1, "b": {"c": 2}, "a": [3], "b": "x"}, '
                                 '"name": "g", "arguments": {}}</tool_call>', None, [("f", '{"a": 1, "b": {"c": 2}}')]),
    "whitespace_only_content": ('\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n \n', None, [("f", "{}")]),
    "not_json": ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    "name_not_a_string": ('<tool_call>{"name": 42, "arguments": {}}</tool_call>',
                          '<tool_call>{"name": 42, "arguments": {}}</tool_call>', []),
    "no_name": ('x<tool_call>{"arguments": {"a": 1}}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>',
                'x<tool_call>{"arguments": {"a": 1}}</tool_call>', [("f", "{}")]),
    "arguments_not_an_object": ('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
                                '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', []),
    "empty_block": ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
}


@pytest.mark.parametrize("case", sorted(HERMES_CASES))
def test_hermes_extracts_calls_and_content(case):
    text, content, calls = HERMES_CASES[case]
    assert extracted(HERMES.extract_tool_calls(text)) == (content, calls)


@pytest.mark.parametrize("case", sorted(HERMES_CASES))
def test_hermes_streams_like_the_whole_output_at_every_chunking(case):
    assert_streams_like_whole(HERMES, HERMES_CASES[case][0])


def test_hermes_malformed_json_after_the_name_is_content_whole_and_a_cut_call_streamed():
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> there'  # the object never closes
    assert extracted(HERMES.extract_tool_calls(text)) == (text, [])
    # Streamed, the call went out once its name and arguments began; the rest of the block is dropped.
    assert assemble(run_stream(HERMES.create_stream_parser(), list(text))) == ("Hi  there", [("f", '{"a": 1}')])
    cut = '<tool_call>{"name": "f", "arguments": {"a": "par'  # output ends inside the call
    assert extracted(HERMES.extract_tool_calls(cut)) == (cut, [])
    assert assemble(run_stream(HERMES.create_stream_parser(), list(cut))) == (None, [("f", '{"a": "par')])


def test_hermes_holds_back_only_what_may_be_markup_and_streams_certain_arguments():
    parser = HERMES.create_stream_parser()
    assert parser.feed("Hello <tool") == [DeltaContent("Hello ")]
    assert parser.feed("_call>\n{\"name\": \"wri") == []
    first = parser.feed('te", "arguments": {"n": 12')
    assert len(first) == 2 and ID.fullmatch(first[0].id)
    assert (first[0].index, first[0].name, first[0].arguments) == (0, "write", "")
    assert first[1] == DeltaToolCall(index=0, id=None, name=None, arguments='{"n": ')  # 12 may go on
    assert parser.feed('3, "text": "hello wor') == [DeltaToolCall(0, None, None, '123, "text": "hello wor')]
    assert parser.feed('ld\\u00') == [DeltaToolCall(0, None, None, "ld")]  # the escape is not finished
    assert parser.feed('fc"}}\n</tool_call> <to') == [DeltaToolCall(0, None, None, 'ü"}'), DeltaContent(" ")]
    assert parser.feed("day") == [DeltaContent("<today")]
    assert parser.finish() == []


# --- Llama 3 JSON ---------------------------------------------------------------------------------

LLAMA_CASES = {
    "single": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
               [("get_weather", '{"city": "Paris"}')]),
    "python_tag_and_arguments_key": ('  <|python_tag|>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    "several": ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [true, null]}}\n'
                '{"name": "c", "parameters": {}};', None,
                [("a", '{"x": 1}'), ("b", '{"y": [true, null]}'), ("c", "{}")]),
    "text_after": ('{"name": "a", "parameters": {}}\nThis looks it up.', "\nThis looks it up.", [("a", "{}")]),
    "text_before_is_plain_content": ('Sure: {"name": "a", "parameters": {}}',
                                     'Sure: {"name": "a", "parameters": {}}', []),
    "no_calls": ("The weather is nice.", "The weather is nice.", []),
    "json_that_is_not_a_call": (' {"answer": 42}', ' {"answer": 42}', []),
    "second_object_not_a_call": ('{"name": "a", "parameters": {}}; {"oops": true} more', '; {"oops": true} more',
                                 [("a", "{}")]),
    "unicode": ('{"name": "say", "parameters": {"text": "naïve 😀 \\ud83d\\ude00 日本"}}', None,
                [("say", '{"text": "naïve 😀 😀 日本"}')]),
    "nested": ('{"name": "q", "parameters": {"filter": {"and": [{"gt": 1.0}, {"in": ["x", "y"]}]}, "limit": 10}}', None,
               [("q", '{"filter": {"and": [{"gt": 1.0}, {"in": ["x", "y"]}]}, "limit": 10}')]),
    "python_tag_then_code": ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama3_json_extracts_calls_and_content(case):
    text, content, calls = LLAMA_CASES[case]
    assert extracted(LLAMA.extract_tool_calls(text)) == (content, calls)


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama3_json_streams_like_the_whole_output_at_every_chunking(case):
    assert_streams_like_whole(LLAMA, LLAMA_CASES[case][0])


def test_llama3_json_malformed_json_is_content_whole():
    text = '{"name": "a", "parameters": {"x": }}'
    assert extracted(LLAMA.extract_tool_calls(text)) == (text, [])
    # Streamed, the call went out already; with no closing tag the rest of the output is dropped.
    assert assemble(run_stream(LLAMA.create_stream_parser(), list(text))) == (None, [("a", '{"x": ')])


# --- Forced tool calls ----------------------------------------------------------------------------

FORCED_CASES = {
    "named": ('{"location": "Paris",\n "days": 3}', "get_weather",
              [("get_weather", '{"location": "Paris", "days": 3}')]),
    "named_empty_unicode_nested": (' {"a": {}, "b": ["ü", "\\ud83d\\ude00"], "c": {"d": -0.5}} ', "f",
                                   [("f", '{"a": {}, "b": ["ü", "😀"], "c": {"d": -0.5}}')]),
    "required": ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "arguments": {}}]', None,
                 [("a", '{"x": 1}'), ("b", "{}")]),
    "required_empty": ("[ ]", None, []),
    "required_arguments_first": ('\n[{"parameters": {"y": "z"}, "name": "b"}]\n', None, [("b", '{"y": "z"}')]),
}
# Text the grammar allows only when cut off (or ignoring it): refused whole, streamed as far as it goes.
FORCED_CUT_CASES = {
    "named_cut_off": ('{"text": "hel', "write", [("write", '{"text": "hel')]),
    "named_not_an_object": ("[1]", "f", [("f", "")]),
    "required_cut_off": ('[{"name": "a", "parameters": {"x": 1}},{"name": "b", "parameters": {"t": "ab', None,
                         [("a", '{"x": 1}'), ("b", '{"t": "ab')]),
    "required_cut_before_a_name": ('[{"name": "a", "parameters": {}}, {"na', None, [("a", "{}")]),
    "required_item_not_a_call": ('[{"foo": 1}, {"name": "b", "parameters": {}}]', None, [("b", "{}")]),
}


@pytest.mark.parametrize("case", sorted(FORCED_CASES))
def test_forced_tool_calls_whole_and_streamed_at_every_chunking(case):
    text, function, calls = FORCED_CASES[case]
    result = parse_forced_tool_calls(text, function)
    assert all(ID.fullmatch(call.id) for call in result)
    assert [(call.name, call.arguments) for call in result] == calls
    for chunks in chunkings(text):
        assert assemble(run_stream(ForcedToolCallStreamParser(function), chunks)) == (None, calls), chunks


@pytest.mark.parametrize("case", sorted(FORCED_CUT_CASES))
def test_forced_tool_calls_cut_off_are_refused_whole_and_streamed_as_far_as_certain(case):
    text, function, streamed_calls = FORCED_CUT_CASES[case]
    with pytest.raises(ValueError):
        parse_forced_tool_calls(text, function)
    for chunks in chunkings(text):
        assert assemble(run_stream(ForcedToolCallStreamParser(function), chunks)) == (None, streamed_calls), chunks


def test_forced_named_call_is_known_before_any_text_and_required_calls_appear_as_written():
    named = ForcedToolCallStreamParser("f")
    [first] = named.feed("")
    assert (first.index, first.name, first.arguments) == (0, "f", "") and ID.fullmatch(first.id)
    assert named.feed('{"a": tr') == [DeltaToolCall(0, None, None, '{"a": ')]
    assert named.feed("ue}") == [DeltaToolCall(0, None, None, "true}")]
    assert named.finish() == []
    required = ForcedToolCallStreamParser(None)
    assert required.feed('[{"name": "a"') == []
    events = required.feed(', "parameters": {"x": 1')
    assert [(e.index, e.name, e.arguments) for e in events] == [(0, "a", ""), (0, None, '{"x": ')]
    events = required.feed('}}, {"name": "b", "parameters": {}}]')
    assert [(e.index, e.name, e.arguments) for e in events] == [(0, None, "1}"), (1, "b", ""), (1, None, "{}")]
    assert required.feed(" trailing") == [] and required.finish() == []


# --- Registry -------------------------------------------------------------------------------------

def test_registry_names_the_parsers_and_refuses_unknown_names():
    assert TOOL_PARSERS == {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
    assert get_tool_parser("hermes") is HermesToolParser and get_tool_parser("llama3_json") is Llama3JsonToolParser
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'; valid: hermes, llama3_json"):
        get_tool_parser("mistral")


# --- Canonical JSON of partial text ---------------------------------------------------------------

_CHARS = ["a", "Z", " ", "é", "世", "😀", '"', "\\", "/", "\n", "\t", "\x01", "\x7f", "<", "\u2028"]


def _random_string(rng: random.Random) -> str:
    out = ['"']
    for _ in range(rng.randrange(6)):
        c = rng.choice(_CHARS)
        form = rng.random()
        if c in '"\\' or c < " ":
            out.append(json.dumps(c)[1:-1])  # must be escaped
        elif form < 0.3:
            out.append(json.dumps(c, ensure_ascii=True)[1:-1])  # \\uXXXX, a surrogate pair for astral
        elif form < 0.35:
            out.append("\\ud800")  # a lone surrogate
        else:
            out.append(c)
    return "".join(out) + '"'


def _random_json(rng: random.Random, depth: int = 0) -> str:
    """JSON text in any spacing and escaping, with repeated keys now and then."""
    ws = lambda: rng.choice(["", "", " ", "\n  ", "\t"])  # noqa: E731
    kind = rng.randrange(3, 8) if depth == 0 else rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return _random_string(rng)
    if kind == 1:
        return rng.choice(["0", "-0", "12", "-7", "3.25", "1e3", "2.50E-2", "123456789012345678901234567890"])
    if kind == 2:
        return rng.choice(["true", "false", "null"])
    if kind in (3, 4) and depth > 0:
        return _random_string(rng)
    if kind % 2:
        items = [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
        return "[" + ws() + ("," + ws()).join(items) + ws() + "]"
    keys = [rng.choice(["a", "b", "k\\u00e9", "", "😀"]) for _ in range(rng.randrange(5))]
    members = [ws() + json.dumps(loads_json(f'"{k}"')) + ws() + ":" + ws() + _random_json(rng, depth + 1) for k in keys]
    return "{" + ",".join(members) + ws() + "}"


def _stream_json(text: str, chunks) -> tuple[JsonStream, str, int]:
    stream, out, end = JsonStream(), "", 0
    final = dumps_json(loads_json(text))
    for chunk in chunks:
        end += stream.feed(chunk) if not stream.is_done else 0
        out += stream.drain()
        assert final.startswith(out)  # only certain text is written
    return stream, out, end


def test_json_stream_writes_exactly_the_canonical_text_at_any_chunking():
    rng = random.Random(1234)
    for _ in range(300):
        text = rng.choice(["", " ", "\n"]) + _random_json(rng)
        final = dumps_json(loads_json(text))
        first_wins = lambda pairs: {k: dict(reversed(pairs))[k] for k in dict(pairs)}  # noqa: E731
        assert final == dumps_json(json.loads(text, object_pairs_hook=first_wins))
        final.encode("utf-8")  # lone surrogates are escaped
        for chunks in ([text], list(text), [text[:len(text) // 3], text[len(text) // 3:]]):
            stream, out, _ = _stream_json(text + " ", chunks + [" "])
            assert stream.is_done and not stream.has_error and out == final, chunks


def test_json_stream_refuses_what_loads_json_refuses_at_the_same_place_whatever_the_chunking():
    rng = random.Random(99)
    texts = ['{"a": 01}', '{"a": NaN}', "[-Infinity]", '{"a": 1e400}', '{"a": "x\ty"}', '{"a": "\\x"}',
             '{"a": "\\u12g4"}', "[1,]", '{"a" 1}', "{,}", '{"a": tru}', '{"a": -}', '{"a": 1.}', "{'a': 1}",
             '{"a": 1}}', "[" * 200 + "]" * 200, "\ufeff{}", '{"a": "b" "c"}', "[1 2]", '{"a": .5}']
    for _ in range(400):  # one-character edits of valid JSON
        text = list(_random_json(rng))
        k = rng.randrange(len(text))
        edit = rng.randrange(3)
        if edit == 0:
            del text[k]
        else:
            text[k:k + (edit == 1)] = [rng.choice('{}[],:"\\ 0-.etaxu')]
        texts.append("".join(text))
    for text in texts:
        try:
            loads_json(text)
            is_valid = text.count("[") < 100  # deeper nesting than MAX_JSON_DEPTH is refused
        except ValueError:
            is_valid = False
        results = set()
        for chunks in ([text + " "], list(text + " ")):
            stream = JsonStream()
            end = 0
            for chunk in chunks:
                if not (stream.is_done or stream.has_error):
                    end += stream.feed(chunk)
            full_valid = stream.is_done and not stream.has_error and not (text + " ")[end:].strip(" \t\n\r")
            results.add((full_valid, stream.has_error, end if stream.has_error else None))
        assert len(results) == 1, text
        assert results.pop()[0] == is_valid, text


def _random_object(rng: random.Random) -> str:
    while not (text := _random_json(rng)).startswith("{"):
        pass
    return text


def test_random_arguments_stream_exactly_in_every_format():
    rng = random.Random(7)
    for _ in range(25):
        arguments = _random_object(rng)
        final = dumps_json(loads_json(arguments))
        hermes = f'Hi <tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call> bye'
        assert extracted(HERMES.extract_tool_calls(hermes)) == ("Hi  bye", [("f", final)])
        assert_streams_like_whole(HERMES, hermes)
        llama = f'<|python_tag|>{{"parameters": {arguments}, "name": "g"}}; {{"name": "h", "parameters": {arguments}}}'
        assert extracted(LLAMA.extract_tool_calls(llama)) == (None, [("g", final), ("h", final)])
        assert_streams_like_whole(LLAMA, llama)
        for text, function in ((arguments, "f"), (f'[{{"name": "f", "parameters": {arguments}}}]', None)):
            assert [(c.name, c.arguments) for c in parse_forced_tool_calls(text, function)] == [("f", final)]
            for chunks in chunkings(text):
                assert assemble(run_stream(ForcedToolCallStreamParser(function), chunks)) == (None, [("f", final)])
