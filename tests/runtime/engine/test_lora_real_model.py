"""SmolLM2 with PEFT LoRA adapters (written by peft itself, rank 8 and 16 on q/k/v/o and the MLP):
the engine's greedy tokens equal those of peft's merged float model in transformers, on the float
base and on the W4A16 base (against the adapters merged onto its dequantized weights), and a
batch of twelve streams mixing the base and three adapters gives each request its tokens alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_up_to_bf16_ties, merge_lora, w4a16_checkpoint

from lmfoundry.checkpoint.folder import CheckpointReader
from lmfoundry.checkpoint.sources import resolve_model
from lmfoundry.runtime.checkpoint_model import load_causal_lm
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, a small robot"]
MAX_TOKENS = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rsLoRA, targets, seed)
ADAPTERS = {"r8": (8, 16, False, TARGETS, 1), "r16": (16, 8, True, TARGETS, 2),
            "r4qv": (4, 8, False, ["q_proj", "v_proj", "down_proj"], 3)}


def hf_model(folder: Path, weights: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if weights is not None:  # the dequantized base: transformers' names are ours
        model.load_state_dict(weights, strict=False)
    return model


@pytest.fixture(scope="module")
def smollm() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def adapters(smollm, tmp_path_factory) -> dict[str, Path]:
    """Three adapters as peft saves them; lora_B random (peft's default zero B is no adapter),
    small enough that the model still writes text."""
    from peft import LoraConfig, get_peft_model

    out = {}
    for name, (rank, alpha, rslora, targets, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        model = get_peft_model(hf_model(smollm), LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                                                            target_modules=targets, init_lora_weights=False))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        folder = tmp_path_factory.mktemp("adapters") / name
        model.save_pretrained(str(folder))
        out[name] = folder
    return out


def peft_greedy(base, adapter: Path | None, tokenizer) -> list[list[int]]:
    """peft's merged float model's greedy tokens for PROMPTS (stopping at EOS as the engine does)."""
    from peft import PeftModel

    model = base if adapter is None else PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            got = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
            eos = tokenizer.eos_token_id
            outs.append(got[: got.index(eos) + 1] if eos in got else got)
    return outs


def engine_for(model: str | Path, adapters: dict[str, Path], dtype: torch.dtype = torch.float32) -> LLMEngine:
    config = EngineConfig(kv_cache_memory_gb=0.25, max_model_len=256, max_num_batched_tokens=64,
                          max_loras=len(adapters), max_lora_rank=16,
                          lora_modules=tuple((k, str(v)) for k, v in adapters.items()))
    return LLMEngine.from_pretrained(str(model), dtype=dtype, config=config)


def engine_greedy(engine: LLMEngine, lora: str | None) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, lora=lora))
    return [o.outputs[0].token_ids for o in outs]


def test_adapters_on_the_float_base_match_peft_merged(smollm, adapters) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm))
    engine = engine_for(smollm, {k: adapters[k] for k in ("r8", "r16")})
    base = engine_greedy(engine, None)
    assert base == peft_greedy(hf_model(smollm), None, tokenizer)
    for name in ("r8", "r16"):
        got = engine_greedy(engine, name)
        assert got == peft_greedy(hf_model(smollm), adapters[name], tokenizer), name
        assert got != base, f"{name} changes nothing"


def test_adapters_on_the_w4a16_base_match_peft_merged_on_the_dequantized_base(smollm, adapters) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm))
    ckpt = w4a16_checkpoint()
    dequantized = load_causal_lm(CheckpointReader(ckpt), torch.float32).state_dict()
    engine = engine_for(ckpt, {k: adapters[k] for k in ("r8", "r16")})
    assert engine_greedy(engine, None) == peft_greedy(hf_model(smollm, dequantized), None, tokenizer)
    for name in ("r8", "r16"):
        assert engine_greedy(engine, name) == peft_greedy(hf_model(smollm, dequantized), adapters[name], tokenizer)


def mixed_requests() -> tuple[list[str], list[SamplingParams]]:
    names = [None, *ADAPTERS]
    pairs = [(p, n) for p in PROMPTS for n in names]  # 3 prompts x (base + 3 adapters) = 12 streams
    return [p for p, _ in pairs], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, lora=n) for _, n in pairs]


def test_twelve_streams_of_the_base_and_three_adapters_equal_each_alone(smollm, adapters) -> None:
    engine = engine_for(smollm, adapters)
    prompts, params = mixed_requests()
    together = engine.generate(prompts, params)
    assert max(engine.stats()[f"lora_requests:{n}"] for n in ADAPTERS) == 3
    for prompt, prm, out in zip(prompts, params, together, strict=True):
        alone = engine.generate([prompt], [prm])[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, prm.lora


def test_bf16_w4a16_mixed_streams_equal_each_alone_up_to_ties(adapters) -> None:
    """The served form: bf16, int4 codes packed, the C LoRA kernels. The base's bf16 products
    round by row count, so a token may differ only where two logits tie at bf16 resolution."""
    ckpt = w4a16_checkpoint()
    engine = engine_for(ckpt, adapters, dtype=torch.bfloat16)
    assert engine.loras is not None and engine.loras.stack.kernels is not None
    prompts, params = mixed_requests()
    together = engine.generate(prompts, params)
    dequantized = load_causal_lm(CheckpointReader(ckpt), torch.float32)
    judges = {None: dequantized.to(torch.bfloat16),
              **{n: merge_lora(load_causal_lm(CheckpointReader(ckpt), torch.float32), f).to(torch.bfloat16)
                 for n, f in adapters.items()}}
    for prompt, prm, out in zip(prompts, params, together, strict=True):
        alone = engine.generate([prompt], [prm])[0]
        assert_greedy_up_to_bf16_ties(judges[prm.lora], [out.outputs[0].token_ids], [alone])
