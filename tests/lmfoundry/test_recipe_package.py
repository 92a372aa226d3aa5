"""Recipes, gates and eval tasks are package data: found through importlib.resources, never by
climbing `__file__` to a source checkout, so `--recipe NAME` works from an installed wheel.

The slow test builds the wheel with `python -m build` from a copy of the source tree, installs it
into a fresh venv that sees the project venv's dependencies but not its editable lmfoundry, and
runs `lmfoundry quantize --recipe smollm2-w4a16-rtn` from a folder outside the repository.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import copy_checkout, linked_venv, tiny_model_folder, write_text

from lmfoundry.errors import UserError
from lmfoundry.recipe import UNREAD_SECTIONS, Recipe, builtin_recipes, resolve_recipe_path
from lmfoundry.resources import shipped

REPO = Path(__file__).resolve().parents[2]
# Shipped data in the source tree -> its place inside the wheel.
DATA = {"recipes": "lmfoundry/recipes", "evals/tasks": "lmfoundry/evals/tasks", "lmfoundry": "lmfoundry"}
DATA_SUFFIXES = (".yaml", ".jsonl", ".json", ".md")


def shipped_files() -> set[str]:
    """Wheel paths of every data file the source tree ships (recipes, gates, tasks, gpus.yaml)."""
    out = set()
    for src, dst in DATA.items():
        root = REPO / src
        files = root.glob("*") if src == "lmfoundry" else root.rglob("*")
        out |= {f"{dst}/{f.relative_to(root).as_posix()}" for f in files
                if f.is_file() and f.suffix in DATA_SUFFIXES and "__pycache__" not in f.parts}
    return out


# ---- fast: name resolution -----------------------------------------------------------------
def test_builtin_recipe_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec = Recipe.from_yaml("smollm2-w4a16-rtn")
    assert Path(rec.source_file) == shipped("lmfoundry.recipes", "smollm2-w4a16-rtn.yaml")
    assert rec.name == "smollm2-w4a16-rtn" and rec.quantize.group_size == 64
    assert Recipe.from_yaml("smollm2-w4a16-rtn.yaml").source_file == rec.source_file


def test_every_builtin_recipe_loads():
    names = builtin_recipes()
    assert {"smollm2-w4a16-rtn", "smollm2-w4a16-gptq", "smollm2-w8a16-rtn", "w4a16-g128-rtn"} <= set(names)
    for name in names:
        assert Recipe.from_yaml(name).name == name


def test_a_local_file_wins_over_a_builtin_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("smollm2-w4a16-rtn").write_text("quantize: {group_size: 32}\n")
    assert Recipe.from_yaml("smollm2-w4a16-rtn").quantize.group_size == 32


@pytest.mark.parametrize("spec", ["no-such-recipe", "gates/default", "../recipes/smollm2-w4a16-rtn", ""])
def test_unknown_recipe_names_the_builtins(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as exc:
        resolve_recipe_path(spec)
    msg = str(exc.value)
    assert "\n" not in msg and "no such recipe" in msg and "smollm2-w4a16-rtn" in msg


@pytest.mark.parametrize("section", sorted(UNREAD_SECTIONS))
def test_sections_no_stage_reads_are_refused(section, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"quantize: {{method: rtn}}\n{section}: {{x: 1}}\n")
    with pytest.raises(UserError) as exc:
        Recipe.from_yaml(str(recipe))
    msg = str(exc.value)
    assert "\n" not in msg and repr(section) in msg and "not read by any stage" in msg


def test_gates_and_tasks_are_package_data():
    from lmfoundry.evals import gate_spec, generation, lm_eval_runner

    assert gate_spec.GATES_DIR == shipped("lmfoundry.recipes", "gates")
    assert gate_spec.resolve_gate_path(None) == gate_spec.GATES_DIR / "default.yaml"
    assert sorted(p.parent.name for p in lm_eval_runner.TASKS_DIR.glob("*/*.yaml")) == \
        ["arc_challenge", "arc_easy", "hellaswag", "piqa"]
    assert generation.PROMPTS == shipped("lmfoundry.evals", "data", "generation.yaml") and generation.PROMPTS.is_file()


# ---- slow: a wheel in a clean venv -----------------------------------------------------------
def _run(cmd: list[str], timeout: int, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A new venv holding only the wheel; the project venv's installed dependencies (torch, ...)
    are reachable through a .pth file pointing at a folder of links to them, lmfoundry's own
    editable install (its .pth finder and dist-info) left out."""
    venv = linked_venv(root, lambda name, owners: not name.lower().startswith(("lmfoundry", "__editable__")))
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index",
          "--quiet", "--disable-pip-version-check", wheel], timeout=120)
    return venv


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_quantizes_with_a_builtin_recipe_from_a_clean_venv(tmp_path):
    src, dist, work = tmp_path / "src", tmp_path / "dist", tmp_path / "work"
    copy_checkout(src)
    # --no-isolation: the build backend (setuptools) comes from this venv instead of a download.
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src], timeout=300)
    (wheel,) = dist.glob("lmfoundry-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        missing = shipped_files() - set(zf.namelist())
    assert not missing, f"shipped data missing from the wheel: {sorted(missing)}"

    venv = _fresh_venv(tmp_path, wheel)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", LMFOUNDRY_CACHE=str(tmp_path / "cache"))
    where = json.loads(_run([venv / "bin" / "python", "-c", (
        "import json, importlib.metadata as md, lmfoundry, lmfoundry.recipes, lmfoundry.evals.gate_spec as g, torch;"
        "print(json.dumps({'pkg': lmfoundry.__file__, 'recipes': lmfoundry.recipes.__file__,"
        " 'gate': str(g.resolve_gate_path(None)), 'dists': [str(d.locate_file('')) for d in md.distributions()"
        " if d.metadata['Name'] == 'lmfoundry']}))")], timeout=120, cwd=work, env=env).stdout)
    site = str(venv.resolve())

    def in_venv(path: str) -> bool:
        return os.path.realpath(path).startswith(site + os.sep)

    assert all(map(in_venv, (where["pkg"], where["recipes"], where["gate"]))), where
    assert len(where["dists"]) == 1 and in_venv(where["dists"][0]), where  # not the editable install

    tiny_model_folder(work / "tiny")  # hidden 128, intermediate 256: group 64 divides both
    write_text(work / "calib.txt")  # a local text: no calibration download
    args = ["quantize", "tiny", "--recipe", "smollm2-w4a16-rtn", "--calib", "calib.txt",
            "--num-samples", "4", "--seq-len", "64", "--quiet"]
    _run([venv / "bin" / "lmfoundry", *args, "-o", "out-wheel"], timeout=300, cwd=work, env=env)
    manifest = json.loads((work / "out-wheel" / "lmfoundry.json").read_text())
    # the shipped recipe, named by package and file (no path); the wheel's copy is the checkout's
    shipped_recipe = shipped("lmfoundry.recipes", "smollm2-w4a16-rtn.yaml").read_bytes()
    assert manifest["recipe_file"] == {"package": "lmfoundry.recipes", "file": "smollm2-w4a16-rtn.yaml",
                                       "sha256": hashlib.sha256(shipped_recipe).hexdigest()}
    assert manifest["recipe"]["name"] == "smollm2-w4a16-rtn"
    assert manifest["recipe"]["quantize"]["group_size"] == 64
    groups = json.loads((work / "out-wheel" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert {g["weights"]["group_size"] for g in groups.values()} == {64}

    # The same command through the source tree writes the same checkpoint bytes.
    _run([Path(sys.executable).parent / "lmfoundry", *args, "-o", "out-src"], timeout=300, cwd=work, env=env)
    weights = sorted(p.name for p in (work / "out-src").glob("*.safetensors"))
    assert weights and weights == sorted(p.name for p in (work / "out-wheel").glob("*.safetensors"))
    for name in [*weights, "config.json"]:
        assert (work / "out-wheel" / name).read_bytes() == (work / "out-src" / name).read_bytes(), name
