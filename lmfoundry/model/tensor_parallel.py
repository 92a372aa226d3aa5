"""Megatron-style tensor parallelism of the reference model: which slice of every weight a rank
holds, and the modules that join the ranks' partial results.

One rank of N holds:
- q/k/v and gate/up split by output rows (column-parallel): whole attention heads, with each
  rank's KV heads those its query heads read (a KV head is replicated on N / kv_heads ranks when
  N exceeds the KV heads), and 1/N of the MLP's (each expert's) intermediate width;
- o_proj and down_proj split by input columns (row-parallel), so each rank's product is a partial
  sum of the layer's output: one all-reduce per attention block and one per MLP block joins them
  (a forward hook on the block). Their biases live on rank 0 only: added once to the sum;
- the embedding and the LM head split by vocabulary rows: a rank embeds the ids in its range and
  zeros elsewhere (an all-reduce joins the rows), and rank 0 gathers the logit columns.
Norms, the MoE router and rotary tables are replicated.

Quantized linears are sliced as their codes and quantization parameters, before the runtime
module is built, so a rank packs only its own share: rows take their rows of scales and zero
points; columns take whole groups (a split inside a group is refused: that group would have no
scale on one rank), or, with act-order's g_idx, their columns of g_idx and every group's scale.

The split rules (whole heads, KV heads divided or replicated, an MLP width N divides) are vLLM's,
and `lmfoundry plan --tp` / `doctor --tp` use these same functions.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.head_split import HeadSplit, split_heads
from lmfoundry.quantformat.quantized_weight import QuantizedWeight


class Collectives(Protocol):
    """What the sharded modules need of the ranks' communication (see runtime.engine.collectives)."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the same bits."""
        ...

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape on all), in rank order, on rank 0; None elsewhere. They may
        be views that the next collective overwrites: use them before."""
        ...


_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)$")
_ROW = re.compile(r"(o_proj|down_proj)$")


@dataclass(frozen=True)
class RankShard:
    """Rank `rank` of `tp`: the slice of each weight it holds."""

    config: ModelConfig
    rank: int
    tp: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} outside 0..{self.tp - 1}")

    @property
    def heads(self) -> HeadSplit:
        return split_heads(self.config, self.tp)

    def kv_head_range(self) -> tuple[int, int]:
        s = self.heads
        first = self.rank // s.kv_replication * s.kv_heads_per_rank
        return first, first + s.kv_heads_per_rank

    def vocab_range(self) -> tuple[int, int, int]:
        """(start, stop, rows per rank): ceil(V / tp) rows a rank, the last one fewer."""
        per = -(-self.config.vocab_size // self.tp)
        start = min(self.rank * per, self.config.vocab_size)
        return start, min(start + per, self.config.vocab_size), per

    def split(self, name: str) -> tuple[str, int, int] | None:
        """("column" | "row", start, stop) of a linear's output rows / input columns; None: replicated."""
        d = self.config.head_dim
        if name == "lm_head":
            start, stop, _ = self.vocab_range()
            return "column", start, stop
        hq = self.heads.heads_per_rank
        i = self.config.mlp_width // self.tp
        col, row = _COLUMN.search(name), _ROW.search(name)
        if col:
            kind = col.group(1)
            if kind == "q_proj":
                return "column", self.rank * hq * d, (self.rank + 1) * hq * d
            if kind in ("k_proj", "v_proj"):
                a, b = self.kv_head_range()
                return "column", a * d, b * d
            return "column", self.rank * i, (self.rank + 1) * i
        if row:
            if row.group(1) == "o_proj":
                return "row", self.rank * hq * d, (self.rank + 1) * hq * d
            return "row", self.rank * i, (self.rank + 1) * i
        return None

    def dense(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's (weight, bias) of a float linear (copies: the full tensors can go)."""
        split = self.split(name)
        if split is None:
            return weight, bias
        kind, a, b = split
        if kind == "column":
            return weight[a:b].clone(), None if bias is None else bias[a:b].clone()
        return weight[:, a:b].clone(), bias if self.rank == 0 else None

    def quantized(self, name: str, qw: QuantizedWeight, bias: torch.Tensor | None
                  ) -> tuple[QuantizedWeight, torch.Tensor | None]:
        """This rank's codes and quantization parameters of a quantized linear."""
        split = self.split(name)
        if split is None:
            return qw, bias
        kind, a, b = split
        out, cols = qw.q.shape
        if kind == "column":
            def rows(t: torch.Tensor) -> torch.Tensor:  # per-tensor parameters stay as they are
                return t if t.ndim == 0 or t.shape[0] != out else t[a:b].clone()

            return (dataclasses.replace(qw, q=qw.q[a:b].clone(), scale=rows(qw.scale),
                                        zero_point=None if qw.zero_point is None else rows(qw.zero_point)),
                    None if bias is None else bias[a:b].clone())
        q = qw.q[:, a:b].clone()
        kept_bias = bias if self.rank == 0 else None
        if qw.g_idx is not None:  # act order: columns name their groups; keep every group's scale
            return dataclasses.replace(qw, q=q, g_idx=qw.g_idx[a:b].clone()), kept_bias
        groups = qw.scale.shape[-1] if qw.scale.ndim == 2 else 1
        if groups <= 1:  # per channel or per tensor: the scale does not depend on the column
            return dataclasses.replace(qw, q=q), kept_bias
        g = cols // groups
        if a % g or b % g:
            raise UserError(f"{name}: tensor parallel {self.tp} gives rank {self.rank} input columns {a}..{b}, "
                            f"which split its quantization groups of {g}; use a --tp that divides them "
                            "(`lmfoundry doctor --tp` lists the splits)")

        def groups_of(t: torch.Tensor) -> torch.Tensor:
            return t[:, a // g : b // g].clone()

        zero_point = None if qw.zero_point is None else groups_of(qw.zero_point)
        return dataclasses.replace(qw, q=q, scale=groups_of(qw.scale), zero_point=zero_point), kept_bias

    def kv_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """A per-head KV scale's entries for this rank's KV heads (a per-tensor one as it is)."""
        if scale.numel() != self.config.num_kv_heads or scale.numel() == 1:
            return scale
        a, b = self.kv_head_range()
        return scale.reshape(self.config.num_kv_heads, *scale.shape[1:])[a:b].clone()


class AllReduceOutput:
    """Forward hook: sum a block's partial output over the ranks (row-parallel o_proj / down_proj).
    A class, not a closure, so a model stays picklable."""

    def __init__(self, comm: Collectives) -> None:
        self.comm = comm

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(out.contiguous())


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of vocabulary [start, stop): ids outside embed to zero, and the ranks'
    rows are summed (each id is non-zero on exactly one rank, so the sum is exact)."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_vocab_share(self.weight, self.start, input_ids, self.comm)


def embed_vocab_share(rows: torch.Tensor, start: int, input_ids: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """Embeddings of `input_ids` from a rank's vocabulary rows [start, start + len(rows)), summed
    over the ranks (an id outside the rows embeds to zero here, and is non-zero on one rank)."""
    n = rows.shape[0]
    local = input_ids - start
    outside = (local < 0) | (local >= n)
    x = F.embedding(local.clamp(0, max(n - 1, 0)), rows)
    x.masked_fill_(outside[..., None], 0)
    return comm.all_reduce(x)


def gather_vocab_share(y: torch.Tensor, vocab_size: int, per_rank: int, comm: Collectives) -> torch.Tensor:
    """The whole vocabulary's logits on rank 0 from each rank's columns (in rank order, the last
    rank's short share padded and cut); other ranks get their own columns back."""
    short = per_rank - y.shape[-1]
    if short:
        y = F.pad(y, (0, short))
    parts = comm.gather(y.contiguous())
    if parts is None:
        return y
    return torch.cat(parts, dim=-1)[..., :vocab_size]


class VocabParallelHead(nn.Module):
    """The LM head's logit columns [start, stop) on each rank, gathered on rank 0 (in vocabulary
    order, the last rank's short share padded and cut). Other ranks return their own columns,
    which nobody reads."""

    def __init__(self, local: nn.Module, vocab_size: int, per_rank: int, comm: Collectives) -> None:
        super().__init__()
        self.local = local
        self.vocab_size = vocab_size
        self.per_rank = per_rank
        self.comm = comm
        self._logit_softcap: float | None = None  # set when the local head already soft-caps (Gemma)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab_share(self.local(hidden), self.vocab_size, self.per_rank, self.comm)


def shard_modules(model: Any, shard: RankShard, comm: Collectives, presliced: bool = False) -> None:
    """After the linears were loaded sliced and the rest whole: local head counts on every
    attention, the all-reduce hooks, and the vocabulary-parallel embedding and LM head (which
    shares the embedding's rows when they are tied; an untied LM head was loaded sliced).

    `presliced`: the model was built from one rank's share (`rank_config`, written by `compile
    --tp`), so its embedding already holds only this rank's rows; it then takes the whole
    model's config, which the engine reads (vocabulary size) as the model's."""
    heads = shard.heads
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = heads.heads_per_rank, heads.kv_heads_per_rank
        attn.register_forward_hook(AllReduceOutput(comm))
        layer.mlp.register_forward_hook(AllReduceOutput(comm))
    start, stop, per = shard.vocab_range()
    tied = model.lm_head.weight is model.model.embed_tokens.weight if hasattr(model.lm_head, "weight") else False
    rows = model.model.embed_tokens.weight
    model.model.embed_tokens = VocabParallelEmbedding(rows if presliced else rows[start:stop].clone(), start, comm)
    head = model.lm_head
    if tied:
        with torch.device("meta"):
            head = nn.Linear(shard.config.hidden_size, stop - start, bias=False)
        head.weight = model.model.embed_tokens.weight
    wrapper = VocabParallelHead(head, shard.config.vocab_size, per, comm)
    # Gemma's final soft-cap (elementwise): a loaded head already applies it to its columns, so the
    # wrapper must not again (CausalLM attaches it to a head without one, as the tied one here)
    wrapper._logit_softcap = getattr(head, "_logit_softcap", None)
    model.lm_head = wrapper
    if presliced:
        model.config = shard.config


SHARE_KEY = "lmfoundry_tensor_parallel"  # config.json key of one rank's share: rank, size, whole config


def rank_config(raw: dict[str, Any], shard: RankShard) -> dict[str, Any]:
    """config.json of one rank's share of a model (what `compile --tp` writes per rank): the sizes
    of the slices the rank holds, so that the share reads, plans and compiles as a model of its
    own (its GEMM and attention shapes are the rank's), and under `SHARE_KEY` the rank, the
    degree and the whole model's config, from which the runtime joins the ranks again."""
    heads = shard.heads
    start, stop, _ = shard.vocab_range()
    width = "moe_intermediate_size" if shard.config.is_moe else "intermediate_size"
    whole = {k: v for k, v in raw.items() if k != SHARE_KEY}
    out = dict(whole)
    out.update({"num_attention_heads": heads.heads_per_rank, "num_key_value_heads": heads.kv_heads_per_rank,
                "head_dim": shard.config.head_dim, width: shard.config.mlp_width // shard.tp,
                "vocab_size": stop - start})
    out[SHARE_KEY] = {"rank": shard.rank, "size": shard.tp, "config": whole}
    return out


def share_of(raw: dict[str, Any], where: str) -> RankShard | None:
    """The `RankShard` a share's config.json says it is (None: a whole model), refused with one
    line when its sizes are not that rank's slice of the whole model it names."""
    meta = raw.get(SHARE_KEY)
    if meta is None:
        return None
    try:
        rank, size, whole = int(meta["rank"]), int(meta["size"]), meta["config"]
        shard = RankShard(ModelConfig.from_dict(whole), rank, size)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{where}: malformed {SHARE_KEY} entry in config.json ({exc})") from None
    expected = rank_config(whole, shard)
    wrong = [k for k, v in expected.items() if k != SHARE_KEY and raw.get(k) != v]
    if wrong:
        raise UserError(f"{where}: config.json is not rank {rank} of {size}'s share of the model it names "
                        f"({', '.join(wrong)} differ)")
    return shard


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer a model holds (shared storage counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key in seen or t.is_meta:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total
