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
import gc


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


def freeze_heap() -> None:
    """Move every object allocated so far (modules, the model's and tokenizer's Python objects) out
    of the garbage collector's reach, then hand the start-up's freed heap back to the system.
    Serving allocates and frees objects per token; without the freeze each full collection walks
    all those long-lived objects again (vLLM's processes do the same). Start-up frees far more than
    it keeps; `release_free_heap` stops resident memory counting those pages."""
    gc.collect()
    gc.freeze()
    release_free_heap()
