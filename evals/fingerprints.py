"""What identifies a model's numbers: the sha256 of every file that determines what it computes
(weights, config, tokenizer; an engine bundle's manifests, which hash its kernels; a LoRA
adapter's config and weights). The gate's cache keys and reports are built from these."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lmfoundry.checkpoint.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lmfoundry.checkpoint.sources import safetensors_files
from lmfoundry.engine_bundle.engine_manifest import MANIFEST_NAME, bundle_degree, own_weights, rank_bundle, rank_folder
from lmfoundry.manifest import sha256_file

FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def fingerprint(folder: Path) -> dict[str, Any]:
    """sha256 of the files that determine what a model computes (weights, config, tokenizer)."""
    files = {p.relative_to(folder).as_posix(): sha256_file(p) for p in safetensors_files(folder)}
    for name in FINGERPRINT_FILES:
        if (folder / name).exists():
            files[name] = sha256_file(folder / name)
    return _fingerprint_of(files)


def _fingerprint_of(files: dict[str, str]) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(), "files": files}


def bundle_fingerprint(engine: Path) -> dict[str, Any]:
    """`fingerprint` of an engine bundle's weights (every rank's of a tensor-parallel bundle) and
    of each engine.json, which holds the sha256 of every kernel and compiled step the bundle
    runs: two bundles of the same weights with other kernels compute other numbers."""
    degree = bundle_degree(engine)
    files = {MANIFEST_NAME: sha256_file(engine / MANIFEST_NAME)}
    for r in range(degree):
        rank = rank_bundle(engine, r) if degree > 1 else engine
        prefix = f"{rank_folder(r)}/" if degree > 1 else ""
        files.update({f"{prefix}{name}": sha for name, sha in fingerprint(own_weights(rank))["files"].items()})
        if degree > 1:
            files[f"{prefix}{MANIFEST_NAME}"] = sha256_file(rank / MANIFEST_NAME)
    return _fingerprint_of(files)


def adapter_fingerprint(folder: str | Path) -> dict[str, Any]:
    """sha256 of a PEFT LoRA folder's config and weights (what the adapter computes)."""
    return _fingerprint_of({name: sha256_file(Path(folder) / name) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)})
