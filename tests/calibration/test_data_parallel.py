"""Data-parallel calibration: statistics are reduced across ranks before they are read, the
calibration batches are shared out contiguously, and `torchrun --nproc-per-node 2` (gloo) writes
a checkpoint equal to the single-process one within float tolerance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lmfoundry.distributed as distributed
from lmfoundry.distributed import Ranks
from lmfoundry.errors import UserError


class TwoRanks(Ranks):
    """A world of two whose other rank saw exactly what this one saw: a sum doubles, a max is
    unchanged, gathered rows repeat. Enough to check every statistic asks for its reduction."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=2, backend="fake")

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t.mul_(2)

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def sum_number(self, x: float) -> float:
        return 2 * x

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t])

    def barrier(self) -> None:
        pass


@pytest.fixture
def two_ranks(monkeypatch):
    fake = TwoRanks()
    monkeypatch.setattr(distributed, "_current", fake)
    return fake


def test_shard_is_contiguous_and_covers_every_batch() -> None:
    batches = list(range(7))
    parts = [Ranks(r, 3).shard(batches) for r in range(3)]
    assert sum(parts, []) == batches and [len(p) for p in parts] == [2, 2, 3]
    assert Ranks().shard(batches) == batches


def test_calibration_batches_keep_single_process_batches(two_ranks) -> None:
    from lmfoundry.calibration.pipeline import calibration_batches

    ids = torch.arange(16 * 4).view(16, 4)
    mine = calibration_batches(ids, 4)  # 4 batches: rank 0 takes the first two, unchanged
    assert [b.tolist() for b in mine] == [b.tolist() for b in ids.split(4)[:2]]
    few = calibration_batches(ids[:3], 8)  # one batch for two ranks: re-cut into two
    assert sum(b.shape[0] for b in few) == 2
    with pytest.raises(UserError, match="cannot be shared by 2 ranks"):
        calibration_batches(ids[:1], 8)


def test_hessian_sums_over_ranks(two_ranks) -> None:
    """Two ranks that each saw x: the Hessian is 2·(2xᵀx)/(2N), the single-process one (the
    sum and the count both doubled), read once; adding after the read is a bug and says so."""
    from lmfoundry.quantizers.hessian import HessianAccumulator

    x = torch.randn(3, 40, 24)
    acc = HessianAccumulator()
    acc.add(x)
    h = acc.hessian()
    flat = x.reshape(-1, 24)
    torch.testing.assert_close(h, 2 * flat.t() @ flat / flat.shape[0], rtol=1e-5, atol=1e-5)
    assert acc.count == 2 * flat.shape[0]
    torch.testing.assert_close(acc.hessian(), h)  # a second read does not reduce again
    with pytest.raises(RuntimeError):
        acc.add(x)


def test_awq_statistics_sum_over_ranks(two_ranks) -> None:
    from lmfoundry.quantizers.awq import InputStats

    x = torch.randn(50, 16) + 0.5
    st = InputStats()
    st.add(x)
    torch.testing.assert_close(st.mean_abs(), x.abs().mean(0))
    torch.testing.assert_close(st.hessian(), 2 * x.t() @ x / 50, rtol=1e-5, atol=1e-5)
    assert st.count == 100


def test_input_recorder_reduces_absmax_and_gathers_rows(monkeypatch) -> None:
    from lmfoundry.quantizers.activations import InputRecorder

    class OtherRankLouder(TwoRanks):
        def max_(self, t: torch.Tensor) -> torch.Tensor:
            return t.copy_(torch.maximum(t, torch.full_like(t, 100.0)))

    monkeypatch.setattr(distributed, "_current", OtherRankLouder())
    rec = InputRecorder(rows_per_batch=4)
    x = torch.randn(2, 16, 8)
    rec(x)
    assert torch.equal(rec.absmax, torch.full((8,), 100.0))
    assert rec.sample().shape == (8, 8)  # 4 rows here, 4 from the other rank
    assert float(rec.tensor_absmax()) == 100.0


def test_kv_scales_take_the_max_over_ranks(monkeypatch) -> None:
    from helpers import tiny_decoder_layer

    from lmfoundry.quantformat.scheme import QuantArgs
    from lmfoundry.quantizers.base import LayerCalibration
    from lmfoundry.quantizers.kv_scales import calibrate_kv_scales

    layer, cos, sin, config = tiny_decoder_layer()
    x = torch.randn(2, 10, config.hidden_size)
    args = QuantArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)
    calib = LayerCalibration([x], cos, sin)
    alone = calibrate_kv_scales(layer, calib, args, torch.float32)

    class OtherRankLouder(TwoRanks):
        def max_(self, t: torch.Tensor) -> torch.Tensor:
            return t.mul_(3)  # the other rank saw three times larger K and V

    monkeypatch.setattr(distributed, "_current", OtherRankLouder())
    both = calibrate_kv_scales(layer, calib, args, torch.float32)
    for a, b in zip(alone, both, strict=True):
        torch.testing.assert_close(b, 3 * a)


# ------------------------------------------------------------------------- torchrun, 2 x gloo
def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--no-python", str(Path(sys.executable).parent / "lmfoundry"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)


def _codes(folder: Path) -> dict[str, torch.Tensor]:
    from lmfoundry.checkpoint.folder import CheckpointReader, decode_linear
    from lmfoundry.model.config import LAYER_LINEARS

    reader = CheckpointReader(folder)
    out = {}
    for i in range(reader.config["num_hidden_layers"]):
        for local in LAYER_LINEARS:
            name = f"model.layers.{i}.{local}"
            scheme = reader.plan.scheme_for(name)
            out[name] = decode_linear(reader.prefixed(name), scheme).q
    return out


def _ppl(folder: Path) -> float:
    from lmfoundry.calibration.data import eval_token_stream
    from lmfoundry.evals.perplexity import perplexity
    from lmfoundry.runtime.loader import load_model

    model, tok = load_model(str(folder))
    stream, _, _ = eval_token_stream(None, tok)
    return perplexity(model, stream, ctx=256, max_windows=8, progress=False).ppl


@pytest.mark.slow
def test_torchrun_two_gloo_ranks_match_one_process(tmp_path: Path) -> None:
    """SmolLM2-135M, GPTQ W4A16 g64 on 16 x 128 calibration tokens: rank 0 of `torchrun
    --nproc-per-node 2` writes a checkpoint whose codes equal the single-process run's on >= 99.9 %
    of weights and whose perplexity is within 0.5 %; the run record has the world size."""
    args = ("--quiet", "--device", "cpu", "--method", "gptq", "--scheme", "w4a16", "--group-size", "64",
            "--num-samples", "16", "--seq-len", "128")
    # the reference is a process of its own with one thread like each rank: BLAS blocking (torch's
    # and scipy's OpenBLAS, which torch.set_num_threads does not reach) changes the last bit
    single = tmp_path / "single"
    lone = subprocess.run([str(Path(sys.executable).parent / "lmfoundry"), "quantize", "smollm2-135m", "-o",
                           str(single), *args], capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert lone.returncode == 0, lone.stderr[-3000:]

    dp = tmp_path / "dp"
    proc = _torchrun(2, "quantize", "smollm2-135m", "-o", str(dp), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1  # one summary: rank 0's
    run = json.loads((dp / "lmfoundry-run.json").read_text())
    assert run["data_parallel"] == {"world_size": 2, "backend": "gloo"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work folders left

    a, b = _codes(single), _codes(dp)
    same = sum(int((a[n] == b[n]).sum()) for n in a)
    total = sum(a[n].numel() for n in a)
    assert same / total >= 0.999, f"{same / total:.5f} of codes equal"
    pa, pb = _ppl(single), _ppl(dp)
    assert abs(pb - pa) / pa < 0.005, (pa, pb)
    shutil.rmtree(dp)


def test_journal_keeps_every_rank_activations_the_journal_points_at(two_ranks, tmp_path: Path) -> None:
    """Each rank saves its activations per layer; the files of layer k are removed only once the
    journal (written by rank 0 after every rank saved) points at layer k+1, and a rank restores
    its own share."""
    from safetensors.torch import save_file

    from lmfoundry.calibration.journal import LayerJournal, activations_file
    from lmfoundry.calibration.pipeline import PipelineReport

    class Writer:
        tmp, weight_map, total_bytes = tmp_path, {}, 0

    journal = LayerJournal(tmp_path, "key")
    save_file({"batch.0": torch.full((2, 3), 1.0)}, str(tmp_path / activations_file(1, 1)))  # rank 1, layer 1
    journal.record(1, Writer, PipelineReport(), [torch.zeros(2, 3)])
    assert (tmp_path / activations_file(0, 1)).is_file() and (tmp_path / activations_file(1, 1)).is_file()
    save_file({"batch.0": torch.full((2, 3), 2.0)}, str(tmp_path / activations_file(1, 2)))
    journal.record(2, Writer, PipelineReport(), [torch.zeros(2, 3)])
    assert sorted(p.name for p in tmp_path.glob("activations*")) == [activations_file(0, 2), activations_file(1, 2)]
    assert LayerJournal.open(tmp_path, "key").done == 2
    two_ranks.rank = 1
    restored = LayerJournal.open(tmp_path, "key").restore(None, PipelineReport())
    assert torch.equal(restored[0], torch.full((2, 3), 2.0))
