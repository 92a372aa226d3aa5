"""`lmfoundry.json`: what was built, from what, with what, and the sha256 of every file.

The manifest makes an artifact auditable: tool and library versions, the recipe as applied, the
source model hash, the calibration token hash, per-layer errors, and file hashes that
`lmfoundry inspect` verifies (the manifest itself is excluded from the hash list; later stages,
such as eval-gate's promotion record, may add keys to it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError

MANIFEST = "lmfoundry.json"
LIBRARIES = ("lmfoundry", "torch", "transformers", "compressed-tensors", "safetensors", "triton", "lm-eval")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_folder(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder` (relative POSIX paths), except the manifest."""
    return {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def tool_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for lib in LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = "not installed"
    return out


def read_manifest(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise UserError(f"{folder}: no {MANIFEST} (not an lmfoundry artifact)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: corrupt manifest ({exc})") from None


def update_manifest(folder: Path, key: str, value: Any) -> None:
    """Set one top-level key of a manifest (atomic rewrite)."""
    data = read_manifest(folder)
    data[key] = value
    tmp = Path(folder) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(Path(folder) / MANIFEST)


def verify_files(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems found comparing the folder with the manifest's hashes (empty = verified)."""
    problems = []
    recorded: dict[str, str] = manifest.get("files", {})
    for rel, digest in recorded.items():
        p = Path(folder) / rel
        if not p.exists():
            problems.append(f"{rel}: missing")
        elif sha256_file(p) != digest:
            problems.append(f"{rel}: sha256 mismatch")
    for p in sorted(Path(folder).rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and p.name != MANIFEST and rel not in recorded:
            problems.append(f"{rel}: not in manifest")
    return problems
