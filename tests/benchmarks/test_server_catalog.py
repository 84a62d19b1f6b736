"""benchmarks.server_catalog: the Spindle rows' configurations, without starting anything."""
from __future__ import annotations

from benchmarks.server_catalog import make_servers


def test_the_int8_kv_cache_rows_set_the_cache_dtype_beside_their_weights():
    bf16, int8 = make_servers(["spindle-bf16-kv8", "spindle-int8-kv8"], "float32", install=False,
                              bf16_max_concurrency=64)
    assert bf16.env == {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_KV_CACHE_DTYPE": "int8"}
    assert int8.env == {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_KV_CACHE_DTYPE": "int8", "SPINDLE_QUANTIZATION": "int8"}
    assert bf16.max_concurrency == int8.max_concurrency == 64
    assert "int8 KV cache" in bf16.note and "weight-only int8" in int8.note


def test_the_w8a8_row_quantizes_its_int8_weights_activations_too():
    (w8a8,) = make_servers(["spindle-w8a8"], "float32", install=False, bf16_max_concurrency=32)
    assert w8a8.env == {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_QUANTIZATION": "w8a8", "SPINDLE_W8A8_GROUP_SIZE": "32"}
    assert w8a8.max_concurrency == 32 and "W8A8" in w8a8.note


def test_the_w8a8_row_with_the_int8_kv_cache():
    (row,) = make_servers(["spindle-w8a8-kv8"], "float32", install=False, bf16_max_concurrency=64)
    assert row.env == {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_KV_CACHE_DTYPE": "int8", "SPINDLE_QUANTIZATION": "w8a8",
                       "SPINDLE_W8A8_GROUP_SIZE": "32"}
    assert "W8A8" in row.note and "int8 KV cache" in row.note


def test_the_w8a8_rows_name_their_activation_groups_on_every_machine():
    # Not auto: auto is per row where the CPU has AMX-INT8, which would change a row's accuracy.
    grouped, rows = make_servers(["spindle-w8a8", "spindle-w8a8-rows"], "float32", install=False,
                                 bf16_max_concurrency=64)
    assert grouped.env["SPINDLE_W8A8_GROUP_SIZE"] == "32" and "groups of 32" in grouped.note
    assert rows.env == {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_QUANTIZATION": "w8a8", "SPINDLE_W8A8_GROUP_SIZE": "0"}
    assert "activations per row" in rows.note


def test_the_layered_row_is_bf16_with_the_decode_stack_off():
    layered, = make_servers(["spindle-bf16-layered"], "float32", install=False, bf16_max_concurrency=64)
    assert layered.env == {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_CPU_FUSED_DECODE": "false"}
    assert layered.max_concurrency == 64


def test_the_full_head_row_is_bf16_kv8_with_the_greedy_head_screen_off():
    row, = make_servers(["spindle-bf16-kv8-full-head"], "float32", install=False, bf16_max_concurrency=64)
    assert row.env == {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_KV_CACHE_DTYPE": "int8",
                       "SPINDLE_CPU_GREEDY_HEAD_SCREEN": "false"}
    assert row.max_concurrency == 64 and "--cpu-greedy-head-screen false" in row.note


def test_a_spindle_row_with_a_stream_interval_is_that_row_with_the_flag():
    base, = make_servers(["spindle-w8a8-kv8"], "bfloat16", install=False, bf16_max_concurrency=64)
    row, = make_servers(["spindle-w8a8-kv8-si8"], "bfloat16", install=False, bf16_max_concurrency=64)
    assert row.name == "spindle-w8a8-kv8-si8" and row.max_concurrency == base.max_concurrency == 64
    assert row.env == {**base.env, "SPINDLE_STREAM_INTERVAL": "8"}
    assert row.note.startswith(base.note) and "every 8 tokens" in row.note
