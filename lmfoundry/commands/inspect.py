"""`lmfoundry inspect DIR`: summarize an artifact and verify every file hash.

The manifest is untrusted input (an artifact may be downloaded): `read_manifest` bounds and
type-checks it, `verify_files` keeps every path it names inside DIR, and the summary below reads
each field defensively, so a malformed manifest is one `error:` line or a "?" in the table, never
a traceback.

What the run measured (time, peak RSS, device) is read from the run record beside the manifest
(`lmfoundry-run.json`, not hashed; see `lmfoundry.manifest`), or from the manifest of an artifact
written before the two were split.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click

from lmfoundry.errors import UserError


@click.command("inspect")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary and verification as JSON.")
def inspect_cmd(folder: str, as_json: bool) -> None:
    """Print what FOLDER holds (recipe, scheme, source, calibration, errors) and verify the sha256
    of every file against lmfoundry.json. Exits 1 naming each file that does not match."""
    from lmfoundry.manifest import read_manifest, recorded_files, verify_files
    from lmfoundry.runtime.bundle_manifest import is_engine_bundle

    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"{folder}: no such folder")
    if is_engine_bundle(path) and not (path / "lmfoundry.json").exists():
        _inspect_engine(path, as_json)
        return
    manifest = read_manifest(path)
    problems = verify_files(path, manifest)
    summary = _summary(path, manifest)
    if as_json:
        click.echo(json.dumps({**summary, "verified": not problems, "problems": problems}, indent=2))
    else:
        for k, v in summary.items():
            click.echo(f"{k:>22}: {v}")
        if problems:
            for p in problems:
                click.echo(f"FAILED {p}", err=True)
        else:
            click.echo(f"{'verified':>22}: {len(recorded_files(manifest))} files match their sha256")
    if problems:
        sys.exit(1)


def _inspect_engine(path: Path, as_json: bool) -> None:
    """An engine bundle: what it was built for, and every file against engine.json (every rank's
    of a tensor-parallel bundle, each rank's engine.json against the top one)."""
    from lmfoundry.runtime.bundle_manifest import bundle_degree, bundle_problems, rank_bundle, read_manifest

    degree = bundle_degree(path)
    problems: list[str] = []
    ranks: list[dict[str, Any]] = []
    if degree > 1:
        for r in range(degree):
            try:
                folder = rank_bundle(path, r)
            except UserError as exc:
                problems.append(str(exc))
                continue
            ranks.append(read_manifest(folder))
            problems += [f"rank{r}: {p}" for p in bundle_problems(folder, ranks[-1])]
        if not ranks:
            raise UserError(f"{path}: no rank bundle matches engine.json")
        m = ranks[0]
    else:
        m = read_manifest(path)
        problems = bundle_problems(path, m)
    model = _dict(m, "model")
    summary: dict[str, Any] = {"engine": str(path), "model": _text(model.get("model_type")),
                               "dtype": _text(model.get("dtype")), "source": _text(_dict(m, "source").get("name") or _dict(m, "source").get("path"))}
    if degree > 1:
        summary["tensor_parallel"] = f"{degree} ranks (rank0/ .. rank{degree - 1}/)"
    if m.get("target") == "cpu":
        cpu = _dict(m, "cpu")
        summary.update(target="cpu", isa=_text(cpu.get("isa")), torch=_text(cpu.get("torch")),
                       step=_text(_dict(cpu, "step").get("path")), max_tokens=_text(cpu.get("max_tokens")))
    else:
        summary.update(target="gpu", archs=", ".join(sorted(_dict(m, "archs"))),
                       kernels=sum(len(r["kernels"]) for r in ranks or [m]))
    files = sum(len(r["weights"]["files"]) for r in ranks or [m])
    summary["weights"] = f"{_text(_dict(m, 'weights').get('mode'))}, {files} files"
    if as_json:
        click.echo(json.dumps({**summary, "verified": not problems, "problems": problems}, indent=2))
    else:
        for k, v in summary.items():
            click.echo(f"{k:>22}: {v}")
        for p in problems:
            click.echo(f"FAILED {p}", err=True)
        if not problems:
            click.echo(f"{'verified':>22}: every file matches engine.json")
    if problems:
        sys.exit(1)


def _dict(d: Any, key: str) -> dict:
    """`d[key]` when both are mappings, else {} (a manifest field of the wrong type reads as absent)."""
    value = d.get(key) if isinstance(d, dict) else None
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> float | None:
    """A finite number from a manifest field, else None (strings, booleans, NaN are not metrics)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _text(value: Any, limit: int = 200) -> str:
    """A manifest value as one bounded line: scalars as text, containers by their type name (a
    hostile manifest can neither flood the terminal nor nest deep enough to break `repr`)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        s = " ".join(str(value).split())
    else:
        s = f"<{type(value).__name__}>"
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _run_record(path: Path, m: dict[str, Any]) -> dict[str, Any]:
    """The run record's fields, else the manifest's (an artifact from before the run record);
    an unreadable run record reads as absent ("?" in the table): it is not part of the artifact."""
    from lmfoundry.manifest import read_run_record

    try:
        run = read_run_record(path)
    except UserError:
        return {}
    return m if run is None else run


def _source_model(src: dict[str, Any]) -> str:
    """The source model as the manifest names it: a built-in name, a GGUF file, or its weights
    files (an old manifest's `spec` is shown as it was given)."""
    if "spec" in src:
        return _text(src["spec"])
    if "file" in src:
        return f"{_text(src['file'])} (sha256 {_text(src.get('file_sha256'))[:16]})"
    files = _dict(src, "sha256")
    if not files:
        return "?"
    return f"{len(files)} weights file(s), config sha256 {_text(src.get('config_sha256'))[:16]}"


def _summary(path: Path, m: dict[str, Any]) -> dict[str, Any]:
    q = _dict(_dict(m, "recipe"), "quantize")
    cal = _dict(m, "calibration")
    layers = {k: v for k, v in _dict(m, "layers").items() if isinstance(v, dict)}
    errs = [e for layer in layers.values() for v in layer.values() if isinstance(v, dict)
            if (e := _num(v.get("weight_rel_error"))) is not None]
    out_errs = [e for layer in layers.values() if (e := _num(layer.get("output_rel_error"))) is not None]
    run = _run_record(path, m)
    peak, wall = _num(run.get("peak_rss_bytes")), _num(run.get("wall_s"))
    warnings = m.get("warnings")
    tools = _dict(m, "tool_versions")
    summary = {
        "artifact": str(path),
        "kind": _text(m.get("kind", "?")),
        "method": _text(q.get("method", "?")),
        "scheme": f"{_text(q.get('scheme'))} group={_text(q.get('group_size'))} "
                  f"per_channel={_text(q.get('per_channel'))} kv={_text(q.get('kv_cache'))}",
        "format": _text(m.get("quantization_config_format", "?")),
        "source model": _source_model(_dict(m, "source_model")),
        "calibration": f"{_text(cal.get('num_samples'))}x{_text(cal.get('seq_len'))} tokens of "
                       f"{_text(Path(_text(cal.get('source', '?'))).name)} (token sha256 "
                       f"{_text(cal.get('token_ids_sha256', ''))[:16]}, used={_text(cal.get('used'))})",
        "mean weight rel error": f"{sum(errs) / len(errs):.4f} over {len(errs)} linears" if errs else "n/a",
        "mean layer out error": f"{sum(out_errs) / len(out_errs):.4f}" if out_errs else
                                "n/a (not measured: a data-free method, or GPTQ's one-pass calibration)",
        "warnings": len(warnings) if isinstance(warnings, list) else 0,
        "peak RSS": f"{peak / 2**20:.0f} MiB" if peak is not None else "?",
        "run": f"{wall:.1f} s on {_text(run.get('device'))}" if wall is not None else "?",
        "tools": _text(", ".join(f"{_text(k)} {_text(v)}" for k, v in tools.items() if v != "not installed"), 400),
    }
    if "promotion" in m:
        summary["promotion"] = _text(_dict(m, "promotion").get("verdict", "?"))
    return summary
