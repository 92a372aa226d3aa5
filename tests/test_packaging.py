"""The wheel holds every package of the source tree. pyproject lists the packages one by one (the
code folders sit at the repository root and map into `lmfoundry` through package-dir), so a new
subpackage left off the list works in the editable install every test runs on, and is missing
from a real install: `lmfoundry.api` was, and the GPU lease's installed copy failed to import
the quantize command."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, mapped = set(setuptools["packages"]), setuptools["package-dir"]
    found = set()
    for name, folder in mapped.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]))
    missing = sorted(found - listed)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"
    assert "lmfoundry.api" in found  # the walk reaches the packages of the root folder
