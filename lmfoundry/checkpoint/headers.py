"""Safetensors files read before any tensor is mapped: one validated header parse.

Every stage that opens weights (the model resolver, the checkpoint reader, compile) goes through
`read_safetensors_header`, so a truncated download, a lying header or a FIFO named like a shard is
one line of error wherever it is met, never a crash inside the safetensors reader.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError

# bits per element of every dtype the safetensors format knows (what its Rust reader accepts)
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors format's own limit


def regular_file(path: Path, what: str) -> os.stat_result:
    """stat of `path`, refused unless it is a regular file: a FIFO, device or folder named like a
    data file would block or never end when read (`/dev/zero`, a named pipe)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{path}: {what} is missing") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: {what} is not a regular file")
    return st


def _bad(path: Path, why: str) -> UserError:
    return UserError(f"{path}: corrupt safetensors file: {why}")


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, data_offsets), without
    `__metadata__` and without reading the data — validated against the file the way the
    safetensors reader will check it at load time (header length within the file, known dtypes,
    byte ranges matching dtype x shape, ranges tiling the data section exactly), so a truncated
    download or a lying header is refused here with one line instead of compiling an engine for
    weights that cannot be loaded."""
    size = regular_file(path, "safetensors file").st_size
    if size < 8:
        raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_SAFETENSORS_HEADER:
            raise _bad(path, f"implausible header length ({n} bytes)")
        if n > size - 8:
            raise _bad(path, f"header claims {n} bytes but the file has {size - 8} after the length (truncated?)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise _bad(path, "the header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad(path, "__metadata__ must map names to strings")
    data_len = size - 8 - n
    spans = []
    for full_name, t in header.items():
        name = full_name[:80]  # for messages: names come from the file and may be anything
        if not isinstance(t, dict):
            raise _bad(path, f"tensor {name!r} is not an object")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPE_BITS:
            raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _bad(path, f"tensor {name!r}: shape must be a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _bad(path, f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
        bits = SAFETENSORS_DTYPE_BITS[dtype]
        for d in shape:
            bits *= d
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise _bad(path, f"tensor {name!r}: {dtype} {shape} needs {bits / 8:g} bytes, data_offsets span "
                             f"{offsets[1] - offsets[0]}")
        if offsets[1] > data_len:
            raise _bad(path, f"tensor {name!r} ends at byte {offsets[1]} of a {data_len}-byte data section "
                             "(truncated?)")
        spans.append((offsets[0], offsets[1], name))
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            what = "overlaps the previous tensor" if begin < cursor else f"leaves a gap at byte {cursor}"
            raise _bad(path, f"tensor {name!r} at data_offsets [{begin}, {end}] {what}")
        cursor = end
    if cursor != data_len:
        raise _bad(path, f"the tensors cover {cursor} of {data_len} data bytes")
    return header
