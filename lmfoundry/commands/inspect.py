"""`lmfoundry inspect DIR`: summarize an artifact and verify every file hash.

The reading and verification are `lmfoundry.inspect` (lmfoundry/api/artifacts.py), which a
script calls directly; this command only prints what it returns and exits 1 when a file does not
match, so the CLI and the API cannot disagree about an artifact.
"""

from __future__ import annotations

import json
import sys

import click


@click.command("inspect")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary and verification as JSON.")
def inspect_cmd(folder: str, as_json: bool) -> None:
    """Print what FOLDER holds (recipe, scheme, source, calibration, errors) and verify the sha256
    of every file against lmfoundry.json. Exits 1 naming each file that does not match."""
    from lmfoundry.api.artifacts import Bundle, inspect
    from lmfoundry.manifest import recorded_files

    artifact = inspect(folder)
    problems = list(artifact.problems or ())
    if as_json:
        click.echo(json.dumps({**artifact.summary, "verified": not problems, "problems": problems}, indent=2))
    else:
        for k, v in artifact.summary.items():
            click.echo(f"{k:>22}: {v}")
        for p in problems:
            click.echo(f"FAILED {p}", err=True)
        if not problems:
            matched = ("every file matches engine.json" if isinstance(artifact, Bundle) else
                       f"{len(recorded_files(artifact.manifest))} files match their sha256")
            click.echo(f"{'verified':>22}: {matched}")
    if problems:
        sys.exit(1)
