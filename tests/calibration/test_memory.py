"""The doctor's calibration memory terms by hand (calibration/memory.py), dense and MoE."""

from __future__ import annotations

from lmfoundry.calibration.memory import FLOAT, activation_bytes, gptq_statistics_bytes
from lmfoundry.model.config import ModelConfig

LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
# Qwen3-30B-A3B: every layer sparse, 128 experts of width 768 (its dense intermediate_size, 6144, unused)
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}


def test_gptq_statistics_peak_is_the_widest_group():
    """(8a + 4)·k²: down_proj's 14336² (a = 1) beats q/k/v's 4096² with two accumulators on the 8B;
    an MoE layer holds one expert's statistics at a time (768 wide), so on Qwen3-30B-A3B o_proj's
    input of 32 heads x 128 is the peak, not a 6144-wide dense MLP the model does not have."""
    assert gptq_statistics_bytes(ModelConfig.from_dict(LLAMA3_8B)) == 12 * 14336**2
    assert gptq_statistics_bytes(ModelConfig.from_dict(QWEN3_MOE)) == 12 * (32 * 128) ** 2 < 12 * 6144**2


def test_moe_activations_use_one_experts_width():
    cfg = ModelConfig.from_dict(QWEN3_MOE)
    parts = activation_bytes(cfg, num_samples=4, seq_len=128, batch_size=1, method="gptq")
    assert parts["mlp_inputs"] == 4 * 128 * 768 * FLOAT
    per_token = 3 * 768 + 4 * 32 * 128
    assert parts["batch_intermediates"] == 128 * per_token * FLOAT + 32 * 128 * 128 * FLOAT
