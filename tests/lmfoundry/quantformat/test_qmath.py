"""Reference quantization math against compressed-tensors' own implementation and error bounds."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.scheme import QuantArgs
from lmfoundry.quantizers.observers import minmax_observer


def ct_args(a: QuantArgs) -> QuantizationArgs:
    return QuantizationArgs(num_bits=a.num_bits, type=a.type, symmetric=a.symmetric, strategy=a.strategy,
                            group_size=a.group_size if a.strategy == "group" else None)


CASES = [
    QuantArgs(4, "int", True, "group", 32),
    QuantArgs(4, "int", False, "group", 64),
    QuantArgs(3, "int", True, "group", 64),
    QuantArgs(8, "int", True, "channel", None),
    QuantArgs(8, "int", False, "channel", None),
    QuantArgs(2, "int", False, "group", 32),
    QuantArgs(8, "float", True, "channel", None),
    QuantArgs(8, "float", True, "tensor", None),
]


@pytest.mark.parametrize("args", CASES, ids=lambda a: a.describe())
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_error_bound_and_ct_equality(args, scale_dtype):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.rand(48, 1) + 0.01
    scale, zp = minmax_observer(w, args, scale_dtype)
    q = qmath.quantize(w, scale, zp, args)
    deq = qmath.dequantize(q, scale, zp, args, torch.float32)
    assert torch.isfinite(deq).all()
    # compressed-tensors decompresses our codes to exactly the same values
    ref = ct_dequantize(q, scale, zp, ct_args(args), dtype=torch.float32)
    assert torch.equal(deq, ref)
    err = (w - deq).abs()
    s = qmath.reduce_shape(torch.ones_like(w), args) * qmath._expand(scale.float(), qmath.reduce_shape(w, args))
    s = s.reshape(w.shape)
    if args.type == "int":
        # round to nearest: half a step, plus the half step lost where the grid's end clips (the
        # symmetric max maps to qmax + 0.5; a rounded zero point shifts the asymmetric grid). A
        # bf16 scale is off by up to 2^-9 relative, which moves a code up to 2^bits steps from
        # zero by 2^bits * 2^-9 steps.
        slack = 1.0 + (2.0**args.num_bits * 2**-9 if scale_dtype == torch.bfloat16 else 1e-5)
        assert (err <= s * slack + 1e-6).all()
    else:
        # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values, plus subnormal spacing
        assert (err <= w.abs() * 2**-4 * 1.02 + s * 2**-9).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_roundtrip(bits):
    torch.manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (24, 96), dtype=torch.int8)
    packed = pack_to_int32(q, bits)
    assert packed.dtype == torch.int32 and packed.shape[1] == (96 * bits + 31) // 32
    assert torch.equal(unpack_from_int32(packed, bits, q.shape), q)


def test_group_size_check():
    from lmfoundry.errors import UserError

    with pytest.raises(UserError, match="does not divide"):
        qmath.check_group_size("x", 576, QuantArgs(4, "int", True, "group", 128))
