"""`compile --tp N`: one bundle per rank, each with its share of the weights and the kernels for
its own shapes; the runtime serves it at that degree only, rank by rank from the shares, with the
same greedy tokens as the checkpoint it was compiled from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_greedy_up_to_bf16_ties, assert_one_error, kernel_model_rank, run_cli, tiny_model_folder

from lmfoundry.cli import cli
from lmfoundry.compile.bundle import build_engine
from lmfoundry.engine_bundle.engine_manifest import EngineIntegrityError
from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.tensor_parallel import SHARE_KEY, RankShard, share_of
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_model

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 9, 33, 70, 12], [7, 7, 8, 100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [42]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _outputs(model: Path, tp: int) -> list[Any]:
    engine = LLMEngine.from_pretrained(str(model), dtype=torch.bfloat16, config=EngineConfig(
        num_kv_blocks=64, block_size=16, max_num_batched_tokens=32, tensor_parallel_size=tp))
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.close()


def _tokens(model: Path, tp: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in _outputs(model, tp)]


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp-compile")
    # two heads over one KV head (replicated on both ranks), head_dim 64 (what the kernels take)
    folder = tiny_model_folder(root / "float", "llama", seed=6, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=64)
    out = root / "w4a16"
    result = CliRunner().invoke(cli, ["quantize", str(folder), "-o", str(out), "--method", "rtn", "--scheme", "w4a16",
                                      "--group-size", "32", "--num-samples", "4", "--seq-len", "64", "--quiet",
                                      "--skip-doctor"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out


@pytest.fixture(scope="module")
def w4a16_tp2(w4a16, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp-engine") / "engine"
    result = CliRunner().invoke(cli, ["compile", str(w4a16), "--arch", "hopper", "--tp", "2", "-o", str(out),
                                      "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "2 ranks" in result.output
    return out


def test_each_rank_is_compiled_for_its_own_shapes(w4a16, w4a16_tp2) -> None:
    whole = ModelConfig.from_file(w4a16)
    top = json.loads((w4a16_tp2 / "engine.json").read_text())
    assert top["tensor_parallel"]["size"] == 2
    assert [r["path"] for r in top["tensor_parallel"]["ranks"]] == ["rank0", "rank1"]
    d, h, i = whole.head_dim, whole.hidden_size, whole.intermediate_size
    for rank in range(2):
        manifest = json.loads((w4a16_tp2 / f"rank{rank}" / "engine.json").read_text())
        assert manifest["source"]["tensor_parallel"] == {"rank": rank, "size": 2}
        assert manifest["model"]["num_heads"] == whole.num_heads // 2
        linears = manifest["linears"]
        fused_qkv = "self_attn.qkv_proj" in linears
        if fused_qkv:
            kv = max(whole.num_kv_heads // 2, 1)
            assert linears["self_attn.qkv_proj"]["n"] == (whole.num_heads // 2 + 2 * kv) * d
        assert linears["self_attn.o_proj"]["k"] == whole.num_heads // 2 * d
        assert linears["mlp.down_proj"]["k"] == i // 2
        assert linears["mlp.down_proj"]["n"] == h
        kernels = [k for k in manifest["kernels"] if k["kernel"] == "w4a16_tiled"]
        shapes = {c["shape"]["K"] for k in kernels for c in k["covers"]}  # inputs: hidden, o_proj, down_proj
        assert shapes == {h, whole.num_heads // 2 * d, i // 2}
        share = share_of(json.loads((w4a16_tp2 / f"rank{rank}" / "weights" / "config.json").read_text()), "test")
        assert share is not None and (share.rank, share.tp) == (rank, 2) and share.config == whole


def test_share_config_that_lies_about_its_slice_is_refused(w4a16) -> None:
    raw = json.loads((w4a16 / "config.json").read_text())
    from lmfoundry.model.tensor_parallel import rank_config

    cfg = rank_config(raw, RankShard(ModelConfig.from_dict(raw), 1, 2))
    assert share_of(cfg, "x") is not None
    cfg["intermediate_size"] *= 2
    with pytest.raises(UserError, match="intermediate_size"):
        share_of(cfg, "x")
    cfg[SHARE_KEY] = {"rank": 1}
    with pytest.raises(UserError, match="malformed"):
        share_of(cfg, "x")


def test_tp_bundle_decodes_like_its_checkpoint(w4a16, w4a16_tp2) -> None:
    """Each rank runs its share from the bundle (un-tiled, packed int4 on CPU) and the ranks join
    as they do from the checkpoint: the same greedy tokens as one process on the checkpoint."""
    assert _tokens(w4a16_tp2, 2) == _tokens(w4a16, 1)


def test_float_model_with_row_parallel_biases(tmp_path) -> None:
    """o_proj's bias lives on rank 0; rank 1's share holds zeros in its place (its config still
    declares the bias): the sum is unchanged. Three ranks share a vocabulary unevenly. The ranks
    sum o_proj and down_proj in partials, so a greedy choice between two logits within bf16
    resolution of each other (this random model has them) may go either way."""
    folder = tiny_model_folder(tmp_path / "llama", "llama", seed=4, attention_bias=True, hidden_size=96, head_dim=64,
                               num_attention_heads=3, num_key_value_heads=1, intermediate_size=192, vocab_size=250)
    engine = build_engine(folder, ["ampere"], tmp_path / "engine", weights="copy", tp=3, progress=False).output
    reference, _ = load_model(folder, torch.bfloat16)
    assert_greedy_up_to_bf16_ties(reference, _tokens(engine, 3), _outputs(folder, 1))


def test_degree_is_checked_before_anything_loads(w4a16, w4a16_tp2, tmp_path, capsys) -> None:
    ppl = ["eval", "ppl", "--device", "cpu", "--max-windows", "1", "--ctx", "16"]

    def refused(args: list[str], *needles: str) -> None:
        code, _out, err = run_cli(args, capsys)
        assert_one_error(code, err, *needles)

    refused([*ppl, str(w4a16_tp2)], "compiled for --tp 2; run it with --tp 2")
    refused([*ppl, "--tp", "3", str(w4a16_tp2)], "compiled for --tp 2")
    refused(["serve", str(w4a16_tp2), "--device", "cpu", "--port", "0"], "compiled for --tp 2; run it with --tp 2")
    refused(["eval-gate", str(w4a16_tp2), "--baseline", str(w4a16), "-o", str(tmp_path / "g")],
            "compiled for --tp 2")
    refused(["compile", str(w4a16), "--arch", "cpu", "--tp", "2", "-o", str(tmp_path / "c")],
            "--arch cpu compiles one process's step")
    refused(["compile", str(w4a16), "--arch", "hopper", "--tp", "3", "-o", str(tmp_path / "x")], "--tp 3")
    refused(["compile", str(w4a16), "--arch", "hopper", "--tp", "2", "--weights", "link", "-o", str(tmp_path / "x")],
            "--weights link")
    assert not (tmp_path / "x").exists() and not (tmp_path / "c").exists()
    single = build_engine(w4a16, ["hopper"], tmp_path / "single", progress=False).output
    refused([*ppl, "--tp", "2", str(single)], "compiled for one device")


def test_a_rank_bundle_that_is_not_the_recorded_one_is_refused(w4a16_tp2, tmp_path, capsys) -> None:
    """The integrity chain: the top engine.json records each rank's engine.json, which records
    that rank's files; `inspect` checks both levels and names the rank."""
    import shutil

    from lmfoundry.engine_bundle.engine_manifest import rank_bundle

    copy = tmp_path / "engine"
    shutil.copytree(w4a16_tp2, copy)
    assert rank_bundle(copy, 1) == copy / "rank1"
    assert run_cli(["inspect", str(copy)], capsys)[0] == 0
    weights = copy / "rank1" / "weights" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    code, out, err = run_cli(["inspect", str(copy)], capsys)
    assert code == 1 and "FAILED rank1: " in err and "model.safetensors" in err, err
    manifest = json.loads((copy / "rank1" / "engine.json").read_text())
    manifest["build"]["workers"] += 1
    (copy / "rank1" / "engine.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineIntegrityError, match="rank1"):
        rank_bundle(copy, 1)
    code, out, err = run_cli(["inspect", str(copy)], capsys)
    assert code == 1 and "rank1/engine.json: missing, or not the one" in err, err


def test_kernel_model_ranks_join_like_one_device(w4a16, w4a16_tp2, tmp_path) -> None:
    """The GPU path of a tensor-parallel bundle (each rank's `KernelModel`, its kernels on the
    rank's shapes, joined after o_proj and down_proj, in the embedding and the logits), run here
    through the kernels' PyTorch references: rank 0's logits are the single-device bundle's, up
    to the bf16 rounding of the two partial sums each row-parallel GEMM now has (two roundings
    instead of one per block: a few bf16 steps of the logits' scale), with the same argmax."""
    import multiprocessing

    from lmfoundry.runtime.engine.collectives import ShmCollectives
    from lmfoundry.runtime.loader import load_bundle

    ids = [5, 9, 33, 70, 12, 7, 7, 8, 100, 3, 4, 5]
    single = build_engine(w4a16, ["hopper"], tmp_path / "single", progress=False).output
    with torch.inference_mode():
        expect = load_bundle(single, "cpu")[0](torch.tensor([ids]))
    folder = tmp_path / "shm"
    folder.mkdir()
    ShmCollectives(folder / "collectives", 0, 2, create=True).close()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=kernel_model_rank, args=(str(w4a16_tp2), r, 2, str(folder), ids, queue))
             for r in range(2)]
    for p in ranks:
        p.start()
    replies = [queue.get(timeout=300) for _ in ranks]
    for p in ranks:
        p.join(timeout=60)
    assert all(kind == "ok" for kind, _ in replies), replies
    got = torch.from_numpy(next(logits for _, logits in replies if logits is not None))
    assert got.shape == expect.shape and torch.isfinite(got).all()
    scale = float(expect.abs().max())
    assert float((got - expect).abs().max()) <= 8 * 2**-8 * scale
    assert torch.equal(got.argmax(-1), expect.argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp_bundle_on_two_gpus_decodes_like_one(w4a16, w4a16_tp2, tmp_path) -> None:
    """`serve ENGINE --tp 2 --device cuda`: rank r on GPU r runs its share's cubins, the ranks
    meet through NCCL; greedy tokens equal the single-GPU bundle's."""
    single = build_engine(w4a16, ["hopper", "ampere", "ada"], tmp_path / "single", progress=False).output

    def tokens(model: Path, tp: int) -> list[list[int]]:
        engine = LLMEngine.from_pretrained(str(model), config=EngineConfig(
            num_kv_blocks=64, block_size=16, max_num_batched_tokens=32, tensor_parallel_size=tp), device="cuda")
        try:
            return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
        finally:
            engine.close()

    assert tokens(w4a16_tp2, 2) == tokens(single, 1)
