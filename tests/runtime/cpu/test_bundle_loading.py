"""`lmfoundry compile --arch cpu`: the engine's CPU step compiled ahead of time (AOTInductor).

One tiny W4A16 checkpoint is compiled once per module (about half a minute on 2 cores). The bundle
serves the checkpoint's greedy tokens with no Inductor compile at load or run time, every file is
verified, a bundle for another ISA serves the packed eager model, and compile refuses a
checkpoint whose files do not match its manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import OwnTokens, assert_greedy_up_to_bf16_ties, tiny_model_folder, write_text

from lmfoundry.cli import main
from lmfoundry.engine_bundle.engine_manifest import EngineIntegrityError
from lmfoundry.errors import UserError
from lmfoundry.runtime.cpu import features as cpu_isa
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_isa.native_bf16(), reason="--arch cpu compiles the bf16 step")

PROMPTS = [[1, 5, 9, 200, 17], [1, 3] * 7, [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


class Built:
    def __init__(self, root: Path) -> None:
        model = tiny_model_folder(root / "tiny", "llama")
        self.checkpoint = root / "w4a16"
        main(["quantize", str(model), "-o", str(self.checkpoint), "--quiet", "--method", "rtn", "--scheme", "w4a16",
              "--group-size", "32", "--num-samples", "2", "--seq-len", "32", "--calib", str(write_text(root / "c.txt"))])
        self.engine = root / "engine"
        main(["compile", str(self.checkpoint), "--arch", "cpu", "-o", str(self.engine), "--max-tokens", "64"])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("cpu-bundle"))


def greedy(model, tokenizer, max_tokens: int = 16, **cfg) -> list[list[int]]:
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, **cfg))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def assert_greedy_as(got: list[list[int]], model, tokenizer) -> None:
    """`got` are `model`'s greedy tokens up to bf16 ties (a compiled bf16 step rounds in another
    order than the eager model: fused norms, other GEMM kernels)."""
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    want = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert_greedy_up_to_bf16_ties(model, got, want)


def test_bundle_serves_the_checkpoints_tokens_without_compiling(built: Built, monkeypatch) -> None:
    import torch._inductor.compile_fx as compile_fx

    compiles = []
    real = compile_fx.compile_fx
    monkeypatch.setattr(compile_fx, "compile_fx", lambda *a, **k: compiles.append(1) or real(*a, **k))
    manifest = json.loads((built.engine / "engine.json").read_text())
    assert manifest["target"] == "cpu" and manifest["cpu"]["isa"] == cpu_isa.isa()
    assert (built.engine / manifest["cpu"]["step"]["path"]).is_file()
    model, tok = load_model(built.engine, dtype=torch.bfloat16)
    assert model.compiled_step is not None
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    got = [o.outputs[0].token_ids for o in engine.generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    checkpoint, _ = load_model(built.checkpoint, dtype=torch.bfloat16)
    assert_greedy_as(got, checkpoint, tok)
    assert engine.runner.executor.compiled_steps > 0  # the package ran: prefill chunks and decodes
    assert compiles == []
    assert engine.info.weight_format == "w4a16 g32 (compiled step)"  # what serve prints and /v1/models says


def test_the_compiled_step_equals_the_eager_step_within_bf16(built: Built) -> None:
    """Hidden states of one mixed step (a prefill chunk and decodes) through the package and the
    eager packed model: the same bf16 operations in another order (fused loops, AMX tiles)."""
    model, _ = load_model(built.engine, dtype=torch.bfloat16)
    step = model.compiled_step
    del model.compiled_step
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (12,))
    positions = torch.arange(12)

    compiled = step(model, ids, positions, OwnTokens()).float()
    eager = model.hidden_states(ids, positions, OwnTokens()).float()
    assert compiled.shape == eager.shape == (12, model.config.hidden_size)
    assert torch.isfinite(compiled).all()
    # bf16 rounding of each of the ~7 ops per layer's outputs, relative to the activations' size
    layers = model.config.num_layers
    assert ((compiled - eager).norm() / eager.norm()) < 8 * layers * 2.0**-8


def test_the_package_looks_rows_up_in_the_eager_table(built: Built) -> None:
    """The package takes embedding rows, looked up in the one table the engine keeps (for the LM
    head too): a row changed in the eager table changes what the compiled step computes, exactly
    as it changes the eager step, and the package holds no copy of the table."""
    model, _ = load_model(built.engine, dtype=torch.bfloat16)
    manifest = json.loads((built.engine / "engine.json").read_text())
    assert manifest["cpu"]["step"]["inputs"] == "embeddings" and model.compiled_step.embedded
    assert manifest["format"] == "lmfoundry-engine/2"  # readers that know only /1 refuse it
    from lmfoundry.heap import page_out_mapped_files

    assert page_out_mapped_files(".wrapper.so") > 0  # the loaded library is what the page-out names
    step = model.compiled_step
    del model.compiled_step
    ids, positions = torch.tensor([7, 8, 9, 7]), torch.arange(4)
    before = step(model, ids, positions, OwnTokens()).float()
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    compiled = step(model, ids, positions, OwnTokens()).float()
    eager = model.hidden_states(ids, positions, OwnTokens()).float()
    assert not torch.allclose(compiled[0], before[0])
    assert ((compiled - eager).norm() / eager.norm()) < 8 * model.config.num_layers * 2.0**-8


@pytest.mark.slow
def test_a_package_of_the_ids_step_still_loads(built: Built, tmp_path: Path) -> None:
    """Bundles written before the step took embedding rows hold the table and take the ids
    (engine.json has no cpu.step.inputs): they load and serve as before."""
    from torch import nn

    from lmfoundry.runtime.cpu.compiled_step import ExportedAttention

    class IdsStep(nn.Module):  # the step as those bundles compiled it
        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.model.hidden_states(ids, positions, ExportedAttention())

    import torch.fx.experimental._config as fx_config

    copy = Path(shutil.copytree(built.engine, tmp_path / "engine"))
    manifest = json.loads((copy / "engine.json").read_text())
    package = copy / manifest["cpu"]["step"]["path"]
    model, tok = load_model(built.checkpoint, dtype=torch.bfloat16)
    example, tokens = torch.arange(8), torch.export.Dim("tokens", min=1, max=64)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        exported = torch.export.export(IdsStep(model).eval(), (example, example.clone()),
                                       dynamic_shapes={"ids": {0: tokens}, "positions": {0: tokens}})
        package.unlink()
        torch._inductor.aoti_compile_and_package(exported, package_path=str(package))
    from lmfoundry.manifest import sha256_file

    manifest["cpu"]["step"]["sha256"] = sha256_file(package)
    del manifest["cpu"]["step"]["inputs"]
    manifest["format"] = "lmfoundry-engine/1"  # as those bundles were
    (copy / "engine.json").write_text(json.dumps(manifest))
    old, _ = load_model(copy, dtype=torch.bfloat16)
    assert not old.compiled_step.embedded
    engine = LLMEngine(old, tok, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    got = [o.outputs[0].token_ids for o in engine.generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    assert engine.runner.executor.compiled_steps > 0
    assert_greedy_as(got, model, tok)


def test_a_modified_step_is_refused(built: Built, tmp_path: Path) -> None:
    copy = tmp_path / "engine"
    shutil.copytree(built.engine, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    step = copy / manifest["cpu"]["step"]["path"]
    data = bytearray(step.read_bytes())
    data[len(data) // 2] ^= 1
    step.write_bytes(bytes(data))
    with pytest.raises(EngineIntegrityError, match="sha256"):
        load_model(copy)


@pytest.mark.parametrize("edit, message", [
    ({"inputs": "pixels"}, "cpu.step.inputs must be 'embeddings' or 'ids'"),
    ({"format": "lmfoundry-engine/1"}, "a step taking embedding rows is format lmfoundry-engine/2"),
    ({"inputs": None}, "a step taking embedding rows is format lmfoundry-engine/2"),
], ids=["unknown input", "embeddings under /1", "ids under /2"])
def test_a_step_input_its_format_does_not_say_is_refused(built: Built, tmp_path: Path, edit, message) -> None:
    copy = Path(shutil.copytree(built.engine, tmp_path / "engine"))
    manifest = json.loads((copy / "engine.json").read_text())
    if "format" in edit:
        manifest["format"] = edit["format"]
    elif edit["inputs"] is None:
        del manifest["cpu"]["step"]["inputs"]
    else:
        manifest["cpu"]["step"]["inputs"] = edit["inputs"]
    (copy / "engine.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=message):
        load_model(copy)


def test_another_isa_serves_the_packed_eager_model(built: Built, monkeypatch, caplog) -> None:
    other = "avx2" if cpu_isa.isa() != "avx2" else "avx512"
    monkeypatch.setattr(cpu_isa, "isa", lambda: other)
    with caplog.at_level(logging.WARNING, logger="lmfoundry.runtime"):
        model, tok = load_model(built.engine, dtype=torch.bfloat16)
    assert getattr(model, "compiled_step", None) is None
    assert any(f"this one is {other}" in r.getMessage() for r in caplog.records)
    checkpoint, _ = load_model(built.checkpoint, dtype=torch.bfloat16)
    assert greedy(model, tok) == greedy(checkpoint, tok)


def test_compile_refuses_a_checkpoint_that_does_not_match_its_manifest(built: Built, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(built.checkpoint, copy)
    shard = next(copy.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    from lmfoundry.compile.cpu_step import build_cpu_engine

    with pytest.raises(UserError, match=f"{shard.name}: sha256 mismatch"):
        build_cpu_engine(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cpu_and_gpu_archs_are_separate_builds(built: Built, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compile", str(built.checkpoint), "--arch", "cpu", "--arch", "hopper", "-o", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and "separately" in err[0]
    assert not (tmp_path / "x").exists()


def test_inspect_verifies_every_file_of_the_bundle(built: Built, tmp_path: Path, capsys) -> None:
    main(["inspect", str(built.engine)])
    out = capsys.readouterr().out
    assert "every file matches engine.json" in out and "amx" in out or cpu_isa.isa() in out
    copy = tmp_path / "engine"
    shutil.copytree(built.engine, copy)
    (copy / "weights" / "config.json").write_text((copy / "weights" / "config.json").read_text() + " ")
    with pytest.raises(SystemExit) as exc:
        main(["inspect", str(copy)])
    assert exc.value.code == 1
    assert "weights/config.json: sha256 mismatch" in capsys.readouterr().err


def test_a_serving_engine_releases_the_eager_linears_the_package_holds(built: Built) -> None:
    """`serve` drops the eager decoder linears of a bundle whose compiled step takes every step:
    the same tokens after, and a step the package cannot take is refused in one line, not run on
    missing weights. With steps larger than the package's, or LoRA, nothing is dropped."""
    model, tok = load_model(built.engine, dtype=torch.bfloat16)
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
    released = engine.release_eager_weights()
    assert released == sum(1 for m in model.modules() if type(m).__name__ == "ReleasedLinear") > 0
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)] == before
    engine.runner.executor.compiled_max_tokens = 4  # a chunk of 8 new prompt tokens is now the eager model's
    with pytest.raises(RuntimeError, match="linears were released"):
        engine.generate([list(range(100, 130))], params)
    for config in ({"max_num_batched_tokens": 128}, {"max_loras": 1}):  # over the package's 64 tokens; LoRA
        kept, tok = load_model(built.engine, dtype=torch.bfloat16)
        engine = LLMEngine(kept, tok, EngineConfig(num_kv_blocks=64, block_size=4, **config))
        assert engine.release_eager_weights() == 0, config
    eager, tok = load_model(built.checkpoint, dtype=torch.bfloat16)  # no compiled step: nothing to release
    assert LLMEngine(eager, tok, EngineConfig(num_kv_blocks=64, block_size=4)).release_eager_weights() == 0


SERVING_CHILD = """
import json, sys
import torch
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from lmfoundry.runtime.loader import load_model
model, tok = load_model(sys.argv[1], dtype=torch.bfloat16)
engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
out = engine.generate([[1, 5, 9, 200, 17]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(json.dumps({"steps": engine.runner.executor.compiled_steps, "tokens": out[0].outputs[0].token_ids,
                  "loaded": sorted(m for m in ("torch._inductor", "torch._dynamo", "triton") if m in sys.modules)}))
"""


def test_a_bundle_serves_without_importing_inductor_dynamo_or_triton(built: Built, tmp_path) -> None:
    """The package runs through torch's C++ AOTInductor loader and the step's ops are plain
    library ops: a serving process keeps none of the compiler's modules resident."""
    env = dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", SERVING_CHILD, str(built.engine)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["steps"] > 0 and len(result["tokens"]) == 4  # the package served the tokens
    assert result["loaded"] == []


CACHED_CHILD = """
import json, sys
import torch
from lmfoundry.runtime.cpu.step_cache import cached_cpu_engine
from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams
bundle, built = cached_cpu_engine(sys.argv[1], max_tokens=64)
engine = LLMEngine.from_pretrained(str(bundle), torch.bfloat16,
                                   EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=8))
released = engine.release_eager_weights()
out = engine.generate([[1, 5, 9, 200, 17]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(json.dumps({"built": built, "released": released, "tokens": len(out[0].outputs[0].token_ids),
                  "loaded": sorted(m for m in ("torch._inductor", "torch._dynamo", "triton") if m in sys.modules)}))
"""


def test_serve_compile_step_builds_the_bundle_once_into_the_cache(built: Built, tmp_path, monkeypatch,
                                                                   capsys) -> None:
    """`serve --compile-step`: the first start compiles the checkpoint's step into the cache, later
    starts (same files, block size, torch, ISA) reuse it; a bundle or a GPU device is refused."""
    from lmfoundry import devices
    from lmfoundry.runtime.cpu import step_cache as cpu_step

    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    first, built_now = cpu_step.cached_cpu_engine(built.checkpoint, max_tokens=64)  # a small step: quick
    assert built_now and (first / "engine.json").is_file() and first.parent == tmp_path / "cache" / "cpu-steps"
    monkeypatch.setattr(cpu_step, "build_in_child", lambda *a, **k: pytest.fail("built twice"))
    again, built_now = cpu_step.cached_cpu_engine(built.checkpoint, max_tokens=64)
    assert again == first and not built_now
    # serve's engine process looks the step up in the cache and serves it, keeping neither the build's
    # modules nor the GPU kernels' resident
    run = subprocess.run([sys.executable, "-c", CACHED_CHILD, str(built.checkpoint)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1"), cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"built": False, "released": result["released"], "tokens": 4, "loaded": []}
    assert result["released"] > 0
    model, tok = load_model(first)
    reference, _ = load_model(built.checkpoint)
    assert_greedy_as(greedy(model, tok), reference, tok)
    # refused by serve itself, before an engine process starts
    for spec, device, needle in ((built.engine, "cpu", "engine bundle already"),
                                 (built.checkpoint, "cuda", "compiles the CPU step")):
        monkeypatch.setattr(devices, "check_device", lambda d, device=device: device)
        with pytest.raises(SystemExit):
            main(["serve", str(spec), "--compile-step", "--port", "0"])
        assert needle in capsys.readouterr().err
