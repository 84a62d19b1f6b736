"""The persistent batch's sampling rows: knobs filled once per request follow their row when rows
move, the per-knob counts keep an all-greedy batch on the fast path, and a step's metadata sliced
from the arrays equals what building it request by request from the SamplingParams gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.messages import SamplingParams
from services.worker import sampling_metadata
from services.worker.input_batch import FLOAT_KNOBS, TEMPERATURE, CachedRequestState, InputBatch, Knob
from services.worker.sampler import TorchSampler
from services.worker.sampling_metadata import build_sampling_metadata
from tests.worker.sampling_batch import batch_of

VOCAB = 64
EOS = (2,)
P = SamplingParams
PARAMS = [
    P(temperature=0.0, logprobs=2),
    P(temperature=0.7, top_p=0.8, seed=11),
    P(temperature=1.3, top_k=7, min_p=0.05, presence_penalty=0.4, repetition_penalty=1.2, logit_bias={4: 1.5, 9: -3.0}),
    P(temperature=0.0, min_tokens=3, stop_token_ids=(5, 3), frequency_penalty=0.25),
    P(temperature=0.9, top_k=VOCAB, frequency_penalty=-0.5, logit_bias={5: 2.0}, logprobs=0, seed=12),
    P(temperature=2.0, top_k=1, min_tokens=1, ignore_eos=True, stop_token_ids=(8,)),  # greedy by top_k
    P(temperature=1.0, top_k=-1, min_p=0.2, min_tokens=2, seed=13),
    P(temperature=0.5, top_p=0.95, top_k=3, repetition_penalty=0.9),
]
PROMPTS = [[10 + i + j for j in range(3 + i)] for i in range(len(PARAMS))]
OUTPUTS = [[20 + i] * (i % 3) for i in range(len(PARAMS))]


def _generators() -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in PARAMS]


def expected_flags(p: SamplingParams, generator) -> set[Knob]:
    is_random = not p.is_greedy
    wanted = {Knob.RANDOM: is_random, Knob.SEEDED: is_random and generator is not None,
              Knob.TOP_K: is_random and p.top_k > 0, Knob.TOP_P: is_random and p.top_p < 1,
              Knob.MIN_P: is_random and p.min_p > 0, Knob.LOGIT_BIAS: bool(p.logit_bias),
              Knob.PENALTIES: bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1),
              Knob.MIN_TOKENS: p.min_tokens > 0, Knob.LOGPROBS: p.logprobs is not None}
    return {knob for knob, on in wanted.items() if on}


def check_rows(batch: InputBatch, live: dict[str, tuple[SamplingParams, object]]) -> None:
    """Raises AssertionError unless each live request's row holds its own knobs, rows past the
    live ones hold none, and the per-knob counts are those of the live requests."""
    assert set(batch.req_id_to_index) == set(live) and sorted(batch.req_id_to_index.values()) == list(range(len(live)))
    counts = np.zeros(len(Knob), dtype=np.int64)
    for req_id, (p, generator) in live.items():
        row = batch.req_id_to_index[req_id]
        values = dict(zip(FLOAT_KNOBS, batch.float_knobs_cpu[:, row].tolist()))
        temperature = 1.0 if p.is_greedy else p.temperature
        assert values == {name: float(np.float32(v)) for name, v in zip(FLOAT_KNOBS, (
            temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty))}, req_id
        assert (batch.top_k_cpu[row], batch.min_tokens_cpu[row]) == (p.top_k, p.min_tokens), req_id
        assert batch.num_logprobs_cpu[row] == (-1 if p.logprobs is None else p.logprobs), req_id
        flags = expected_flags(p, generator)
        assert {Knob(k) for k in np.flatnonzero(batch.knob_flags_cpu[:, row])} == flags, req_id
        assert batch.generators.get(row) is generator, req_id
        bias = batch.logit_bias.get(row)
        assert (dict(zip(bias[0].tolist(), bias[1].tolist())) if bias else {}) == \
            {t: float(np.float32(b)) for t, b in p.logit_bias.items()}, req_id
        counts[list(flags)] += 1
    assert not batch.knob_flags_cpu[:, len(live):].any()
    assert all(row < len(live) for row in (*batch.generators, *batch.logit_bias))
    assert batch.num_rows_using.tolist() == counts.tolist()


def _remove_and_condense(batch: InputBatch, live: dict, req_ids: list[str]) -> None:
    for req_id in req_ids:
        batch.remove_request(req_id)
        del live[req_id]
    batch.condense()


def _run_moves(batch: InputBatch, generators: list) -> None:
    """Rows leave, the last rows fill the holes, a request is resumed with other knobs, one joins."""
    live = {f"r{i}": (p, g) for i, (p, g) in enumerate(zip(PARAMS, generators))}
    check_rows(batch, live)
    _remove_and_condense(batch, live, ["r0", "r2", "r3"])
    check_rows(batch, live)
    resumed = P(temperature=0.6, top_p=0.5, logit_bias={1: 1.0})
    batch.add_request(CachedRequestState("r4", [1, 2], resumed, None, [], 0, [3]))  # replaces r4's row
    live["r4"] = (resumed, None)
    check_rows(batch, live)
    new = P(temperature=0.8, presence_penalty=1.0, seed=5)
    generator = torch.Generator().manual_seed(5)
    batch.add_request(CachedRequestState("r9", [7], new, generator, [], 0))
    live["r9"] = (new, generator)
    _remove_and_condense(batch, live, ["r1", "r7"])
    check_rows(batch, live)


def test_knobs_follow_their_row_through_remove_condense_and_resume():
    generators = _generators()
    batch = batch_of(PARAMS, generators, PROMPTS, OUTPUTS)
    _run_moves(batch, generators)
    assert batch.req_id_to_index == {"r4": 0, "r5": 1, "r6": 2, "r9": 3}


_original_move_row = InputBatch._move_row


def _move_keeping(name: str):
    """A `_move_row` that leaves `name`'s entry for the destination row as it was."""
    def move_row(self, src, dst):
        state = getattr(self, name)
        kept = dict(state) if isinstance(state, dict) else state[..., dst].copy()
        _original_move_row(self, src, dst)
        if isinstance(state, dict):
            state.clear(), state.update(kept)
        else:
            state[..., dst] = kept
    return move_row


@pytest.mark.parametrize("name", ["float_knobs_cpu", "knob_flags_cpu", "top_k_cpu", "generators", "logit_bias"])
def test_a_move_that_forgets_a_knob_fails_the_check(name, monkeypatch):
    generators = _generators()
    batch = batch_of(PARAMS, generators, PROMPTS, OUTPUTS)
    monkeypatch.setattr(InputBatch, "_move_row", _move_keeping(name))
    with pytest.raises(AssertionError):
        _run_moves(batch, generators)


def test_an_all_greedy_batch_builds_no_sampling_tensors(monkeypatch):
    copies = []

    def to_device(values, device):
        copies.append(values)
        return torch.from_numpy(values)

    monkeypatch.setattr(sampling_metadata, "_to_device", to_device)
    greedy = [P(temperature=0.0), P(temperature=0.8, top_k=1), P(temperature=0.0, top_p=0.5, min_p=0.3, seed=3)]
    batch = batch_of(greedy + [P(temperature=0.7, logprobs=1)], max_num_reqs=4)
    batch.remove_request("r3")  # the one row with knobs in use leaves: the counts drop to zero
    batch.condense()
    assert batch.num_rows_using.tolist() == [0] * len(Knob)
    metadata = build_sampling_metadata(batch, np.array([2, 0, 1]), EOS, VOCAB, torch.device("cpu"))
    assert metadata == sampling_metadata.SamplingMetadata(all_greedy=True) and copies == []
    logits = torch.randn(3, VOCAB)
    assert TorchSampler()(logits.clone(), metadata).sampled_token_ids == logits.argmax(-1).tolist()
    # the spy sees the copies of a batch that uses a knob: its float knobs, then is_greedy
    batch.add_request(CachedRequestState("t", [1], P(temperature=0.5), None, [], 0))
    metadata = build_sampling_metadata(batch, np.array([3, 0]), EOS, VOCAB, torch.device("cpu"))
    assert metadata.temperature.tolist() == [[0.5], [1.0]] and metadata.is_greedy.tolist() == [False, True]
    assert [c.shape for c in copies] == [(len(FLOAT_KNOBS), 2), (1, 2)]
    assert copies[0][TEMPERATURE].tolist() == [0.5, 1.0] and copies[1].tolist() == [[0, 1]]


def reference(params, generators, prompts, outputs) -> dict:
    """The step's metadata built request by request from the SamplingParams, as plain values."""
    greedy = [p.is_greedy for p in params]
    random_rows = [p for p, g in zip(params, greedy) if not g]

    def column(values, dtype):
        return dtype, torch.tensor(values, dtype=dtype).tolist()

    out = dict(all_greedy=all(greedy), is_greedy=None, temperature=None, top_k=None, top_p=None, min_p=None)
    if not all(greedy):
        if any(greedy):
            out["is_greedy"] = column(greedy, torch.bool)
        out["temperature"] = column([[1.0 if g else p.temperature] for p, g in zip(params, greedy)], torch.float32)
        if any(0 < p.top_k < VOCAB for p in random_rows):
            out["top_k"] = column([p.top_k if 0 < p.top_k < VOCAB else VOCAB for p in params], torch.int64)
        if any(p.top_p < 1 for p in random_rows):
            out["top_p"] = column([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0 for p in random_rows):
            out["min_p"] = column([p.min_p for p in params], torch.float32)
    out["generators"] = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}
    wanted = [p.logprobs for p in params]
    out["num_logprobs"] = wanted if any(n is not None for n in wanted) else None
    bias = [(i, t, float(np.float32(b))) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
    out["logit_bias"] = bias or None
    banned = [(i, t) for i, (p, o) in enumerate(zip(params, outputs)) if len(o) < p.min_tokens
              for t in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)))]
    out["banned"] = banned or None
    out["penalties"] = None
    penalised = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1]
    if penalised:  # rows without penalties are left out: their factors leave their logits alone
        out["penalties"] = dict(
            factors=[column([[getattr(p, k)] for p in params], torch.float32) for k in
                     ("presence_penalty", "frequency_penalty", "repetition_penalty")],
            tokens={i: (prompts[i], outputs[i]) for i in penalised})
    return out


def as_plain(m: sampling_metadata.SamplingMetadata) -> dict:
    def column(t):
        return None if t is None else (t.dtype, t.tolist())

    out = {k: column(getattr(m, k)) for k in ("is_greedy", "temperature", "top_k", "top_p", "min_p")}
    out.update(all_greedy=m.all_greedy, generators=m.generators, num_logprobs=m.num_logprobs, penalties=None,
               logit_bias=None if m.logit_bias is None else list(zip(*(a.tolist() for a in m.logit_bias))),
               banned=None if m.banned is None else list(zip(*(a.tolist() for a in m.banned))))
    if m.num_logprobs is not None:
        assert m.max_num_logprobs == max(n for n in m.num_logprobs if n is not None)
    if (p := m.penalties) is not None:
        tokens = {int(r): ([t for t in prompt if t >= 0], [t for t in output if t >= 0])
                  for r, prompt, output in zip(p.rows, p.prompt_token_ids.tolist(), p.output_token_ids.tolist())}
        out["penalties"] = dict(factors=[column(t) for t in (p.presence, p.frequency, p.repetition)], tokens=tokens)
    return out


def _step_of(batch: InputBatch, req_ids: list[str]):
    rows = np.array([batch.req_id_to_index[r] for r in req_ids])
    return build_sampling_metadata(batch, rows, EOS, VOCAB, torch.device("cpu"))


def _moved_batch(generators) -> InputBatch:
    """PARAMS' requests with others between them that leave, so each row moves on condense; the
    others use every knob, so a value left behind by a move would show."""
    batch = InputBatch(max_num_reqs=2 * len(PARAMS), max_model_len=32, block_size=16)
    other = P(temperature=0.3, top_k=2, top_p=0.4, min_p=0.6, presence_penalty=1.0, logit_bias={1: 1.0},
              min_tokens=9, logprobs=5)
    for i, p in enumerate(PARAMS):
        batch.add_request(CachedRequestState(f"other{i}", [1, 2], other, torch.Generator(), [], 0))
        batch.add_request(CachedRequestState(f"r{i}", list(PROMPTS[i]), p, generators[i], [], 0, list(OUTPUTS[i])))
    for i in range(len(PARAMS)):
        batch.remove_request(f"other{i}")
    batch.condense()
    assert [batch.req_id_to_index[f"r{i}"] for i in range(len(PARAMS))] == list(range(len(PARAMS)))
    return batch


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5, 6, 7], [7, 4, 1, 6], [5, 3], [2], [3, 5, 0]])
def test_metadata_equals_the_per_request_construction(order):
    """Steps sample a subset of the batch's rows, in their own order, after rows moved; as tokens
    are sampled the penalties' history grows and min_tokens bans lift, step by step."""
    generators = _generators()
    batch = _moved_batch(generators)
    outputs = [list(o) for o in OUTPUTS]
    for step in range(4):
        ref = reference(*([x[i] for i in order] for x in (PARAMS, generators, PROMPTS, outputs)))
        assert as_plain(_step_of(batch, [f"r{i}" for i in order])) == ref, step
        for i in range(len(PARAMS)):
            batch.append_token(batch.req_id_to_index[f"r{i}"], 30 + step + i)
            outputs[i].append(30 + step + i)


def test_a_greedy_row_storing_its_own_temperature_fails_the_comparison(monkeypatch):
    original = InputBatch._set_sampling_row

    def set_row(self, row, p, generator):
        original(self, row, p, generator)
        self.temperature_cpu[row] = p.temperature  # greedy rows must divide by 1.0

    monkeypatch.setattr(InputBatch, "_set_sampling_row", set_row)
    generators = _generators()
    batch = batch_of(PARAMS, generators, PROMPTS, OUTPUTS)
    with pytest.raises(AssertionError):
        assert as_plain(_step_of(batch, ["r0", "r1"])) == reference(PARAMS[:2], generators[:2], PROMPTS[:2],
                                                                    OUTPUTS[:2])
