"""`lmfoundry.json`: what was built, from what, with what, and the sha256 of every file.

The manifest makes an artifact auditable: tool and library versions, the recipe as applied, the
source model hash, the calibration token hash, per-layer errors, and file hashes that
`lmfoundry inspect` verifies (the manifest itself is excluded from the hash list; later stages,
such as eval-gate's promotion record, may add keys to it).

The manifest describes the artifact, not the run that built it, so the same inputs give the same
bytes on every machine: sources are named by package, file name and sha256, never by a local path
(the user's home or `LMFOUNDRY_CACHE` would leak into a published artifact and change its hash),
and what the run measured (times, resident memory, the device, a resume) goes into the run record
`lmfoundry-run.json` beside it (`RUN_RECORD`). The run record is neither listed nor hashed, and
the verification ignores it: two runs of the same job that compute the same weights differ in it
and only in it.

An artifact may come from anywhere (a download, a colleague's disk), so everything a manifest
names is untrusted: paths are kept inside the artifact folder, only regular files are opened (a
FIFO or `/dev/zero` would block or never end), and every read is bounded.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from lmfoundry.errors import UserError

MANIFEST = "lmfoundry.json"
RUN_RECORD = "lmfoundry-run.json"  # the run's measurements, top level only, outside the hashes
# A run record is a few numbers per layer; anything much larger is not one of ours.
MAX_RUN_RECORD_BYTES = 16 << 20
LIBRARIES = ("lmfoundry", "torch", "transformers", "compressed-tensors", "safetensors", "triton", "lm-eval")
# Manifests hold per-layer metrics: a few hundred KiB for the largest models we know. Anything
# much bigger is not ours and would only cost memory to parse.
MAX_MANIFEST_BYTES = 64 << 20


def open_regular(path: Path) -> int:
    """A read-only descriptor for `path`, refused unless it is a regular file.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer; the type is
    checked on the opened descriptor (fstat), so the file cannot be swapped after the check."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{path}: not a regular file")
    return fd


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a regular file's bytes, reading no more than the size it had when opened.

    Refusing non-regular files and bounding the read keeps a hash from hanging on a FIFO or
    running forever on a device (`/dev/zero`) named where a data file was expected."""
    h = hashlib.sha256()
    fd = open_regular(Path(path))
    with os.fdopen(fd, "rb") as f:
        left = os.fstat(f.fileno()).st_size
        while left > 0 and (block := f.read(min(chunk, left))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def new_unique_folder(parent: Path, prefix: str) -> Path:
    """Create and return an empty folder `parent/<prefix><random>` that no other process uses.

    Unlike `tempfile.mkdtemp` (mode 0700) it gets the usual mode (0777 minus the umask), because
    these folders are renamed into place as artifacts and cache entries other users may read."""
    import secrets

    for _ in range(100):
        path = Path(parent) / f"{prefix}{secrets.token_hex(6)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{parent}: no free name for {prefix}*")


def hash_folder(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder` (relative POSIX paths), except the manifest and the
    run record."""
    return {
        rel: sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST and (rel := p.relative_to(folder).as_posix()) != RUN_RECORD
    }


def content_files(folder: Path) -> list[Path]:
    """The regular files at the top of an artifact folder that make up what it computes: all but
    the run record (a measurement of the run that made them, different on every run). A bundle
    copies these and keys its cache by them, so re-running the same quantization reuses it."""
    return [p for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != RUN_RECORD]


def write_run_record(folder: Path, record: dict[str, Any]) -> None:
    """Write the run record (`RUN_RECORD`) into a finished artifact folder (before it is moved
    into place, so it arrives with the artifact)."""
    (Path(folder) / RUN_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def read_run_record(folder: Path) -> dict[str, Any] | None:
    """The artifact's run record, None when it has none; UserError when it is not one (it is
    untrusted like the manifest: kept inside the folder, a regular file, bounded)."""
    if not os.path.lexists(Path(folder) / RUN_RECORD):
        return None
    path = contained_file(Path(folder), RUN_RECORD)
    return parse_json_object(read_bounded(path, MAX_RUN_RECORD_BYTES, "run record"), path, "run record")


def tool_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for lib in LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = "not installed"
    return out


def hub_repo_root(folder: Path) -> Path | None:
    """The `models--org--name` folder when `folder` is a Hugging Face hub cache snapshot, whose
    files are symlinks into the repo's own `blobs/` (outside the snapshot, inside the repo)."""
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent
    return None


def contained_file(folder: Path, rel: Any, hub_cache: bool = False) -> Path:
    """The resolved path of `folder / rel` (a path an artifact names itself), refused (UserError,
    short reason) unless `rel` is relative without `..`, resolves (symlinks followed) inside
    `folder`, and is a regular file — so a manifest cannot make us read `/etc/...`, `../x` or
    `/dev/zero`.
    `hub_cache`: a hub cache snapshot may also link into its own repo's blobs."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise UserError(f"{rel!r}: not a file name")
    posix, windows = PurePosixPath(rel), PureWindowsPath(rel)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts or ".." in windows.parts:
        raise UserError(f"{rel}: outside the folder (absolute or `..` path)")
    root = Path(folder).resolve()
    allowed = [root]
    if hub_cache and (repo := hub_repo_root(root)) is not None:
        allowed.append(repo)
    try:
        target = (root / rel).resolve(strict=True)
    except FileNotFoundError:
        raise UserError(f"{rel}: missing") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop, a permission problem
        raise UserError(f"{rel}: cannot be resolved ({exc})") from None
    if not any(target == a or target.is_relative_to(a) for a in allowed):
        raise UserError(f"{rel}: resolves outside the folder (symlink to {target})")
    if not stat.S_ISREG(target.stat().st_mode):
        raise UserError(f"{rel}: not a regular file")
    return target


def read_bounded(path: Path, limit: int, what: str = "manifest") -> bytes:
    """The bytes of a regular file, refused when longer than `limit` (never reads past it)."""
    fd = open_regular(Path(path))
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{path}: larger than {limit >> 20} MiB, too large for a {what}")
    return data


def parse_json_object(raw: bytes, where: Path | str, what: str = "manifest") -> dict[str, Any]:
    """A JSON object from untrusted bytes; anything else (invalid UTF-8 or JSON, nesting deep
    enough to exhaust the parser's stack, a list or number at the top) is one UserError."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: corrupt {what} ({exc})") from None
    except RecursionError:
        raise UserError(f"{where}: corrupt {what} (nested too deeply)") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: corrupt {what} (a JSON object is expected, found {type(data).__name__})")
    return data


def read_manifest(folder: Path) -> dict[str, Any]:
    """The artifact's manifest as a dict: a regular file inside `folder`, at most
    MAX_MANIFEST_BYTES, holding a JSON object (UserError otherwise)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not os.path.lexists(path):
        raise UserError(f"{folder}: no {MANIFEST} (not an lmfoundry artifact)")
    try:
        contained_file(folder, MANIFEST)
    except UserError as exc:
        raise UserError(f"{folder}: bad manifest: {exc}") from None
    return parse_json_object(read_bounded(path, MAX_MANIFEST_BYTES), path)


def update_manifest(folder: Path, key: str, value: Any) -> None:
    """Set one top-level key of a manifest (atomic rewrite)."""
    data = read_manifest(folder)
    data[key] = value
    tmp = Path(folder) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(Path(folder) / MANIFEST)


def recorded_files(manifest: dict[str, Any], where: Path | str = MANIFEST) -> dict[str, str]:
    """The manifest's `files` (relative path -> sha256), checked to be that shape."""
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise UserError(f"{where}: corrupt manifest (`files` must map file names to sha256 strings)")
    return files


def folder_entries(folder: Path) -> list[tuple[str, bool]]:
    """(relative POSIX path, is a regular file) of every non-folder entry below `folder` that its
    manifest accounts for, without following symlinked folders; symlinks count as regular only
    when they stay inside `folder`. The run record at the top is left out (by design not listed)
    when it is a regular file inside the folder: one that links out stays, to be refused, since
    later stages copy every file of an artifact."""
    root = Path(folder)
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        linked_dirs = [d for d in dirnames if (here / d).is_symlink()]
        for name in sorted(filenames + linked_dirs):
            rel = (here / name).relative_to(root).as_posix()
            try:
                contained_file(root, rel)
                regular = True
            except UserError:
                regular = False
            if not (regular and rel == RUN_RECORD):
                out.append((rel, regular))
    return sorted(out)


def verify_artifact(folder: Path, what: str = "load") -> None:
    """Refuse (UserError naming the first problem) an artifact whose files do not match its
    manifest, before any of them is read: a stage that consumed tampered weights would pass them
    on as good (compile would record their hashes). A folder without a manifest (a plain model
    folder, the built-in model) has nothing to check against and passes."""
    folder = Path(folder)
    if not os.path.lexists(folder / MANIFEST):
        return
    problems = verify_files(folder, read_manifest(folder))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{folder}: {problems[0]}{more} against its {MANIFEST}; refusing to {what} it")


def verify_files(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems found comparing the folder with the manifest's hashes (empty = verified).

    Each recorded path is contained first (see `contained_file`), so a hostile manifest yields
    "outside the artifact folder" or "not a regular file" problems instead of reads elsewhere."""
    problems = []
    recorded = recorded_files(manifest, Path(folder) / MANIFEST)
    for rel, digest in recorded.items():
        try:
            path = contained_file(Path(folder), rel)
            actual = sha256_file(path)
        except UserError as exc:
            problems.append(str(exc))
            continue
        if actual != digest:
            problems.append(f"{rel}: sha256 mismatch")
    for rel, regular in folder_entries(Path(folder)):
        if PurePosixPath(rel).name == MANIFEST or rel in recorded:
            continue
        problems.append(f"{rel}: not in manifest" if regular else f"{rel}: not in manifest (not a regular file)")
    return problems
