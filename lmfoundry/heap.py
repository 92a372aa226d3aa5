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


def release_free_heap() -> bool:
    """Return the freed heap's pages to the system; False where the C library has no way to
    (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
