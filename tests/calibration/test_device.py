"""`quantize --device` and `--offload`: the pipeline's placement of layers, activations and
statistics. On CPU the offload path (activations moved per batch) must write the same bytes as
the resident one; `--device cuda` without a GPU is one error line; on a GPU (gpu tier) the CUDA
run agrees with the CPU run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_model_folder, write_text

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.manifest import read_run_record
from lmfoundry.recipe import Recipe


def _recipe(tmp_path: Path, method: str, **q) -> dict:
    rec = Recipe().with_overrides(method=method, **q)
    rec = rec.with_overrides(source=str(write_text(tmp_path / "calib.txt")), num_samples=4, seq_len=32,
                    batch_size=2)
    return rec


def _shards(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("method,q", [("gptq", {"scheme": "w4a16", "group_size": 32}),
                                      ("awq", {"scheme": "w4a16", "group_size": 32}),
                                      ("smoothquant", {"scheme": "w8a8", "kv_cache": "int8"})])
def test_offloaded_activations_write_the_same_bytes(tmp_path: Path, monkeypatch, method: str, q: dict) -> None:
    """The sequential (GPTQ) and two-pass (AWQ, SmoothQuant + KV) paths through `load`/`store`:
    every batch leaves and re-enters its storage, and the checkpoint is byte-identical."""
    from lmfoundry.quantizers import base

    moves = {"load": 0, "store": 0}
    load, store = base.LayerCalibration.load, base.LayerCalibration.store

    def counted_load(self, x):
        moves["load"] += self.offload
        return load(self, x)

    def counted_store(self, y):
        moves["store"] += self.offload
        return store(self, y)

    monkeypatch.setattr(base.LayerCalibration, "load", counted_load)
    monkeypatch.setattr(base.LayerCalibration, "store", counted_store)
    src = tiny_model_folder(tmp_path / "src", "llama")
    rec = _recipe(tmp_path, method, **q)
    run_job(QuantizeJob(str(src), tmp_path / "resident", rec, progress=False, offload="no"))
    assert moves == {"load": 0, "store": 0}
    import lmfoundry.calibration.memory as memory

    monkeypatch.setattr(memory, "activations_offload", lambda *a, **k: True)  # as on a GPU that is full
    run_job(QuantizeJob(str(src), tmp_path / "offloaded", rec, progress=False))
    assert moves["load"] > 0 and moves["store"] > 0
    assert _shards(tmp_path / "offloaded") == _shards(tmp_path / "resident")
    offloaded, resident = read_run_record(tmp_path / "offloaded"), read_run_record(tmp_path / "resident")
    assert offloaded is not None and offloaded["activations_offloaded"] is True
    assert resident is not None and resident["device"] == "cpu"


def test_device_flag_errors_and_auto(tmp_path: Path, monkeypatch, capsys) -> None:
    from lmfoundry.cli import main

    src = tiny_model_folder(tmp_path / "src", "llama")
    calib = write_text(tmp_path / "calib.txt")
    base = ["quantize", str(src), "--method", "rtn", "--quiet", "--calib", str(calib), "--num-samples", "2",
            "--seq-len", "16"]

    def fails(*args: str) -> str:
        with pytest.raises(SystemExit) as exc:
            main([*base, *args])
        assert exc.value.code != 0
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in fails("-o", str(tmp_path / "a"), "--device", "cuda")
    assert not (tmp_path / "a").exists()
    assert "--device 'tpu'" in fails("-o", str(tmp_path / "b"), "--device", "tpu")
    main([*base, "-o", str(tmp_path / "c")])  # --device auto: the CPU here
    run = read_run_record(tmp_path / "c")
    assert run is not None
    assert run["device"] == "cpu" and run["data_parallel"] == {"world_size": 1, "backend": None}
    assert len(run["layer_seconds"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_calibration_agrees_with_cpu(tmp_path: Path) -> None:
    """GPTQ on the GPU (Hessians, Cholesky and sweep on the device, activations resident or
    offloaded to pinned memory) against the CPU run: codes agree on >= 99 % of weights (matmul
    rounding differs between the devices), and offloading changes no byte."""
    from lmfoundry.checkpoint.folder import CheckpointReader, decode_linear
    from lmfoundry.model.config import LAYER_LINEARS

    src = tiny_model_folder(tmp_path / "src", "llama")
    rec = _recipe(tmp_path, "gptq", scheme="w4a16", group_size=32)
    run_job(QuantizeJob(str(src), tmp_path / "cpu", rec, progress=False, device="cpu"))
    run_job(QuantizeJob(str(src), tmp_path / "cuda", rec, progress=False, device="cuda", offload="no"))
    run_job(QuantizeJob(str(src), tmp_path / "cuda-off", rec, progress=False, device="cuda", offload="yes"))
    assert _shards(tmp_path / "cuda") == _shards(tmp_path / "cuda-off")
    a, b = CheckpointReader(tmp_path / "cpu"), CheckpointReader(tmp_path / "cuda")
    same = total = 0
    for i in range(a.config["num_hidden_layers"]):
        for local in LAYER_LINEARS:
            name = f"model.layers.{i}.{local}"
            qa = decode_linear(a.prefixed(name), a.plan.scheme_for(name)).q
            qb = decode_linear(b.prefixed(name), b.plan.scheme_for(name)).q
            same, total = same + int((qa == qb).sum()), total + qa.numel()
    assert same / total >= 0.99, same / total
