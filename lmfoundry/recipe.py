"""Recipes: one YAML file that ties the stages together (quantize, calibration, gate, ...).

CLI flags override recipe values; the recipe *as applied* (after overrides) is what the manifest
records, so an artifact can be rebuilt from its own manifest.

Every `quantize` and `calibration` value is type-checked (`check_recipe`) when the YAML is read and
again after the overrides: YAML happily yields `"no"` for a flag (truthy!), `1.0e+23` for a seed
or a string for a list, and such values used to fail deep inside the pipeline with a traceback or,
worse, silently change the result. `gate` belongs to eval-gate, which checks it. A section that no
stage reads (`model`, `compile`, `serve`: the model is the command's argument, compile and serve
take flags) is refused rather than silently ignored.

`--recipe NAME` finds a built-in recipe (`recipes/NAME.yaml`, shipped as package data of
`lmfoundry.recipes`) through importlib.resources, so it works from an installed wheel.
"""

from __future__ import annotations

import copy
from pathlib import Path
from collections.abc import Callable
from typing import Any

import yaml

from lmfoundry.errors import UserError
from lmfoundry.manifest import read_bounded
from lmfoundry.resources import shipped

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
        "moe_experts": "all",  # the tokens an MoE expert calibrates on: all, or those routed to it
    },
}
SECTIONS = ("name", "description", "quantize", "calibration", "gate")
# Sections earlier recipes carried that no stage ever read: refused with a reason.
UNREAD_SECTIONS = {
    "model": "the model is the command's MODEL argument",
    "compile": "`lmfoundry compile` takes flags",
    "serve": "`lmfoundry serve` takes flags",
}
RECIPES_PACKAGE = "lmfoundry.recipes"
# torch.Generator.manual_seed takes an unsigned 64-bit seed.
MAX_SEED = 2**64 - 1
# A recipe is a page of YAML; refusing anything much larger keeps `--recipe /dev/zero` (or a
# mistyped path to a checkpoint) from being read into memory.
MAX_RECIPE_BYTES = 1 << 20
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> str | None:
    return None if _is_int(value) and value >= 1 else "a whole number >= 1"


def _optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    return lambda value: None if value is None else (
        None if check(value) is None else f"{check(value)} or null")


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "a non-empty string"


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda value: None if value in choices else "one of " + ", ".join(choices)


def _string_list(value: Any) -> str | None:
    ok = isinstance(value, list) and all(isinstance(v, str) and v for v in value)
    return None if ok else "a list of strings"


def _mapping(value: Any) -> str | None:
    return None if isinstance(value, dict) and all(isinstance(k, str) for k in value) else \
        "a mapping of option names to values"


def _seed(value: Any) -> str | None:
    return None if _is_int(value) and 0 <= value <= MAX_SEED else f"a whole number from 0 to {MAX_SEED}"


# What each value may be; the message completes "... must be ...". Choices that the stage itself
# checks with a good message (method, scheme, observer, kv_strategy) are only type-checked here.
CHECKS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "quantize": {
        "method": _string,
        "scheme": _string,
        "group_size": _optional(_positive_int),
        "per_channel": _boolean,
        "symmetric": _optional(_boolean),
        "observer": _string,
        "actorder": _optional(_one_of("static", "dynamic")),
        "targets": lambda v: _string_list(v) or (None if v else "a non-empty list of strings"),
        "ignore": _string_list,
        "kv_cache": _optional(_one_of("int8", "fp8")),
        "kv_strategy": _optional(_string),
        "dtype": _optional(_one_of(*DTYPES)),
        "options": _mapping,
    },
    "calibration": {
        "source": _string,
        "num_samples": _positive_int,
        "seq_len": _positive_int,
        "seed": _seed,
        "propagate": _one_of("quantized", "float"),
        "batch_size": _positive_int,
        "moe_experts": _one_of("all", "routed"),
    },
}


def check_recipe(recipe: dict[str, Any], where: str = "recipe") -> dict[str, Any]:
    """Raise UserError naming the first `quantize`/`calibration` value of the wrong type or out of
    range (`where` prefixes the message: the recipe file, or "recipe" after CLI overrides)."""
    for section, checks in CHECKS.items():
        values = recipe.get(section, {})
        for key, check in checks.items():
            if key in values and (expected := check(values[key])) is not None:
                raise UserError(f"{where}: {section}.{key} must be {expected}, not {_show(values[key])}")
    for key in ("name", "description"):
        if key in recipe and not isinstance(recipe[key], str):
            raise UserError(f"{where}: {key} must be a string, not {_show(recipe[key])}")
    return recipe


def _show(value: Any) -> str:
    """A short rendering of a bad value for an error line."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def builtin_recipes() -> list[str]:
    """Names of the recipes shipped with lmfoundry (`--recipe NAME`)."""
    return sorted(f.stem for f in shipped(RECIPES_PACKAGE).glob("*.yaml"))


def resolve_recipe_path(path: str | Path) -> Path:
    """`path` if it exists, else the built-in recipe of that name (`smollm2-w4a16-rtn`, with or
    without `.yaml`); a name with a folder in it is only ever a path."""
    name = str(path)
    p = Path(name).expanduser()
    if name and p.exists():  # not a regular file: read_bounded refuses it with one line
        return p
    if "/" not in name and "\\" not in name and name not in ("", ".", ".."):
        builtin = shipped(RECIPES_PACKAGE, name if name.endswith(".yaml") else f"{name}.yaml")
        if builtin.is_file():
            return builtin
    raise UserError(f"{path}: no such recipe file or built-in recipe (built-in: {', '.join(builtin_recipes())})")


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases. A recipe or gate never needs them, and a few hundred
    bytes of nested aliases ("billion laughs") expand to hundreds of MiB once the recipe is
    written into a manifest as JSON."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise UserError(f"{self.name}: YAML aliases (*name) are not allowed here (line {mark.line + 1}); "
                            "write the values out")
        return super().compose_node(parent, index)


def load_yaml(raw: bytes | str, where: Path | str) -> Any:
    """Parse one YAML document from a recipe or gate file: aliases refused, errors one line."""
    loader = _NoAliasLoader(raw)
    loader.name = str(where)
    try:
        return loader.get_single_data()
    except UnicodeDecodeError:
        raise UserError(f"{where}: not UTF-8 text (a recipe is YAML)") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{where}: invalid YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise UserError(f"{where}: invalid YAML (nested too deeply)") from None
    finally:
        loader.dispose()


def load_recipe(path: str | Path | None) -> dict[str, Any]:
    """Defaults, overlaid with the YAML file at `path` (if any); unknown keys are errors."""
    recipe: dict[str, Any] = copy.deepcopy(DEFAULTS)
    if path is None:
        return recipe
    p = resolve_recipe_path(path)
    raw = read_bounded(p, MAX_RECIPE_BYTES, "recipe")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{p}: not UTF-8 text (a recipe is YAML)") from None
    data = load_yaml(text, p) or {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: a recipe is a mapping of sections ({', '.join(SECTIONS)})")
    for key, value in data.items():
        if key in UNREAD_SECTIONS:
            raise UserError(f"{p}: recipe section {key!r} is not read by any stage "
                            f"({UNREAD_SECTIONS[key]}); remove it")
        if key not in SECTIONS:
            raise UserError(f"{p}: unknown recipe section {key!r}; known: {', '.join(SECTIONS)}")
        if key in DEFAULTS:
            if not isinstance(value, dict):
                raise UserError(f"{p}: section {key!r} must be a mapping")
            unknown = set(value) - set(DEFAULTS[key])
            if unknown:
                raise UserError(f"{p}: unknown key(s) in {key}: {', '.join(sorted(map(str, unknown)))}; "
                                f"known: {', '.join(DEFAULTS[key])}")
            recipe[key].update(value)
        else:
            recipe[key] = value
    check_recipe(recipe, str(p))
    recipe["source_file"] = str(p)
    return recipe


def apply_overrides(recipe: dict[str, Any], section: str, **overrides: Any) -> dict[str, Any]:
    """Set every override that is not None (a CLI flag the user gave)."""
    for key, value in overrides.items():
        if value is not None:
            recipe[section][key] = value
    return recipe
