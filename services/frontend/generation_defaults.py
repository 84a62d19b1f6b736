"""The sampling defaults a request gets for the fields it leaves unset, as vLLM's
`--generation-config auto`: the model folder's `generation_config.json` values of temperature,
top_p, top_k, min_p and repetition_penalty, then `--override-generation-config JSON` on top.

The embedded SmolLM2-135M-Instruct gets its model card's example values (temperature 0.2, top_p
0.9) where its converted folder does not carry them: with transformers' 1.0 the README's first
request answers with unrelated words. Read once at start-up; the engine gRPC API reports them in
`GetModelInfo.default_sampling_params_json`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from services.common.model_files import DEFAULT_MODEL_NAME, EMBEDDED_GENERATION_DEFAULTS

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_path: str | Path, model_name: str, override_json: str | None = None
                             ) -> dict[str, float | int]:
    """The defaults for `model_path`; raises ValueError for an override that is not a JSON object of
    known, finite values."""
    defaults: dict[str, float | int] = {}
    if model_name == DEFAULT_MODEL_NAME:
        defaults.update(EMBEDDED_GENERATION_DEFAULTS)  # a read-only cache may lack them
    path = Path(model_path) / "generation_config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            config = {}
        defaults.update(_pick(config if isinstance(config, dict) else {}, strict=False))
    if override_json:
        try:
            override = json.loads(override_json)
        except ValueError as exc:
            raise ValueError(f"--override-generation-config is not JSON: {exc}") from None
        if not isinstance(override, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        defaults.update(_pick(override, strict=True))
    return defaults


def _pick(config: Mapping[str, Any], strict: bool) -> dict[str, float | int]:
    picked: dict[str, float | int] = {}
    for key, value in config.items():
        if key not in SAMPLING_KEYS:
            if strict:
                raise ValueError(f"--override-generation-config: unknown key {key!r}; known: {', '.join(SAMPLING_KEYS)}")
            continue
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not is_number or (key == "top_k" and not isinstance(value, int)):
            if strict:
                raise ValueError(f"--override-generation-config: {key} must be a finite number")
            continue
        picked[key] = value
    return picked
