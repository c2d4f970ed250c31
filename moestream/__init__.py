"""moestream: a serving engine for Mixture-of-Experts language models.

The public names (`LLM`, `SamplingParams`, ...) are imported on first use (PEP 562), so
that `import moestream` and the command line's `--help` do not pay for torch and
transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput", "CompletionOutput", "__version__"]

# public name -> the module defining it
_LAZY = {
    "LLM": "moestream.llm",
    "SamplingParams": "moestream.sampling_params",
    "EngineConfig": "moestream.config",
    "ModelConfig": "moestream.config",
    "RequestOutput": "moestream.outputs",
    "CompletionOutput": "moestream.outputs",
}

if TYPE_CHECKING:
    from moestream.config import EngineConfig, ModelConfig
    from moestream.llm import LLM
    from moestream.outputs import CompletionOutput, RequestOutput
    from moestream.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and cache the name here.

    Raises:
        AttributeError: `name` is not a public name of moestream.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moestream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy public ones included."""
    return sorted(set(globals()) | set(__all__))
