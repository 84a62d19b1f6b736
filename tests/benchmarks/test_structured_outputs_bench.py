"""The structured-outputs benchmark's pure parts, without a server: the schema and the output check,
the length matching, the comparison of rounds, the profile split and the table."""
from __future__ import annotations

import json

from benchmarks.loadgen import RequestResult
from benchmarks.structured_outputs import (categorise_profile, check_outputs, compare, inventory_schema,
                                           matched_lengths, render)
from benchmarks.workload import ChatRequest


def result(index: int, text: str, finish_reason: str = "stop", error: str = "") -> RequestResult:
    r = RequestResult(index, prompt_tokens=10, max_tokens=320, finish_reason=finish_reason, saw_done=True, error=error)
    r.text = text
    return r


def items(num: int) -> str:
    return json.dumps({"items": [{"name": f"n{i}", "note": "short", "count": i} for i in range(num)]})


def test_check_outputs_counts_valid_cut_and_invalid_apart():
    schema = inventory_schema(num_items=2, max_name_chars=4, max_note_chars=8)
    results = [
        result(0, items(2)),
        result(1, items(2)[:-5], finish_reason="length"),  # cut by max_tokens: counted apart
        result(2, items(3)),  # three items where the schema allows exactly two
        result(3, json.dumps({"items": [{"name": "toolong", "note": "x", "count": 1}] * 2})),
        result(4, items(2)[:-5]),  # ended ("stop") mid-object
    ]

    check = check_outputs(results, schema)

    assert (check["num_valid"], check["num_cut_by_max_tokens"], check["num_invalid"]) == (1, 1, 3)
    assert [e.split(" ")[1] for e in check["invalid_examples"]] == ["2", "3", "4"]


def test_matched_lengths_asks_each_request_for_its_constrained_length():
    requests = [ChatRequest(i, [{"role": "user", "content": "x"}], 320, 5, False) for i in range(3)]

    matched = matched_lengths(requests, {0: 140, 1: 0, 2: 320})

    assert [r.max_tokens for r in matched] == [140, 1, 320]
    assert [r.messages for r in matched] == [r.messages for r in requests]


def row(kind: str, index: int, tok_s: float) -> dict:
    return {"kind": kind, "round": index, "output_throughput": tok_s, "mean_output_tokens": 140.0,
            "tpot_ms_p50": 100.0, "ttft_ms_p50": 300.0, "max_num_running_reqs": 32}


def test_compare_takes_medians_and_pairs_rounds_in_order():
    rows = [row("unconstrained", 1, 200.0), row("constrained", 1, 190.0), row("unconstrained", 2, 250.0),
            row("constrained", 2, 150.0), row("unconstrained", 3, 220.0), row("constrained", 3, 170.0)]

    out = compare(rows, goal=0.9)

    assert out["unconstrained"]["output_throughput_median"] == 220.0
    assert out["constrained"]["output_throughput_median"] == 170.0
    assert out["ratio"] == 170.0 / 220.0 and not out["is_goal_met"]
    assert out["ratio_per_round"] == [190.0 / 200.0, 150.0 / 250.0, 170.0 / 220.0]
    assert out["constrained"]["max_num_running_reqs"] == 32


def test_categorise_profile_takes_the_innermost_named_frame():
    step = ("_bootstrap (threading.py:1);WorkerServicer._step (services/worker/server.py:103);"
            "ModelRunner.execute_model (services/worker/model_runner.py:126)")
    raw = "\n".join([
        f"{step};ModelRunner._sample (m.py:315);ModelRunner._apply_grammars (m.py:330);"
        "GrammarBitmask.fill (g.py:60);GrammarMatcher.fill_next_token_bitmask (xgrammar/matcher.py:9) 3",
        f"{step};ModelRunner._sample (m.py:319);GrammarState.accept (g.py:26);"
        "GrammarMatcher.accept_token (xgrammar/matcher.py:5) 2",
        f"{step};ModelRunner._sample (m.py:315);ModelRunner._apply_grammars (m.py:333);"
        "TorchSampler.apply_token_bitmask (s.py:73);CpuTokenBitmask.__call__ (c.py:30) 1",
        f"{step};ModelRunner._sample (m.py:315);ModelRunner._apply_grammars (m.py:331) 1",
        f"{step};Module._wrapped_call_impl (torch/nn/modules/module.py:1);LlamaModel.forward (model.py:1) 10",
        f"{step};ModelRunner._sample (m.py:316);TorchSampler.__call__ (s.py:59) 1",
        f"{step} 1",
        "BaseEventLoop._run_once (asyncio/base_events.py:1922) 1",
        "not a sample line",
    ])

    out = categorise_profile(raw)

    assert out["num_samples"] == 20
    counts = {k: round(v * 20) for k, v in out["shares"].items()}
    assert counts == {"fill_next_token_bitmask": 3, "accept_token": 2, "bitmask kernel": 1, "other grammar work": 1,
                      "sampling": 1, "model forward": 10, "rest of execute_model": 1, "other": 1}


def test_render_prints_every_round_and_the_ratio():
    rows = [row("unconstrained", 1, 200.0), {**row("constrained", 1, 190.0), "check": {
        "num_valid": 63, "num_cut_by_max_tokens": 1, "num_invalid": 0}}]
    result = {"rounds": rows, "comparison": compare(rows, goal=0.9),
              "compile_probe": {"unconstrained_ttft_ms": 60.0, "constrained_ttft_ms": 1000.0}, "profile": None}

    text = render(result)

    assert "| 1 | constrained | 190.0 | 140.0 | 100.0 | 300 | 32 | 63 / 1 / 0 |" in text
    assert "ratio 0.950" in text and "goal >= 0.90: met" in text
    assert "TTFT 1000 ms against 60 ms" in text
