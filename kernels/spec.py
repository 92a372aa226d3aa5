"""What a kernel is, independently of how it gets run.

A `KernelDef` names one Triton kernel, its runtime parameters in launch order (with types that may
depend on the call's dtypes), the constexprs that define *what* it computes (`semantics`) apart from
*how fast* (`tiles`), a grid rule written as small expressions, and a PyTorch reference that
computes the same outputs. A `KernelCall` is one invocation: arguments, dtypes, semantic constexprs
and the problem shape.

Why this split: the same call must be runnable three ways — Triton JIT (or its interpreter), a
cubin shipped in an engine bundle and launched through the CUDA driver with no Triton at all, and
the PyTorch reference on CPU — and the bundle must record enough (signature, grid rule, tile
constexprs, num_warps, shared memory) for the second way to work on a machine whose Triton version
differs. Everything a launcher needs is therefore plain data (str/int/float), serialisable to JSON.
"""

from __future__ import annotations

import ast
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# Triton pointer/scalar type names by torch dtype name.
TRITON_TYPE = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "int8": "i8",
    "int32": "i32",
    "int64": "i64",
    "float8_e4m3fn": "fp8e4nv",
}


def triton_type(dtype: Any) -> str:
    """Triton's name for a torch dtype (`torch.float16` -> "fp16")."""
    name = str(dtype).replace("torch.", "")
    try:
        return TRITON_TYPE[name]
    except KeyError:
        raise TypeError(f"no Triton kernel type for dtype {name}") from None


# What an AOT build may assume: every pointer a multiple of DIVISIBILITY bytes, every `aligned`
# integer a multiple of DIVISIBILITY (Triton's `tt.divisibility`, its own JIT default for pointers).
# Each kernel's JSON records it per parameter; the runtime's metadata buffers are laid out to it.
DIVISIBILITY = 16


@dataclass(frozen=True)
class Param:
    """One runtime kernel parameter, in launch order.

    `type` is a Triton signature type, optionally with `{var}` placeholders filled from the call's
    `types` (e.g. "*{act}" -> "*fp16"). `aligned` marks an integer the AOT build may assume to be a
    multiple of 16 (pointers are always assumed 16-byte aligned); launchers check the assumption
    and fall back to JIT when a call breaks it, so the assumption is a speed hint, never a hazard.
    """

    name: str
    type: str
    aligned: bool = False

    def resolve(self, types: Mapping[str, str]) -> str:
        return self.type.format(**types)

    @property
    def is_pointer(self) -> bool:
        return self.type.startswith("*")


@dataclass(frozen=True)
class TileConfig:
    """Tile constexprs plus launch options: what an arch table or `--tune` chooses."""

    constexprs: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def make(cls, num_warps: int = 4, num_stages: int = 2, **constexprs: int) -> "TileConfig":
        return cls(tuple(sorted(constexprs.items())), num_warps, num_stages)

    def as_dict(self) -> dict[str, Any]:
        return {"constexprs": dict(self.constexprs), "num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TileConfig":
        return cls.make(int(d["num_warps"]), int(d["num_stages"]), **{k: int(v) for k, v in d["constexprs"].items()})

    def __getitem__(self, key: str) -> int:
        return dict(self.constexprs)[key]


@dataclass(frozen=True)
class KernelDef:
    """A Triton kernel together with everything needed to launch it without Triton's JIT."""

    name: str
    fn: Any  # the @triton.jit function (an InterpretedFunction under TRITON_INTERPRET=1)
    params: tuple[Param, ...]
    grid: tuple[str, str, str]
    type_vars: tuple[str, ...]
    semantics: tuple[str, ...]
    tiles: tuple[str, ...]
    reference: Callable[["KernelCall"], None]
    default_config: Callable[[Mapping[str, int]], TileConfig]
    # (arch, config, types, semantics) -> SASS opcodes at least one of which must appear.
    expect_sass: Callable[[int, TileConfig, Mapping[str, str], Mapping[str, Any]], tuple[str, ...]] = (
        lambda arch, cfg, types, sem: ()
    )
    # shape -> the values the `aligned` integer params take for it (contiguous tensors), so that an
    # AOT build assumes divisibility by 16 only where every shape it covers has it.
    shape_ints: Callable[[Mapping[str, int]], dict[str, int]] = lambda shape: {}
    # Shape entries fixed by the model (a compiled kernel covers a list of these), and the one
    # dynamic entry the per-arch tile tables bucket on (e.g. GEMM rows M), if any.
    static_shape: tuple[str, ...] = ()
    rows: str | None = None

    def signature(self, types: Mapping[str, str]) -> dict[str, str]:
        """Triton signature: runtime params with resolved types, then every constexpr."""
        sig = {p.name: p.resolve(types) for p in self.params}
        for name in (*self.semantics, *self.tiles):
            sig[name] = "constexpr"
        return sig


@dataclass
class KernelCall:
    """One invocation: runtime args by parameter name, dtypes, semantic constexprs, shape."""

    kernel: KernelDef
    args: dict[str, Any]
    types: dict[str, str]
    semantics: dict[str, Any]
    shape: dict[str, int]

    def variant(self) -> "Variant":
        return Variant(self.kernel.name, tuple(sorted(self.types.items())), tuple(sorted(self.semantics.items())))

    def grid(self, config: TileConfig) -> tuple[int, int, int]:
        names: dict[str, Any] = {}
        names.update({k: v for k, v in self.args.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        names.update(self.shape)
        names.update(self.semantics)
        names.update(dict(config.constexprs))
        return tuple(eval_grid_rule(rule, names) for rule in self.kernel.grid)  # type: ignore[return-value]


@dataclass(frozen=True)
class Variant:
    """What a kernel computes (name + dtypes + semantic constexprs), independent of tiles."""

    kernel: str
    types: tuple[tuple[str, str], ...]
    semantics: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "types": dict(self.types), "semantics": dict(self.semantics)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Variant":
        return cls(d["kernel"], tuple(sorted(d["types"].items())), tuple(sorted(d["semantics"].items())))


# ---- grid rules ---------------------------------------------------------------------------------
# A grid rule is a tiny integer expression ("cdiv(M, BLOCK_M)", "NUM_HEADS", "1") so that it can be
# stored in JSON and evaluated by any launcher without importing the kernel module.

_BINOPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def eval_grid_rule(rule: str, names: Mapping[str, Any]) -> int:
    """Evaluate `rule` with integer names; only + - * //, cdiv, max, min and literals are allowed."""
    return compile_grid_rule(rule)(names)


@functools.lru_cache(maxsize=None)
def compile_grid_rule(rule: str) -> Callable[[Mapping[str, Any]], int]:
    """`rule` parsed and checked once, as a function of the names (launchers call it per launch,
    so nothing is parsed on the hot path)."""

    def build(node: ast.AST) -> Callable[[Mapping[str, Any]], int]:
        if isinstance(node, ast.Expression):
            return build(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            value = node.value
            return lambda names: value
        if isinstance(node, ast.Name):
            key = node.id

            def name(names: Mapping[str, Any]) -> int:
                if key not in names:
                    raise KeyError(f"grid rule {rule!r} needs {key!r}")
                return int(names[key])

            return name
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            op, left, right = _BINOPS[type(node.op)], build(node.left), build(node.right)
            return lambda names: op(left(names), right(names))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            args = [build(a) for a in node.args]
            if node.func.id == "cdiv" and len(args) == 2:
                a, b = args
                return lambda names: -(-a(names) // b(names))
            if node.func.id in ("max", "min") and args:
                fn = max if node.func.id == "max" else min
                return lambda names: fn([f(names) for f in args])
        raise ValueError(f"unsupported grid rule {rule!r}")

    return build(ast.parse(rule, mode="eval"))


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (Triton block shapes must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class Support:
    """What a kernel family declares it handles; `supports(**query)` checks a request against it."""

    values: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    note: str = ""

    def supports(self, **query: Any) -> bool:
        for key, value in query.items():
            if value is None:
                continue
            if key not in self.values:
                raise KeyError(f"unknown support key {key!r}; known: {sorted(self.values)}")
            if value not in self.values[key]:
                return False
        return True
