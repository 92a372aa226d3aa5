"""Freed heap pages go back to the system, and a server's start-up heap leaves the collector's
reach (`lmfoundry/heap.py`)."""

from __future__ import annotations

import gc
import platform

import pytest

from lmfoundry.heap import freeze_heap, page_out_mapped_files, release_free_heap


def _resident_anonymous_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_pages_go_back_to_the_system() -> None:
    # 64 KiB blocks come from the heap (below glibc's mmap threshold); the last one stays alive,
    # so the freed ones sit below it and free() alone cannot shrink the heap past them
    blocks = [bytearray(64 * 1024) for _ in range(2000)]
    kept = blocks[-1]
    del blocks
    before = _resident_anonymous_mib()
    assert release_free_heap()
    after = _resident_anonymous_mib()
    assert before - after > 100, f"resident anonymous memory {before:.0f} -> {after:.0f} MiB"
    assert len(kept) == 64 * 1024


def test_freeze_heap_leaves_objects_alive_and_out_of_collections() -> None:
    frozen_before = gc.get_freeze_count()
    owner = {"weights": list(range(1000))}
    freeze_heap()
    try:
        assert gc.get_freeze_count() > frozen_before
        assert owner["weights"][-1] == 999
    finally:
        gc.unfreeze()


def _resident_kib_of(name: str) -> int:
    """Resident KiB of this process's mappings of files named `name`."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            inside = len(fields) > 5 and fields[5].endswith(name)
        elif inside and fields and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def _filesystem_type(path) -> str:
    """The type of the filesystem `path` is on (the longest mount point above it)."""
    best, kind = "", ""
    for line in open("/proc/self/mounts"):
        point, fstype = line.split()[1:3]
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


def _kernel_version() -> tuple[int, int]:
    parts = platform.release().split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


@pytest.mark.skipif(platform.system() != "Linux" or _kernel_version() < (5, 4),
                    reason="madvise(MADV_PAGEOUT) is Linux's, from 5.4")
def test_read_only_file_pages_are_paged_out_and_still_read_back(tmp_path) -> None:
    """What a compiled step's library gets once the loader has copied its weights out: the pages
    of its read-only mapping leave resident memory, and reading them again reads the file."""
    import mmap
    import os

    if _filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a file in memory has no disk copy to drop its pages for (it would need swap)")

    data = os.urandom(8 << 20)
    path = tmp_path / "weights.wrapper.so"
    path.write_bytes(data)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    try:
        assert mapped[:] == data  # every page read: resident
        before = _resident_kib_of("weights.wrapper.so")
        assert before >= 8 * 1024 - 64
        assert page_out_mapped_files("weights.wrapper.so") == len(data)
        after = _resident_kib_of("weights.wrapper.so")
        assert after < before / 4, f"{before} -> {after} KiB resident"
        assert mapped[:] == data
    finally:
        mapped.close()
