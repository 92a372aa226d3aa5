"""Causal attention of a step's prompt chunks over the paged KV cache on CPU, blocks read in place
(`paged_prefill.c`); the reference is `lmfoundry.kernels.paged_attention_common.reference` (chunk
by chunk: its queries are the last `lens[c]` of `contexts[c] + lens[c]` keys), as for the GPU
prefill kernel.

The C kernel takes every chunk of a step at once (one call per layer): their rows in the step's
flat batch, their cached context lengths and block tables, the engine's cache layout. The new
tokens' K/V must already be in the cache (the runtime writes them before attending).
"""

from __future__ import annotations

import ctypes

import torch

from lmfoundry.runtime.cpu.native.build import bound
from lmfoundry.runtime.cpu.native.paged_decode import check_paged_arguments

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ITEM_BYTES = 5 * 4  # the C side's Item: five ints
MAX_GROUP = 64  # query heads per KV head an item holds (the C side's MAX_QV)


class PagedPrefill:
    """The built kernel with its C signature; `__call__` checks what the C side cannot."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lmf_paged_prefill
        fn.restype = _c_int
        fn.argtypes = [_ptr, _c_i64, _c_i64, _ptr, _ptr, _c_int, _c_int, _c_int, _c_int, _ptr, _c_i64, _ptr, _ptr,
                       _ptr, _c_int, _ptr, _c_i64, ctypes.c_float, _ptr, _c_int]
        self._fn = fn
        self._items = lib.lmf_paged_prefill_items
        self._items.restype = _c_int
        self._items.argtypes = [_ptr, _c_int, _c_int, _c_int]
        self.supported = bool(lib.lmf_paged_prefill_supported())  # built without AVX-512 BF16 or AVX2 + FMA: no kernel
        self._room = torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int, group: int = 1) -> bool:
        """Whether the kernel takes this cache dtype, head size and GQA group (query heads per KV head)."""
        return dtype == torch.bfloat16 and 0 < head_dim <= 512 and head_dim % 64 == 0 and 0 < group <= MAX_GROUP

    def __call__(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, lens: torch.Tensor, contexts: torch.Tensor, out: torch.Tensor,
                 scale: float | None = None, threads: int | None = None) -> None:
        """For each chunk c: out[starts[c] + i] = softmax(q[starts[c] + i] K^T * scale) V over keys
        0 .. contexts[c] + i of tables[c], per query head (GQA: head h reads KV head h // (Hq // Hkv)).

        q, out: [T, Hq, D] bf16 (each head's D contiguous; out's heads side by side); caches:
        contiguous [num_blocks, block_size, Hkv, D] bf16 holding every chunk's tokens; tables
        [C, nb], starts, lens, contexts [C]: contiguous int32."""
        nblocks, block_size, hkv, d = key_cache.shape
        hq = q.shape[1]
        check_paged_arguments("paged_prefill", self.supports(q.dtype, d), "bfloat16, head_dim a multiple of 64,",
                              q, out, key_cache, value_cache, tables=tables, starts=starts, lens=lens,
                              contexts=contexts)
        chunks = starts.shape[0]
        if chunks == 0:
            return
        count = self._items(lens.data_ptr(), chunks, hq, hkv)
        if count < 0:
            raise ValueError(f"paged_prefill refused hq {hq}, hkv {hkv}")
        if self._room.numel() < count * _ITEM_BYTES:
            self._room = torch.empty(count * _ITEM_BYTES, dtype=torch.uint8)
        status = self._fn(q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                          block_size, hq, hkv, d, tables.data_ptr(), tables.stride(0), starts.data_ptr(),
                          lens.data_ptr(), contexts.data_ptr(), chunks, out.data_ptr(), out.stride(0),
                          d**-0.5 if scale is None else scale, self._room.data_ptr(),
                          threads or torch.get_num_threads())
        if status != 0:
            raise ValueError(f"paged_prefill refused its arguments (hq {hq}, hkv {hkv}, d {d}, block {block_size})")


def load_paged_prefill() -> PagedPrefill | None:
    """The kernel, built on first use; None where it cannot be built, the CPU has neither AVX-512
    BF16 nor AVX2 + FMA, or native kernels are turned off."""
    kernel = bound("paged_prefill", PagedPrefill)
    return kernel if kernel is not None and kernel.supported else None

