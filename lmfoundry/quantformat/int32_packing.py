"""compressed-tensors' `pack-quantized` layout, read without importing compressed-tensors.

Every process that serves a quantized checkpoint reads its packed weights once, at load. Importing
compressed-tensors for its unpack helper brings the whole package (its pydantic schemas, its
transformers integration) into the engine process and keeps it resident for the server's life,
memory the float model's engine does not pay (`benchmarks/serve_memory.py` reads it). The layout is small enough to read here: a row's codes
sit in its int32 words as one little-endian bit stream, element i at bits [i*b, i*b + b), each
code unsigned (q + 2^(b-1)). Writing keeps compressed-tensors' own `pack_to_int32` (quantize runs
with the library loaded anyway); the tests check this reader against its `unpack_from_int32`.
"""

from __future__ import annotations

import sys

import torch

ROWS_AT_ONCE = 1024  # the gather path's rows per pass: its int64 temporaries are [rows, length]


def unsigned_codes(packed: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """The unsigned codes (q + 2^(b-1)) of int32 `packed`, as int32, unpacked along `dim` (1: each
    row's words hold that row's codes, as weights; 0: each column's, as zero points) to `length`."""
    codes = _codes(_rows_of_words(packed, bits, length, dim), bits, length).to(torch.int32)
    return codes if dim == 1 else codes.t()


def unpack_int32(packed: torch.Tensor, bits: int, shape: torch.Size | tuple[int, int], dim: int = 1) -> torch.Tensor:
    """Signed int8 codes of the [rows, cols] `shape` from compressed-tensors' int32 words packed
    along `dim` (what its `unpack_from_int32` returns)."""
    length = int(shape[dim])
    codes = _codes(_rows_of_words(packed, bits, length, dim), bits, length)
    signed = (codes.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
    return signed if dim == 1 else signed.t()


def _rows_of_words(packed: torch.Tensor, bits: int, length: int, dim: int) -> torch.Tensor:
    """`packed` as [rows, words] with each row's codes in its words, after checking it can hold them."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed codes must be int32, got {packed.dtype}")
    if not 1 <= bits <= 8:
        raise ValueError(f"codes of {bits} bits cannot be unpacked (1..8)")
    words = packed if dim == 1 else packed.t()
    if words.shape[-1] * 32 < length * bits:
        raise ValueError(f"{words.shape[-1]} words of 32 bits cannot hold {length} codes of {bits} bits")
    return words


def _codes(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """[rows, length] unsigned codes of each row's words: uint8 where no code crosses a byte (on a
    little-endian host the words' bytes are the stream's bytes in order), else int32."""
    mask = (1 << bits) - 1
    if 8 % bits == 0 and sys.byteorder == "little":
        octets = words.contiguous().view(torch.uint8)
        shifts = torch.arange(8 // bits, device=words.device, dtype=torch.uint8) * bits
        return ((octets.unsqueeze(-1) >> shifts) & mask).reshape(words.shape[0], -1)[:, :length]
    if 32 % bits == 0:  # no code crosses a word: shift each word by every code's offset
        shifts = torch.arange(32 // bits, device=words.device, dtype=torch.int32) * bits
        return ((words.unsqueeze(-1) >> shifts) & mask).reshape(words.shape[0], -1)[:, :length]
    return torch.cat([_stream_codes(words[i:i + ROWS_AT_ONCE], bits, length)
                      for i in range(0, words.shape[0], ROWS_AT_ONCE)])


def _stream_codes(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Codes that may straddle two words (3, 5, 6, 7 bits): the low part from the word the code
    starts in, the rest from the next word."""
    unsigned = words.to(torch.int64) & 0xFFFFFFFF  # int32 >> would carry the sign bit in
    unsigned = torch.cat([unsigned, torch.zeros_like(unsigned[:, :1])], dim=1)  # the last code's "next word"
    start = torch.arange(length, device=words.device, dtype=torch.int64) * bits
    word, offset = start // 32, start % 32
    value = (unsigned[:, word] >> offset) | (unsigned[:, word + 1] << (32 - offset))
    return (value & ((1 << bits) - 1)).to(torch.int32)
