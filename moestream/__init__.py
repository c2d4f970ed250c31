"""moestream: a serving engine for Mixture-of-Experts language models."""

from moestream.config import EngineConfig, ModelConfig
from moestream.llm import LLM
from moestream.outputs import CompletionOutput, RequestOutput
from moestream.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput", "CompletionOutput", "__version__"]
