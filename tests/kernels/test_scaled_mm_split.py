"""INT8 / FP8 scaled GEMM with the small-M tile options: split-K and swapped operands.

Same bounds as the plain kernel (`kernels.examples._scaled`, `checks.dot_bound`): int8 products sum
exactly in int32 in any order and split, so only the fp32 scale epilogue and the output rounding
differ from the reference; fp8 partials are fp32, gamma_{K+2} sum |a||b| a_s b_s covers any order
of the same K products (split-K reorders the sum, the serial hand-over adds at most 16 terms).
Outputs are NaN-filled by the example builder; shapes cover M = 1, 3, 16, 64 and 70 (above
SPLIT_MAX_M the op passes no workspace and the kernel does not split), K not a multiple of the
split, N not a multiple of the tile.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels import harness, splitk
from lmfoundry.kernels.dispatch import JitLauncher
from lmfoundry.kernels.spec import TileConfig

I8 = ("w8a8_gemm", {"a": "i8", "bscale": "bf16", "out": "bf16"})
F8 = ("fp8_gemm", {"a": "fp8e4nv", "bscale": "bf16", "out": "bf16"})
CASES = [
    # (kernel, types), M, N, K, per-token, bias, (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, SWAP_AB)
    (I8, 1, 96, 320, True, True, (16, 64, 64, 3, 1)),  # 5 k-tiles over 3 splits, swapped
    (I8, 3, 80, 256, False, False, (16, 32, 32, 5, 0)),  # per-tensor scale, 8 k-tiles / 5 splits
    (I8, 64, 64, 512, True, False, (64, 64, 64, 4, 1)),
    (F8, 1, 64, 192, True, False, (16, 64, 64, 4, 1)),  # 3 k-tiles / 4 splits: one split is empty
    (F8, 16, 96, 256, True, True, (16, 32, 64, 2, 0)),
    (F8, 70, 64, 256, False, True, (64, 64, 64, 4, 1)),  # M > SPLIT_MAX_M: split turned off
]


@pytest.mark.parametrize("kt,m,n,k,per_token,bias,tiles", CASES)
def test_split_and_swapped_tiles_match_the_reference(kt, m, n, k, per_token, bias, tiles, device):
    kernel, types = kt
    sem = {"A_PER_TOKEN": per_token, "B_PER_CHANNEL": True, "HAS_BIAS": bias, "ACC_INT": kernel == "w8a8_gemm"}
    ex = harness.build(kernel, types, sem, {"M": m, "N": n, "K": k}, device)
    bm, bn, bk, split, swap = tiles
    cfg = TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SWAP_AB=swap)
    harness.run_and_check(ex, JitLauncher(pick_config=lambda call: cfg))


def test_split_k_is_deterministic_and_resets_its_counters(device):
    kernel, types = F8
    sem = {"A_PER_TOKEN": True, "B_PER_CHANNEL": True, "HAS_BIAS": False, "ACC_INT": False}
    ex = harness.build(kernel, types, sem, {"M": 5, "N": 64, "K": 384}, device)
    cfg = TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=3, SWAP_AB=1)
    runs = []
    for _ in range(2):
        call = ex.clone()
        JitLauncher(pick_config=lambda c: cfg).run(call)
        runs.append(call.args["out_ptr"])
    assert torch.equal(runs[0], runs[1])
    assert int(splitk.split_counters(torch.device(device), 1).abs().sum()) == 0
