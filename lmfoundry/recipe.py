"""Recipes: one YAML file that ties the stages together (quantize, calibration, gate, ...).

CLI flags override recipe values; the recipe *as applied* (after overrides) is what the manifest
records, so an artifact can be rebuilt from its own manifest.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from lmfoundry.errors import UserError

DEFAULTS: dict[str, dict[str, Any]] = {
    "quantize": {
        "method": "rtn",
        "scheme": "w4a16",
        "group_size": None,  # None = the scheme's default (128 for wNa16)
        "per_channel": False,
        "symmetric": None,  # None = the scheme's default (symmetric)
        "observer": "minmax",
        "actorder": None,
        "targets": ["Linear"],
        "ignore": ["lm_head"],
        "kv_cache": None,
        "kv_strategy": "tensor",
        "dtype": "auto",
        "options": {},
    },
    "calibration": {
        "source": "c4",
        "num_samples": 128,
        "seq_len": 512,
        "seed": 0,
        "propagate": "quantized",
        "batch_size": 8,
    },
}
SECTIONS = ("name", "description", "model", "quantize", "calibration", "gate", "compile", "serve")


def load_recipe(path: str | Path | None) -> dict[str, Any]:
    """Defaults, overlaid with the YAML file at `path` (if any); unknown keys are errors."""
    recipe = copy.deepcopy(DEFAULTS)
    if path is None:
        return recipe
    p = Path(path)
    if not p.exists():
        builtin = Path(__file__).resolve().parent.parent / "recipes" / f"{path}.yaml"
        if not builtin.exists():
            raise UserError(f"{path}: no such recipe file")
        p = builtin
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{p}: invalid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: a recipe is a mapping of sections ({', '.join(SECTIONS)})")
    for key, value in data.items():
        if key not in SECTIONS:
            raise UserError(f"{p}: unknown recipe section {key!r}; known: {', '.join(SECTIONS)}")
        if key in DEFAULTS:
            if not isinstance(value, dict):
                raise UserError(f"{p}: section {key!r} must be a mapping")
            unknown = set(value) - set(DEFAULTS[key])
            if unknown:
                raise UserError(f"{p}: unknown key(s) in {key}: {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(DEFAULTS[key])}")
            recipe[key].update(value)
        else:
            recipe[key] = value
    recipe["source_file"] = str(p)
    return recipe


def apply_overrides(recipe: dict[str, Any], section: str, **overrides: Any) -> dict[str, Any]:
    """Set every override that is not None (a CLI flag the user gave)."""
    for key, value in overrides.items():
        if value is not None:
            recipe[section][key] = value
    return recipe
