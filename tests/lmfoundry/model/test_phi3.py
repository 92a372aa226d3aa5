"""Phi-3: a checkpoint that stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`.

The reader presents the parts as the separate linears every stage works on, the writer joins
them again, so our forward equals transformers' on a tiny random Phi-3 built offline, every
method quantizes it into a checkpoint transformers loads with the fused names, and the engine
serves it token for token like the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_engine_serves_like_reference, tiny_tokenizer

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.errors import UserError
from lmfoundry.recipe import Recipe
from lmfoundry.runtime.loader import load_model

IDS = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    folder = tmp_path_factory.mktemp("phi3") / "src"
    cfg = Phi3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                     tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers' init is tiny (std 0.02): give the layers real signal
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    tiny_tokenizer(256).save_pretrained(str(folder))
    assert "model.layers.0.self_attn.qkv_proj.weight" in json.dumps(
        __import__("safetensors").safe_open(str(folder / "model.safetensors"), "pt").keys())
    return folder


def test_reference_forward_equals_transformers(phi3: Path) -> None:
    """float32 on both sides, same op order up to matmul blocking: 1e-5 of the logits' range."""
    from transformers import AutoModelForCausalLM

    ours, _ = load_model(str(phi3))
    hf = AutoModelForCausalLM.from_pretrained(str(phi3), dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours(IDS).float(), hf(IDS).logits.float()
    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@pytest.mark.parametrize("method,q", [("rtn", {"scheme": "w4a16", "group_size": 32}),
                                      ("gptq", {"scheme": "w4a16", "group_size": 32, "actorder": "static"}),
                                      ("awq", {"scheme": "w4a16", "group_size": 32, "symmetric": False}),
                                      ("smoothquant", {"scheme": "w8a8"}),
                                      ("fp8", {"scheme": "fp8-dynamic"})])
def test_every_method_writes_fused_tensors_transformers_loads(phi3: Path, tmp_path: Path, method: str,
                                                               q: dict) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    rec = Recipe().with_overrides(method=method, **q)
    rec = rec.with_overrides(source="tiny", num_samples=4, seq_len=32)
    out = tmp_path / "q"
    run_job(QuantizeJob(str(phi3), out, rec, progress=False))
    names = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    assert any(".self_attn.qkv_proj." in n for n in names) and any(".mlp.gate_up_proj." in n for n in names)
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    ours, _ = load_model(str(out))
    with torch.no_grad():
        a = ours(IDS).float()
    if not (method == "awq"):  # transformers 5 re-initializes asymmetric packed zero points (llm-compressor#1618)
        hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            b = hf(IDS).logits.float()
        # W8A8/FP8: transformers runs the dequantized weights with float activations, we quantize
        # activations per token as the kernels do: agreement to that rounding (int8 1/127, fp8 2^-4)
        tol = {"smoothquant": 0.05, "fp8": 0.1}.get(method, 1e-4)
        assert float((a - b).abs().max()) <= tol * float(b.abs().max()), float((a - b).abs().max())


def test_engine_serves_quantized_phi3(phi3: Path, tmp_path: Path) -> None:
    rec = Recipe().with_overrides(method="rtn", scheme="w4a16", group_size=32)
    run_job(QuantizeJob(str(phi3), tmp_path / "q", rec, progress=False))
    model, _ = load_model(str(tmp_path / "q"))
    assert_engine_serves_like_reference(model, [IDS[0, :7].tolist(), IDS[1, :13].tolist()])


def test_refuses_what_a_fused_checkpoint_cannot_hold(phi3: Path, tmp_path: Path) -> None:
    rec = Recipe().with_overrides(method="gptq", scheme="w4a16", group_size=32, actorder="dynamic")
    with pytest.raises(UserError, match="fused"):
        run_job(QuantizeJob(str(phi3), tmp_path / "q", rec, progress=False))
    assert not (tmp_path / "q").exists()
    cfg = json.loads((phi3 / "config.json").read_text())
    from lmfoundry.model.config import ModelConfig

    with pytest.raises(UserError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**cfg, "partial_rotary_factor": 0.75})
