"""The paged KV cache: one [slots, kv_heads, head_dim] tensor per layer for K and for V.

Storage is pluggable per layer through a `KVFormat`: plain float storage (fp32/bf16/fp16), or INT8 /
FP8-e4m3 codes with a per-tensor or per-head scale taken from the checkpoint (compressed-tensors'
`kv_cache_scheme` stores `self_attn.k_scale` / `v_scale`). Quantize on write, dequantize on read,
so attention always sees values in the model's compute dtype.

If an `Attention` carries a `kv_round_trip` (KV quantization simulated by the quantizer), the runner
applies it before writing, so the cache holds exactly the values the reference execution attends
to; with scales present, re-encoding those values recovers the same integer/fp8 codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.model.kv_quant import FP8_DTYPE as FP8
from lmfoundry.model.kv_quant import broadcast_scale, dequantize_kv, quantize_kv
from lmfoundry.runtime.cpu.native.store_kv import load_store_kv

if TYPE_CHECKING:
    from lmfoundry.model.reference import CausalLM, DecoderLayer

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED = {"int8": ("int", torch.int8), "fp8": ("float", FP8)}


@dataclass
class KVFormat:
    """How one layer stores K and V: float storage (scales None), or int8 / fp8 codes ("int" /
    "float" kind, `lmfoundry.model.kv_quant` arithmetic) with scales shaped to broadcast over
    [..., kv_heads, head_dim] ([1, 1] per tensor, [kv_heads, 1] per head)."""

    storage_dtype: torch.dtype
    compute_dtype: torch.dtype
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    kind: str | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def lossless(self) -> bool:
        """Whether a write followed by a read returns the written values bit for bit."""
        return not self.quantized and self.storage_dtype == self.compute_dtype

    def encode(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:
            return x.to(self.storage_dtype)
        assert self.kind is not None  # set with the scales
        return quantize_kv(x, scale, self.kind)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:
            return codes.to(self.compute_dtype)
        return dequantize_kv(codes, scale, self.compute_dtype)

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_kv_heads * head_dim * torch.empty((), dtype=self.storage_dtype).element_size()


def kv_cache_scheme(model: nn.Module) -> dict | None:
    """The checkpoint's compressed-tensors `kv_cache_scheme`, if it declares one."""
    raw = getattr(model.config, "raw", {}) or {}
    return (raw.get("quantization_config") or {}).get("kv_cache_scheme")


def _layer_kv_quant(attn: nn.Module) -> tuple[str | None, torch.Tensor | None, torch.Tensor | None]:
    """(kind, k_scale, v_scale) known for one attention: scales registered on the module, or
    those of its `kv_round_trip` (the loader builds it from the checkpoint's scales)."""
    round_trip = getattr(attn, "kv_round_trip", None)
    kind = getattr(getattr(round_trip, "kv_args", None), "type", None)
    k_scale, v_scale = getattr(attn, "k_scale", None), getattr(attn, "v_scale", None)
    if k_scale is None or v_scale is None:
        k_scale, v_scale = getattr(round_trip, "k_scale", None), getattr(round_trip, "v_scale", None)
    return kind, k_scale, v_scale


def resolve_kv_formats(model: nn.Module, kv_cache_dtype: str = "auto") -> list[KVFormat]:
    """One KVFormat per layer, from the requested dtype, the checkpoint's scheme and scales."""
    lm = cast("CausalLM", model)  # the reference model's structure (ModuleList items are typed as Module)
    compute = lm.dtype
    attns = [cast("DecoderLayer", layer).self_attn for layer in lm.model.layers]
    scheme = kv_cache_scheme(model)
    requested = kv_cache_dtype
    if requested == "auto":
        kinds = {_layer_kv_quant(a)[0] for a in attns} - {None}
        kind = scheme.get("type") if scheme is not None else (kinds.pop() if len(kinds) == 1 else None)
        quantized_dtype: dict[str | None, str] = {"float": "fp8", "int": "int8"}
        requested = quantized_dtype.get(kind, str(compute).replace("torch.", ""))
    if scheme is not None and scheme.get("num_bits", 8) != 8:
        raise UserError(f"kv_cache_scheme with {scheme.get('num_bits')} bits is not supported (8 only)")
    if requested not in FLOAT_DTYPES and requested not in QUANTIZED:
        raise UserError(f"unknown kv cache dtype {kv_cache_dtype!r}; use auto, "
                        f"{', '.join(FLOAT_DTYPES)}, int8 or fp8")
    formats = []
    for attn in attns:
        if requested in FLOAT_DTYPES:
            formats.append(KVFormat(FLOAT_DTYPES[requested], compute))
            continue
        kind, storage = QUANTIZED[requested]
        _, k_scale, v_scale = _layer_kv_quant(attn)
        if k_scale is None or v_scale is None:
            if getattr(attn, "kv_round_trip", None) is not None:
                # Quantization simulated by a round trip that exposes no scales: store its output
                # in float, which is exact though it saves no memory.
                formats.append(KVFormat(compute, compute))
                continue
            raise UserError(f"kv cache dtype {requested} needs k_scale/v_scale from the checkpoint "
                            f"(layer {attn.layer_idx} has none)")
        try:
            ks, vs = (broadcast_scale(torch.as_tensor(s).cpu(), attn.num_kv_heads) for s in (k_scale, v_scale))
        except ValueError as exc:
            raise UserError(f"layer {attn.layer_idx}: {exc}") from None
        formats.append(KVFormat(storage, compute, ks, vs, kind))
    return formats


class KVCacheLayers:
    """The reference executor's paged KV cache: per layer, the kernels' one paged layout
    (`lmfoundry.kernels.kv_layout.PagedKVCache`: K and V as
    [num_blocks, block_size, kv_heads, head_dim], a token's slot is block * block_size + offset),
    so the reference executor and the kernel executor share one layout. Reads gather whole blocks
    (index_select over contiguous rows, several times faster on CPU than gathering single slots)."""

    def __init__(self, formats: list[KVFormat], num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int) -> None:
        from lmfoundry.kernels.kv_layout import PagedKVCache as LayerCache
        from lmfoundry.model.kv_quant import per_head

        self.formats = formats
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [
            LayerCache.allocate(num_blocks, block_size, num_kv_heads, head_dim, f.storage_dtype, "cpu",
                                None if f.k_scale is None else per_head(f.k_scale, num_kv_heads),
                                None if f.v_scale is None else per_head(f.v_scale, num_kv_heads))
            for f in formats
        ]
        # float storage in the compute dtype: rows are copied by the C kernel where it is built
        self.store = load_store_kv() if any(f.lossless for f in formats) else None

    @property
    def k(self) -> list[torch.Tensor]:
        return [layer.key_cache for layer in self.layers]

    @property
    def v(self) -> list[torch.Tensor]:
        return [layer.value_cache for layer in self.layers]

    @staticmethod
    def _bits(t: torch.Tensor) -> torch.Tensor:
        """Index fp8 storage through a uint8 view (CPU index kernels do not cover fp8)."""
        return t.view(torch.uint8) if t.dtype == FP8 else t

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] for the T slots in `slots`."""
        f = self.formats[layer]
        lc = self.layers[layer]
        if self.store is not None and f.lossless and k.dtype == f.storage_dtype:
            self.store(k, v, lc.key_cache, lc.value_cache, slots)  # one C call: rows copied as they are
            return
        for cache, x, scale in ((lc.key_cache, k, f.k_scale), (lc.value_cache, v, f.v_scale)):
            flat = self._bits(cache).view(-1, *cache.shape[2:])
            flat.index_copy_(0, slots, self._bits(f.encode(x, scale)))

    def read(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks ([*S] block ids) as [*S[:-1], S[-1] * block_size, kv_heads,
        head_dim] in compute dtype: each row of blocks becomes one token sequence."""
        f = self.formats[layer]
        out = []
        lc = self.layers[layer]
        for cache, scale in ((lc.key_cache, f.k_scale), (lc.value_cache, f.v_scale)):
            codes = self._bits(cache).index_select(0, blocks.reshape(-1)).view(cache.dtype)
            codes = codes.view(*blocks.shape[:-1], blocks.shape[-1] * self.block_size, *cache.shape[2:])
            out.append(f.decode(codes, scale))
        return out[0], out[1]
