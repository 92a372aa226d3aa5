"""The gate's lm-eval tasks: the shipped task YAMLs made runnable, the gated metrics checked before
any model runs, and lm-eval driven on a model with its per-document results returned.

lm-eval's evaluator and task index are imported where they are used: they add seconds to an
import that `eval-gate --dry-run` and the model checks never need.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import unittest.mock
import warnings
from pathlib import Path
from typing import Any, Iterator

import yaml

from lmfoundry.errors import UserError
from lmfoundry.evals.comparison import FLIPS
from lmfoundry.evals.gate_spec import GateSpec, TaskSpec
from lmfoundry.resources import shipped

TASKS_DIR = shipped("lmfoundry.evals", "tasks")


def materialize_tasks(workdir: Path) -> tuple[Path, dict[str, str]]:
    """Copy the shipped task YAMLs into `workdir` with data_files made absolute (lm-eval needs
    absolute paths); returns the include path and a sha256 per task over its YAML and data."""
    out = workdir / "lmfoundry-tasks"
    out.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for yml in sorted(TASKS_DIR.glob("*/*.yaml")):
        cfg = yaml.safe_load(yml.read_text())
        h = hashlib.sha256(yml.read_bytes())
        files = cfg.get("dataset_kwargs", {}).get("data_files", {})
        for split, rel in files.items():
            path = (yml.parent / rel).resolve()
            if not path.exists():
                raise UserError(f"{yml}: data file {path} is missing (reinstall lmfoundry)")
            files[split] = str(path)
            h.update(path.read_bytes())
        (out / yml.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
        hashes[cfg["task"]] = h.hexdigest()
    return out, hashes


def task_manager(names: list[str], include_paths: list[Path]) -> Any:
    """lm-eval TaskManager over our tasks (+ the user's include paths); lm-eval's built-in task
    index (16 s to build) is only loaded when a requested name is not found locally."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=[str(p) for p in include_paths], include_defaults=False)
    if all(n in tm.all_tasks for n in names):
        return tm
    tm = TaskManager(include_path=[str(p) for p in include_paths], include_defaults=True)
    missing = [n for n in names if n not in tm.all_tasks]
    if missing:
        raise UserError(f"unknown lm-eval task(s): {', '.join(missing)} (add --include-path for your own task YAMLs)")
    return tm


def check_gated_metrics(tasks: list[TaskSpec], include_paths: list[Path]) -> None:
    """Refuse, before any model is evaluated, a gate on a metric its task does not report (a typo
    such as `acc_nrom` used to surface only after both models had run). The tasks' configs are read
    through lm-eval itself, so a user task's own metric_list and filters count as lm-eval reports
    them (`metric` for the unfiltered result, `metric,filter` otherwise)."""
    gated = [t for t in tasks if t.gate]
    if not gated:
        return
    loaded = task_manager([t.name for t in gated], include_paths).load([t.name for t in gated])["tasks"]
    for t in gated:
        task = loaded.get(t.name)
        if task is None:  # a group: its members report per member; checked after evaluation
            continue
        filters = [f.name for f in getattr(task, "_filters", [])] or ["none"]
        reported = {m if f == "none" else f"{m},{f}" for m in task._metric_fn_list for f in filters}
        asked = {m[: -len(FLIPS)] if m.endswith(FLIPS) else m for m in t.gate}
        unknown = sorted(asked - reported)
        if unknown:
            raise UserError(f"{t.name}: gated metric(s) {', '.join(unknown)} not produced by the task (it reports "
                            f"{', '.join(sorted(reported))}); nothing was evaluated")


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """Nothing lm-eval (or the datasets library under it) writes reaches the terminal: progress
    bars whatever their `disable` argument (tqdm reads TQDM_DISABLE only when it is imported, and
    an explicit disable=False wins over it), prints and warnings all go to the current
    sys.stdout/sys.stderr, which are swapped for a sink. Errors still raise."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def run_lm_eval(lm: Any, tasks: list[TaskSpec], gate: GateSpec, include_paths: list[Path],
                progress: bool = False) -> dict[str, dict[str, Any]]:
    """Run lm-eval on `lm` and return per-task, per-document results, ordered by doc id."""
    from lm_eval import simple_evaluate

    if not tasks:
        return {}
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING if progress else logging.ERROR)
    names = [t.name for t in tasks]
    tm = task_manager(names, include_paths)
    samples = {t.name: list(range(t.limit)) for t in tasks if t.limit is not None}
    # lm-eval records its own git commit by running `git describe` in the working directory: outside
    # a checkout git prints `fatal: not a git repository` on our stderr (fd 2, past `_silenced`), and
    # inside one it records the user's repository, not lm-eval's. The installed version is in the
    # report already (tool versions), so the lookup is skipped.
    import lm_eval.evaluator

    with contextlib.nullcontext() if progress else _silenced(), \
            unittest.mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None):
        res = simple_evaluate(model=lm, tasks=names, num_fewshot=gate.num_fewshot, samples=samples or None,
                              log_samples=True, bootstrap_iters=0, apply_chat_template=gate.chat_template,
                              random_seed=gate.seed, numpy_random_seed=gate.seed, torch_random_seed=gate.seed,
                              fewshot_random_seed=gate.seed, task_manager=tm)
    if res is None:
        raise RuntimeError("lm-eval returned no results")
    out = {}
    for task in names:
        rows = sorted(res["samples"].get(task, []), key=lambda r: r["doc_id"])
        if not rows:
            raise UserError(f"lm-eval task {task} produced no documents (is the tier's limit beyond its data?)")
        metrics: dict[str, list[Any]] = {}
        for r in rows:
            suffix = "" if r.get("filter", "none") == "none" else f",{r['filter']}"
            for m in r["metrics"]:
                v = r[m]
                metrics.setdefault(m + suffix, []).append(list(v) if isinstance(v, (tuple, list)) else float(v))
        lls = [[float(x[0]) if isinstance(x, (tuple, list)) else x for x in r["filtered_resps"]] for r in rows]
        out[task] = {
            "doc_ids": [int(r["doc_id"]) for r in rows],
            "doc_hashes": [r.get("doc_hash") for r in rows],
            "metrics": metrics,
            "responses": lls,
            "higher_is_better": dict(res.get("higher_is_better", {}).get(task, {})),
            "n_docs": len(rows),
        }
    return out

