"""`compile --arch cpu` for the architectures beyond the Llama layer: Gemma 2 (soft-capped
scores, its own attention scale, sliding windows on every other layer), Gemma 3 text (sliding
layers with their own rope base) and a mixture of experts (Qwen3-MoE). Attention stays one op that
passes the layer's `AttentionSpec` to the engine's paged attention, an MoE block one op that runs
the eager model's block, so the bundle must serve the checkpoint's greedy tokens (up to bf16 ties)
through its compiled step, with the experts' weights held once. Prompts and outputs run past the
tiny Gemmas' window (8 tokens). A Llama checkpoint with an int8 KV cache checks the package's
attention reads the quantized cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    OwnTokens,
    assert_greedy_up_to_bf16_ties,
    tiny_gemma_folder,
    tiny_model_folder,
    tiny_moe_folder,
    write_text,
)

from lmfoundry.cli import main
from lmfoundry.model.reference import SparseMoE
from lmfoundry.runtime.cpu import features as cpu_isa
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_isa.native_bf16(), reason="--arch cpu compiles the bf16 step")]

PROMPTS = [[1, 5, 9, 200, 17], [1, 3] * 7, [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


def _source(kind: str, folder: Path) -> Path:
    if kind == "qwen3_moe":
        return tiny_moe_folder(kind, folder)
    if kind == "llama-int8-kv":
        return tiny_model_folder(folder, "llama")
    return tiny_gemma_folder(folder, kind)


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text", "qwen3_moe", "llama-int8-kv"])
def bundle(request, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = root / "w4a16"
    kv = ["--kv-cache", "int8"] if request.param.endswith("int8-kv") else []
    main(["quantize", str(_source(request.param, root / "src")), "-o", str(checkpoint), "--quiet", "--method", "rtn",
          "--scheme", "w4a16", "--group-size", "32", "--num-samples", "2", "--seq-len", "32",
          "--calib", str(write_text(root / "c.txt")), *kv])
    engine = root / "engine"
    main(["compile", str(checkpoint), "--arch", "cpu", "-o", str(engine), "--max-tokens", "64"])
    return checkpoint, engine


def _greedy(model, tokenizer):
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    return engine, engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))


def test_the_compiled_step_equals_the_eager_step_within_bf16(bundle: tuple[Path, Path]) -> None:
    """Hidden states of a 24-token prompt (three Gemma windows) through the package and the eager
    model, each layer's attention spec passed through the op: the same bf16 operations in another
    order, so within a few bf16 roundings per layer."""
    _, engine_dir = bundle
    model, _ = load_model(engine_dir, dtype=torch.bfloat16)
    step = model.compiled_step
    del model.compiled_step
    ids = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24)
    compiled = step(model, ids, positions, OwnTokens()).float()
    eager = model.hidden_states(ids, positions, OwnTokens()).float()
    assert compiled.shape == eager.shape == (24, model.config.hidden_size)
    assert torch.isfinite(compiled).all()
    assert ((compiled - eager).norm() / eager.norm()) < 8 * model.config.num_layers * 2.0**-8


def test_the_bundle_serves_the_checkpoints_tokens_through_its_compiled_step(bundle: tuple[Path, Path]) -> None:
    checkpoint, engine_dir = bundle
    model, tok = load_model(engine_dir, dtype=torch.bfloat16)
    assert model.compiled_step is not None
    engine, outs = _greedy(model, tok)
    assert engine.runner.executor.compiled_steps > 0  # prefill chunks and decodes ran the package
    if "int8-kv" in str(checkpoint.parent.name):  # the package attends over the checkpoint's int8 KV cache
        assert all(f.storage_dtype == torch.int8 for f in engine.runner.executor.formats)
    eager, _ = load_model(checkpoint, dtype=torch.bfloat16)
    _, want = _greedy(eager, tok)
    assert_greedy_up_to_bf16_ties(eager, [o.outputs[0].token_ids for o in outs], want)
    # as serve runs it: the eager linears released (an MoE block's experts stay, the package calls them)
    assert engine.release_eager_weights() > 0
    again = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_a_mixture_of_experts_keeps_its_experts_outside_the_package(bundle: tuple[Path, Path]) -> None:
    """The package's `lmfoundry::moe` calls run the eager model's blocks: the same modules, so
    the experts' weights are held once."""
    _, engine_dir = bundle
    model, _ = load_model(engine_dir, dtype=torch.bfloat16)
    blocks = {i: layer.mlp for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)}
    assert model.compiled_step.moe_blocks.keys() == blocks.keys()
    assert all(model.compiled_step.moe_blocks[i] is block for i, block in blocks.items())
    if model.config.is_moe:
        assert blocks, "an MoE model with no SparseMoE block"
