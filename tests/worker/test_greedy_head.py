"""The greedy head screen (layers/greedy_head.py, csrc/greedy_screen.c): an int8 copy of a bfloat16
LM head picks the tokens in reach of the maximum and the bfloat16 weight decides among them. It must
give the full head's argmax (its first maximum of the bfloat16 logits) on ties, near ties and
vocabularies with tails, leave non-finite rows to the full head, and serve a bfloat16 model's greedy
steps with the same tokens as the full head, and only those steps."""
from __future__ import annotations

import pytest
import torch

from services.common.messages import SamplingParams
from services.worker.config import WorkerConfig
from services.worker.layers.greedy_head import MAX_WEIGHT_ONLY_SCREEN_ROWS, AmxInt8Head, GreedyHeadScreen, error_bounds
from services.worker.layers.int8_kernels import quantize_per_channel
from services.worker.layers.int8_linear import Int8Weight
from tests.worker.harness import VOCAB_SIZE, MiniScheduler
from tests.worker.kernel_builds import MARCHES, library_for

HIDDEN = 96  # the weight-only int8 kernels' screen (not a multiple of 64)
AMX_HIDDEN = 128  # where the library has AMX-INT8: head_int8_amx.c's screen


def _plain_int8(qweight: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
    return Int8Weight(qweight, scales, native_bf16=True)  # int8pack_mm or the widening GEMM


@pytest.fixture(scope="module", params=MARCHES)
def library(request, kernel_cache):
    return library_for(request.param, kernel_cache)


@pytest.fixture(params=[HIDDEN, AMX_HIDDEN], ids=["weight-only", "amx-or-weight-only"])
def hidden_size(request):
    return request.param


def _full_head_tokens(hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
    """The full head's greedy tokens: bfloat16 logits from float64 sums, their first maximum."""
    logits = (hidden.double() @ weight.double().T).to(torch.bfloat16)
    return logits.float().max(dim=-1).indices.tolist()


def _weight(vocab: int, seed: int, hidden: int = HIDDEN) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, hidden, generator=gen) * 0.05).to(torch.bfloat16)


@pytest.mark.parametrize("vocab", (16, 300, 4133, 49152))
def test_random_rows_get_the_full_heads_token(library, vocab, hidden_size):
    weight = _weight(vocab, vocab, hidden_size)
    screen = GreedyHeadScreen.build(library, weight, _plain_int8)
    gen = torch.Generator().manual_seed(1)
    hidden = (torch.randn(40, hidden_size, generator=gen) * 3).to(torch.bfloat16)
    hidden[3, 5] = 40.0  # an outlier, as final hidden states hold
    tokens = screen(hidden)
    assert tokens is not None and tokens.tolist() == _full_head_tokens(hidden, weight)
    # Some tokens were computed again, and far fewer than the vocabulary (the screen screens).
    assert 40 <= screen.num_candidates < 40 * max(vocab // 4, 16)


def test_ties_go_to_the_first_token_and_near_ties_are_decided_exactly(library, hidden_size):
    vocab = 2000
    weight = _weight(vocab, 3, hidden_size)
    gen = torch.Generator().manual_seed(4)
    hidden = (torch.randn(6, hidden_size, generator=gen) * 3).to(torch.bfloat16)
    winners = _full_head_tokens(hidden, weight)
    # Exact copies of row 0's winner, before and after it: equal logits, the first copy wins.
    weight[5] = weight[winners[0]]
    weight[1990] = weight[winners[0]]
    # Row 1: a token whose weight differs from the winner's by one bfloat16 step in one value, so
    # their logits differ by less than the int8 error: only the bfloat16 weight can tell them apart.
    near = weight[winners[1]].clone()
    near.view(torch.int16)[int(hidden[1].float().abs().argmax())] += 1  # one bfloat16 step larger in size
    weight[7] = near
    screen = GreedyHeadScreen.build(library, weight, _plain_int8)
    expected = _full_head_tokens(hidden, weight)
    assert expected[0] == 5
    assert screen(hidden).tolist() == expected


def test_a_row_that_is_not_finite_leaves_the_step_to_the_full_head(library, hidden_size):
    weight = _weight(500, 5, hidden_size)
    screen = GreedyHeadScreen.build(library, weight, _plain_int8)
    hidden = torch.randn(3, hidden_size).to(torch.bfloat16)
    for bad in (float("nan"), float("inf")):
        hidden[1, 7] = bad
        assert screen(hidden) is None
    with pytest.raises(ValueError):
        screen(torch.randn(2, hidden_size + 1).to(torch.bfloat16))


def test_without_amx_only_few_row_steps_take_the_screen(library, hidden_size):
    screen = GreedyHeadScreen.build(library, _weight(300, 9, hidden_size), _plain_int8)
    if isinstance(screen.approx, AmxInt8Head):  # AMX-INT8's product gains at every row count
        assert screen.max_rows is None and screen.takes(1) and screen.takes(4096)
    else:  # the weight-only copy, not on AMX int8 panels: a batch costs more than the bfloat16 head
        assert screen.max_rows == MAX_WEIGHT_ONLY_SCREEN_ROWS
        assert screen.takes(1) and screen.takes(MAX_WEIGHT_ONLY_SCREEN_ROWS)
        assert not screen.takes(MAX_WEIGHT_ONLY_SCREEN_ROWS + 1)


def test_the_bounds_cover_the_int8_copys_error():
    weight = _weight(3000, 6)
    qweight, scales = quantize_per_channel(weight, bfloat16_scales=True)
    assert torch.equal(scales, scales.bfloat16().float())  # bfloat16 holds them exactly
    assert (scales * 127 >= weight.float().abs().amax(dim=1)).all()  # no weight clipped
    bounds, norms = error_bounds(weight, qweight, scales)
    hidden = torch.randn(50, HIDDEN, dtype=torch.float64)
    exact = hidden @ weight.double().T
    approx = hidden @ (qweight.double() * scales.double()[:, None]).T
    assert ((exact - approx).abs() <= hidden.norm(dim=1, keepdim=True) * bounds.double()).all()
    assert (norms.double() >= weight.double().norm(dim=1)).all()


def test_the_amx_int8_logits_and_row_errors_keep_within_the_bound(library):
    if not AmxInt8Head.supports(library, AMX_HIDDEN):
        pytest.skip("this build has no AMX-INT8 (the weight-only screen is tested above)")
    weight = _weight(1000 + 17, 7, AMX_HIDDEN)  # a vocabulary past the last whole panel
    qweight, scales = quantize_per_channel(weight, bfloat16_scales=True)
    bounds, norms = error_bounds(weight, qweight, scales)
    gen = torch.Generator().manual_seed(8)
    hidden = (torch.randn(37, AMX_HIDDEN, generator=gen) * 2).to(torch.bfloat16)  # 3 row blocks, the last partial
    hidden[0, 3] = -60.0
    approx, x_errors = AmxInt8Head(library, qweight, scales)(hidden)
    x = hidden.double()
    step = x.abs().amax(dim=1, keepdim=True) / 16256
    assert torch.allclose(x_errors.double(), (x - torch.round(x / step) * step).norm(dim=1), rtol=1e-3, atol=1e-9)
    exact = x @ weight.double().T
    errors = x_errors.double()[:, None]
    margin = (x.norm(dim=1, keepdim=True) + errors) * bounds.double() + errors * norms.double() \
        + 2.0**-7 * approx.double().abs()
    assert ((exact - approx.double()).abs() <= margin).all()
    assert (x_errors < 1e-2 * x.norm(dim=1)).all()  # 15 bits: far below one int8 step per value


def test_a_bfloat16_models_greedy_steps_take_the_screen_with_the_same_tokens(tiny_llama_dir):
    from tests.worker.test_decode_stack import _runner

    def run(screen: bool, params: SamplingParams | None = None,
            max_rows: int | None = None) -> tuple[list[list[int]], int, int]:
        runner = _runner(tiny_llama_dir, torch.bfloat16, "none", fused=True)
        head = runner.model.lm_head
        assert head.greedy_screen is not None and WorkerConfig().cpu_greedy_head_screen
        head.greedy_screen.max_rows = max_rows  # None: every step, whatever the CPU
        if not screen:
            head.greedy_screen = None
        calls = {"screen": 0, "logits": 0}
        greedy, logits = runner.model.compute_greedy_tokens, runner.model.compute_logits

        def screened(hidden: torch.Tensor) -> torch.Tensor | None:
            tokens = greedy(hidden)
            if tokens is not None:
                assert max_rows is None or hidden.shape[0] <= max_rows  # larger steps are not screened
                calls["screen"] += 1
            return tokens

        runner.model.compute_greedy_tokens = screened
        runner.model.compute_logits = lambda h: (calls.__setitem__("logits", calls["logits"] + 1), logits(h))[1]
        scheduler = MiniScheduler(block_size=4, token_budget=32)
        gen = torch.Generator().manual_seed(2)
        for i, n in enumerate((5, 11, 3, 17)):
            scheduler.add(f"r{i}", torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist(), 10, params)
        scheduler.run(runner)
        return [scheduler.outputs(f"r{i}") for i in range(4)], calls["screen"], calls["logits"]

    screened, num_screened, num_full = run(True)
    full, _, num_full_off = run(False)
    assert screened == full
    assert num_screened > 0 and num_full == 0 and num_full_off > 0
    # Logprobs read the logits: such steps take the full head.
    _, num_screened, num_full = run(True, SamplingParams(temperature=0, max_tokens=10, logprobs=2))
    assert num_screened == 0 and num_full > 0
    # Steps of more rows than the screen's limit take the full head, with the same tokens.
    limited, num_screened, num_full = run(True, max_rows=2)
    assert limited == full and num_screened > 0 and num_full > 0
