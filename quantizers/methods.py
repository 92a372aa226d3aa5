"""The quantization methods by name (`--method`, a recipe's `quantize.method`): `get_quantizer`.

A module of its own above the methods' modules, so that the interface they implement (base.py)
names none of them: the table imports every method and no method imports the table.
"""

from __future__ import annotations

from typing import Any

from lmfoundry.errors import UserError
from lmfoundry.quantizers.awq import AWQQuantizer
from lmfoundry.quantizers.base import Quantizer, construct
from lmfoundry.quantizers.fp8 import FP8Quantizer
from lmfoundry.quantizers.gptq import GPTQQuantizer
from lmfoundry.quantizers.rtn import RTNQuantizer
from lmfoundry.quantizers.smoothquant import SmoothQuantQuantizer

METHODS: dict[str, type[Quantizer]] = {
    cls.name: cls for cls in (RTNQuantizer, GPTQQuantizer, AWQQuantizer, SmoothQuantQuantizer, FP8Quantizer)
}


def get_quantizer(method: str, options: dict[str, Any] | None = None) -> Quantizer:
    """The quantizer of `method` with its options (UserError for an unknown method or a bad option)."""
    cls = METHODS.get(method)
    if cls is None:
        raise UserError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    return construct(cls, options)
