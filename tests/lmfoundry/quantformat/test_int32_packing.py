"""Our reader of the pack-quantized layout against compressed-tensors' own unpack (the format's
definition), for the code widths it reads, both packing directions and lengths that leave a
partial last word; other widths go to the library's reader, whose layout changed between
releases."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from lmfoundry.quantformat.int32_packing import WIDTHS, unpack_int32, unsigned_codes


@pytest.mark.parametrize("bits", WIDTHS)
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
    codes = unsigned_codes(packed, bits, cols)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0
    assert torch.equal(codes - (1 << (bits - 1)), q.to(torch.int32))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_along_columns(bits: int) -> None:
    """Zero points are packed down the columns ([out, groups], packed_dim=0)."""
    gen = torch.Generator().manual_seed(bits)
    zp = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (45, 3), generator=gen, dtype=torch.int8)
    packed = pack_to_int32(zp, bits, packed_dim=0)
    assert torch.equal(unpack_int32(packed, bits, zp.shape, dim=0), zp)
    assert torch.equal(unsigned_codes(packed, bits, 45, dim=0) - (1 << (bits - 1)), zp.to(torch.int32))


def test_refuses_what_it_does_not_read() -> None:
    words = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot hold"):
        unsigned_codes(words, 4, 9)
    with pytest.raises(ValueError, match="int32"):
        unsigned_codes(words.to(torch.int64), 4, 8)
    for bits in (3, 5, 6, 7):
        with pytest.raises(ValueError, match="laid out differently"):
            unpack_int32(words, bits, (2, 4))


@pytest.mark.parametrize("bits", [3, 4])
def test_checkpoint_reader_decodes_what_it_encodes(bits: int) -> None:
    """decode_linear reads 4-bit codes here and 3-bit codes through the library, asymmetric
    (packed zero points) either way."""
    from lmfoundry.checkpoint.folder import decode_linear, encode_linear
    from lmfoundry.quantformat import qmath
    from lmfoundry.quantformat.quantized_weight import QuantizedWeight
    from lmfoundry.quantformat.scheme import make_scheme

    scheme = make_scheme(f"w{bits}a16", group_size=32, symmetric=False)
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(bits))
    x = qmath.reduce_shape(w, scheme.weights)
    scale, zp = qmath.qparams_from_range(x.amin(-1), x.amax(-1), scheme.weights, torch.bfloat16)
    qw = QuantizedWeight(qmath.quantize(w, scale, zp, scheme.weights), scale, zp, scheme.weights)
    stored = {k.removeprefix("layer."): v for k, v in encode_linear("layer", qw, scheme).items()}
    assert "weight_packed" in stored and "weight_zero_point" in stored
    back = decode_linear(stored, scheme)
    assert torch.equal(back.q, qw.q.to(back.q.dtype)) and back.zero_point is not None
    assert torch.equal(back.zero_point.to(torch.int8), qw.zero_point.to(torch.int8))
