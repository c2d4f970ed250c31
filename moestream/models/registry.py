"""model_type -> model class (one file per model in this package)."""

from moestream.models.deepseek_v2 import DeepseekV2ForCausalLM
from moestream.models.deepseek_v3 import DeepseekV3ForCausalLM
from moestream.models.glm4_moe import Glm4MoeForCausalLM
from moestream.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from moestream.models.gpt_oss import GptOssForCausalLM
from moestream.models.kimi_linear import KimiLinearForCausalLM
from moestream.models.loop_moe import LoopMoEForCausalLM
from moestream.models.mixtral import MixtralForCausalLM
from moestream.models.moe_decoder import MoEForCausalLM
from moestream.models.nemotron_h import NemotronHForCausalLM
from moestream.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from moestream.models.qwen3_moe import Qwen3MoeForCausalLM
from moestream.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type[MoEForCausalLM]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "granitemoehybrid": GraniteMoeHybridForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "kimi_linear": KimiLinearForCausalLM,
    "loop-moe": LoopMoEForCausalLM,
}


def get_model_class(model_type: str) -> type[MoEForCausalLM]:
    """Raises ValueError naming the supported types for an unknown `model_type`."""
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"unsupported model_type '{model_type}'; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_type]
