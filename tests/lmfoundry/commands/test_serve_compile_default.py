"""`serve CKPT` builds the compiled CPU step by default only where it is the faster path: an AMX
CPU and an integer weight-only checkpoint, with nothing else needing the eager model; otherwise
it serves the eager model, and a default build that fails falls back to it in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_model_folder, write_text

from lmfoundry.cli import main
from lmfoundry.runtime.cpu import step_policy
from lmfoundry.runtime.server import api_process


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("compile-default")
    tiny = tiny_model_folder(root / "tiny", "llama")
    calib = str(write_text(root / "c.txt"))
    out = {"float": str(tiny)}
    for scheme in ("w4a16", "w8a8"):
        main(["quantize", str(tiny), "-o", str(root / scheme), "--quiet", "--method", "rtn", "--scheme", scheme,
              "--group-size", "32", "--num-samples", "2", "--seq-len", "32", "--calib", calib])
        out[scheme] = str(root / scheme)
    return out


@pytest.fixture
def amx(monkeypatch) -> None:
    from lmfoundry.runtime.cpu import features as cpu_isa

    features = dict(cpu_isa.cpu_features(), amx_bf16=True)
    monkeypatch.setattr(cpu_isa, "cpu_features", lambda: features)


def by_default(model: str, **overrides) -> str | None:
    args = {"device": "cpu", "tp": 1, "deterministic": False, "run_dtype": torch.bfloat16, "lora_slots": 0,
            "speculative": None, **overrides}
    return step_policy.compiled_step_by_default(model, **args)


def test_an_amx_cpu_compiles_a_weight_only_checkpoint(folders, amx) -> None:
    assert by_default(folders["w4a16"]) is not None
    assert by_default(folders["float"]) is None  # float weights: oneDNN already runs them on AMX
    assert by_default(folders["w8a8"]) is None  # activations quantized too: not what the step compiles for
    for overrides in ({"device": "cuda"}, {"tp": 2}, {"deterministic": True}, {"run_dtype": torch.float32},
                      {"lora_slots": 1}, {"speculative": "ngram"}):
        assert by_default(folders["w4a16"], **overrides) is None, overrides


def test_without_amx_the_eager_model_serves(folders, monkeypatch) -> None:
    from lmfoundry.runtime.cpu import features as cpu_isa

    features = dict(cpu_isa.cpu_features(), amx_bf16=False)
    monkeypatch.setattr(cpu_isa, "cpu_features", lambda: features)
    assert by_default(folders["w4a16"]) is None


def test_a_default_build_that_fails_serves_the_eager_model(folders, monkeypatch, capsys) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nfound")

    monkeypatch.setattr(step_policy, "compiled_step_bundle", broken)
    model = folders["w4a16"]
    assert step_policy.default_compiled_step(model, 16, "reason", True) == model
    err = capsys.readouterr().err
    assert "serving through the compiled step: reason" in err
    assert "could not be built (no C++ compiler found); serving the eager model" in err
    monkeypatch.setattr(step_policy, "compiled_step_bundle", lambda m, b, v: str(Path(m) / "bundle"))
    assert step_policy.default_compiled_step(model, 16, "reason", True) == str(Path(model) / "bundle")
    assert step_policy.default_compiled_step(model, 16, None, True) == model  # no reason: no build


class EngineHere:
    """`EngineCoreClient`'s stand-in: runs the spec's factory (what the engine process runs) in
    this process, with `LLMEngine.from_pretrained` recording the model it was asked to load."""

    info = SimpleNamespace(max_position_embeddings=64, max_model_len=64)

    def __init__(self, spec, **kwargs) -> None:
        spec.build()

    def shutdown(self, seconds) -> None:
        pass


@pytest.fixture
def engine_here(monkeypatch) -> list[str]:
    from lmfoundry.errors import UserError
    from lmfoundry.runtime.engine import core_client, llm_engine

    loaded: list[str] = []

    def load(model, *args, **kwargs):
        loaded.append(model)
        return SimpleNamespace(release_eager_weights=lambda: 0)

    def named(name, info):
        raise UserError(f"served as {name}")

    monkeypatch.setattr(core_client, "EngineCoreClient", EngineHere)
    monkeypatch.setattr(llm_engine.LLMEngine, "from_pretrained", load)
    monkeypatch.setattr(api_process, "print_runtime", named)
    return loaded


def test_serve_takes_the_default_and_no_compile_step_turns_it_off(folders, amx, engine_here, monkeypatch,
                                                                    capsys) -> None:
    """The CLI path: on an AMX CPU the engine of `serve CKPT` loads the compiled step's bundle;
    with `--no-compile-step` it loads the checkpoint itself. Either way clients address the model
    they named, not the cache folder's digest."""
    model = folders["w4a16"]
    cached = str(Path(model).parent / "cache" / "cpu-steps" / "0123abcd")
    built: list[tuple[str, int, bool]] = []

    def build(m, block_size, verified):
        built.append((m, block_size, verified))
        return cached

    monkeypatch.setattr(step_policy, "compiled_step_bundle", build)
    with pytest.raises(SystemExit):
        main(["serve", model, "--port", "0", "--dtype", "bfloat16"])
    err = capsys.readouterr().err
    # serve verified the checkpoint against its manifest: the cache key may take its sha256s
    assert built == [(model, 16, True)] and engine_here == [cached]
    assert "serving through the compiled step" in err and f"served as {Path(model).name}" in err
    with pytest.raises(SystemExit):
        main(["serve", model, "--port", "0", "--dtype", "bfloat16", "--no-compile-step"])
    err = capsys.readouterr().err
    assert built == [(model, 16, True)] and engine_here == [cached, model]
    with pytest.raises(SystemExit):
        main(["serve", model, "--port", "0", "--dtype", "bfloat16", "--skip-verify"])
    assert built[-1] == (model, 16, False)  # not verified: the key hashes every file
    assert "compiled step" not in err and f"served as {Path(model).name}" in err


def test_options_are_checked_before_a_default_build(folders, amx, monkeypatch, capsys) -> None:
    """A bad option fails at once, not after minutes of compiling."""
    monkeypatch.setattr(step_policy, "default_compiled_step",
                        lambda *a: pytest.fail("built before the options were checked"))
    for extra, needle in ((["--block-size", "0"], "--block-size must be at least 1"),
                          (["--draft-model", folders["float"]], "--draft-model needs --speculative draft")):
        with pytest.raises(SystemExit):
            main(["serve", folders["w4a16"], "--port", "0", "--dtype", "bfloat16", *extra])
        assert needle in capsys.readouterr().err


def test_gguf_files_and_builtin_names_are_not_read_for_the_default(amx, monkeypatch) -> None:
    """Only a checkpoint folder's config.json is read: a GGUF file or a built-in name would be
    converted just to find out, and neither is ever weight-only quantized."""
    from lmfoundry.checkpoint import sources

    monkeypatch.setattr(sources, "resolve_model", lambda *a, **k: pytest.fail("converted in the front process"))
    assert step_policy.weight_only_integer("smollm2-135m") is False
    assert step_policy.weight_only_integer("/nowhere/model.gguf") is False
