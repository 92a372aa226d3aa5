"""Decode attention over the paged KV cache on CPU, blocks read in place (`paged_decode.c`), and
its PyTorch reference.

The C kernel takes the engine's own cache layout ([num_blocks, block_size, Hkv, D] for K and for
V), the step's block tables and context lengths, and the positions of the decode rows in the step's
flat batch, so it reads q and writes the output where the model has them: no gather, no copy.
"""

from __future__ import annotations

import ctypes
import math

import torch

from lmfoundry.runtime.cpu.native.build import bound

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_PARTITION = 512  # tokens an item scores at once: its scores (every head's) live on the thread's stack
MIN_PARTITION = 64  # shorter partitions cost more in merging than they gain in balance
ITEMS_PER_THREAD = 4  # enough items per thread for the dynamic schedule to even out lengths
# The batch-invariant plan: partitions of a fixed length, so a query's arithmetic depends on its own
# context alone (not on the batch's longest context, its size or the thread count)
FIXED_PARTITION = MAX_PARTITION
WORK_FLOATS = 2**25  # partial results one fixed-partition call may hold (128 MiB); more rows: more calls

_c_i64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def plan_partitions(max_len: int, batch: int, threads: int, block_size: int) -> tuple[int, int]:
    """(tokens per partition, partitions per sequence): contexts are split when longer than
    MAX_PARTITION, or when the batch's sequences are too few to give every thread work."""
    parts = max(1, math.ceil(max_len / MAX_PARTITION))
    if batch < ITEMS_PER_THREAD * threads:
        parts = max(parts, min(math.ceil(ITEMS_PER_THREAD * threads / batch), math.ceil(max_len / MIN_PARTITION)))
    part_len = math.ceil(math.ceil(max_len / parts) / block_size) * block_size
    return part_len, math.ceil(max_len / part_len)


class PagedDecode:
    """The built kernel with its C signature; `__call__` checks what the C side cannot."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lmf_paged_decode
        fn.restype = _c_int
        fn.argtypes = [_ptr, _c_i64, _c_i64, _ptr, _ptr, _ptr, _c_i64, _ptr, _ptr, _ptr, _c_i64, _c_int, _c_int,
                       _c_int, _c_int, _c_int, _c_int, _c_int, ctypes.c_float, _c_int, _ptr, _c_int]
        self._fn = fn
        self._p_bf16 = lib.lmf_paged_decode_p_bf16
        self._p_bf16.restype, self._p_bf16.argtypes = _c_int, [_c_int, _c_int]
        self._work = torch.empty(0, dtype=torch.float32)

    def p_dtype(self, dtype: torch.dtype, head_dim: int) -> torch.dtype:
        """The dtype the softmax weights P take in the PV product: bfloat16 for bf16 attention
        on CPUs with AVX512-BF16 (two tokens per dot-product instruction, as GPU flash attention
        rounds P), else float32. Error bounds depend on it."""
        return torch.bfloat16 if self._p_bf16(DTYPE_CODES[dtype], head_dim) else torch.float32

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in DTYPE_CODES and 0 < head_dim <= 512

    def __call__(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, max_len: int,
                 scale: float | None = None, threads: int | None = None, batch_invariant: bool = False) -> None:
        """out[rows[i]] = softmax(q[rows[i]] K^T * scale) V over the first lengths[i] tokens of
        tables[i], per query head (GQA: head h reads KV head h // (Hq // Hkv)).

        q, out: [T, Hq, D] (each head's D contiguous; rows may be any subset of T); caches:
        contiguous [num_blocks, block_size, Hkv, D] in q's dtype; tables [B, nb], lengths [B] and
        rows [B] int32; max_len: the largest of lengths (the caller knows it without a sync).

        With `batch_invariant` contexts are cut at fixed multiples of FIXED_PARTITION tokens, so
        each query's softmax is summed in an order set by its own context length alone (the
        default plan splits by the batch's size, longest context and threads); rows go in several
        calls where their partial results would exceed WORK_FLOATS."""
        nblocks, block_size, hkv, d = key_cache.shape
        batch, hq = rows.shape[0], q.shape[1]
        check_paged_arguments("paged_decode", self.supports(q.dtype, d), f"one of {sorted(map(str, DTYPE_CODES))}",
                              q, out, key_cache, value_cache, tables=tables, lengths=lengths, rows=rows)
        if batch == 0:
            return
        threads = threads or torch.get_num_threads()
        if batch_invariant:
            part_len = -(-FIXED_PARTITION // block_size) * block_size  # whole blocks, as the kernel reads them
            parts = -(-max_len // part_len)
            step = max(1, WORK_FLOATS // (parts * hq * (d + 2)))
            if batch > step:
                for i in range(0, batch, step):
                    self(q, key_cache, value_cache, tables[i : i + step], lengths[i : i + step], rows[i : i + step],
                         out, max_len, scale, threads, batch_invariant)
                return
        else:
            part_len, parts = plan_partitions(max_len, batch, threads, block_size)
        work = 0
        if parts > 1:
            need = batch * parts * hq * (d + 2)
            if self._work.numel() < need:
                self._work = torch.empty(need, dtype=torch.float32)
            work = self._work.data_ptr()
        status = self._fn(q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                          tables.data_ptr(), tables.stride(0), lengths.data_ptr(), rows.data_ptr(), out.data_ptr(),
                          out.stride(0), batch, hq, hkv, d, block_size, part_len, parts,
                          d**-0.5 if scale is None else scale, DTYPE_CODES[q.dtype], work, threads)
        if status != 0:
            raise ValueError(f"paged_decode refused its arguments (hq {hq}, hkv {hkv}, d {d}, block {block_size})")


def check_paged_arguments(kernel: str, supported: bool, dtypes: str, q: torch.Tensor, out: torch.Tensor,
                          key_cache: torch.Tensor, value_cache: torch.Tensor, **int32s: torch.Tensor) -> None:
    """Raise ValueError unless q, out and the caches are what the paged kernels read in place: one
    supported dtype, contiguous caches of one shape, heads of the cache's head_dim with contiguous
    elements (out's heads side by side), and the named index tensors contiguous int32."""
    d = key_cache.shape[3]
    if not (q.dtype == out.dtype == key_cache.dtype == value_cache.dtype and supported):
        raise ValueError(f"{kernel}: dtypes q {q.dtype}, out {out.dtype}, cache {key_cache.dtype} ({dtypes} for all)")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous() and value_cache.shape == key_cache.shape):
        raise ValueError(f"{kernel}: K and V caches must be contiguous and of one shape")
    if q.stride(2) != 1 or out.stride(2) != 1 or out.stride(1) != d or q.shape[2] != d:
        raise ValueError(f"{kernel}: q and out need contiguous heads of the cache's head_dim")
    for name, t in int32s.items():
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{kernel}: {name} must be contiguous int32")


def load_paged_decode() -> PagedDecode | None:
    """The kernel, built for this machine on first use; None where it cannot be built or is
    turned off (`LMFOUNDRY_NATIVE_KERNELS=0`; the reason: `lmfoundry.runtime.cpu.native.build.
    unavailable_reason("paged_decode")`)."""
    return bound("paged_decode", PagedDecode)


def paged_decode_reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           tables: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """The same attention, sequence by sequence in float64: [B, Hq, D] in q's dtype."""
    _, block_size, hkv, d = key_cache.shape
    hq = q.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = []
    for i in range(rows.shape[0]):
        n = int(lengths[i])
        blocks = tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].reshape(-1, hkv, d)[:n].double().repeat_interleave(hq // hkv, dim=1)
        v = value_cache[blocks].reshape(-1, hkv, d)[:n].double().repeat_interleave(hq // hkv, dim=1)
        qi = q[int(rows[i])].double()  # [Hq, D]
        p = torch.softmax(torch.einsum("hd,thd->ht", qi, k) * scale, dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out).to(q.dtype) if out else q.new_empty(0, hq, d)
