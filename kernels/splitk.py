"""Serial split-K for the GEMM kernels: partial tiles added in split order, in one launch.

Why: at decode sizes (a few tokens) a GEMM has too few output tiles to fill the SMs — a 4096-wide
layer has 32 tiles of 128 rows for an H200's 132 SMs — so the K range is split over SPLIT_K
programs per tile. Why serial: splits of a tile hand their fp32 (or int32) partial over in order
s = 0, 1, ... through a workspace, each waiting for the tile's counter to reach s; the sum is then
the same for every run (no atomics on data, no memset, one launch), and the counter is reset by
the last split for the next launch. Waiting cannot deadlock: grid axis 2 is the split, the slowest
axis, so split s - 1 of a tile has a lower linear program id than split s and was scheduled first
(CUTLASS's serial split-K rests on the same order).

Contract with the ops: a workspace [M, N] and the counters are passed for M <= SPLIT_MAX_M rows;
above that the ops pass placeholders and the kernels treat SPLIT_K as 1 (split 0 does all of K,
the others exit), so a tile table entry can never make a kernel write through a placeholder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_MAX_M = 64
SPLIT_MAX_M_C = tl.constexpr(SPLIT_MAX_M)

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """The per-device tile counters (int32, zero between launches). Kept for the process's lifetime
    and grown only outside CUDA-graph capture (the engine warms every shape up before capturing);
    launches sharing them must be stream-ordered, as one engine's are."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K counters for {count} tiles first needed during CUDA-graph capture; "
                               "run the shape once before capturing")
        have = torch.zeros(max(count, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def workspace(m: int, n: int, dtype: torch.dtype, device: torch.device,
              placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace [m, n] of `dtype`, counters) for a launch of m rows; placeholders above SPLIT_MAX_M."""
    if m > SPLIT_MAX_M:
        return placeholder, placeholder
    return torch.empty((m, n), dtype=dtype, device=device), split_counters(device, -(-m // 16) * -(-n // 16))


@triton.jit
def split_count(M, SPLIT_K: tl.constexpr):
    """The splits a launch really uses: SPLIT_K up to SPLIT_MAX_M rows, 1 above (no workspace)."""
    if SPLIT_K == 1:
        return 1
    else:
        return tl.where(M <= SPLIT_MAX_M_C, SPLIT_K, 1)


@triton.jit
def serial_split_k(acc, ws_ptrs, mask, counter, pid_s, splits):
    """`acc` plus the partials of splits 0..pid_s-1 of this tile, in order. Every split but the last
    stores the running sum in the workspace and passes the tile on; the last resets the counter
    and returns the total (the caller writes the output only when pid_s == splits - 1)."""
    if pid_s > 0:
        seen = tl.atomic_add(counter, 0, sem="acquire")
        while seen != pid_s:
            seen = tl.atomic_add(counter, 0, sem="acquire")
        acc += tl.load(ws_ptrs, mask=mask, other=0, cache_modifier=".cg")
    if pid_s < splits - 1:
        tl.store(ws_ptrs, acc, mask=mask, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's part is written before the counter moves
        tl.atomic_xchg(counter, pid_s + 1, sem="release")
    else:
        tl.atomic_xchg(counter, 0)
    return acc
