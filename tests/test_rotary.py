"""RoPE inverse frequencies against transformers' ROPE_INIT_FUNCTIONS, and rotation parity."""

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moestream.models.hf_config import model_config_from_dict
from moestream.layers.rotary import rope_inv_freq

CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("kind", list(CASES))
def test_inv_freq_matches_hf(kind: str) -> None:
    params = {**CASES[kind], "rope_theta": 10000.0}
    hf = AutoConfig.for_model("qwen3_moe", hidden_size=128, num_attention_heads=4, head_dim=32,
                              max_position_embeddings=4096, rope_parameters=params)
    ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    ours = model_config_from_dict(hf.to_dict())
    assert ours.rope.rope_type == kind
    inv, scale = rope_inv_freq(ours.rope, 32, 4096)
    torch.testing.assert_close(inv, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)
