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


def test_perplexity_through_the_serving_engine(tmp_path):
    """`RuntimeLM` on the serving engine scores the windows as `serve` computes them: in float32
    what the reference forward gives; deterministic, the same numbers whatever the batch size."""
    from lmfoundry.evals.lm_adapter import RuntimeLM

    folder = tiny_model_folder(tmp_path / "m", "llama")
    stream = torch.randint(3, 256, (700,), generator=torch.Generator().manual_seed(1))
    model, tok = load_model(folder)
    ref = perplexity(model, stream, ctx=64, batch_size=3, progress=False)
    served = perplexity(RuntimeLM(*load_model(folder), serving=True), stream, ctx=64, batch_size=3, progress=False)
    assert served.windows == ref.windows == 10
    assert math.isclose(served.ppl, ref.ppl, rel_tol=1e-5)
    for dtype in (torch.float32, torch.bfloat16):
        lm = RuntimeLM(*load_model(folder, dtype=dtype), deterministic=True)
        one, three = (perplexity(lm, stream, ctx=64, batch_size=b, progress=False) for b in (1, 3))
        assert one.window_nll == three.window_nll
