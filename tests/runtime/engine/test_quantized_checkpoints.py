"""Every quantization scheme, through a real checkpoint: `lmfoundry quantize` on the toy model,
`load_model` (the runtime module swap), then the engine against the reference execution of the
same loaded model (full recompute, quantized linears and KV round trip included)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from helpers import reference_greedy
from toy import save_toy_checkpoint

from lmfoundry.cli import cli
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.kv_cache import FP8

CASES = {
    "w4a16": ["--scheme", "w4a16", "--group-size", "32"],
    "w8a8": ["--scheme", "w8a8"],
    "fp8-dynamic": ["--scheme", "fp8-dynamic", "--method", "fp8"],
    "w8a8+kv-int8": ["--scheme", "w8a8", "--kv-cache", "int8"],
    "w4a16+kv-fp8": ["--scheme", "w4a16", "--group-size", "32", "--kv-cache", "fp8"],
    "w4a16+lm-head-w8a16": ["--scheme", "w4a16", "--group-size", "32", "--lm-head", "w8a16"],
}


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory):
    return save_toy_checkpoint(tmp_path_factory.mktemp("toy") / "float", seed=6)


@pytest.mark.parametrize("case", list(CASES))
def test_engine_equals_reference_on_quantized_checkpoint(case: str, toy_folder, tmp_path) -> None:
    from lmfoundry.runtime.loader import load_model

    out = tmp_path / case
    # rtn unless the case names its method (click keeps an option's last value)
    args = ["quantize", str(toy_folder), "-o", str(out), "--method", "rtn", "--num-samples", "4", "--seq-len", "64",
            "--quiet", "--skip-doctor", *CASES[case]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    model, tok = load_model(str(out))
    if "w4a16" not in case:  # activation-quantized linears stay quantized modules at run time
        assert {type(m).__name__ for m in model.modules()} & {"ActivationQuantizedLinear"}
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    if "kv-int8" in case:
        assert engine.runner.cache.k[0].dtype == torch.int8
    elif "kv-fp8" in case:
        assert engine.runner.cache.k[0].dtype == FP8
    else:
        assert engine.runner.cache.k[0].dtype == model.dtype
    prompts = [tok("Hello, quantized world").input_ids, tok("abc" * 7).input_ids, [5, 6, 7]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for ids, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == reference_greedy(model, ids, 12)
