"""Our reference execution equals Hugging Face transformers on every supported architecture."""

import pytest
import torch
from helpers import tiny_model_folder
from transformers import AutoModelForCausalLM

from lmfoundry.runtime.loader import load_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(tmp_path, arch):
    folder = tiny_model_folder(tmp_path / arch, arch)
    ours, tok = load_model(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    assert torch.isfinite(out).all()
    # same fp32 arithmetic in the same order: only summation-order rounding may differ
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_unsupported_architecture(tmp_path):
    from lmfoundry.errors import UserError

    folder = tiny_model_folder(tmp_path / "m", "llama")
    cfg = (folder / "config.json").read_text().replace('"llama"', '"gpt2"')
    (folder / "config.json").write_text(cfg)
    with pytest.raises(UserError, match="unsupported architecture .*supported: llama"):
        load_model(folder)
