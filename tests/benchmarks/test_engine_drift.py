"""benchmarks.engine_drift's agreement measure: the tokens a row keeps before it first differs
from the reference, per prompt (the OpenVINO side needs the peer's venv and is not run here)."""
from __future__ import annotations

from benchmarks.engine_drift import BF16_OF, SPINDLE_CONFIGS, agreement


def test_agreement_counts_the_tokens_kept_before_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    result = agreement(reference, other)
    assert result["tokens_kept"] == [4, 2, 0]
    assert result["num_identical"] == 1 and result["num_prompts"] == 3
    assert result["mean_tokens_kept"] == 2.0


def test_a_shorter_row_keeps_only_what_it_has():
    assert agreement([[1, 2, 3]], [[1, 2]])["tokens_kept"] == [2]
    assert agreement([[1, 2, 3]], [[1, 2]])["num_identical"] == 0


def test_every_int8_row_is_set_against_a_bf16_row_of_its_engine():
    assert all(own in SPINDLE_CONFIGS or own == "openvino-bf16" for own in BF16_OF.values())
    assert {"bf16-kv8", "w8a8", "w8a8-kv8", "openvino-int8"} <= set(BF16_OF)
