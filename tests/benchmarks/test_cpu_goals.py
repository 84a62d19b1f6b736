"""benchmarks.cpu_goals: the CPU table and its goals, from a result built here (no servers)."""
from __future__ import annotations

from benchmarks import cpu_goals, report
from tests.benchmarks.test_merge import _scenario


def _server(name: str, tok_s_by_level: dict[int, float], single_tok_s: float | None = None) -> dict:
    server = {"name": name, "note": "", "latencies": {},
              "scenarios": [_scenario(c, tok_s, 20.0) for c, tok_s in tok_s_by_level.items()]}
    if single_tok_s is not None:
        server["single_stream"] = {"num_tokens": 256, "e2e_s": 256 / single_tok_s, "ttft_ms": 50.0,
                                   "tok_s": single_tok_s, "decode_tok_s": single_tok_s * 1.02}
    return server


def _result() -> dict:
    floors = {"cpu_flags": ["avx2", "avx512f"], "read_gb_s": 20.0, "matmul_shape": [64, 576, 1536],
              "matmul_gflop_s": {"bfloat16": 300.0, "float32": 100.0},
              "model_weight_bytes": {"num_params": 100_000_000, "bfloat16": 200_000_000, "int8": 100_000_000}}
    return {
        "workload_note": "test", "spindle_reference": "spindle",
        "machine": {"loadavg_before": [1.0], "loadavg_after": [1.0], "cpus": 2, "floors": floors},
        "servers": [
            _server("spindle-bf16", {1: 40.0, 32: 300.0, 64: 450.0}, single_tok_s=50.0),
            _server("spindle-int8", {1: 50.0, 32: 250.0}, single_tok_s=70.0),
            _server("openvino-bf16", {1: 45.0, 32: 200.0, 64: 320.0}, single_tok_s=49.0),
            _server("openvino-int8", {1: 60.0, 32: 280.0, 64: 300.0}, single_tok_s=65.0),
            _server("transformers-serve", {32: 90.0, 64: 160.0}),
            {"name": "llama-cpp", "skip_reason": "not installed", "scenarios": []},
        ],
        "engine_overhead": {"rows": [{"num_running": 256, "steps_per_s": 1111.0, "step_ms": 0.9, "scheduling_ms": 0.2,
                                      "serialization_ms": 0.2, "cpu_ms_per_step": {"frontend": 0.3}}]},
    }


def _goals(result: dict) -> dict[str, list[str]]:
    return {row[0]: row[1:] for row in cpu_goals.goal_rows(result)}


def test_each_goal_is_the_ratio_of_the_same_run():
    goals = _goals(_result())
    assert goals["1. single stream, spindle-bf16 vs openvino-bf16"] == [
        "1.02x (50.0 vs 49.0 tok/s)", ">= 1x", "met"]
    assert goals["1. single stream, spindle-int8 vs openvino-int8"][0].startswith("1.08x")
    # floor: 200 MB at 20 GB/s is 10 ms; decoding at 51 tok/s is 19.6 ms a token
    assert goals["1. spindle-bf16 decode step against the floor (weight bytes / read bandwidth)"] == [
        "1.96x (19.6 vs 10.0 ms)", "<= 1.3x", "NOT met"]
    assert goals["2. c=32, spindle-bf16 vs openvino-bf16"] == ["1.50x (300.0 vs 200.0 tok/s)", ">= 1.5x", "met"]
    assert goals["2. c=64, spindle-bf16 vs openvino-bf16"][2] == "NOT met"  # 450 / 320 = 1.41
    assert goals["2. c=64, spindle-int8 vs openvino-int8"] == ["n/a", ">= 1.5x", "n/a"]  # no c=64 row of ours
    assert goals["3. c=64, spindle-bf16 vs transformers serve"] == ["2.81x (450.0 vs 160.0 tok/s)", ">= 3x", "NOT met"]
    assert goals["3. engine overhead per step, 256 running"] == ["0.90 ms", "< 1 ms", "met"]


def test_a_peer_row_with_almost_no_tokens_gives_no_ratio():
    result = _result()
    stalled = next(s for s in result["servers"] if s["name"] == "transformers-serve")["scenarios"][-1]
    stalled["output_throughput"], stalled["total_output_tokens"] = 0.3, 30  # c=64: 30 tokens in the limit
    assert _goals(result)["3. c=64, spindle-bf16 vs transformers serve"] == ["n/a", ">= 3x", "n/a"]


def test_the_matrix_has_every_level_and_leaves_out_skipped_servers():
    rows = {row[0]: row[1:] for row in cpu_goals.matrix_rows(_result())}
    assert set(rows) == {"spindle-bf16", "spindle-int8", "openvino-bf16", "openvino-int8", "transformers-serve"}
    assert rows["spindle-bf16"] == ["40.0", "-", "300.0", "450.0", "50.0", "51.0"]
    assert rows["transformers-serve"][-2:] == ["-", "-"]


def test_the_report_carries_the_cpu_table_only_when_cpu_engines_ran():
    text = report.render(_result())
    assert "CPU goals (same run, same requests)" in text
    assert "Machine: flags avx2 avx512f; read 20.0 GB/s; matmul 64x576x1536 GFLOP/s: bfloat16 300, float32 100" in text
    plain = _result()
    plain["servers"] = [_server("spindle", {1: 40.0})]
    assert cpu_goals.render(plain) == ""


def test_an_int8_kv_cache_row_is_set_against_the_openvino_row_of_its_weights():
    result = _result()
    assert not any(k.startswith("2. c=32, spindle-bf16-kv8") for k in _goals(result))  # not run: not listed
    result["servers"].append(_server("spindle-bf16-kv8", {32: 330.0}, single_tok_s=52.0))
    goals = _goals(result)
    assert goals["2. c=32, spindle-bf16-kv8 vs openvino-bf16"] == ["1.65x (330.0 vs 200.0 tok/s)", ">= 1.5x", "met"]
    assert goals["1. single stream, spindle-bf16-kv8 vs openvino-bf16"][0].startswith("1.06x")


def test_goal_2_says_which_pairs_are_alike_in_configuration_only_and_adds_the_pair_of_like_accuracy():
    result = _result()
    result["servers"] += [_server("spindle-w8a8-kv8", {32: 560.0}, single_tok_s=150.0),
                          _server("spindle-w8a8-rows", {32: 600.0}, single_tok_s=150.0),
                          _server("spindle-bf16-kv8", {32: 330.0, 64: 400.0}, single_tok_s=52.0)]
    goals = _goals(result)
    assert goals["2. c=32, spindle-w8a8-kv8 vs openvino-int8 (like configuration and accuracy)"] == [
        "2.00x (560.0 vs 280.0 tok/s)", ">= 1.5x", "met"]
    assert goals["2. c=32, spindle-w8a8-rows vs openvino-int8 (like configuration, not accuracy)"][0].startswith(
        "2.14x")
    assert goals["2. c=32, spindle-bf16-kv8 vs openvino-int8 (like accuracy)"] == [
        "1.18x (330.0 vs 280.0 tok/s)", ">= 1.5x", "NOT met"]
    assert goals["2. c=64, spindle-bf16-kv8 vs openvino-int8 (like accuracy)"][0].startswith("1.33x")
    assert goals["2. c=32, spindle-bf16-kv8 vs openvino-bf16"][0].startswith("1.65x")  # its own weights' row stays
    # The accuracy pair is a goal-2 row only: goal 1 keeps one floor row per Spindle row.
    assert not any("spindle-bf16-kv8 vs openvino-int8" in k for k in goals if k.startswith("1."))
    assert sum(k.startswith("1. spindle-bf16-kv8 decode step") for k in goals) == 1


def test_a_row_with_a_stream_interval_is_paired_as_its_row_and_says_so():
    result = _result()
    result["servers"] += [_server("spindle-w8a8-kv8", {32: 560.0}, single_tok_s=150.0),
                          _server("spindle-w8a8-kv8-si8", {32: 588.0}, single_tok_s=151.0),
                          _server("spindle-bf16-si4", {32: 320.0}, single_tok_s=50.0)]
    goals = _goals(result)
    assert goals["2. c=32, spindle-w8a8-kv8-si8 vs openvino-int8 (like configuration and accuracy, streamed every 8 "
                 "tokens)"] == ["2.10x (588.0 vs 280.0 tok/s)", ">= 1.5x", "met"]
    assert goals["2. c=32, spindle-bf16-si4 vs openvino-bf16 (streamed every 4 tokens)"][0].startswith("1.60x")
    keys = list(goals)  # each row right after its row without the interval
    assert keys.index("2. c=32, spindle-bf16-si4 vs openvino-bf16 (streamed every 4 tokens)") == \
        keys.index("2. c=32, spindle-bf16 vs openvino-bf16") + 1
    assert goals["1. single stream, spindle-w8a8-kv8-si8 vs openvino-int8"][0].startswith("2.32x")
