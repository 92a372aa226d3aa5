"""`lmfoundry eval-gate`: block or allow promotion of a candidate checkpoint, with an exit code CI can use.

The command parses its flags, calls `lmfoundry.api.gating` (the Python API's `eval_gate` and its
dry-run plan) and prints the verdict: the API and the command run one code path."""

from __future__ import annotations

import sys

import click

from lmfoundry.commands.lora_options import parse_spec
from lmfoundry.commands.run_options import device_option, dtype_option, tp_option


@click.command("eval-gate")
@click.argument("candidate")
@click.option("--baseline", required=True, help="The model the candidate must match (folder, GGUF or built-in name).")
@click.option("--gate", "gate_file", default=None,
              help="Gate YAML (path or name in recipes/gates/), or a recipe YAML with a `gate` section. [default]")
@click.option("--tier", default="quick", show_default=True, help="Tier of the gate to run (quick, full, ...).")
@click.option("-o", "--output", default="eval-gate", show_default=True, type=click.Path(file_okay=False),
              help="Folder for eval-gate.json, eval-gate.md and eval-gate.png.")
@click.option("--task", "tasks", multiple=True, metavar="NAME",
              help="Also run this lm-eval task (reported, not gated unless the gate file gates it).")
@click.option("--include-path", "include_paths", multiple=True, type=click.Path(file_okay=False),
              help="Folder of your own lm-eval task YAMLs (with local data).")
@click.option("--inconclusive-exit", type=click.IntRange(0, 2), default=None,
              help="Exit code for an inconclusive verdict (overrides the gate file; default 2).")
@click.option("--no-cache", is_flag=True, help="Re-evaluate both models even if cached results match.")
@click.option("--no-promotion", is_flag=True, help="Do not write the verdict into the candidate's lmfoundry.json.")
@click.option("--quiet", is_flag=True, help="No progress bars and nothing from lm-eval: only the verdict lines.")
@device_option
@dtype_option
@tp_option
@click.option("--deterministic", is_flag=True,
              help="Run both models as `serve --deterministic` does (batch-invariant: every score is independent of "
                   "how requests are batched), so `lm_eval --model local-completions` against `serve "
                   "--deterministic` with the same --dtype scores exactly what the gate scored. CPU, one process.")
@click.option("--skip-verify", is_flag=True,
              help="Do not check each checkpoint's files against the sha256 in its lmfoundry.json first.")
@click.option("--lora", default=None, metavar="NAME=PATH",
              help="Run this PEFT LoRA adapter on both models (as `serve --lora` runs it): gates the adapter on "
                   "the quantized CANDIDATE against the adapter on the float --baseline, the question before "
                   "promoting a QLoRA deployment. Refused in one line if it does not fit either model.")
@click.option("--dry-run", is_flag=True,
              help="Print what the run will hold in memory (weights, KV cache, activations, logits, the process) "
                   "and its predicted peak, from the configs and safetensors headers; evaluate nothing.")
def eval_gate(candidate: str, baseline: str, gate_file: str | None, tier: str, output: str,
              tasks: tuple[str, ...], include_paths: tuple[str, ...], inconclusive_exit: int | None,
              no_cache: bool, no_promotion: bool, quiet: bool, device: str, dtype: str, tp: int,
              deterministic: bool, skip_verify: bool, lora: str | None = None, dry_run: bool = False) -> None:
    """Evaluate CANDIDATE and --baseline on the same documents through the serving engine, in the
    dtype and on the execution path `serve` runs them with (recorded in the report): lm-eval tasks (accuracy and flips), perplexity windows with the per-token
    KL divergence, same-top-token rate and Δp against the baseline's next-token distributions
    (llama.cpp's --kl-divergence statistics), and greedy answers to fixed prompts (divergence,
    JSON and tool-call validity). Each gated statistic is decided with a paired bootstrap interval;
    eval-gate.json, a markdown report and a plot are written. The verdict and the report's sha256
    go into CANDIDATE's lmfoundry.json (`promotion`). The baseline's results and next-token
    reference are cached: gating N candidates evaluates it once.

    Exit codes: 0 pass, 1 fail, 2 inconclusive (configurable) or error."""
    # lmfoundry.api.gating imports the engine and torch: `lmfoundry --help` imports this module
    from lmfoundry.api.gating import eval_gate as gate_candidate
    from lmfoundry.api.gating import plan_eval_gate

    adapter = parse_spec(lora, "--lora") if lora is not None else None
    if dry_run:
        for line in plan_eval_gate(candidate, baseline=baseline, gate=gate_file, tier=tier, device=device,
                                   dtype=dtype, tp=tp, lora=adapter).lines():
            click.echo(line)
        return
    res = gate_candidate(candidate, baseline=baseline, gate=gate_file, tier=tier, output=output, tasks=tasks,
                         include_paths=include_paths, use_cache=not no_cache, inconclusive_exit=inconclusive_exit,
                         write_promotion=not no_promotion, device=device, dtype=dtype, tp=tp,
                         deterministic=deterministic, skip_verify=skip_verify, quiet=quiet, lora=adapter)
    for m in res.report["metrics"]:
        if m["gated"]:
            click.echo(f"{m['verdict']:>12}  {m['name']}: {m['statistic']} {m['point']:.4f} "
                       f"[{m['low']:.4f}, {m['high']:.4f}] vs {m['threshold']:g} "
                       f"(baseline {m['baseline']:.4f}, candidate {m['candidate']:.4f}, n={m['n']})")
    extra = f"; failing: {', '.join(res.report['failing'])}" if res.report["failing"] else ""
    click.echo(f"verdict: {res.verdict.upper()}{extra}")
    click.echo(f"report: {res.markdown_path} ({res.json_path}, {res.plot_path})"
               + ("; promotion recorded in the candidate's lmfoundry.json" if res.promotion_written else ""))
    if res.exit_code:
        sys.exit(res.exit_code)
