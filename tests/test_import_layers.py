"""The import graph follows the stage layering of docs/architecture.md: a module imports only from
its own layer or an earlier one (module-level and function-level imports alike). That no modules
import each other, counting every import statement, is test_import_cycles.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# package prefix -> source folder: pyproject's package-dir itself, the map setuptools installs by
FOLDERS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
# (layer, module prefixes), earliest first: the longest matching prefix decides
LAYERS = [
    (1, ("lmfoundry.errors", "lmfoundry.distributed", "lmfoundry.manifest", "lmfoundry.output_paths", "lmfoundry.resources",
         "lmfoundry.gpus", "lmfoundry.recipe", "lmfoundry.checkpoint.headers", "lmfoundry.recipes",
         "lmfoundry.child_python", "lmfoundry.devices", "lmfoundry.heap", "lmfoundry.staging")),
    # the quantized-weight format sits below the model, whose linears are built from it
    (2, ("lmfoundry.kernels", "lmfoundry.quantformat")),
    (3, ("lmfoundry.model",)),
    # the engine-bundle format sits below compile, the runtime and evals, which all read or write it
    (4, ("lmfoundry.model.linears", "lmfoundry.model.quantized_linear", "lmfoundry.checkpoint",
         "lmfoundry.engine_bundle")),
    (5, ("lmfoundry.quantizers",)),
    (6, ("lmfoundry.calibration",)),
    (7, ("lmfoundry.runtime",)),
    (8, ("lmfoundry.compile",)),  # --arch cpu traces the runtime's step; the runtime reads no compile code
    (9, ("lmfoundry.evals",)),
    # the quantize job (calibration/job.py) composes every stage and runs the doctor: a verb's layer
    (10, ("lmfoundry.commands", "lmfoundry.cli", "lmfoundry.preflight", "lmfoundry.api",
          "lmfoundry.calibration.job", "lmfoundry.export", "lmfoundry.benchmarking",
          "lmfoundry.capacity")),
]
# The package itself (its __init__ imports nothing): placed by name only, never as a prefix, so a
# new module under lmfoundry/ stays unplaced until LAYERS says where it belongs.
ROOT_PACKAGE = "lmfoundry"
# Package __init__s that are also entry points of the Python API (`lmfoundry.quantize`, ...;
# `lmfoundry.compile(...)`): at module level they import nothing of lmfoundry, so importing them,
# or a module through them, costs no dependency; their functions import the API (layer 10) when
# called. Only their module-level imports are held to their layer.
FACADES = ("lmfoundry", "lmfoundry.compile")


def layer_of(module: str) -> int:
    """The module's layer; 0 where no prefix of LAYERS places it."""
    if module == ROOT_PACKAGE:
        return 1
    best, layer = -1, 0
    for n, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), n
    return layer


def modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in FOLDERS.items():
        base = ROOT / folder
        for f in base.rglob("*.py"):
            rel = f.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p in FOLDERS.values() and prefix == "lmfoundry" for p in parts[:1]):
                continue
            name = ".".join([prefix, *parts])
            out.setdefault(name, f)
    return out


def imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported lmfoundry module, at module level) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        names = [n for n in names if n.startswith("lmfoundry")]
        found += [(n, id(node) in top) for n in names]
    return found


def empty_package(path: Path, module: str = "") -> bool:
    """A package `__init__` that imports nothing (a facade: nothing at module level): importing
    through it costs no dependency."""
    return path.name == "__init__.py" and not [top for _, top in imports(path, "") if top or module not in FACADES]


def test_no_stage_imports_a_later_stage() -> None:
    mods = modules()
    wrong = []
    for name, path in mods.items():
        for target, top in imports(path, name):
            # `from X import name`: a name that is no module is a symbol of X; an empty package
            # __init__ on the way to a module is no dependency
            if target not in mods or empty_package(mods[target], target) or (name in FACADES and not top):
                continue
            if layer_of(target) > layer_of(name):
                wrong.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not wrong, "\n".join(wrong)


# Stages that must not reach into each other at all, whatever their layers allow: serving reads
# checkpoints, never the quantizers or calibration that wrote them; calibration and the quantizers
# never load through the serving runtime; evals drive the engine, not the HTTP server; the model
# the quantizers run takes quantized weights from the format below both (lmfoundry.quantformat),
# never from the quantizers, so the two folders import one way only.
SEPARATE = [
    ("lmfoundry.model", ("lmfoundry.quantizers",)),
    ("lmfoundry.runtime", ("lmfoundry.quantizers", "lmfoundry.calibration")),
    ("lmfoundry.calibration", ("lmfoundry.runtime",)),
    ("lmfoundry.quantizers", ("lmfoundry.runtime",)),
    ("lmfoundry.evals", ("lmfoundry.runtime.server",)),
]


def crossings(mods: dict[str, Path]) -> list[str]:
    wrong = []
    for name, path in mods.items():
        for source, banned in SEPARATE:
            if not (name == source or name.startswith(source + ".")):
                continue
            for target, _ in imports(path, name):
                if target in mods and any(target == b or target.startswith(b + ".") for b in banned):
                    wrong.append(f"{name} imports {target}")
    return sorted(set(wrong))


def test_separate_stages_do_not_import_each_other() -> None:
    assert not crossings(modules()), "\n".join(crossings(modules()))
    # the rules bite: a serving module that imported the calibration pipeline, or a model module
    # that imported what a pipeline module imports of the quantizers, would be reported
    for name, path, banned in (
            ("lmfoundry.runtime.x", ROOT / "calibration" / "job.py", ("lmfoundry.calibration", "lmfoundry.quantizers")),
            ("lmfoundry.model.x", ROOT / "calibration" / "pipeline.py", ("lmfoundry.quantizers",))):
        planted = {name: path, **modules()}
        expected = sorted({t for t, _ in imports(path, "") if t in planted and t.startswith(banned)})
        assert expected and crossings(planted) == [f"{name} imports {t}" for t in expected]


def test_every_module_is_placed() -> None:
    unplaced = sorted(m for m in modules() if not layer_of(m))
    assert not unplaced, f"modules no prefix of LAYERS places: {unplaced}"
    # a module nobody placed yet, in the package and in a stage folder, is caught
    assert layer_of("lmfoundry.something_new") == 0 and layer_of("lmfoundry.runtime.something_new") == 7
