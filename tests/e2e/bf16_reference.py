"""Teacher-forced comparison of served logprobs with Hugging Face transformers.

The served side gives, for each generated position, the chosen token id, its logprob and the top-k
alternatives (as token bytes and logprobs, the shape chat's `logprobs.content` has). The reference
runs transformers once over prompt + the served tokens and takes float32 log-softmax of its logits
at each generated position, so every position is judged on the same prefix the server had: a
divergence early in the sequence cannot cascade into the rest.

Token bytes come from GPT-2's byte-to-unicode table in transformers itself, not from the server's
own token-string code, so the top-k sets are matched independently of it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode


@dataclass
class ServedPosition:
    token_id: int
    token_bytes: bytes
    logprob: float
    top: list[tuple[bytes, float]]  # the server's top-k alternatives, best first


@dataclass
class ServedSample:
    label: str
    prompt_token_ids: list[int]
    positions: list[ServedPosition]

    @property
    def token_ids(self) -> list[int]:
        return [p.token_id for p in self.positions]


@dataclass(frozen=True)
class Tolerances:
    chosen_within_top: int  # our greedy token must rank at most this in the reference
    max_argmax_gap: float  # nats: where it is not the reference's argmax, how far below it may be
    min_argmax_fraction: float  # share of positions where our token is the reference's argmax
    max_logprob_diff: float  # nats, |ours - reference| for the chosen token
    max_mean_logprob_diff: float  # nats, the same averaged over all positions (a systematic error)
    min_top_overlap: int  # of our top-k and the reference's top-k (same k)


@dataclass
class Measured:
    """Worst values over all positions compared, kept for the report and the failure message."""

    positions: int = 0
    argmax_hits: int = 0
    worst_rank: int = 1
    worst_argmax_gap: float = 0.0
    worst_logprob_diff: float = 0.0
    sum_logprob_diff: float = 0.0
    worst_top_overlap: int | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def argmax_fraction(self) -> float:
        return self.argmax_hits / self.positions if self.positions else 0.0

    @property
    def mean_logprob_diff(self) -> float:
        return self.sum_logprob_diff / self.positions if self.positions else 0.0

    def summary(self) -> str:
        return (f"{self.positions} positions: argmax {self.argmax_hits}/{self.positions} "
                f"({self.argmax_fraction:.3f}), worst rank {self.worst_rank}, worst gap to argmax "
                f"{self.worst_argmax_gap:.4f}, |dlogprob| worst {self.worst_logprob_diff:.4f} mean "
                f"{self.mean_logprob_diff:.4f}, worst top-k overlap {self.worst_top_overlap}")


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class ByteTable:
    """Token id -> its exact bytes, for a byte-level BPE tokenizer (the SmolLM2/Llama-3 family)."""

    def __init__(self, tokenizer):
        decoder = repr(tokenizer.backend_tokenizer.decoder)
        if "ByteLevel" not in decoder:
            raise ValueError(f"not a byte-level tokenizer (decoder {decoder})")
        self._tokenizer = tokenizer
        self._added = {int(i) for i in tokenizer.added_tokens_decoder}

    def __call__(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self._added:  # special tokens are stored as their text
            return piece.encode()
        table = _unicode_to_byte()
        return bytes(table[c] for c in piece)


def reference_logprobs(model, prompt_token_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 log-probabilities of each generated position, from one forward
    pass over prompt + generated tokens in the model's own dtype."""
    ids = torch.tensor([prompt_token_ids + token_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    # The logits at position t predict token t + 1: the first generated token comes from the last
    # prompt position, and the last position (after the final token) predicts nothing compared.
    start = len(prompt_token_ids) - 1
    return torch.log_softmax(logits[start:start + len(token_ids)].float(), dim=-1)


def compare(sample: ServedSample, ref: torch.Tensor, token_bytes: ByteTable, tol: Tolerances,
            measured: Measured | None = None) -> Measured:
    """Checks every position of `sample` against `ref` (from reference_logprobs). Accumulates into
    `measured` (so one Measured spans many samples) and raises AssertionError naming each failure."""
    m = measured if measured is not None else Measured()
    if ref.shape[0] != len(sample.positions):
        raise AssertionError(f"{sample.label}: {len(sample.positions)} served positions, "
                             f"{ref.shape[0]} reference positions")
    first_failure = len(m.failures)
    for i, pos in enumerate(sample.positions):
        where = f"{sample.label}: position {i} (token {pos.token_id} {pos.token_bytes!r})"
        if pos.token_bytes != token_bytes(pos.token_id):
            m.failures.append(f"{where}: served bytes do not belong to the served token id")
        row = ref[i]
        ref_lp = float(row[pos.token_id])
        rank = int((row > row[pos.token_id]).sum()) + 1
        m.positions += 1
        m.argmax_hits += rank == 1
        m.worst_rank = max(m.worst_rank, rank)
        gap = float(row.max()) - ref_lp
        m.worst_argmax_gap = max(m.worst_argmax_gap, gap)
        if rank > tol.chosen_within_top or gap > tol.max_argmax_gap:
            m.failures.append(f"{where}: reference rank {rank} (limit {tol.chosen_within_top}), {gap:.4f} "
                              f"nats below its argmax (limit {tol.max_argmax_gap})")
        diff = abs(pos.logprob - ref_lp)
        m.worst_logprob_diff = max(m.worst_logprob_diff, diff)
        m.sum_logprob_diff += diff
        if diff > tol.max_logprob_diff:
            m.failures.append(f"{where}: logprob ours {pos.logprob:.4f} vs reference {ref_lp:.4f} "
                              f"(|d| {diff:.4f} > {tol.max_logprob_diff})")
        k = len(pos.top)
        ref_top = {token_bytes(int(t)) for t in torch.topk(row, k).indices}
        overlap = len(ref_top & {b for b, _ in pos.top})
        m.worst_top_overlap = overlap if m.worst_top_overlap is None else min(m.worst_top_overlap, overlap)
        if overlap < tol.min_top_overlap:
            m.failures.append(f"{where}: top-{k} overlap {overlap} < {tol.min_top_overlap}: ours "
                              f"{[b for b, _ in pos.top]} vs reference {sorted(ref_top)}")
    if len(m.failures) > first_failure:
        raise AssertionError("\n".join(m.failures[first_failure:]) + "\n" + m.summary())
    return m


def assert_aggregates(m: Measured, tol: Tolerances) -> None:
    """What holds over all positions together, checked once after every sample went through compare."""
    if m.argmax_fraction < tol.min_argmax_fraction:
        raise AssertionError(f"our token is the reference's argmax at {m.argmax_fraction:.3f} of positions, "
                             f"< {tol.min_argmax_fraction}\n{m.summary()}")
    if m.mean_logprob_diff > tol.max_mean_logprob_diff:
        raise AssertionError(f"mean |dlogprob| {m.mean_logprob_diff:.4f} > {tol.max_mean_logprob_diff}\n"
                             f"{m.summary()}")


def sample_from_chat(label: str, response: dict) -> ServedSample:
    """A ServedSample from a chat completion's JSON (with logprobs, top_logprobs and return_token_ids)."""
    choice = response["choices"][0]
    content = choice["logprobs"]["content"]
    token_ids = choice["token_ids"]
    if len(content) != len(token_ids):
        raise AssertionError(f"{label}: {len(content)} logprobs entries for {len(token_ids)} tokens")
    positions = [
        ServedPosition(token_id=t, token_bytes=bytes(entry["bytes"]), logprob=entry["logprob"],
                       top=[(bytes(alt["bytes"]), alt["logprob"]) for alt in entry["top_logprobs"]])
        for t, entry in zip(token_ids, content)
    ]
    return ServedSample(label, list(response["prompt_token_ids"]), positions)
