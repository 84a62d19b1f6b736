"""Properties of the incremental detokenizer (services/frontend/detokenizer.py) on arbitrary token
sequences (single bytes that split or break UTF-8 characters, any vocabulary id, special tokens),
grouped into steps at random, with the test BPE and with the embedded model's tokenizer.

Its contract: text is emitted once final and never revised (each delta extends the text so far,
which is always a prefix of the end result); once the request finishes everything is emitted, and
without stop strings the deltas add up to a one-shot `decode` of all the tokens; with stop strings
the text is cut before the first one to appear, and no stop string is left in what is kept.
"""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.detokenizer import IncrementalDetokenizer
from tests.frontend.fakes import make_tokenizer

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@functools.lru_cache(maxsize=None)
def tokenizer_of(name: str):
    if name == "test-bpe":
        return make_tokenizer()
    from services.common.model_files import resolve_model
    from services.frontend.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None, None).path)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-character table, which both tokenizers use: printable bytes stand for
    themselves, the others for 256 + n."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, n = [], 0
    for b in range(256):
        chars.append(chr(b) if b in printable else chr(256 + n))
        n += b not in printable
    return chars


@functools.lru_cache(maxsize=None)
def byte_token_ids(name: str) -> dict[int, int]:
    """The id of each single-byte token, by byte value (SmolLM2 has none for a few bytes that UTF-8
    never uses, such as 0xC0 and 0xF5 to 0xFF)."""
    tokenizer = tokenizer_of(name)
    ids = {b: tokenizer.convert_tokens_to_ids(c) for b, c in enumerate(_byte_level_alphabet())}
    ids = {b: i for b, i in ids.items() if tokenizer.convert_ids_to_tokens(i) == _byte_level_alphabet()[b]}
    assert all(b in ids for b in range(0x80, 0xC0)) and tokenizer.decode([ids[ord("a")]]) == "a"
    return ids


def token_sequences(name: str, max_pieces: int = 10) -> st.SearchStrategy[list[int]]:
    """Any ids, single bytes (lone continuation bytes, stray lead bytes), a character's bytes whole or
    cut short, and the tokens of ordinary text."""
    tokenizer, byte_ids = tokenizer_of(name), byte_token_ids(name)
    any_id = st.integers(0, len(tokenizer) - 1).map(lambda t: [t])
    one_byte = st.sampled_from(sorted(byte_ids)).map(lambda b: [byte_ids[b]])
    character = st.tuples(st.characters(codec="utf-8"), st.integers(1, 4)).map(
        lambda c: [byte_ids[b] for b in c[0].encode()[:c[1]] if b in byte_ids])
    text = st.text(max_size=6).map(lambda s: list(tokenizer.encode(s, add_special_tokens=False)))
    special = st.sampled_from(tokenizer.all_special_ids).map(lambda t: [t])
    pieces = st.lists(any_id | one_byte | character | text | special, max_size=max_pieces)
    return pieces.map(lambda p: [t for piece in p for t in piece])


def _groups(draw, num_tokens: int) -> list[int]:
    sizes = []
    while sum(sizes) < num_tokens:
        sizes.append(draw(st.integers(1, 4)))
    return sizes


def run_steps(detok: IncrementalDetokenizer, token_ids: list[int], sizes: list[int]) -> list[str]:
    """Feeds the tokens a step at a time, finishing on the last; checks after each step that the text
    emitted so far is what the detokenizer holds as final (never revised later). Returns the deltas."""
    deltas, start = [], 0
    for size in sizes or [0]:
        group, start = token_ids[start:start + size], start + size
        deltas.append(detok.update(group, is_finished=start >= len(token_ids)))
        assert detok.output_text.startswith("".join(deltas))
        if detok.is_stopped:
            break
    return deltas


TOKENIZERS = pytest.mark.parametrize("name", ["test-bpe", "smollm2"])


@TOKENIZERS
@SETTINGS
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_deltas_add_up_to_a_one_shot_decode(name, data, skip_special_tokens):
    tokenizer = tokenizer_of(name)
    token_ids = data.draw(token_sequences(name))
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = run_steps(detok, token_ids, _groups(data.draw, len(token_ids)))
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_token_ids == token_ids and not detok.is_stopped


@TOKENIZERS
@SETTINGS
@given(data=st.data())
def test_prompt_context_does_not_change_the_text(name, data):
    """The prompt's last tokens are context only (for SentencePiece spacing): with byte-level BPE the
    text is the output's own decode, even when the prompt ends mid-character."""
    tokenizer = tokenizer_of(name)
    prompt, token_ids = data.draw(token_sequences(name)), data.draw(token_sequences(name))
    deltas = run_steps(IncrementalDetokenizer(tokenizer, prompt), token_ids, _groups(data.draw, len(token_ids)))
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True)


@TOKENIZERS
@SETTINGS
@given(data=st.data(), include_stop_str=st.booleans())
def test_text_is_cut_before_the_first_stop_string(name, data, include_stop_str):
    tokenizer = tokenizer_of(name)
    token_ids = data.draw(token_sequences(name))
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    # Stop strings that occur in the text (most of the time), and some that may not.
    inner = st.integers(0, len(full)).flatmap(lambda i: st.integers(i + 1, len(full) + 1).map(lambda j: full[i:j]))
    stops = data.draw(st.lists((inner if full else st.nothing()) | st.text(min_size=1, max_size=3),
                               min_size=1, max_size=3).map(lambda s: [x for x in s if x] or ["\x00"]))
    detok = IncrementalDetokenizer(tokenizer, stop=stops, include_stop_str_in_output=include_stop_str)
    text = "".join(run_steps(detok, token_ids, _groups(data.draw, len(token_ids))))
    assert text == detok.output_text
    if not detok.is_stopped:
        assert text == full and not any(s in full for s in stops)
        return
    stop = detok.stop_str
    kept = text[:len(text) - len(stop)] if include_stop_str else text
    assert stop in stops and full.startswith(kept + stop)
    assert not any(s in kept for s in stops), "a stop string that appeared earlier was passed over"


@TOKENIZERS
@SETTINGS
@given(data=st.data())
def test_held_back_text_never_splits_a_stop_string(name, data):
    """While running, the last len(longest stop) - 1 characters wait: no delta ends in a stop
    string's beginning that the next step completes."""
    tokenizer = tokenizer_of(name)
    token_ids = data.draw(token_sequences(name))
    stop = data.draw(st.text(min_size=2, max_size=4))
    detok = IncrementalDetokenizer(tokenizer, stop=[stop])
    emitted = ""
    for size_start in range(len(token_ids)):
        emitted += detok.update(token_ids[size_start:size_start + 1])
        if detok.is_stopped:
            break
        assert len(detok.output_text) - len(emitted) >= min(len(stop) - 1, len(detok.output_text))
    assert stop not in emitted
