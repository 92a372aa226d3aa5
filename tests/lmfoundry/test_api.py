"""The Python API (lmfoundry/api/, re-exported by `lmfoundry`): the same artifacts and verdicts as
the CLI, the engine's tokens, typed one-line errors, and an `import lmfoundry` that costs nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import tiny_model_folder

import lmfoundry
from lmfoundry.cli import main
from lmfoundry.errors import LmfoundryError, UserError

ROOT = Path(__file__).resolve().parents[2]
RUN_RECORD = "lmfoundry-run.json"  # how a run went (time, memory): differs between runs by design
QUANT = {"method": "rtn", "scheme": "w4a16", "group_size": 32, "num_samples": 2, "seq_len": 16}


@pytest.fixture(scope="module")
def checkpoint(model, calib, tmp_path_factory) -> lmfoundry.Checkpoint:
    """`model` and `calib` (tests/lmfoundry/conftest.py): a tiny random Llama and calibration text."""
    return lmfoundry.quantize(model, output=tmp_path_factory.mktemp("q") / "api", calib=str(calib), quiet=True,
                              **QUANT)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != RUN_RECORD}


_ENV = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}  # no checkout folder shadows the package


def _python(code: str) -> str:
    """Run `code` in a fresh interpreter (what a module import costs, in which order, is only
    visible in a process that has imported nothing yet); its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=_ENV)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_lmfoundry_imports_no_torch_and_no_stage():
    out = _python("import sys, lmfoundry; lmfoundry.SamplingParams; lmfoundry.Checkpoint; "
                  "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('lmfoundry.calibration')))")
    assert out.strip() == "[]"


def test_every_exported_name_resolves():
    for name in lmfoundry.__all__:
        assert getattr(lmfoundry, name) is not None, name
    assert lmfoundry.LmfoundryError is LmfoundryError and issubclass(UserError, LmfoundryError)
    with pytest.raises(AttributeError):
        lmfoundry.no_such_name  # noqa: B018


@pytest.mark.parametrize("first", ["import lmfoundry.compile.bundle; import lmfoundry",
                                   "import lmfoundry; before = lmfoundry.compile; import lmfoundry.compile.source; "
                                   "assert lmfoundry.compile is before"])
def test_compile_is_callable_whichever_import_comes_first(first):
    # an empty arch list is refused by the API's compile itself: the call reached it
    out = _python(f"{first}\nfrom lmfoundry.errors import LmfoundryError\n"
                  "try:\n    lmfoundry.compile('x', arch=[])\nexcept LmfoundryError as e:\n    print('refused:', e)")
    assert out.startswith("refused: name at least one --arch")


def test_api_and_cli_write_byte_identical_checkpoints(model, calib, checkpoint, tmp_path):
    cli = tmp_path / "cli"
    main(["quantize", str(model), "-o", str(cli), "--quiet", "--method", "rtn", "--scheme", "w4a16",
          "--group-size", "32", "--num-samples", "2", "--seq-len", "16", "--calib", str(calib)])
    rec = lmfoundry.Recipe().with_overrides(source=str(calib), **QUANT)
    from_recipe = lmfoundry.quantize(model, recipe=rec, output=tmp_path / "recipe", quiet=True)
    assert (checkpoint.path / RUN_RECORD).is_file()
    api_files = _files(checkpoint.path)
    assert "model.safetensors.index.json" in api_files and "lmfoundry.json" in api_files
    assert api_files == _files(cli) == _files(from_recipe.path)
    assert checkpoint.scheme["scheme"] == "w4a16" and checkpoint.scheme["group_size"] == 32
    assert checkpoint.problems is None and checkpoint.verify() == ()


def test_quantize_is_quiet_on_stdout_and_says_its_summary_on_stderr(model, calib, tmp_path, capfd):
    lmfoundry.quantize(model, output=tmp_path / "loud", calib=str(calib), **QUANT)
    out, err = capfd.readouterr()
    assert out == "" and "wrote" in err
    lmfoundry.quantize(model, output=tmp_path / "quiet", calib=str(calib), quiet=True, **QUANT)
    assert capfd.readouterr() == ("", "")


def test_inspect_verifies_and_reports_a_tampered_file(checkpoint, tmp_path, capsys):
    good = lmfoundry.inspect(checkpoint.path)
    assert isinstance(good, lmfoundry.Checkpoint) and good.verified and good.problems == ()
    assert good.manifest == json.loads((checkpoint.path / "lmfoundry.json").read_text())
    assert good.summary["method"] == "rtn"
    bad_dir = tmp_path / "tampered"
    shutil.copytree(checkpoint.path, bad_dir)
    shard = sorted(bad_dir.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    bad = lmfoundry.inspect(bad_dir)
    assert bad.verified is False and any(shard.name in p for p in bad.problems)
    assert bad.verify() == bad.problems
    with pytest.raises(SystemExit) as exit_info:  # the command exits 1 on the same finding
        main(["inspect", str(bad_dir), "--json"])
    assert exit_info.value.code == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["problems"] == list(bad.problems) and not printed["verified"]


def test_api_errors_are_lmfoundry_errors_not_system_exit(model, tmp_path):
    with pytest.raises(LmfoundryError, match="no such folder"):
        lmfoundry.inspect(tmp_path / "missing")
    with pytest.raises(LmfoundryError, match="method"):
        lmfoundry.quantize(model, method="nope", output=tmp_path / "out", quiet=True)
    with pytest.raises(LmfoundryError, match="--max-tokens"):
        lmfoundry.compile(model, arch="hopper", max_tokens=8, output=tmp_path / "engine")
    assert not (tmp_path / "out").exists() and not (tmp_path / "engine").exists()


def test_llm_greedy_tokens_equal_the_engines(checkpoint):
    import torch

    from lmfoundry.runtime.engine.engine_config import EngineConfig
    from lmfoundry.runtime.engine.llm_engine import LLMEngine

    prompts = ["the model", "a cache of blocks and", [5, 6, 7, 8, 9, 10]]
    greedy = lmfoundry.SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    engine = LLMEngine.from_pretrained(str(checkpoint.path), torch.float32, EngineConfig(max_num_batched_tokens=64))
    expected = [(o.outputs[0].token_ids, o.outputs[0].text) for o in engine.generate(prompts, greedy)]
    with lmfoundry.LLM(checkpoint, dtype="float32", max_num_batched_tokens=64) as llm:
        outs = llm.generate(prompts, greedy)
        assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == expected
        first = outs[0].outputs[0]
        assert first.finish_reason == "length" and len(first.logprobs) == 8 and len(first.logprobs[0].top) == 2
        messages = [{"role": "user", "content": "the model"}]
        templated = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chat = llm.chat(messages, greedy)
        assert chat[0].prompt_token_ids == llm.tokenizer(templated, add_special_tokens=False).input_ids
        assert chat[0].outputs[0].token_ids == llm.generate(templated, greedy)[0].outputs[0].token_ids
        with pytest.raises(LmfoundryError, match="prompt 1: max_tokens"):
            llm.generate(["ok", "too long"], [greedy, lmfoundry.SamplingParams(max_tokens=0)])
    with pytest.raises(LmfoundryError, match="closed"):
        llm.generate("the model", greedy)
    with pytest.raises(LmfoundryError, match="unknown engine option"):
        lmfoundry.LLM(checkpoint, max_num_seq=4)


def test_llm_greedy_tokens_equal_serves(checkpoint):
    """The same prompts, greedy, through `LLM.generate` in this process and through `lmfoundry
    serve`'s /v1/completions: the same text and the same log-probabilities of the chosen tokens
    (one engine behind both; serve adds the HTTP layer and its own engine process)."""
    import json as jsonlib
    import urllib.request

    from helpers import start_serve, stop_serve, wait_for_url

    prompts: list = [[5, 6, 7, 8, 9, 10], "a cache of blocks and"]
    greedy = lmfoundry.SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    with lmfoundry.LLM(checkpoint, dtype="float32") as llm:
        ours = llm.generate(prompts, greedy)
    proc = start_serve([str(checkpoint.path), "--port", "0", "--dtype", "float32", "--max-model-len", "256",
                        "--kv-cache-gb", "0.01"])
    try:
        url = wait_for_url(proc)
        for prompt, out in zip(prompts, ours, strict=True):
            body = {"model": checkpoint.path.name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "logprobs": 1, "ignore_eos": True}
            req = urllib.request.Request(f"{url}/completions", data=jsonlib.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                choice = jsonlib.loads(resp.read())["choices"][0]
            assert choice["text"] == out.outputs[0].text
            served = choice["logprobs"]["token_logprobs"]
            mine = [step.logprob for step in out.outputs[0].logprobs]
            assert len(served) == len(mine) == 8
            assert max(abs(a - b) for a, b in zip(served, mine, strict=True)) < 1e-4
    finally:
        stop_serve(proc)


def _gate(tmp: Path) -> Path:
    """A gate of perplexity windows and greedy answers only: seconds on the tiny model."""
    text = tmp / "ppl.txt"
    text.write_text(("Perplexity is the exponential of the mean negative log-likelihood per token. " * 40 + "\n") * 4)
    prompts = tmp / "prompts.yaml"
    prompts.write_text('chat:\n  - {id: fox, prompt: "The quick brown fox"}\n')
    gate = {"name": "tiny", "seed": 0, "confidence": 0.95, "resamples": 200,
            "prompt": {"add_bos": "tokenizer", "chat_template": False, "num_fewshot": 0},
            "defaults": {"max_ppl_ratio": 1.05, "max_mean_kld": 0.05, "min_same_top": 0.9},
            "tiers": {"quick": {"perplexity": {"text": str(text), "ctx": 32, "windows": 6, "top_k": 16},
                                "generation": {"prompts": str(prompts), "max_tokens": 4}}}}
    path = tmp / "gate.yaml"
    path.write_text(yaml.safe_dump(gate))
    return path


def test_eval_gate_gives_the_commands_verdict(model, checkpoint, tmp_path):
    gate = _gate(tmp_path)
    api = lmfoundry.eval_gate(checkpoint, baseline=model, gate=gate, output=tmp_path / "api", write_promotion=False,
                              use_cache=False, quiet=True)
    assert api.verdict in ("pass", "fail", "inconclusive") and api.json_path.is_file()
    gated = [m for m in api.report["metrics"] if m["gated"]]
    assert gated and all({"low", "high", "point", "threshold", "verdict"} <= set(m) for m in gated)
    try:
        main(["eval-gate", str(checkpoint.path), "--baseline", str(model), "--gate", str(gate), "-o",
              str(tmp_path / "cli"), "--no-promotion", "--no-cache", "--quiet"])
        code = 0
    except SystemExit as exc:
        code = exc.code
    cli = json.loads((tmp_path / "cli" / "eval-gate.json").read_text())
    assert code == api.exit_code and cli["verdict"] == api.verdict
    assert [m["point"] for m in cli["metrics"]] == [m["point"] for m in api.report["metrics"]]


@pytest.mark.slow
def test_the_ci_example_ships_the_recipe_that_passes(calib, tmp_path):
    """docs/examples/ci_gate.py end to end on a tiny model whose heads the GPU kernels take: W4A16
    fails the gate's same-top-token rate, W8A16 passes, is compiled for ampere and generates."""
    baseline = tiny_model_folder(tmp_path / "tiny", num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "ci_gate.py"), "--model", str(baseline), "--work",
         str(tmp_path / "ci"), "--gate", str(_gate(tmp_path)), "--calib", str(calib), "--num-samples", "2",
         "--seq-len", "16", "--arch", "ampere"],
        capture_output=True, text=True, timeout=900, env=_ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "smollm2-w4a16-rtn: fail" in "\n".join(lines) and any(line.startswith("shipping smollm2-w8a16-rtn") for line in lines)
    assert sum(line.startswith("length: ") for line in lines) == 2
    assert lmfoundry.inspect(tmp_path / "ci" / "smollm2-w8a16-rtn-engine").verified
