"""LoRA adapters on an engine bundle compiled with `--max-loras`: its KernelModel adds each row's
delta with the bundle's shrink/expand kernels after every GEMM, and agrees with the reference
executor serving the same adapters within the bound of `test_kernel_executor.py` (two more
roundings per layer and product: the LoRA output is added once)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import write_checkpoint
from helpers import write_lora_adapter

from lmfoundry.checkpoint.folder import CheckpointReader
from lmfoundry.compile.bundle import build_engine
from lmfoundry.errors import UserError
from lmfoundry.kernels.dispatch import is_interpreter
from lmfoundry.runtime.checkpoint_model import load_causal_lm
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_bundle

from .test_kernel_executor import U_BF16

pytestmark = pytest.mark.slow  # two bundles compiled (about a minute each on two cores)
PROMPTS = [[1, 5, 9, 33, 70, 8], [1, 40, 41, 42], [1, *range(100, 130)]]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bundle")
    ckpt = write_checkpoint(root / "w4a16", "w4a16", group=32, seed=3)
    engine = root / "engine"
    build_engine(ckpt, ["hopper"], engine, progress=False, lora=(2, 8))
    config = load_causal_lm(CheckpointReader(ckpt), torch.float32).config
    adapters = {"a": write_lora_adapter(root / "a", config, rank=8, seed=1, strength=1.0),
                "b": write_lora_adapter(root / "b", config, rank=4, seed=2, targets=("v_proj", "down_proj"),
                                        strength=1.0)}
    return ckpt, engine, adapters


def config(adapters) -> EngineConfig:
    return EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, max_loras=2, max_lora_rank=8,
                        lora_modules=tuple((k, str(v)) for k, v in adapters.items()))


def teacher_forced(engine: LLMEngine, ids: list[int], lora: str | None) -> list:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2, lora=lora)
    return engine.generate([ids], params)[0].prompt_logprobs[1:]


def test_the_bundle_records_its_lora_kernels(bundle) -> None:
    _, engine, _ = bundle
    manifest = json.loads((engine / "engine.json").read_text())
    assert manifest["lora"] == {"max_loras": 2, "max_rank": 8}
    used = {u for k in manifest["kernels"] if k["kernel"].startswith("lora") for c in k["covers"] for u in c["used_by"]}
    assert used == {"self_attn.qkv_proj.lora", "self_attn.o_proj.lora", "mlp.gate_up_proj.lora", "mlp.down_proj.lora"}


def test_kernel_executor_serves_adapters_like_the_reference_executor(bundle) -> None:
    ckpt, engine, adapters = bundle
    ref_model = load_causal_lm(CheckpointReader(ckpt), torch.bfloat16)
    kmodel, _ = load_bundle(engine, "cpu", interpret=False)
    reference = LLMEngine(ref_model, None, config(adapters))
    kernels = LLMEngine(kmodel, None, config(adapters))
    assert kmodel.lora is not None and kmodel.lora.ops is not None
    k = 8 * ref_model.config.num_layers + 2
    w = ref_model.lm_head.weight.float()
    for lora in (None, "a", "b"):
        for prompt in PROMPTS:
            greedy = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0, lora=lora))
            ids = prompt + greedy[0].outputs[0].token_ids
            ref_lp, ker_lp = teacher_forced(reference, ids, lora), teacher_forced(kernels, ids, lora)
            # the bound of test_kernel_executor: 2 K u max_v sum_j |h_j| |W_vj|, h the adapted model's final
            # hidden state (the reference executor's forward with every row in the adapter's slot)
            executor = reference.runner.executor
            slot = -1 if lora is None else reference.loras.adapters[lora].slot
            with torch.inference_mode(), executor.lora.active(torch.full((len(ids),), slot, dtype=torch.int32)):
                h = executor.model.hidden_states(torch.tensor([ids]))[0].float()
            bounds = 2 * k * U_BF16 * (h.abs() @ w.abs().t()).amax(dim=-1)
            for pos, (r, q) in enumerate(zip(ref_lp, ker_lp, strict=True)):
                bound = float(bounds[pos])
                assert abs(r.logprob - q.logprob) <= bound, (lora, pos, r.logprob, q.logprob, bound)
                if r.top[0][1] - r.top[1][1] > bound:
                    assert q.top[0][0] == r.top[0][0], (lora, pos, r.top, q.top)
    assert kmodel.kernels.stats["reference"] > 0


def test_a_mixed_batch_through_the_kernels_equals_each_alone(bundle) -> None:
    _, engine, adapters = bundle
    kmodel, _ = load_bundle(engine, "cpu", interpret=is_interpreter())
    kernels = LLMEngine(kmodel, None, config(adapters))
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, lora=lora) for lora in (None, "a", "b")]
    prompts = [p for p in PROMPTS for _ in params]
    together = kernels.generate(prompts, params * len(PROMPTS))
    for prompt, prm, out in zip(prompts, params * len(PROMPTS), together, strict=True):
        assert out.outputs[0].token_ids == kernels.generate([prompt], [prm])[0].outputs[0].token_ids, prm.lora


def test_bundles_without_enough_lora_kernels_are_refused(bundle, tmp_path) -> None:
    ckpt, engine, adapters = bundle
    kmodel, _ = load_bundle(engine, "cpu", interpret=False)
    with pytest.raises(UserError, match="serve --max-loras 2 and --max-lora-rank 8"):
        LLMEngine(kmodel, None, EngineConfig(num_kv_blocks=64, max_loras=3, max_lora_rank=8))
    plain = tmp_path / "plain"
    build_engine(ckpt, ["hopper"], plain, progress=False)
    kmodel, _ = load_bundle(plain, "cpu", interpret=False)
    with pytest.raises(UserError, match="no LoRA kernels"):
        LLMEngine(kmodel, None, config(adapters))
