"""Sampling defaults for unset fields, as vLLM's `--generation-config auto`: the model folder's
generation_config.json, the embedded model's card values where its folder lacks them, and
`--override-generation-config` on top; a request's own values always win."""
from __future__ import annotations

import json

import pytest

from services.common.model_files import DEFAULT_MODEL_NAME
from services.frontend.generation_defaults import load_generation_defaults
from services.frontend.protocol import parse_chat_request, parse_completion_request


def folder_with(tmp_path, config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_folders_values_then_the_override(tmp_path):
    path = folder_with(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
                                  "max_new_tokens": 9, "repetition_penalty": 1.1})
    assert load_generation_defaults(path, "m") == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                   "repetition_penalty": 1.1}
    assert load_generation_defaults(path, "m", '{"temperature": 0.0, "min_p": 0.05}') == {
        "temperature": 0.0, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "min_p": 0.05}


def test_the_embedded_model_gets_its_cards_values_unless_its_folder_says_otherwise(tmp_path):
    assert load_generation_defaults(tmp_path, DEFAULT_MODEL_NAME) == {"temperature": 0.2, "top_p": 0.9}
    path = folder_with(tmp_path, {"temperature": 0.7})
    assert load_generation_defaults(path, DEFAULT_MODEL_NAME) == {"temperature": 0.7, "top_p": 0.9}
    assert load_generation_defaults(tmp_path / "missing", "other") == {}


@pytest.mark.parametrize("override", ['[1]', '{"temperature": "hot"}', '{"max_tokens": 5}', 'nope',
                                      '{"top_k": 1.5}', '{"temperature": NaN}'])
def test_bad_overrides_are_refused_at_start_up(tmp_path, override):
    with pytest.raises(ValueError, match="--override-generation-config"):
        load_generation_defaults(tmp_path, "m", override)


def test_unset_fields_take_the_defaults_and_set_ones_keep_theirs():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.01, "repetition_penalty": 1.05}
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    params = parse_chat_request(body, defaults).options.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.2, 0.9, 40, 0.01, 1.05)
    params = parse_chat_request({**body, "temperature": 1.0, "top_p": 1.0, "top_k": -1}, defaults).options.sampling_params
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    params = parse_completion_request({"prompt": "x", "temperature": None}, defaults).options.sampling_params
    assert params.temperature == 0.2  # null means unset
    assert parse_chat_request(body).options.sampling_params.temperature == 1.0  # no defaults: the API's
