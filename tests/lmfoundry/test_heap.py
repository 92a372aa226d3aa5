"""Freed heap pages go back to the system, and a server's start-up heap leaves the collector's
reach (`lmfoundry/heap.py`)."""

from __future__ import annotations

import gc
import platform

import pytest

from lmfoundry.heap import freeze_heap, release_free_heap


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
