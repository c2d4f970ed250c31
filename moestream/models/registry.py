"""model_type -> model class."""

from moestream.models.mixtral import MixtralForCausalLM
from moestream.models.moe_decoder import MoEForCausalLM
from moestream.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[MoEForCausalLM]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
}


def get_model_class(model_type: str) -> type[MoEForCausalLM]:
    """Raises ValueError naming the supported types for an unknown `model_type`."""
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"unsupported model_type '{model_type}'; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_type]
