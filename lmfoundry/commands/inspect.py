"""`lmfoundry inspect DIR`: summarize an artifact and verify every file hash."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lmfoundry.errors import UserError


@click.command("inspect")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary and verification as JSON.")
def inspect_cmd(folder: str, as_json: bool) -> None:
    """Print what FOLDER holds (recipe, scheme, source, calibration, errors) and verify the sha256
    of every file against lmfoundry.json. Exits 1 naming each file that does not match."""
    from lmfoundry.manifest import read_manifest, verify_files

    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"{folder}: no such folder")
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
            click.echo(f"{'verified':>22}: {len(manifest.get('files', {}))} files match their sha256")
    if problems:
        sys.exit(1)


def _summary(path: Path, m: dict) -> dict:
    q = m.get("recipe", {}).get("quantize", {})
    cal = m.get("calibration", {})
    layers = m.get("layers", {})
    errs = [v.get("weight_rel_error") for layer in layers.values() for v in layer.values()
            if isinstance(v, dict) and v.get("weight_rel_error") is not None]
    out_errs = [layer.get("output_rel_error") for layer in layers.values() if layer.get("output_rel_error") is not None]
    summary = {
        "artifact": str(path),
        "kind": m.get("kind", "?"),
        "method": q.get("method", "?"),
        "scheme": f"{q.get('scheme')} group={q.get('group_size')} per_channel={q.get('per_channel')} "
                  f"kv={q.get('kv_cache')}",
        "format": m.get("quantization_config_format", "?"),
        "source model": m.get("source_model", {}).get("spec", "?"),
        "calibration": f"{cal.get('num_samples')}x{cal.get('seq_len')} tokens of {Path(str(cal.get('source', '?'))).name}"
                       f" (token sha256 {str(cal.get('token_ids_sha256', ''))[:16]}, used={cal.get('used')})",
        "mean weight rel error": f"{sum(errs) / len(errs):.4f} over {len(errs)} linears" if errs else "n/a",
        "mean layer out error": f"{sum(out_errs) / len(out_errs):.4f}" if out_errs else "n/a (data-free method)",
        "warnings": len(m.get("warnings", [])),
        "peak RSS": f"{m.get('peak_rss_bytes', 0) / 2**20:.0f} MiB",
        "tools": ", ".join(f"{k} {v}" for k, v in m.get("tool_versions", {}).items() if v != "not installed"),
    }
    if "promotion" in m:
        summary["promotion"] = m["promotion"].get("verdict", "?")
    return summary
