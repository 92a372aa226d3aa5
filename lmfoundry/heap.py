"""Handing freed heap memory back to the system.

glibc keeps the pages that freed memory leaves inside the heap mapped in the process, for reuse,
unless asked to return them. Two places free far more than they keep at one moment: a server's
start-up (checkpoint tensors decoded, weights repacked, products timed on scratch buffers), and a
quantize job once the embeddings are gathered; resident memory would otherwise count those pages
for the rest of the process's life.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, loaded once (None where it cannot be): malloc_trim and madvise here, prctl
    for the engine process's parent-death signal (`runtime/engine/engine_process.py`)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def release_free_heap() -> bool:
    """Return the freed heap's pages to the system; False where the C library has no way to
    (not glibc)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def freeze_heap() -> None:
    """Move every object allocated so far (modules, the model's and tokenizer's Python objects) out
    of the garbage collector's reach, then hand the start-up's freed heap back to the system.
    Serving allocates and frees objects per token; without the freeze each full collection walks
    all those long-lived objects again (vLLM's processes do the same). Start-up frees far more than
    it keeps; `release_free_heap` stops resident memory counting those pages."""
    gc.collect()
    gc.freeze()
    release_free_heap()


MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (clean file pages are dropped, not lost)


def page_out_mapped_files(suffix: str) -> int:
    """Ask the kernel to reclaim the resident pages of this process's read-only, non-executable
    mappings of files whose name ends with `suffix`; returns the bytes of the mappings asked.

    An AOTInductor package's library carries its weights in a read-only section, and the loader
    copies them into memory of its own at load: the section's pages, read once, would otherwise
    stay counted in the server's resident memory beside the copy. They are clean file pages, so
    reclaiming them loses nothing (a later read would fault them in from the file again); writable
    and executable mappings are left alone. Where madvise or MADV_PAGEOUT does not exist (not
    Linux, or a kernel before 5.4) nothing happens."""
    madvise = getattr(libc(), "madvise", None)
    if madvise is None:
        return 0
    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    asked = 0
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].endswith(suffix) or fields[1] != "r--p":
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if madvise(low, high - low, MADV_PAGEOUT) == 0:
            asked += high - low
    return asked
