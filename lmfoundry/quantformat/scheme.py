"""Quantization schemes: what to quantize (weights, activations, KV) and how.

A `QuantArgs` is one tensor's recipe (bits, int or float, symmetric, strategy, group size,
static/dynamic). A `Scheme` bundles the weight and input-activation args of a linear with the
compressed-tensors storage format it implies. Names on the CLI (`w4a16`, `w8a8`, `fp8-dynamic`, ...)
map to schemes here; `to_compressed_tensors` emits the exact config schema vLLM and transformers
read, validated by the compressed-tensors library itself.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from lmfoundry.errors import UserError

# "attn_head" (compressed-tensors' name) = one scale per attention head, for the KV cache
Strategy = Literal["tensor", "channel", "group", "token", "attn_head"]


@dataclass(frozen=True)
class QuantArgs:
    num_bits: int = 4
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    strategy: Strategy = "group"
    group_size: int | None = 128
    dynamic: bool = False
    observer: str = "minmax"
    actorder: str | None = None  # GPTQ: None | "static" | "dynamic"

    def __post_init__(self) -> None:
        if self.type == "int" and not 2 <= self.num_bits <= 8:
            raise UserError(f"integer quantization supports 2..8 bits, got {self.num_bits}")
        if self.type == "float" and self.num_bits != 8:
            raise UserError("float quantization supports 8 bits (fp8 e4m3) only")
        if self.strategy == "group" and (self.group_size is None or self.group_size <= 0):
            raise UserError(f"group quantization needs a positive group size, got {self.group_size}")

    @property
    def qmin(self) -> float:
        return -448.0 if self.type == "float" else float(-(1 << (self.num_bits - 1)))

    @property
    def qmax(self) -> float:
        return 448.0 if self.type == "float" else float((1 << (self.num_bits - 1)) - 1)

    def describe(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.num_bits}"
        how = f"g{self.group_size}" if self.strategy == "group" else self.strategy
        sym = "sym" if self.symmetric else "asym"
        return f"{kind} {how} {sym}{' dynamic' if self.dynamic else ''}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Scheme:
    """How one linear is quantized, and the compressed-tensors format that stores it."""

    name: str
    weights: QuantArgs
    input_activations: QuantArgs | None = None

    @property
    def format(self) -> str:
        if self.weights.type == "float":
            return "float-quantized"
        if self.input_activations is not None:
            return "int-quantized"
        return "pack-quantized"

    @property
    def needs_activation_calibration(self) -> bool:
        act = self.input_activations
        return act is not None and not act.dynamic

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "format": self.format,
            "weights": self.weights.to_dict(),
            "input_activations": self.input_activations.to_dict() if self.input_activations else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Scheme":
        act = d.get("input_activations")
        return cls(d["name"], QuantArgs(**d["weights"]), QuantArgs(**act) if act else None)


SCHEME_NAMES = ("wNa16 (N=2..8, e.g. w4a16, w8a16)", "w8a8", "w8a8-static", "fp8-dynamic", "fp8-static")
_WNA16 = re.compile(r"^w([2-8])a16$")


def make_scheme(
    name: str,
    group_size: int | None = None,
    symmetric: bool | None = None,
    per_channel: bool = False,
    observer: str | None = None,
    actorder: str | None = None,
) -> Scheme:
    """Build a scheme from its CLI name and the overriding flags (None = scheme default)."""
    key = name.lower()
    if m := _WNA16.match(key):
        bits = int(m.group(1))
        strategy: Strategy = "channel" if per_channel or group_size == 0 else "group"
        weights = QuantArgs(
            num_bits=bits,
            symmetric=True if symmetric is None else symmetric,
            strategy=strategy,
            group_size=(group_size or 128) if strategy == "group" else None,
            observer=observer or "minmax",
            actorder=actorder,
        )
        return Scheme(key, weights)
    if key in ("w8a8", "w8a8-static"):
        weights = QuantArgs(8, "int", True, "channel", None, observer=observer or "minmax", actorder=actorder)
        scheme = Scheme(key, weights, QuantArgs(8, "int", True, "token", None, dynamic=True))
        return with_static_activations(scheme) if key == "w8a8-static" else scheme
    if key in ("fp8-dynamic", "fp8-static"):
        dynamic = key == "fp8-dynamic"
        weights = QuantArgs(8, "float", True, "channel" if dynamic else "tensor", None,
                            observer=observer or "minmax")
        act = QuantArgs(8, "float", True, "token" if dynamic else "tensor", None, dynamic=dynamic)
        return Scheme(key, weights, act)
    raise UserError(f"unknown scheme {name!r}; known: {', '.join(SCHEME_NAMES)}")


def with_static_activations(scheme: Scheme) -> Scheme:
    """W8A8 with per-tensor static (calibrated) int8 activations instead of dynamic per-token."""
    act = replace(scheme.input_activations or QuantArgs(8, "int", True), strategy="tensor", dynamic=False)
    return replace(scheme, input_activations=act)


@dataclass(frozen=True)
class SchemeGroup:
    """A scheme and the modules it targets (compressed-tensors `config_groups` entry)."""

    scheme: Scheme
    targets: tuple[str, ...] = ("Linear",)


@dataclass
class QuantizationPlan:
    """Everything a checkpoint's `quantization_config` states."""

    groups: list[SchemeGroup]
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    kv_cache: QuantArgs | None = None

    def __post_init__(self) -> None:
        """Every "re:" pattern compiles (one line naming it, before any work), and is cached."""
        for pat in [t for g in self.groups for t in g.targets] + list(self.ignore):
            if not isinstance(pat, str):
                raise UserError(f"targets and ignore take strings, got {pat!r}")
            if pat.startswith("re:"):
                _regex(pat[3:])

    def unmatched(self, module_names: list[str]) -> list[str]:
        """The targets (other than the class name "Linear") that name none of `module_names`: a
        recipe whose target matches nothing would write a checkpoint that declares quantization
        while nothing was quantized."""
        return [t for g in self.groups for t in g.targets
                if t != "Linear" and not any(matches_any(n, (t,)) for n in module_names)]

    def scheme_for(self, module_name: str) -> Scheme | None:
        """The scheme of the group whose target names the module (a name or "re:" pattern), else
        of the first group whose target is the class "Linear": compressed-tensors' and vLLM's
        order, so a group for `lm_head` beside a "Linear" group means the same to every reader."""
        if matches_any(module_name, self.ignore):
            return None
        for by_name in (True, False):
            for group in self.groups:
                named = [t for t in group.targets if (t != "Linear") == by_name]
                if matches_any(module_name, named):
                    return group.scheme
        return None

    def format(self) -> str:
        formats = {g.scheme.format for g in self.groups}
        return formats.pop() if len(formats) == 1 else "mixed-precision"


@functools.lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UserError(f"target 're:{pattern}' is not a valid regular expression ({exc})") from None


def matches_any(module_name: str, patterns: tuple[str, ...] | list[str], is_linear: bool = True) -> bool:
    """compressed-tensors target semantics: a class name ("Linear"), "re:REGEX" (re.match on the
    full module name), or an exact module name / name suffix."""
    for pat in patterns:
        if pat == "Linear":
            if is_linear:
                return True
        elif pat.startswith("re:"):
            if _regex(pat[3:]).match(module_name):
                return True
        elif module_name == pat or module_name.endswith("." + pat):
            return True
    return False


def _ct_args(args: QuantArgs) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_bits": args.num_bits,
        "type": args.type,
        "symmetric": args.symmetric,
        "strategy": args.strategy,
        "group_size": args.group_size if args.strategy == "group" else None,
        "dynamic": args.dynamic,
        "observer": None if args.dynamic else args.observer,
    }
    if args.actorder:
        out["actorder"] = {"static": "weight", "dynamic": "group"}.get(args.actorder, args.actorder)
    return out


def to_compressed_tensors(plan: QuantizationPlan) -> dict[str, Any]:
    """The `quantization_config` dict, validated through compressed-tensors' own pydantic schema."""
    from compressed_tensors.quantization import QuantizationConfig

    groups: dict[str, dict[str, Any]] = {}
    for i, g in enumerate(plan.groups):
        groups[f"group_{i}"] = {
            "targets": list(g.targets),
            "weights": _ct_args(g.scheme.weights),
            "input_activations": _ct_args(g.scheme.input_activations) if g.scheme.input_activations else None,
            "output_activations": None,
            "format": g.scheme.format,
        }
    # compressed-tensors 0.20 refuses actorder "group" (desc_act with g_idx) and would ignore
    # weight_g_idx; validate without it and write it back, so loaders that honour g_idx (ours,
    # vLLM) read it and the others refuse the checkpoint instead of computing wrong weights.
    validated = {n: {**g, "weights": {k: v for k, v in g["weights"].items() if not (k == "actorder" and v == "group")}}
                 for n, g in groups.items()}
    cfg = QuantizationConfig(
        config_groups=validated,
        quant_method="compressed-tensors",
        format=plan.format(),
        quantization_status="compressed",
        ignore=list(plan.ignore),
        kv_cache_scheme=_ct_args(plan.kv_cache) if plan.kv_cache else None,
    )
    out = cfg.model_dump(exclude_none=False, mode="json")
    for name, group in groups.items():
        if group["weights"].get("actorder") == "group":
            out["config_groups"][name]["weights"]["actorder"] = "group"
    return out


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _whole(d: dict[str, Any], key: str, default: int | None, where: str) -> int | None:
    """An integer field (num_bits, group_size), one line when it is not a whole number."""
    value = d.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise UserError(f"{where}: {key} must be an integer, got {value!r}")
    return int(value)


def _names(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise UserError(f"{where} must be a list of names")
    return value


def plan_from_compressed_tensors(qcfg: dict[str, Any], where: str = "quantization_config") -> QuantizationPlan:
    """Read back a checkpoint's `quantization_config` (ours or another tool's): the one reader of
    that schema. Every field is type-checked on the way in, so a malformed config is one line
    naming the field (`where` prefixes it), wherever the config is read (runtime, compile, doctor)."""
    _object(qcfg, where)
    if qcfg.get("quant_method") not in ("compressed-tensors", None):
        raise UserError(f"{where}: quant_method {qcfg.get('quant_method')!r} is not supported (compressed-tensors)")

    def args(d: Any, at: str) -> QuantArgs | None:
        if not d:
            return None
        d = _object(d, at)
        actorder = d.get("actorder")
        actorder = {"weight": "static", "group": "dynamic"}.get(actorder, actorder) if actorder else None
        strategy = d.get("strategy") or ("group" if d.get("group_size") else "tensor")
        if not isinstance(strategy, str):
            raise UserError(f"{at}: strategy must be a name, got {strategy!r}")
        group_size = _whole(d, "group_size", None, at) if strategy == "group" else None
        return QuantArgs(
            num_bits=_whole(d, "num_bits", 8, at) or 8, type=d.get("type", "int"),
            symmetric=bool(d.get("symmetric", True)), strategy=strategy,  # type: ignore[arg-type]
            group_size=group_size, dynamic=bool(d.get("dynamic", False)), observer=d.get("observer") or "minmax",
            actorder=actorder,
        )

    groups = []
    for gname, g in _object(qcfg.get("config_groups") or {}, f"{where}.config_groups").items():
        at = f"{where}: config group {gname}"
        g = _object(g, at)
        w = args(g.get("weights"), f"{at}: weights")
        if w is None:
            raise UserError(f"{at} has no weight quantization (unsupported)")
        scheme = Scheme(gname, w, args(g.get("input_activations"), f"{at}: input_activations"))
        groups.append(SchemeGroup(scheme, tuple(_names(g.get("targets"), f"{at}: targets"))))
    ignore = _names(qcfg.get("ignore"), f"{where}.ignore")
    return QuantizationPlan(groups, ignore, args(qcfg.get("kv_cache_scheme"), f"{where}: kv_cache_scheme"))
