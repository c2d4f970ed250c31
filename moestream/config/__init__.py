"""Plain configuration dataclasses: model architecture, engine options, speculative decoding.

This package imports nothing from `models/`, `layers/`, `experts/` or `engine/`: HF config
parsing lives with the model registry (`moestream.models.hf_config`), and names that belong
to a component (eviction policies, ...) live with that component.
"""

from moestream.config.dtype import resolve_dtype
from moestream.config.engine import EngineConfig, check_request_expert_mode
from moestream.config.model import (
    EXPERT_ACTIVATIONS,
    SUPPORTED_ROPE_TYPES,
    ExpertActivation,
    Mamba2Config,
    LoopConfig,
    MLAConfig,
    ModelConfig,
    MultiModalConfig,
    RopeConfig,
    RouterConfig,
)
from moestream.config.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

__all__ = ["EngineConfig", "ExpertActivation", "EXPERT_ACTIVATIONS", "LoopConfig", "Mamba2Config", "ModelConfig", "MLAConfig", "MultiModalConfig", "RopeConfig", "RouterConfig",
           "SpeculativeConfig", "MAX_SPECULATIVE_TOKENS", "SUPPORTED_ROPE_TYPES", "check_request_expert_mode",
           "resolve_dtype"]
