"""Speculative decoding through an engine bundle's kernels (the kernel executor, each kernel's
PyTorch reference on CPU): a draft chunk runs as a paged prefill chunk with cached context, and
greedy output equals plain decoding through the same kernels. Slow tier: building the bundle
(quantize + compile) takes most of a minute on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_model_folder, write_text

from lmfoundry.cli import main
from lmfoundry.compile.bundle import build_engine
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_bundle

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 33, 70, 8] * 3, [1, 40, 41, 42, 43] * 4, [1, *range(100, 120), *range(100, 110)]]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("spec-kernels")
    model = tiny_model_folder(root / "tiny", "llama", head_dim=64, torch_dtype="bfloat16")
    ckpt = root / "w4a16"
    main(["quantize", str(model), "-o", str(ckpt), "--quiet", "--num-samples", "2", "--seq-len", "32",
          "--calib", str(write_text(root / "calib.txt")), "--scheme", "w4a16", "--group-size", "32"])
    out = root / "engine"
    build_engine(ckpt, ["hopper"], out, progress=False)
    return out


def test_speculation_through_the_kernel_executor(bundle: Path) -> None:
    model, tok = load_bundle(bundle, "cpu", interpret=False)
    draft, _ = load_bundle(bundle, "cpu", interpret=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs, engines = [], []
    for spec in ({}, {"speculative": "ngram", "num_speculative_tokens": 3},
                 {"speculative": "draft", "num_speculative_tokens": 3}):
        engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, **spec),
                           draft_model=draft if spec.get("speculative") == "draft" else None)
        outs.append([o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)])
        engines.append(engine)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert engines[1].speculator.num_draft_tokens > 0
    s = engines[2].speculator
    assert s.num_accepted_tokens == s.num_draft_tokens > 0  # the draft is the target's own bundle
    assert model.kernels.mode == "reference" and model.kernels.stats["reference"] > 0
