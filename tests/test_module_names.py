"""Each module's file name says what it is without its folder: two modules of the package never
share a name, so a traceback, a grep or an import line names one file. The one exception is a
kernel's CPU backend: `runtime/cpu/native/<name>.py` implements the kernel `kernels/<name>.py` defines
(GPTQModel's one-file-per-backend registry), and the shared name is the point."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from test_import_layers import modules


def _backend_mirror(paths: list[Path]) -> bool:
    """Whether the files are one kernel's definition and its CPU backend."""
    folders = sorted(p.parent.relative_to(Path(__file__).resolve().parents[1]).as_posix() for p in paths)
    return folders == ["kernels", "runtime/cpu/native"]


def test_no_two_modules_share_a_file_name() -> None:
    shared = {name: sorted(str(p) for p in paths) for name, paths in _names().items()
              if len(paths) > 1 and not _backend_mirror(paths)}
    assert not shared, f"module names used twice (rename one to say what it is): {shared}"


def test_the_backend_exception_names_real_pairs() -> None:
    mirrors = [name for name, paths in _names().items() if len(paths) > 1 and _backend_mirror(paths)]
    assert "paged_decode" in mirrors  # the rule above is exercised, not vacuous
    assert all((Path(__file__).resolve().parents[1] / "kernels" / f"{m}.py").is_file() for m in mirrors)


def _names() -> dict[str, list[Path]]:
    by_name: dict[str, list[Path]] = defaultdict(list)
    for path in modules().values():
        if path.name != "__init__.py":
            by_name[path.stem].append(path)
    return by_name
