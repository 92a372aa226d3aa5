"""Attention over the paged KV cache for one ragged batch: the runtime's `AttentionContext`.

The model calls `attend(layer, q, k, v)` with the new tokens of all scheduled sequences flattened
into one [T, heads, head_dim] batch. We write the new K/V into their slots, then attend:
- single-token sequences (decodes) in groups: a group's K/V are gathered into a padded
  [B, L, kv_heads, D] tensor and one masked SDPA call serves it. Query heads are viewed as
  [kv_heads, group] so grouped-query attention needs no K/V repeat. Decodes that share a prompt
  prefix (the same leading blocks, from the prefix cache) form a group of their own whose prefix
  is read once (cascade attention); the others form one plain group.
- each multi-token chunk (a prefill or a prefill chunk) on its own, causally, with its earlier
  tokens (prefix-cache hits or previous chunks) read back from the cache.
The gather indices and masks are built once per step and shared by every layer.

Where the CPU's C kernel is built (`lmfoundry.runtime.cpu.native.paged_decode`), the step's decodes come
as one `DecodeBatch` instead of groups: the kernel reads each sequence's blocks where they lie, so
nothing is gathered and a shared prefix needs no cascade split (its blocks stay in the CPU's cache
while the sequences that share them read them). Likewise, with a bf16 cache on a CPU with AVX-512
BF16, the step's chunks come as one `PrefillBatch` (`lmfoundry.runtime.cpu.native.paged_prefill`): one
call per layer attends every chunk causally over its blocks, a prefix-cache hit included, without
the gather, the mask or the scores above the diagonal that SDPA would need.

In the engine's deterministic mode there are no chunks: every row of the step, a prompt token too,
is one query of the `DecodeBatch` over its own context (the new K/V are written first), with
partitions fixed by that context alone. A token's attention is then the same arithmetic whether
it is decoded, prefilled in a chunk of any length, or follows a prefix-cache hit.

A layer whose attention is not the plain causal one (Gemma: its own scale, soft-capped scores,
sliding windows) passes its `AttentionSpec`; then every group goes through `spec_attention`, the
reference's own implementation, with absolute query and key positions recovered from the step's
masks (a decode's query is its last real key; a chunk's queries follow its cached context). That
path reads whole block tables (no cascade split): correctness over the shared-prefix saving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmfoundry.model.attention_math import AttentionSpec, spec_attention
from lmfoundry.model.kv_quant import KVRoundTrip
from lmfoundry.runtime.cpu.native.paged_decode import PagedDecode
from lmfoundry.runtime.cpu.native.paged_prefill import PagedPrefill
from lmfoundry.runtime.engine.kv_cache import KVCacheLayers

# SDPA's CPU flash kernel, which also returns each query's log-sum-exp (cascade merging needs it).
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # positions in the flat batch (None: rows 0..B-1 in order)
    blocks: torch.Tensor  # [B, nb] block tables, padded with block 0
    mask: torch.Tensor  # [B, 1, 1, nb * block_size] True where the key is real
    shared: int = 0  # leading blocks common to every table (a shared prompt prefix)
    _tail_bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def tail_bias(self, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The tails' mask as an additive bias (0 or -inf) in `dtype`, the form the CPU flash
        kernel takes; built once a step, not once a layer."""
        if dtype not in self._tail_bias:
            tail = self.mask[..., self.shared * block_size :]
            self._tail_bias[dtype] = torch.zeros(tail.shape, dtype=dtype).masked_fill_(~tail, float("-inf"))
        return self._tail_bias[dtype]


@dataclass
class DecodeBatch:
    """Every decode of a step, for the in-place kernel: rows 0..B-1 of the flat batch (in the
    deterministic mode, every row of the step)."""

    kernel: PagedDecode
    tables: torch.Tensor  # [B, nb] int32 block tables, padded with block 0
    lengths: torch.Tensor  # [B] int32 context lengths, the new token included
    rows: torch.Tensor  # [B] int32: 0..B-1
    max_len: int
    # the deterministic mode: every row of the step (prompt chunks too, one query each) with
    # partitions fixed by each query's own context (see PagedDecode)
    batch_invariant: bool = False


@dataclass
class PrefillBatch:
    """Every prompt chunk of a step, for the in-place prefill kernel (all read from the cache)."""

    kernel: PagedPrefill
    tables: torch.Tensor  # [C, nb] int32 block tables, padded with block 0
    starts: torch.Tensor  # [C] int32: each chunk's first row in the flat batch
    lens: torch.Tensor  # [C] int32: its new tokens
    contexts: torch.Tensor  # [C] int32: tokens already cached before it


@dataclass
class Chunk:
    start: int  # rows [start, end) of the flat batch
    end: int
    context: int  # tokens already in the cache before this chunk
    blocks: torch.Tensor | None  # [nb] the sequence's blocks; None when context == 0 and reads are exact
    mask: torch.Tensor | None  # [n, context + n] causal-with-offset mask, None: plain causal


class PagedAttention:
    supports_attention_spec = True  # `attend` honours a layer's AttentionSpec (see the reference)

    def __init__(
        self,
        cache: KVCacheLayers,
        round_trips: list[KVRoundTrip | None],
        slot_mapping: torch.Tensor,
        decodes: list[DecodeGroup],
        chunks: list[Chunk],
        batch: DecodeBatch | None = None,
        prefill: PrefillBatch | None = None,
    ) -> None:
        self.cache = cache
        self.round_trips = round_trips
        self.slot_mapping = slot_mapping
        self.decodes = decodes
        self.chunks = chunks
        self.batch = batch  # set instead of `decodes` (not with an AttentionSpec)
        self.prefill = prefill  # set instead of `chunks` (not with an AttentionSpec)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        round_trip = self.round_trips[layer_idx]
        if round_trip is not None:
            k, v = round_trip(k, v)
        self.cache.write(layer_idx, self.slot_mapping, k, v)
        if spec is not None:
            assert self.batch is None, "the in-place decode kernel has no AttentionSpec"
            return self._attend_spec(layer_idx, q, k, v, spec)
        if self.batch is not None or self.prefill is not None:
            return self._attend_native(layer_idx, q, k, v)
        if len(self.decodes) == 1 and self.decodes[0].rows is None:  # decodes only, in order
            return self._decode(layer_idx, q, self.decodes[0])
        out = torch.empty_like(q)
        for d in self.decodes:
            out[d.rows] = self._decode(layer_idx, q[d.rows], d)
        for c in self.chunks:
            out[c.start : c.end] = self._chunk(layer_idx, q[c.start : c.end], k, v, c)
        return out

    def _attend_native(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The step through the C kernels: decodes (`batch`) and chunks (`prefill`, else SDPA per
        chunk) read the cache in place and write their rows of one output."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = q.new_empty(q.shape)
        layer = self.cache.layers[layer_idx]
        batch, prefill = self.batch, self.prefill
        if batch is not None:
            batch.kernel(q, layer.key_cache, layer.value_cache, batch.tables, batch.lengths, batch.rows, out,
                         batch.max_len, batch_invariant=batch.batch_invariant)
        if prefill is not None:
            prefill.kernel(q, layer.key_cache, layer.value_cache, prefill.tables, prefill.starts, prefill.lens,
                           prefill.contexts, out)
        else:
            for c in self.chunks:
                out[c.start : c.end] = self._chunk(layer_idx, q[c.start : c.end], k, v, c)
        return out

    def _attend_spec(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     spec: AttentionSpec) -> torch.Tensor:
        """Every group of the step under `spec` (scale, soft-cap, window), at absolute positions."""
        out = torch.empty_like(q)
        for d in self.decodes:
            b = d.blocks.shape[0]
            rows = d.rows if d.rows is not None else torch.arange(b, device=q.device)
            kk, vv = self.cache.read(layer_idx, d.blocks)  # [B, L, Hkv, D]
            real = d.mask[:, 0, 0, :]  # [B, L]: a prefix of each table, ending at the new token
            q_pos = real.sum(-1, keepdim=True) - 1  # [B, 1]
            k_pos = torch.arange(real.shape[1], device=q.device).expand_as(real)
            out[rows] = spec_attention(q[rows].unsqueeze(1), kk, vv, spec, q_pos, k_pos, real[:, None, :])[:, 0]
        for c in self.chunks:
            n = c.end - c.start
            if c.blocks is None:  # a whole prompt in this step: its keys are the new ones
                kk, vv = k[c.start : c.end], v[c.start : c.end]
            else:
                kk, vv = self.cache.read(layer_idx, c.blocks)
                kk, vv = kk[: c.context + n], vv[: c.context + n]
            q_pos = c.context + torch.arange(n, device=q.device)
            k_pos = torch.arange(kk.shape[0], device=q.device)
            out[c.start : c.end] = spec_attention(q[c.start : c.end], kk, vv, spec, q_pos, k_pos)
        return out

    def _decode(self, layer_idx: int, q: torch.Tensor, d: DecodeGroup) -> torch.Tensor:
        if d.shared:
            return self._decode_cascade(layer_idx, q, d)
        kk, vv = self.cache.read(layer_idx, d.blocks)  # [B, L, Hkv, D]
        b, hq, dim = q.shape
        hkv = kk.shape[2]
        qg = q.view(b, hkv, hq // hkv, dim)
        o = F.scaled_dot_product_attention(qg, kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=d.mask)
        return o.reshape(b, hq, dim)

    def _decode_cascade(self, layer_idx: int, q: torch.Tensor, d: DecodeGroup) -> torch.Tensor:
        """Decode attention split at the prefix all sequences share (cascade attention).

        The shared blocks are read once and attended by every query of the batch in one call;
        each sequence then attends its own tail, and the two partial softmaxes are merged through
        their log-sum-exps. Without the split, each sequence would gather its own copy of the
        shared prefix in every layer: with 16 sequences on a 400-token system prompt that copy
        is most of the memory traffic of a decode step on CPU. On CPU both parts are one call
        each of PyTorch's flash kernel, which returns the log-sum-exp; elsewhere plain matmuls."""
        b, hq, dim = q.shape
        ks, vs = self.cache.read(layer_idx, d.blocks[:1, : d.shared])  # [1, Ls, Hkv, D]
        kt, vt = self.cache.read(layer_idx, d.blocks[:, d.shared :])  # [B, Lt, Hkv, D]
        hkv = ks.shape[2]
        g = hq // hkv
        if q.device.type == "cpu" and ks.dtype == q.dtype:
            qg = q.view(b, hkv, g, dim)
            q_all = qg.transpose(0, 1).reshape(1, hkv, b * g, dim)  # every query of a KV head at once
            o1, lse1 = _FLASH_CPU(q_all, ks.transpose(1, 2), vs.transpose(1, 2))
            o2, lse2 = _FLASH_CPU(qg, kt.transpose(1, 2), vt.transpose(1, 2),
                                  attn_mask=d.tail_bias(self.cache.block_size, q.dtype))
            o1 = o1.view(hkv, b, g, dim).transpose(0, 1)
            lse1 = lse1.view(hkv, b, g, 1).transpose(0, 1)
            lse2 = lse2.view(b, hkv, g, 1)
        else:
            scale = dim**-0.5
            qf = q.float().view(b, hkv, g, dim)
            q_all = qf.permute(1, 0, 2, 3).reshape(hkv, b * g, dim)  # [Hkv, B*G, D]
            s1 = torch.matmul(q_all, ks[0].float().permute(1, 2, 0)) * scale
            o1, lse1 = _softmax_av(s1, vs[0].float().transpose(0, 1))
            o1 = o1.view(hkv, b, g, dim).permute(1, 0, 2, 3)
            lse1 = lse1.view(hkv, b, g, 1).permute(1, 0, 2, 3)
            s2 = torch.matmul(qf, kt.float().permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, Lt]
            tail_mask = d.mask[..., d.shared * self.cache.block_size :]  # [B, 1, 1, Lt]
            o2, lse2 = _softmax_av(s2.masked_fill(~tail_mask, float("-inf")), vt.float().transpose(1, 2))
        top = torch.maximum(lse1, lse2)
        w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
        return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype).reshape(b, hq, dim)

    def _chunk(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Chunk) -> torch.Tensor:
        if c.blocks is None:
            kk, vv = k[c.start : c.end], v[c.start : c.end]
        else:
            length = c.context + c.end - c.start
            kk, vv = self.cache.read(layer_idx, c.blocks)
            kk, vv = kk[:length], vv[:length]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            kk.transpose(0, 1).unsqueeze(0),
            vv.transpose(0, 1).unsqueeze(0),
            attn_mask=c.mask,
            is_causal=c.mask is None,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)


def _softmax_av(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) @ v and the log-sum-exp of each row of scores (for merging partial results)."""
    top = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - top)
    total = p.sum(dim=-1, keepdim=True)
    return torch.matmul(p, v) / total, top + torch.log(total)
