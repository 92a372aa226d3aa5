"""Multi-LoRA serving in the engine: every request gets its own adapter's tokens in batches that
mix adapters and the base (against the adapter merged into the weights, and against the same
request served alone), the prefix cache keyed by adapter, and loading and unloading rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from helpers import assert_greedy_up_to_bf16_ties, merge_lora, plain_lora, reference_greedy, write_lora_adapter
from toy import toy_model

from lmfoundry.checkpoint.folder import CheckpointReader
from lmfoundry.errors import UserError
from lmfoundry.runtime.checkpoint_model import load_causal_lm
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.lora_adapters import LoRAManager, LoRAStack


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def mixed(ps: list[list[int]], names: list[str | None], max_tokens: int = 10):
    """Every prompt under every adapter name (None: the base), interleaved."""
    pairs = [(p, name) for p in ps for name in names]
    return [p for p, _ in pairs], [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora=name)
                                   for _, name in pairs]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    config = toy_model(seed=1).config
    return {"a": write_lora_adapter(folder / "a", config, rank=8, seed=1),
            "b": write_lora_adapter(folder / "b", config, rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj")),
            "c": write_lora_adapter(folder / "c", config, rank=16, seed=3, targets=("qkv_proj", "gate_up_proj"))}


def engine_with(model, adapters: dict[str, Path], **config) -> LLMEngine:
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("block_size", 4)
    config.setdefault("max_num_batched_tokens", 16)
    config.setdefault("max_loras", len(adapters) or 1)
    return LLMEngine(model, None, EngineConfig(lora_modules=tuple((k, str(v)) for k, v in adapters.items()), **config))


def test_each_request_gets_its_adapter_in_a_mixed_batch(adapters) -> None:
    """float32: the gathered deltas give the greedy tokens of the adapter merged into the weights,
    with prefill chunked across steps and decodes of every adapter in the same steps."""
    base = toy_model(seed=1)
    refs = {None: base, **{name: merge_lora(base, folder) for name, folder in adapters.items()}}
    engine = engine_with(toy_model(seed=1), adapters)
    ps, params = mixed(prompts(3, seed=4), [None, "a", "b", "c"])
    outs = engine.generate(ps, params)
    for p, prm, out in zip(ps, params, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(refs[prm.lora], p, 10), prm.lora
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 4  # the adapters do change the output
    assert engine.block_manager.num_used_blocks == 0


def test_bf16_mixed_batch_equals_each_request_alone(adapters) -> None:
    """bf16 with the CPU serving swap (fused q/k/v and gate/up prepacked, the C LoRA kernels):
    twelve streams of the base and three adapters give each request what it gets alone."""
    def bf16_model():
        return toy_model(seed=1, dtype=torch.bfloat16)

    engine = engine_with(bf16_model(), adapters, max_num_batched_tokens=64)
    stack = engine.loras.stack
    assert any(len(site.names) == 3 for site in stack.sites)  # the fused q/k/v product is a site
    ps, params = mixed(prompts(3, seed=5), [None, "a", "b", "c"])
    together = engine.generate(ps, params)
    judges = {None: bf16_model(), **{name: merge_lora(bf16_model(), f).to(torch.bfloat16) for name, f in adapters.items()}}
    for p, prm, out in zip(ps, params, together, strict=True):
        alone = engine.generate([p], [prm])[0]
        # the base's bf16 products round by row count (one row alone, twelve together): tokens may part
        # only where two logits tie at bf16 resolution; the LoRA kernels themselves are per row
        assert_greedy_up_to_bf16_ties(judges[prm.lora], [out.outputs[0].token_ids], [alone])


def test_a_quantized_base_serves_adapters_like_the_merged_dequantized_base(tmp_path) -> None:
    """W4A16: in float32 the base is dequantized, and its adapter tokens equal those of the
    adapter merged into the dequantized weights; in bf16 the int4 codes stay packed (separate
    q/k/v products) and a mixed batch equals each request alone."""
    ckpt = write_checkpoint(tmp_path / "w4a16", "w4a16", group=32, seed=3)
    fp32 = load_causal_lm(CheckpointReader(ckpt), torch.float32)
    folder = write_lora_adapter(tmp_path / "ad", fp32.config, rank=8, seed=7, strength=1.0)
    merged = merge_lora(fp32, folder)
    engine = engine_with(load_causal_lm(CheckpointReader(ckpt), torch.float32), {"ad": folder})
    ps, params = mixed(prompts(2, seed=6), [None, "ad"], max_tokens=8)
    for p, prm, out in zip(ps, params, engine.generate(ps, params), strict=True):
        assert out.outputs[0].token_ids == reference_greedy(merged if prm.lora else fp32, p, 8)

    bf16 = load_causal_lm(CheckpointReader(ckpt), torch.bfloat16)
    assert type(bf16.model.layers[0].self_attn.q_proj).__name__ == "Int4PackLinear"
    engine = engine_with(bf16, {"ad": folder})
    together = engine.generate(ps, params)
    judges = {None: load_causal_lm(CheckpointReader(ckpt), torch.bfloat16), "ad": merged.to(torch.bfloat16)}
    for p, prm, out in zip(ps, params, together, strict=True):
        assert_greedy_up_to_bf16_ties(judges[prm.lora], [out.outputs[0].token_ids], [engine.generate([p], [prm])[0]])


def test_the_prefix_cache_is_keyed_by_adapter(adapters, tmp_path) -> None:
    engine = engine_with(toy_model(seed=1), adapters, max_loras=3)
    prompt = prompts(1, seed=7, lo=20, hi=21)[0]

    def run(lora):
        return engine.generate([prompt], [SamplingParams(max_tokens=2, temperature=0, lora=lora)])[0]

    assert run(None).num_cached_tokens == 0
    assert run("a").num_cached_tokens == 0  # the base's blocks hold other K/V
    assert run("a").num_cached_tokens == 16  # the same adapter's do
    assert run("b").num_cached_tokens == 0
    engine.unload_lora("a")
    engine.load_lora("a", str(adapters["b"]))  # the name again, other weights: a new key
    assert run("a").num_cached_tokens == 0


def test_loading_and_unloading(adapters) -> None:
    engine = engine_with(toy_model(seed=1), {"a": adapters["a"]}, max_loras=2)
    with pytest.raises(UserError, match="already loaded"):
        engine.load_lora("a", str(adapters["b"]))
    engine.load_lora("b", str(adapters["b"]))
    with pytest.raises(UserError, match="all 2 adapter slots are in use"):
        engine.load_lora("c", str(adapters["c"]))
    rid = engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, lora="b"))
    assert engine.lora_command("x", "unload", "b", None).status == 409  # in use
    assert engine.stats()["lora_waiting:b"] == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["lora_requests:b"] == 1
    result = engine.lora_command("x", "unload", "b", None)
    assert result.status == 200 and result.adapters == ("a",)
    assert engine.lora_command("x", "unload", "b", None).status == 404
    bad = engine.lora_command("x", "load", "d", "/nonexistent/adapter")
    assert bad.status == 400 and "not a folder" in bad.message and bad.adapters == ("a",)
    assert engine.lora_command("x", "load", "c", str(adapters["c"])).status == 200
    with pytest.raises(ValueError, match="no LoRA adapter named 'b'"):
        engine.add_request(rid + "-again", [1, 2], SamplingParams(max_tokens=2, lora="b"))


def test_a_step_with_adapters_bypasses_a_compiled_step(adapters) -> None:
    """The adapters wrap the eager model's linears; an `--arch cpu` bundle's compiled step runs
    only the base, so steps with adapter rows take the eager layers."""
    engine = engine_with(toy_model(seed=1), adapters)
    executor = engine.runner.executor
    calls = []

    def compiled(model, ids, positions, context):
        calls.append(len(ids))
        return model.hidden_states(ids, positions, context)

    executor.compiled_step, executor.compiled_max_tokens = compiled, 1024
    engine.generate([[1, 2, 3]], [SamplingParams(max_tokens=3, temperature=0, lora="a")])
    assert calls == []
    engine.generate([[1, 2, 3]], [SamplingParams(max_tokens=3, temperature=0)])
    assert calls


def test_lora_off_and_other_executors_are_refused(adapters) -> None:
    engine = LLMEngine(toy_model(seed=1), None, EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match="LoRA is off"):
        engine.add_request(None, [1, 2], SamplingParams(max_tokens=2, lora="a"))
    with pytest.raises(UserError, match="LoRA is off"):
        engine.load_lora("a", str(adapters["a"]))

    class Kernels:
        name = "kernels"

    with pytest.raises(UserError, match="runs 'kernels'"):
        LoRAManager.for_executor(Kernels(), toy_model(seed=1).config, 2, 16)
    with pytest.raises(UserError, match="at least 1"):
        LoRAManager.for_executor(engine.runner.executor, toy_model(seed=1).config, 0, 16)


def test_closing_a_stack_restores_the_base_forward(adapters) -> None:
    """The stack wraps each site's forward; with no row map and no default slot it adds nothing,
    and `close` removes the wrappers (the modules' own forwards again)."""
    model = toy_model(seed=1)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = model(ids)
        stack = LoRAStack.on_model(model, model.config, 1, 8)
        from lmfoundry.checkpoint.lora_adapter import read_adapter

        stack.write(0, read_adapter(adapters["a"], model.config, 8))
        assert torch.equal(model(ids), want)  # wrapped, but no row runs an adapter
        stack.default_slot = 0
        assert not torch.equal(model(ids), want)
        stack.close()
        assert all("forward" not in vars(m) for m in model.modules())
        assert torch.equal(model(ids), want)


def test_slots_past_the_free_memory_are_refused_before_they_are_allocated(monkeypatch) -> None:
    """--max-loras 100000000 reached the allocator ("DefaultCPUAllocator: can't allocate memory:
    you tried to allocate 2457600000000 bytes", a traceback). The stack now counts its bytes first
    and refuses in one line naming how many slots fit; that many are allocated, one more is not."""
    import psutil

    from lmfoundry.capacity.arithmetic import lora_bytes

    model = toy_model(seed=1)
    with pytest.raises(UserError, match=r"^--max-loras 100000000: 100000000 adapter slots of rank 16 need .* GiB"):
        LoRAStack.on_model(model, model.config, 100_000_000, 16)
    slot = lora_bytes(model.config, 1, 8, element_bytes=4)  # float32, as the toy model is
    free = type("Memory", (), {"available": 5 * slot + slot // 2})()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    with pytest.raises(UserError, match="GiB free on cpu; at most 5 fit"):
        LoRAStack.on_model(model, model.config, 6, 8)
    assert LoRAStack.on_model(model, model.config, 5, 8).nbytes() == 5 * slot


QUANTIZED = {
    "w8a8": ["--scheme", "w8a8"],
    "fp8-dynamic": ["--scheme", "fp8-dynamic", "--method", "fp8"],
    "w8a16+kv-int8": ["--scheme", "w8a16", "--per-channel", "--kv-cache", "int8"],
    "w4a16+kv-fp8": ["--scheme", "w4a16", "--group-size", "32", "--kv-cache", "fp8"],
}


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_adapters_on_every_quantized_base(case: str, adapters, tmp_path) -> None:
    """W8A8, FP8 (activations quantized: no merge possible), W8A16 and W4A16 with quantized KV
    caches: a batch of base and adapter requests gives the greedy tokens of the same quantized
    model with the adapter added unmerged by plain PyTorch (`helpers.plain_lora`)."""
    from click.testing import CliRunner
    from toy import save_toy_checkpoint

    from lmfoundry.cli import cli
    from lmfoundry.runtime.loader import load_model

    out = tmp_path / case
    result = CliRunner().invoke(cli, ["quantize", str(save_toy_checkpoint(tmp_path / "float", seed=1)), "-o", str(out),
                                      "--method", "rtn", "--num-samples", "4", "--seq-len", "64", "--quiet",
                                      "--skip-doctor", *QUANTIZED[case]])
    assert result.exit_code == 0, result.output + repr(result.exception)
    engine = engine_with(load_model(str(out))[0], {"a": adapters["a"]})
    if "kv" in case:
        assert engine.runner.cache.k[0].element_size() == 1
    reference = plain_lora(load_model(str(out))[0], adapters["a"])
    ps, params = mixed(prompts(2, seed=8), [None, "a"], max_tokens=8)
    for p, prm, got in zip(ps, params, engine.generate(ps, params), strict=True):
        want = reference_greedy(reference if prm.lora else load_model(str(out))[0], p, 8)
        assert got.outputs[0].token_ids == want, (case, prm.lora)
