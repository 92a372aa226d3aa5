"""A rank's slice of every weight: the ranks' slices put back together are the whole weight, for
float and quantized linears alike, and the split rules refuse what cannot split."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.head_split import split_heads, valid_tp_sizes
from lmfoundry.model.tensor_parallel import RankShard
from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import QuantArgs

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 250, "hidden_size": 96,
          "intermediate_size": 192, "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 64}


def config(**overrides: object) -> ModelConfig:
    return ModelConfig.from_dict(dict(CONFIG, **overrides))


def test_split_rules_follow_vllm() -> None:
    cfg = config()
    assert valid_tp_sizes(cfg, 12) == [1, 2, 6]  # 6 heads, 2 KV heads, MLP 192
    s = split_heads(cfg, 6)
    assert (s.heads_per_rank, s.kv_heads_per_rank, s.kv_replication) == (1, 1, 3)
    for bad, why in ((4, "does not divide the 6 attention heads"), (0, "positive")):
        with pytest.raises(UserError, match=why):
            split_heads(cfg, bad)
    with pytest.raises(UserError, match="neither divides nor is a multiple of the 4 KV heads"):
        split_heads(config(num_attention_heads=12, num_key_value_heads=4), 6)


def test_kv_heads_follow_their_query_heads() -> None:
    """With replication, rank r's KV head is the one its query heads read (q head j reads KV head
    j // (heads / kv_heads))."""
    cfg = config()
    for tp in (2, 6):
        hq = cfg.num_heads // tp
        for rank in range(tp):
            a, b = RankShard(cfg, rank, tp).kv_head_range()
            group = cfg.num_heads // cfg.num_kv_heads
            assert list(range(a, b)) == sorted({j // group for j in range(rank * hq, (rank + 1) * hq)})


def _stitch(shards: list[torch.Tensor], kind: str) -> torch.Tensor:
    return torch.cat(shards, dim=0 if kind == "column" else 1)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj",
                                  "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj", "lm_head"])
def test_dense_slices_stitch_back(name: str) -> None:
    cfg = config()
    out, inp = {"lm_head": (250, 96), "model.layers.0.self_attn.o_proj": (96, 96),
                "model.layers.0.mlp.down_proj": (96, 192)}.get(name, (96 if "q_proj" in name else 192, 96))
    w, bias = torch.randn(out, inp), torch.randn(out)
    pieces = [RankShard(cfg, r, 2).dense(name, w, bias) for r in range(2)]
    kind = RankShard(cfg, 0, 2).split(name)[0]
    assert torch.equal(_stitch([p[0] for p in pieces], kind), w)
    if kind == "column":
        assert torch.equal(torch.cat([p[1] for p in pieces]), bias)
    else:  # a row-parallel bias is added once, after the sum: rank 0 keeps it
        assert torch.equal(pieces[0][1], bias) and pieces[1][1] is None


def _quantized(out: int, inp: int, group: int | None, act_order: bool = False) -> QuantizedWeight:
    args = QuantArgs(num_bits=4, type="int", symmetric=False, strategy="group" if group else "channel",
                     group_size=group)
    w = torch.randn(out, inp)
    g = group or inp
    scale = w.view(out, inp // g, g).abs().amax(-1) / 7 + 1e-3
    zp = torch.randint(-2, 3, scale.shape).to(torch.int8)
    q = torch.randint(-8, 8, (out, inp), dtype=torch.int8)
    g_idx = torch.randperm(inp) // g if act_order else None
    return QuantizedWeight(q, scale, zp, args, g_idx)


@pytest.mark.parametrize("case", ["group", "channel", "act-order"])
@pytest.mark.parametrize("name", ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"])
def test_quantized_slices_dequantize_to_the_dense_slices(case: str, name: str) -> None:
    """Slicing codes and quantization parameters, then dequantizing, equals slicing the
    dequantized weight: the rank's packed module computes exactly its share."""
    cfg = config()
    out, inp = (192, 96) if "gate" in name else (96, 192)
    qw = _quantized(out, inp, None if case == "channel" else 16, act_order=case == "act-order")
    full = qw.dequantize(torch.float32)
    for tp in (2, 6):
        pieces = []
        for rank in range(tp):
            part, _ = RankShard(cfg, rank, tp).quantized(name, qw, None)
            assert torch.count_nonzero(part.q) or not torch.count_nonzero(qw.q)
            pieces.append(part.dequantize(torch.float32))
        kind = RankShard(cfg, 0, tp).split(name)[0]
        assert torch.equal(_stitch(pieces, kind), full), (case, name, tp)


def test_a_split_inside_a_group_is_refused() -> None:
    cfg = config()
    qw = _quantized(96, 192, 64)  # down_proj at tp 6: 32 columns a rank, groups of 64
    with pytest.raises(UserError, match="split its quantization groups of 64"):
        RankShard(cfg, 1, 6).quantized("model.layers.0.mlp.down_proj", qw, None)


def test_vocabulary_ranges_cover_the_vocabulary_once() -> None:
    cfg = config()
    ranges = [RankShard(cfg, r, 6).vocab_range() for r in range(6)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 250
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert {r[2] for r in ranges} == {42} and ranges[-1][1] - ranges[-1][0] == 40  # ceil(250/6), last shorter


def test_dequantize_reference_is_qmath() -> None:
    """The slicing test above relies on QuantizedWeight.dequantize being the plain formula."""
    qw = _quantized(8, 32, 16)
    expect = qmath.dequantize(qw.q, qw.scale, qw.zero_point, qw.args, torch.float32)
    assert torch.equal(qw.dequantize(torch.float32), expect)
