"""Recipes: one YAML file that ties the stages together (quantize, calibration, gate, ...).

CLI flags override recipe values; the recipe *as applied* (after overrides) is what the manifest
records, so an artifact can be rebuilt from its own manifest.

A recipe is a `Recipe` (typed sections `QuantizeSection` and `CalibrationSection`, whose field
defaults are the only defaults) built once from the YAML and the flags. Every `quantize` and
`calibration` value is type-checked when the YAML is read and again after the overrides: YAML
happily yields `"no"` for a flag (truthy!), `1.0e+23` for a seed or a string for a list, and such
values used to fail deep inside the pipeline with a traceback or, worse, silently change the result. `gate` belongs to eval-gate, which checks it. A section that no
stage reads (`model`, `compile`, `serve`: the model is the command's argument, compile and serve
take flags) is refused rather than silently ignored.

`--recipe NAME` finds a built-in recipe (`recipes/NAME.yaml`, shipped as package data of
`lmfoundry.recipes`) through importlib.resources, so it works from an installed wheel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from lmfoundry.errors import UserError
from lmfoundry.manifest import read_bounded
from lmfoundry.resources import shipped

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


LM_HEAD_CHOICES = ("float", "w8a16", "w4a16")
# `quantize` keys added after checkpoints were published, with the value that means "as before":
# the manifest records them only when set otherwise, so the same recipe keeps writing the same
# lmfoundry.json (and checkpoint hash) it wrote before the key existed
LATER_KEYS = {"lm_head": "float"}

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
        "lm_head": _one_of(*LM_HEAD_CHOICES),
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

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A mapping, refused when a key appears twice: YAML itself keeps the last one silently,
        so a threshold or a scheme written twice would apply whichever came second."""
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                seen = key in first
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if seen:
                raise UserError(f"{self.name}: key {key!r} appears twice (lines {first[key] + 1} and "
                                f"{key_node.start_mark.line + 1}); keep one")
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


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


@dataclass(frozen=True)
class QuantizeSection:
    """The recipe's `quantize` section: what each linear becomes. These field defaults are the
    only defaults of a recipe (a YAML file or a flag overrides them)."""

    method: str = "rtn"
    scheme: str = "w4a16"
    group_size: int | None = None  # None = the scheme's default (128 for wNa16)
    per_channel: bool = False
    symmetric: bool | None = None  # None = the scheme's default (symmetric)
    observer: str = "minmax"
    actorder: str | None = None
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    kv_cache: str | None = None
    # what the LM head becomes: float (it stays as the source stores it: vLLM and SGLang read it), or
    # weight-only int8 per output channel / int4 grouped, which unties a tied head from the embedding
    lm_head: str = "float"
    kv_strategy: str | None = "tensor"
    dtype: str | None = "auto"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CalibrationSection:
    """The recipe's `calibration` section: the data the quantizer's statistics come from."""

    source: str = "c4"
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    propagate: Literal["quantized", "float"] = "quantized"  # what feeds the next layer (see calibration.pipeline)
    batch_size: int = 8
    moe_experts: Literal["all", "routed"] = "all"  # the tokens an MoE expert calibrates on: all, or those routed to it


# the keys of each typed section, in the order the manifest records them
SECTION_KEYS = {name: tuple(f.name for f in dataclasses.fields(kind))
                for name, kind in (("quantize", QuantizeSection), ("calibration", CalibrationSection))}


@dataclass(frozen=True)
class Recipe:
    """A recipe as applied: built once (`from_yaml`, then `with_overrides` for the command-line
    flags), checked at every step, and handed to the stages whole instead of as loose values.
    `to_dict()` is what the manifest records, so an artifact can be rebuilt from it."""

    quantize: QuantizeSection = field(default_factory=QuantizeSection)
    calibration: CalibrationSection = field(default_factory=CalibrationSection)
    name: str | None = None
    description: str | None = None
    gate: Any = None  # eval-gate's section: carried into the manifest, checked by eval-gate
    source_file: str | None = None  # the YAML it came from (recorded apart from the recipe)

    @classmethod
    def from_yaml(cls, path: str | Path | None) -> Recipe:
        """The defaults, overlaid with the YAML file at `path` (a path or a built-in recipe's
        name; None = the defaults alone); unknown sections and keys are errors."""
        if path is None:
            return cls()
        p = resolve_recipe_path(path)
        raw = read_bounded(p, MAX_RECIPE_BYTES, "recipe")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{p}: not UTF-8 text (a recipe is YAML)") from None
        data = load_yaml(text, p) or {}
        if not isinstance(data, dict):
            raise UserError(f"{p}: a recipe is a mapping of sections ({', '.join(SECTIONS)})")
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in UNREAD_SECTIONS:
                raise UserError(f"{p}: recipe section {key!r} is not read by any stage "
                                f"({UNREAD_SECTIONS[key]}); remove it")
            if key not in SECTIONS:
                raise UserError(f"{p}: unknown recipe section {key!r}; known: {', '.join(SECTIONS)}")
            if key in SECTION_KEYS:
                if not isinstance(value, dict):
                    raise UserError(f"{p}: section {key!r} must be a mapping")
                unknown = set(value) - set(SECTION_KEYS[key])
                if unknown:
                    raise UserError(f"{p}: unknown key(s) in {key}: {', '.join(sorted(map(str, unknown)))}; "
                                    f"known: {', '.join(SECTION_KEYS[key])}")
            values[key] = value
        return cls._build(values, str(p), source_file=str(p))

    def with_overrides(self, **flags: Any) -> Recipe:
        """A copy with every flag that is not None (one the user gave) set; each flag is a key of
        `quantize` or `calibration` (the names do not overlap). Checked again afterwards: a flag
        may be what makes the recipe invalid."""
        values = self.to_dict()
        for key, value in flags.items():
            section = next((s for s, keys in SECTION_KEYS.items() if key in keys), None)
            if section is None:
                raise TypeError(f"with_overrides: {key!r} is no recipe key")
            if value is not None:
                values[section][key] = value
        return self._build(values, "recipe (with the command-line flags)", source_file=self.source_file)

    def to_dict(self) -> dict[str, Any]:
        """The recipe as the manifest records it (without `source_file`, recorded apart)."""
        out: dict[str, Any] = {"quantize": dataclasses.asdict(self.quantize),
                               "calibration": dataclasses.asdict(self.calibration)}
        for key, default in LATER_KEYS.items():  # at its default, a later key leaves the record as it was
            if out["quantize"][key] == default:
                del out["quantize"][key]
        for key in ("name", "description", "gate"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def check(self, where: str = "recipe") -> Recipe:
        """Raise UserError naming the first value of the wrong type or out of range (a Recipe
        built directly rather than through `from_yaml`/`with_overrides` is checked here)."""
        _check_values(self.to_dict(), where)
        return self

    @classmethod
    def _build(cls, values: dict[str, Any], where: str, source_file: str | None) -> Recipe:
        _check_values(values, where)
        return cls(quantize=QuantizeSection(**values.get("quantize", {})),
                   calibration=CalibrationSection(**values.get("calibration", {})), name=values.get("name"), description=values.get("description"), gate=values.get("gate"),
                   source_file=source_file)


def _check_values(recipe: dict[str, Any], where: str) -> None:
    """The checks of CHECKS over a recipe's plain values (`where` prefixes the message: the
    recipe file, or "recipe" after the command-line flags)."""
    for section, checks in CHECKS.items():
        values = recipe.get(section, {})
        for key, check in checks.items():
            if key in values and (expected := check(values[key])) is not None:
                raise UserError(f"{where}: {section}.{key} must be {expected}, not {_show(values[key])}")
    for key in ("name", "description"):
        if key in recipe and not isinstance(recipe[key], str):
            raise UserError(f"{where}: {key} must be a string, not {_show(recipe[key])}")
