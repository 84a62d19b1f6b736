"""IncrementalDetokenizer: never broken UTF-8, same text however tokens are grouped, stop strings."""
from __future__ import annotations

import random

import pytest

from services.frontend.detokenizer import IncrementalDetokenizer
from tests.frontend.fakes import make_tokenizer

TEXTS = [
    "Hello world. The capital of France is Paris.",
    "日本語のテキストと中文文本。",
    "emoji 😀😀😀 🎉🎉 👍🏽 and café naïve",
    "mixed: 😀日本 café 👍🏽!",
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: the hardest case, every multi-byte character is split."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())  # byte-level maps each byte to one printable character
    byte_to_char = {b: c for b, c in zip(range(256), _byte_level_chars())}
    assert set(byte_to_char.values()) == set(alphabet)
    return [tokenizer.convert_tokens_to_ids(byte_to_char[b]) for b in text.encode()]


def _byte_level_chars() -> list[str]:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256+n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def _run(detok: IncrementalDetokenizer, token_ids: list[int], group_sizes: list[int]) -> list[str]:
    deltas, i = [], 0
    for size in group_sizes:
        group = token_ids[i:i + size]
        i += size
        deltas.append(detok.update(group, is_finished=i >= len(token_ids)))
        if detok.is_stopped:
            break
    return deltas


def _random_groups(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 3))
    return sizes


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_tokens_one_at_a_time_never_emit_broken_characters(tokenizer, text):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _run(IncrementalDetokenizer(tokenizer), token_ids, [1] * len(token_ids))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokens_in_random_groups_give_the_same_text(tokenizer, text):
    token_ids = _byte_token_ids(tokenizer, text)
    assert tokenizer.decode(token_ids) == text
    rng = random.Random(len(text))
    for _ in range(5):
        deltas = _run(IncrementalDetokenizer(tokenizer), token_ids, _random_groups(len(token_ids), rng))
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_prompt_context_and_special_tokens_are_not_emitted(tokenizer):
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    output = tokenizer.encode("Paris.", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(_run(detok, output, [1] * len(output))) == "Paris."
    assert detok.output_token_ids == output


def test_prompt_ending_mid_character_is_not_used_as_context(tokenizer):
    token_ids = _byte_token_ids(tokenizer, "日本")
    detok = IncrementalDetokenizer(tokenizer, token_ids[:2])  # 2 of 日's 3 bytes
    assert "".join(_run(detok, token_ids[3:], [1, 1, 1])) == "本"


def test_incomplete_character_is_held_back_until_finish(tokenizer):
    token_ids = _byte_token_ids(tokenizer, "a😀")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(token_ids[:3]) == "a"
    assert detok.update(token_ids[3:4]) == ""
    # Finishing mid-character (length limit) flushes the replacement character, like decode() does.
    assert detok.update([], is_finished=True) == "\ufffd"


@pytest.mark.parametrize(
    "text, stop, include, expected",
    [
        ("Hello world. The capital", ["."], False, "Hello world"),
        ("Hello world. The capital", ["."], True, "Hello world."),
        ("Hello world. The capital", ["capital", "wor"], False, "Hello "),  # earliest match wins
        ("Hello world. The capital", ["orld. Th"], False, "Hello w"),  # spans several tokens
        ("Hello world. The capital", ["Hello"], False, ""),
        ("Hello world. The capital", ["zzz"], False, "Hello world. The capital"),
        ("emoji 😀😀😀 done", ["😀😀"], False, "emoji "),
    ],
)
def test_stop_strings(tokenizer, text, stop, include, expected):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    for sizes in ([1] * len(token_ids), [len(token_ids)], _random_groups(len(token_ids), random.Random(1))):
        detok = IncrementalDetokenizer(tokenizer, stop=stop, include_stop_str_in_output=include)
        deltas = _run(detok, token_ids, sizes)
        assert "".join(deltas) == expected
        assert detok.output_text == expected
        assert detok.is_stopped == (expected != text)


def test_stop_buffer_holds_back_a_possible_stop_prefix(tokenizer):
    token_ids = _byte_token_ids(tokenizer, "abcSTOP")
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    emitted = [detok.update([t]) for t in token_ids]
    assert emitted[:4] == ["", "", "", "a"]  # 3 characters are held back: "STO" could start "STOP"
    assert "".join(emitted) == "abc"
    assert detok.stop_str == "STOP"
    assert detok.update([1, 2, 3]) == ""  # nothing after a stop


def test_held_back_text_is_flushed_at_finish(tokenizer):
    token_ids = _byte_token_ids(tokenizer, "abcST")
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    emitted = [detok.update([t]) for t in token_ids[:-1]] + [detok.update(token_ids[-1:], is_finished=True)]
    assert "".join(emitted) == "abcST"
    assert not detok.is_stopped


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    """transformers removes the space before punctuation where `clean_up_tokenization_spaces` is set
    on a non-BPE tokenizer; the detokenizer must then decode through transformers, not the Rust call."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from services.frontend.detokenizer import decode_fn

    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3, "!": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(cleanup=False)  # the Rust decoder leaves the spaces
    cleaned = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=True)
    raw = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    ids = [1, 2, 3, 4]
    assert cleaned.decode(ids) == "hello, world!" and raw.decode(ids) == "hello , world !"
    assert decode_fn(cleaned)(ids, True) == "hello, world!"
    assert decode_fn(raw)(ids, True) == "hello , world !"
    detok = IncrementalDetokenizer(cleaned)
    assert "".join(detok.update([t]) for t in ids) + detok.update([], is_finished=True) == "hello, world!"
