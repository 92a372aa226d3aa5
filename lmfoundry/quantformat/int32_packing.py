"""compressed-tensors' `pack-quantized` layout, read without importing compressed-tensors.

Every process that serves a quantized checkpoint reads its packed weights once, at load. Importing
compressed-tensors for its unpack helper brings the whole package (its pydantic schemas, its
transformers integration) into the engine process and keeps it resident for the server's life,
memory the float model's engine does not pay (`benchmarks/serve_memory.py` reads it). For codes
of 1, 2, 4 or 8 bits the layout is simple and the same in every release: a row's codes sit in its
int32 words 32/b to a word, code i of a word at bits [i*b, i*b + b), little-endian, each code
unsigned (q + 2^(b-1)). Widths that do not divide 32 are laid out differently by different
releases (padded words in older ones, one bit stream across words in newer ones), so those are
left to the installed library's own reader (`checkpoint.folder.decode_linear`), which matches
its writer. The tests check this reader against `unpack_from_int32`.
"""
from __future__ import annotations

import sys

import torch

WIDTHS = (1, 2, 4, 8)  # code widths read here: those that divide a 32-bit word


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
    if bits not in WIDTHS:
        raise ValueError(f"codes of {bits} bits are laid out differently by compressed-tensors releases; "
                         f"this reader takes {', '.join(map(str, WIDTHS))} bits")
    words = packed if dim == 1 else packed.t()
    if words.shape[-1] * (32 // bits) < length:
        raise ValueError(f"{words.shape[-1]} words of 32 bits cannot hold {length} codes of {bits} bits")
    return words


def _codes(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """[rows, length] unsigned codes of each row's words: uint8 from the words' bytes on a
    little-endian host (code i of a word is then in byte i*b/8, in order), int32 shifts elsewhere."""
    mask = (1 << bits) - 1
    if sys.byteorder == "little":
        octets = words.contiguous().view(torch.uint8)
        shifts = torch.arange(8 // bits, device=words.device, dtype=torch.uint8) * bits
        return ((octets.unsqueeze(-1) >> shifts) & mask).reshape(words.shape[0], -1)[:, :length]
    shifts = torch.arange(32 // bits, device=words.device, dtype=torch.int32) * bits
    return ((words.unsqueeze(-1) >> shifts) & mask).reshape(words.shape[0], -1)[:, :length]
