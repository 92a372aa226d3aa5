"""Tensor-parallel engines on CPU ranks: the same greedy tokens as one process for float and
quantized checkpoints, each rank holding about 1/N of the weights and exactly what `plan --tp`
says, perplexity through the ranks, and a clear refusal of a degree the heads cannot split."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_one_error, run_cli, tiny_model_folder
from toy import save_toy_checkpoint

from lmfoundry.capacity.arithmetic import default_quant_specs, kv_bytes_per_token, weight_bytes
from lmfoundry.cli import cli
from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.preflight import tp_partitions
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.engine.ranks import ShardSpec, load_sharded
from lmfoundry.runtime.loader import load_model

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 9, 33, 70, 12], [7, 7, 8, 100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# 6 heads over 3 KV heads, MLP 192, and a vocabulary of 250 that 3 ranks share unevenly
SIX_HEADS = dict(hidden_size=96, head_dim=16, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192,
                 vocab_size=250)


def _tokens(folder, tp: int, dtype: torch.dtype = torch.float32, backend: str = "shm") -> list[list[int]]:
    engine = LLMEngine.from_pretrained(str(folder), dtype=dtype, config=EngineConfig(
        num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, tensor_parallel_size=tp, tp_backend=backend))
    try:
        return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.close()


@pytest.mark.parametrize("case,tp,backend", [
    ("llama", 2, "shm"), ("llama", 2, "gloo"),
    ("llama", 4, "shm"),  # 4 ranks on 2 KV heads: each KV head on two ranks
    ("six-heads", 3, "shm"),  # uneven vocabulary split
    ("qwen2", 2, "shm"),  # q/k/v biases (column-parallel) and tied embeddings
])
def test_greedy_tokens_equal_one_process(case: str, tp: int, backend: str, tmp_path) -> None:
    folder = tiny_model_folder(tmp_path / case, "llama" if case == "six-heads" else case, seed=3,
                               **(SIX_HEADS if case == "six-heads" else {}))
    assert _tokens(folder, tp, backend=backend) == _tokens(folder, 1)


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory):
    return save_toy_checkpoint(tmp_path_factory.mktemp("toy") / "float", seed=6)


def _quantize(toy_folder, out, *scheme: str):
    args = ["quantize", str(toy_folder), "-o", str(out), "--method", "rtn", "--num-samples", "4", "--seq-len", "64",
            "--quiet", "--skip-doctor", *scheme]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out


def test_w4a16_splits_over_ranks_in_packed_int4(toy_folder, tmp_path) -> None:
    """In bfloat16 each rank packs its share of the codes for the int4 kernel: whole groups of
    the row-parallel inputs, its rows of the column-parallel outputs."""
    out = _quantize(toy_folder, tmp_path / "q", "--scheme", "w4a16", "--group-size", "16")
    assert _tokens(out, 2, torch.bfloat16) == _tokens(out, 1, torch.bfloat16)


@pytest.mark.parametrize("kv", [[], ["--kv-cache", "int8"]])
def test_w8a8_splits_within_its_activation_quantization_error(kv: list[str], toy_folder, tmp_path) -> None:
    """Each rank quantizes its share of o_proj's and down_proj's input with its own per-token
    scale (as vLLM does): a scale over fewer columns is at most the whole row's, so the split can
    only make activation codes finer. The split's change of the logits is therefore bounded by
    the activation quantization's own error (the same codes' weights on float activations): here
    within twice it, on the same tokens (teacher-forced, no divergence cascade). The int8 KV cache
    takes each rank's KV heads' scales."""
    from lmfoundry.model.linears import dense_linear
    from lmfoundry.model.quantized_linear import ActivationQuantizedLinear

    out = _quantize(toy_folder, tmp_path / "q", "--scheme", "w8a8", *kv)
    ids = torch.tensor([PROMPTS[1] * 3])
    whole, _ = load_model(str(out), dtype=torch.float32)
    with torch.inference_mode():
        one = whole(ids)
        for name, m in list(whole.named_modules()):
            if isinstance(m, ActivationQuantizedLinear):
                whole.set_submodule(name, dense_linear(m.dequantized_weight(), m.bias))
        float_activations = whole(ids)
    model, _ = load_sharded(ShardSpec(str(out), torch.float32, 2))
    try:
        two = model(ids)
    finally:
        model.close()
    own_error = torch.linalg.norm(one - float_activations)
    assert own_error > 0
    assert torch.linalg.norm(two - one) <= 2 * own_error, (float(torch.linalg.norm(two - one)), float(own_error))
    assert (two.argmax(-1) == one.argmax(-1)).float().mean() >= 0.9


def test_each_rank_holds_what_plan_says(tmp_path) -> None:
    """Rank 0's weights (bfloat16) and KV bytes per token are `plan --tp`'s numbers for one GPU,
    its linears the per-rank shapes `doctor --tp` checks; every rank holds about 1/N of the whole
    model."""
    folder = tiny_model_folder(tmp_path / "m", seed=1, **SIX_HEADS)
    cfg = ModelConfig.from_file(folder)
    whole, _ = load_model(str(folder), dtype=torch.bfloat16)
    from lmfoundry.model.tensor_parallel import resident_bytes

    total = resident_bytes(whole)
    model, _ = load_sharded(ShardSpec(str(folder), torch.bfloat16, 3))
    try:
        rotary = model.local.model.rotary_emb.inv_freq
        rotary_bytes = rotary.numel() * rotary.element_size()
        planned = weight_bytes(cfg, default_quant_specs()["bf16"], tp=3)["total"]
        assert model.group.resident[0] - rotary_bytes == planned
        replicated = (2 * cfg.hidden_size * cfg.num_layers + cfg.hidden_size) * 2 + rotary_bytes  # norms
        for held in model.group.resident:
            assert held <= (total - replicated) / 3 * 1.02 + replicated, (held, total)
        # doctor --tp's per-rank (out, in) of each fused layer: what rank 0 really holds
        local = dict(model.local.named_modules())
        for fused, member, n, k, _ in tp_partitions(cfg, 3):
            prefix = "model.layers.0." + member.rsplit(".", 1)[0] + "."
            members = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(
                fused, (member.rsplit(".", 1)[1],))
            shapes = [tuple(local[prefix + m].weight.shape) for m in members]
            assert (sum(o for o, _ in shapes), shapes[0][1]) == (n, k), (fused, shapes)
        engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=8, tensor_parallel_size=3))
        assert engine.runner.executor.kv_bytes_per_token() == kv_bytes_per_token(cfg, "bf16", tp=3)
    finally:
        model.close()


def test_perplexity_through_the_ranks(tmp_path) -> None:
    """`eval ppl --tp 2` scores the same windows as one process, to float32 rounding."""
    folder = tiny_model_folder(tmp_path / "m", seed=2)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37} next{i % 11}" for i in range(3000)))
    runner = CliRunner()
    ppl = []
    for tp in (1, 2):
        res = runner.invoke(cli, ["eval", "ppl", str(folder), "--text", str(text), "--ctx", "64", "--max-windows",
                                  "6", "--dtype", "float32", "--tp", str(tp), "--json"])
        assert res.exit_code == 0, res.output + repr(res.exception)
        import json

        ppl.append(json.loads(res.output.strip().splitlines()[-1])["ppl"])
    assert abs(ppl[1] / ppl[0] - 1) < 1e-5, ppl


def test_a_degree_the_heads_cannot_split_is_refused(tmp_path, capsys) -> None:
    folder = tiny_model_folder(tmp_path / "m", seed=1)  # 4 heads
    with pytest.raises(UserError, match="--tp 3 does not divide the 4 attention heads; valid: 1, 2, 4"):
        load_sharded(ShardSpec(str(folder), torch.float32, 3))
    code, _, err = run_cli(["eval", "ppl", str(folder), "--tp", "3", "--dtype", "float32"], capsys)
    assert_one_error(code, err, "--tp 3 does not divide the 4 attention heads")
    code, _, err = run_cli(["eval", "ppl", str(folder), "--tp", "0"], capsys)
    assert_one_error(code, err, "--tp must be at least 1")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["float", "w4a16"])
def test_smollm2_at_tp3_decodes_like_one_process(which: str) -> None:
    """The shipped model split over 3 ranks (9 heads and 3 KV heads: one KV head a rank; W4A16
    groups of 64: o_proj's 192 columns a rank are 3 whole groups), in float32: the same greedy
    tokens as one process."""
    from helpers import w4a16_checkpoint

    from lmfoundry.checkpoint.sources import resolve_model
    from lmfoundry.checkpoint.tokenizer import load_tokenizer

    target = "smollm2-135m" if which == "float" else str(w4a16_checkpoint())
    tok = load_tokenizer(resolve_model(target))
    prompts = [tok("The capital of France is").input_ids, tok("Write a haiku about the sea:").input_ids]

    def run(tp: int) -> list[list[int]]:
        engine = LLMEngine.from_pretrained(target, dtype=torch.float32, config=EngineConfig(
            kv_cache_memory_gb=0.1, tensor_parallel_size=tp, num_threads=max(tp, 2)))
        try:
            return [o.outputs[0].token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=16,
                                                                                            temperature=0))]
        finally:
            engine.close()

    assert run(3) == run(1)
