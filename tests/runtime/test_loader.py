"""What a serving engine process keeps resident beyond the model: loading a quantized checkpoint
and building its CPU engine must not import compressed-tensors (our reader of its packed layout is
`quantformat.int32_packing`), TorchDynamo (which the meta-device skeleton's arithmetic would pull
in through torch._refs) or Triton (the GPU kernels' modules; the CPU engine runs their PyTorch
references from `kernels.kv_layout` and `kernels.w8a8_reference`). Each stays resident for the
server's life (benchmarks/serve_memory.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_model_folder, write_text

from lmfoundry.cli import main

CHILD = """
import json, sys
import torch
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_model
model, tokenizer = load_model(sys.argv[1], dtype=torch.bfloat16)
engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=32, block_size=4, max_num_batched_tokens=16,
                                                  kv_cache_dtype=sys.argv[2]))
out = engine.generate([[1, 5, 9, 200, 17]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(json.dumps({"tokens": out[0].outputs[0].token_ids,
                  "loaded": sorted(m for m in ("compressed_tensors", "torch._dynamo", "triton") if m in sys.modules)}))
"""


def test_a_quantized_cpu_engine_imports_no_compressed_tensors_dynamo_or_triton(tmp_path: Path) -> None:
    model = tiny_model_folder(tmp_path / "tiny", "llama")
    checkpoint = tmp_path / "w4a16"
    main(["quantize", str(model), "-o", str(checkpoint), "--quiet", "--method", "rtn", "--scheme", "w4a16",
          "--group-size", "32", "--num-samples", "2", "--seq-len", "32", "--kv-cache", "int8",
          "--calib", str(write_text(tmp_path / "c.txt"))])
    env = dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")
    for kv_cache_dtype in ("auto", "bfloat16"):  # auto: the calibrated int8 cache, through the layout's reference
        run = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), kv_cache_dtype], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert len(result["tokens"]) == 4  # the engine served from the checkpoint it read
        assert result["loaded"] == [], kv_cache_dtype


@pytest.mark.slow
def test_a_tp_bundle_with_its_rank_folders_swapped_is_refused_in_one_line(tmp_path: Path) -> None:
    """Rank 0 finds rank 1's share under rank0/ (and rank 1 rank 0's): each rank's engine.json is
    checked against the top-level record. serve says so in one line with the bundle check's exit
    code (4); the engine's own exit used to print "Exception ignored ... SystemExit: 143" under it."""
    from lmfoundry.compile.bundle import build_engine

    folder = tiny_model_folder(tmp_path / "llama", "llama", seed=4, hidden_size=128, head_dim=64,
                               num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    engine = build_engine(folder, ["ampere"], tmp_path / "engine", weights="copy", tp=2, progress=False).output
    (engine / "rank0").rename(engine / "swap")
    (engine / "rank1").rename(engine / "rank0")
    (engine / "swap").rename(engine / "rank1")
    run = subprocess.run([sys.executable, "-m", "lmfoundry.cli", "serve", str(engine), "--tp", "2", "--port", "0",
                          "--kv-cache-gb", "0.01", "--max-model-len", "64"], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 4, run.stderr
    lines = [line for line in run.stderr.splitlines() if not line.startswith("cpu: ")]
    assert lines == [f"error: {engine}/rank0/engine.json: missing, or not the one {engine}/engine.json records"], \
        run.stderr
