import math

import torch
import torch.nn.functional as F
from helpers import tiny_model_folder
from transformers import AutoModelForCausalLM

from lmfoundry.evals.perplexity import perplexity
from lmfoundry.runtime.loader import load_model


def test_perplexity_matches_direct_hf_computation(tmp_path):
    folder = tiny_model_folder(tmp_path / "m", "llama")
    model, _ = load_model(folder)
    stream = torch.randint(3, 256, (1000,), generator=torch.Generator().manual_seed(0))
    res = perplexity(model, stream, ctx=64, batch_size=3, progress=False)
    assert res.windows == 15 and res.tokens == 15 * 63 and len(res.window_nll) == 15
    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    total = 0.0
    with torch.no_grad():
        for w in stream[: 15 * 64].view(15, 64):
            logits = hf(w[None]).logits[0, :-1]
            total += F.cross_entropy(logits, w[1:], reduction="sum").item()
    assert math.isclose(res.ppl, math.exp(total / res.tokens), rel_tol=1e-5)
    assert math.isclose(sum(res.window_nll), total, rel_tol=1e-5)
    assert perplexity(model, stream, ctx=64, max_windows=4, progress=False).windows == 4
