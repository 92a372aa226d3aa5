"""Our reader of the pack-quantized layout against compressed-tensors' own unpack (the format's
definition), for every bit width a scheme allows, both packing directions and lengths that leave
a partial last word."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from lmfoundry.quantformat.int32_packing import unpack_int32, unsigned_codes


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("cols", [1, 31, 96, 100])
def test_unpack_matches_compressed_tensors(bits: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + cols)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (7, cols), generator=gen, dtype=torch.int8)
    packed = pack_to_int32(q, bits)
    ours = unpack_int32(packed, bits, q.shape)
    assert ours.dtype == torch.int8 and ours.shape == q.shape
    assert torch.equal(ours, q)
    assert torch.equal(ours, unpack_from_int32(packed, bits, q.shape))


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_unpack_along_columns(bits: int) -> None:
    """Zero points are packed down the columns ([out, groups], packed_dim=0)."""
    gen = torch.Generator().manual_seed(bits)
    zp = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (45, 3), generator=gen, dtype=torch.int8)
    packed = pack_to_int32(zp, bits, packed_dim=0)
    assert torch.equal(unpack_int32(packed, bits, zp.shape, dim=0), zp)


def test_codes_are_unsigned_and_rows_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The straddling path processes rows a chunk at a time; every chunk lands in its place."""
    import lmfoundry.quantformat.int32_packing as packing

    monkeypatch.setattr(packing, "ROWS_AT_ONCE", 2)
    q = torch.randint(-4, 4, (5, 40), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    codes = unsigned_codes(pack_to_int32(q, 3), 3, 40)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0
    assert torch.equal(codes - 4, q.to(torch.int32))


def test_refuses_what_cannot_be_unpacked() -> None:
    words = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot hold"):
        unsigned_codes(words, 4, 9)
    with pytest.raises(ValueError, match="int32"):
        unsigned_codes(words.to(torch.int64), 4, 8)
