"""Sliding-window attention outside Gemma: Mistral (every layer; 4096 when config.json omits it),
Mixtral and Phi-3 (every layer), Qwen2/Qwen3 (with use_sliding_window, the layers from
max_window_layers on) and Qwen3-MoE (every layer), read as transformers reads them.

Tiny random models are built with transformers' own classes; sequences run 3x past the window (8),
so a dropped window moves the logits by far more than the 1e-5 equality bound. The compiled-kernel
path attends causally over everything, which is exact only up to the window: a bundle of such a
model serves at most that many tokens and says so, rather than silently attending past it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import hf_eager, save_transformers_model

from lmfoundry.errors import UserError
from lmfoundry.model.architectures import FULL, SLIDING
from lmfoundry.model.config import ModelConfig
from lmfoundry.runtime.loader import load_model

WINDOW = 8
IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))
COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=3)


def _config(model_type: str, **kw) -> ModelConfig:
    base = {"model_type": model_type, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 32768}
    return ModelConfig.from_dict({**base, **kw})


def test_config_reads_windows_as_transformers_does() -> None:
    mistral = _config("mistral")  # MistralConfig's default window when config.json has none
    assert mistral.sliding_window == 4096 and mistral.layer_types == (SLIDING,) * 4
    assert mistral.kernel_context_limit == 4096 and mistral.needs_attention_spec
    assert _config("mistral", sliding_window=None).sliding_window is None  # Mistral v0.2+: explicit null
    # a window that reaches every position the model has changes nothing: plain causal attention
    plain = _config("mistral", sliding_window=32768)
    assert plain.layer_types == () and not plain.needs_attention_spec and plain.kernel_context_limit == 32768
    assert _config("phi3", sliding_window=2047).layer_window(3) == 2047
    assert _config("mixtral", num_local_experts=4, num_experts_per_tok=2).sliding_window is None
    assert _config("qwen2", sliding_window=4096).sliding_window is None  # use_sliding_window defaults off
    qwen = _config("qwen2", use_sliding_window=True, sliding_window=1024, max_window_layers=2)
    assert qwen.layer_types == (FULL, FULL, SLIDING, SLIDING) and qwen.kernel_context_limit == 1024
    given = _config("qwen3", use_sliding_window=True, sliding_window=512, layer_types=[SLIDING, FULL, SLIDING, FULL])
    assert [given.layer_window(i) for i in range(4)] == [512, None, 512, None]
    assert _config("qwen2", use_sliding_window=True, max_window_layers=4).layer_types == ()  # no layer slides
    assert _config("llama", sliding_window=16).sliding_window is None  # Llama has no window
    with pytest.raises(UserError, match="sliding_window must be positive"):
        _config("mistral", sliding_window=0)
    with pytest.raises(UserError, match="layer_types"):
        _config("qwen2", use_sliding_window=True, layer_types=[SLIDING])


def _build(folder: Path, model_type: str) -> Path:
    """A random transformers model with a window of 8, saved with save_pretrained (+ a tokenizer)."""
    if model_type == "mistral":
        from transformers import MistralConfig as Config
        from transformers import MistralForCausalLM as Model

        cfg = Config(**COMMON, sliding_window=WINDOW)
    else:  # Qwen2: full attention on layer 0, windows on layers 1 and 2
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model

        cfg = Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    return save_transformers_model(Model, cfg, folder, embed_std=0.5)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request, tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp(request.param) / "src", request.param)


def test_reference_forward_equals_transformers_past_the_window(windowed: Path) -> None:
    ours, _ = load_model(str(windowed))
    expected = {"mistral": [WINDOW] * 3, "qwen2": [None, WINDOW, WINDOW]}[ours.config.model_type]
    assert [ours.config.layer_window(i) for i in range(3)] == expected
    hf = hf_eager(windowed)
    with torch.no_grad():
        a, b = ours(IDS).float(), hf(IDS).logits.float()
    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), float((a - b).abs().max())
    for layer in ours.model.layers:  # the window matters on this data
        layer.self_attn.spec = dataclasses.replace(layer.self_attn.spec, window=None)
    with torch.no_grad():
        c = ours(IDS).float()
    assert float((c - b).abs().max()) > 1e-2 * float(b.abs().max())


def test_engine_generates_past_the_window_like_transformers(windowed: Path) -> None:
    """Paged KV cache in blocks of 4, chunked prefill of 8 tokens: greedy tokens and their
    log-probabilities equal transformers' over a sequence three windows long."""
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

    hf = hf_eager(windowed)
    model, _ = load_model(str(windowed))
    prompts = [IDS[0, :11].tolist(), IDS[1, :5].tolist()]
    new = 14
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    assert engine.max_model_len == 256  # the reference path honours the window: the full context is served
    outs = engine.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=0))
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ids = torch.tensor([p])  # an explicit mask: a prompt token equal to pad_token_id is not padding
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                               min_new_tokens=new, pad_token_id=3)[0, len(p):].tolist()
            full = torch.log_softmax(hf(torch.tensor([p + want])).logits[0].float(), dim=-1)
        assert o.outputs[0].token_ids == want
        got = [lp.logprob for lp in o.outputs[0].logprobs]
        assert max(abs(g - float(full[len(p) + j - 1, t]))
                   for j, (g, t) in enumerate(zip(got, want, strict=True))) <= 1e-4


def test_gguf_export_refuses_a_window(windowed: Path, tmp_path: Path) -> None:
    from lmfoundry.calibration.job import QuantizeJob, run_job
    from lmfoundry.export.gguf import export_gguf
    from lmfoundry.recipe import Recipe

    rec = Recipe().with_overrides(method="rtn", scheme="w4a16", group_size=32)
    run_job(QuantizeJob(str(windowed), tmp_path / "q", rec, progress=False))
    with pytest.raises(UserError, match="sliding window of 8 tokens"):
        export_gguf(tmp_path / "q", tmp_path / "out.gguf")
