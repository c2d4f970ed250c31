"""Default sampling parameters from a checkpoint's `generation_config.json`, as vLLM's
`--generation-config auto` (vllm/config/model.py `get_diff_sampling_param`): the model
creator's recommended values replace the built-in defaults of the fields a request leaves
unset. HF transformers' `generate` applies the same file by default, so greedy output with
these defaults still matches HF's.
"""

from __future__ import annotations

import json
import os
from typing import Any

# generation_config.json name -> SamplingParams field (vLLM's list).
_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def default_sampling_fields(generation_config: str, model_dir: str) -> dict[str, Any]:
    """SamplingParams fields to use where a request gives none.

    Args:
        generation_config: "auto" reads `model_dir/generation_config.json`; "vllm" ignores it
            (the built-in defaults only); anything else is a directory holding a
            `generation_config.json`.
        model_dir: the checkpoint directory.

    Returns:
        e.g. {"repetition_penalty": 1.3}; empty when there is no file or it sets none of
        repetition_penalty, temperature, top_k, top_p, min_p, max_new_tokens (-> max_tokens).

    Raises:
        ValueError: the file is not valid JSON or not an object, a value has the wrong type,
            or a directory given as `generation_config` has no generation_config.json.
    """
    if generation_config == "vllm":
        return {}
    folder = model_dir if generation_config == "auto" else generation_config
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if generation_config != "auto":
            raise ValueError(f"generation_config: {path} does not exist; give a directory with a "
                             "generation_config.json, 'auto' (the model's) or 'vllm' (built-in defaults)")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for name, field in _FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        integer = field in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ValueError(f"{path}: '{name}' must be {'an integer' if integer else 'a number'}, got {value!r}")
        out[field] = value if integer else float(value)
    return out
