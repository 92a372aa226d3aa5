"""Promotion: a gate's verdict written into the candidate it judged, so that whoever deploys the
candidate later reads whether it passed, against which baseline and gate, and the report's hash,
from the candidate's own manifest."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle, record_in_manifest
from lmfoundry.manifest import MANIFEST, sha256_file, update_manifest


def record_promotion(candidate: str, report: dict[str, Any], json_path: Path, md_path: Path) -> bool:
    """Write the verdict into the candidate's manifest (`promotion`): a checkpoint's lmfoundry.json or
    an engine bundle's engine.json, if it has one; False when it has neither."""
    folder = Path(report["candidate"]["path"])
    bundle = is_engine_bundle(folder)
    if not (folder / MANIFEST).exists() and not bundle:
        return False
    record = {
        "verdict": report["verdict"],
        "exit_code": report["exit_code"],
        "gate": report["gate"]["name"], "gate_sha256": report["gate"]["sha256"], "tier": report["gate"]["tier"],
        "baseline": report["baseline"]["spec"], "baseline_sha256": report["baseline"]["sha256"],
        "candidate_sha256": report["candidate"]["sha256"],
        "failing": report["failing"],
        **({"lora": report["lora"]} if report.get("lora") else {}),
        # the report by name and hash: its folder is local (the manifest holds no local path)
        "report": json_path.name, "report_sha256": sha256_file(json_path),
        "markdown_sha256": sha256_file(md_path),
        "created_unix": int(time.time()),
    }
    if bundle:  # the verdict goes into the bundle's manifest (weights stay as hashed)
        record_in_manifest(folder, "promotion", record)
        return True
    update_manifest(folder, "promotion", record)
    return True
