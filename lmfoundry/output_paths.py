"""Where a verb may write: never into, over, or through a link to one of its own inputs.

Every verb that writes (`quantize`, `compile`, `export`, `eval-gate`, `bench`) names its output
with `-o` and reads inputs it must not damage: the checkpoint or bundle it works on, the recipe, the
baseline, the calibration text. A path can reach an input in four ways, and each has cost an input
before: it is the input (`-o CKPT/model-00006-of-00006.safetensors`), it lies inside an input folder
(`compile CKPT -o CKPT/engine` leaves files the checkpoint's manifest does not list, so the checkpoint
no longer verifies), it is a symbolic link to an input (the rename that installs the output replaces
the file the link points at), or it is a hard link to one (a writer that opens the path writes into
the input's bytes). `refuse_overlap` checks all four on resolved paths and device/inode numbers,
before anything is created, and says which input and which way in one `error:` line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from lmfoundry.errors import UserError

# Folders are walked to compare inode numbers; a checkpoint has tens of files, a bundle hundreds.
# The bound keeps a mistaken `-o ~` from walking a home folder: past it the walk stops (the path
# checks above it still hold, and the writers replace files by rename, never write into them).
MAX_WALK_FILES = 20000


def resolved(path: str | os.PathLike[str], option: str = "") -> Path:
    """`path` made absolute with every symbolic link in it followed (also the last component and
    links in parts that do not exist yet); a loop of links is one error line, naming `option`
    (the flag that gave the path) when there is one."""
    where = f"{option} {path}".strip()
    try:
        return Path(os.path.abspath(Path(path).expanduser())).resolve()
    except RuntimeError:  # Python < 3.13 reports a loop this way
        raise UserError(f"{where}: a loop of symbolic links") from None
    except OSError as exc:
        raise UserError(f"{where}: cannot resolve the path ({exc.strerror or exc})") from None


def _files(root: Path) -> Iterator[Path]:
    """Regular files at or under `root` (a file is itself), links to files included, at most
    MAX_WALK_FILES of them; folders reached through links are not entered."""
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        return
    seen = 0
    for folder, _dirs, names in os.walk(root, followlinks=False):
        for name in names:
            p = Path(folder) / name
            if p.is_file():
                yield p
                seen += 1
                if seen >= MAX_WALK_FILES:
                    return


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def refuse_overlap(output: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None], *,
                   option: str = "-o", holds_inputs_ok: bool = False) -> None:
    """Raise UserError when writing `output` could change any of `inputs` (files or folders; None
    and paths that do not exist are skipped): `output` is an input (also through a symbolic link),
    lies inside an input folder, shares a file with an input through a hard link, or, unless
    `holds_inputs_ok`, is a folder that holds an input (a verb that replaces its output folder as a
    whole would remove it; eval-gate, which only adds its report files, passes True)."""
    out = resolved(output, option)
    out_files: dict[tuple[int, int], list[Path]] | None = None
    for given in inputs:
        if given is None or not os.path.lexists(Path(given).expanduser()):
            continue
        src = resolved(given)
        what = f"{option} {output}"
        if out == src:
            link = "" if Path(os.path.abspath(Path(output).expanduser())) == out else " (through a symbolic link)"
            raise UserError(f"{what}: is the input {given} itself{link}; write the output elsewhere")
        if src.is_dir() and out.is_relative_to(src):
            if out.exists():
                link = "" if Path(os.path.abspath(Path(output).expanduser())) == out else " (through a symbolic link)"
                raise UserError(f"{what}: is the input's own {out.relative_to(src)} (in {given}){link}; "
                                "write the output elsewhere")
            raise UserError(f"{what}: lies inside the input folder {given}, which would no longer be what it was "
                            "(its manifest lists its files); write the output elsewhere")
        if not holds_inputs_ok and src.is_relative_to(out):
            raise UserError(f"{what}: holds the input {given}, and writing it replaces that folder; "
                            "write the output elsewhere")
        if out_files is None:
            out_files = {}
            for p in _files(out):
                if (ino := _inode(p)) is not None:
                    out_files.setdefault(ino, []).append(p)
        if not out_files:
            continue
        for f in _files(src):
            # the input's own entry, met again under an output that holds it, is not a link
            links = [p for p in out_files.get(_inode(f) or (-1, -1), []) if p != f]
            if links:
                raise UserError(f"{what}: {links[0]} is a link to the input's {f}, so writing it "
                                "would change the input; write the output elsewhere")
