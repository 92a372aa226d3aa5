"""`lmfoundry eval-gate` is the Python API's `eval_gate` (issue 59: one code path, the command only
parses flags and prints): the same flags and keywords reach `run_gate` (and, with --dry-run,
`plan_gate`) with the same arguments, and the command's refusals are the API's. The end-to-end
comparison of both verdicts on a tiny model is tests/lmfoundry/test_api.py's
`test_eval_gate_gives_the_commands_verdict`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import lmfoundry.evals.gate as gate_module  # where the API's calls find run_gate and plan_gate
from lmfoundry.api import gating
from lmfoundry.cli import main
from lmfoundry.errors import UserError
from lmfoundry.evals.gate import GateResult
from lmfoundry.evals.gate_memory import MemoryPlan, ModelMemory


def _recorder(calls: list[tuple[tuple[Any, ...], dict[str, Any]]], result: Any):
    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return result
    return record


def _cli(args: list[str]) -> int | None:
    try:
        main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return None


def test_the_command_runs_the_apis_gate(model, tmp_path, monkeypatch, capsys):
    adapter = tmp_path / "adapter"
    result = GateResult("fail", 1, {"metrics": [], "failing": []}, tmp_path / "r.json", tmp_path / "r.md",
                        tmp_path / "r.png", False)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(gate_module, "run_gate", _recorder(calls, result))
    code = _cli(["eval-gate", str(model), "--baseline", str(model), "--gate", "g.yaml", "--tier", "full",
                 "-o", str(tmp_path / "out"), "--task", "lmf_piqa", "--include-path", str(tmp_path),
                 "--inconclusive-exit", "1", "--no-cache", "--no-promotion", "--quiet", "--dtype", "float32",
                 "--lora", f"ad={adapter}"])
    assert code == 1 and "verdict: FAIL" in capsys.readouterr().out
    api = gating.eval_gate(model, baseline=str(model), gate="g.yaml", tier="full", output=str(tmp_path / "out"),
                           tasks=["lmf_piqa"], include_paths=[str(tmp_path)], inconclusive_exit=1, use_cache=False,
                           write_promotion=False, quiet=True, dtype="float32", lora=("ad", str(adapter)))
    assert api is result
    (cli_args, cli_kwargs), (api_args, api_kwargs) = calls
    assert (list(cli_args), cli_kwargs) == (list(api_args), api_kwargs)
    assert cli_kwargs["lora"] == ("ad", str(adapter)) and cli_kwargs["progress"] is False


def test_the_dry_run_is_the_apis_plan(model, tmp_path, monkeypatch, capsys):
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(gate_module, "plan_gate", _recorder(calls, MemoryPlan(1 << 30, [ModelMemory("m", 1, 2, 3, 4)])))
    assert _cli(["eval-gate", str(model), "--baseline", str(model), "--tier", "full", "--dry-run"]) is None
    printed = capsys.readouterr().out.splitlines()
    plan = gating.plan_eval_gate(Path(model), baseline=model, tier="full")
    assert calls[0] == calls[1] and printed == plan.lines()


@pytest.mark.parametrize(("flags", "keywords", "needle"), [
    (["--deterministic", "--tp", "2"], {"deterministic": True, "tp": 2}, "--deterministic runs the CPU engine"),
    (["--tp", "0"], {"tp": 0}, "--tp must be at least 1"),
])
def test_the_command_refuses_what_the_api_refuses(model, monkeypatch, capsys, flags, keywords, needle):
    monkeypatch.setattr(gate_module, "run_gate", lambda *a, **k: pytest.fail("a refused gate ran"))
    with pytest.raises(UserError, match=needle) as api:
        gating.eval_gate(model, baseline=model, **keywords)
    assert _cli(["eval-gate", str(model), "--baseline", str(model), *flags]) == 2
    assert capsys.readouterr().err == f"error: {api.value}\n"


def test_the_dry_run_refuses_what_it_cannot_plan(model):
    with pytest.raises(UserError, match="--dry-run plans the CPU engine in one process"):
        gating.plan_eval_gate(model, baseline=model, tp=2)
