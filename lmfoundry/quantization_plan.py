"""The quantization plan a recipe describes: its `quantize` section turned into a
`QuantizationPlan` (which linears get which scheme, what is ignored, how the KV cache is stored).

Shared by the quantize stage and the doctor's pre-flight checks, which must judge exactly the plan
`quantize` would run. (Not to be confused with the memory plan of `lmfoundry plan`, see
`lmfoundry.capacity_*`, or compile's kernel plan, `lmfoundry.compile.plan`.)
"""

from __future__ import annotations

from typing import Any

from lmfoundry.errors import UserError

KV_CHOICES = ("int8", "fp8")


def build_plan(q: dict[str, Any]):
    """The QuantizationPlan a recipe's `quantize` section describes."""
    from lmfoundry.quantizers.scheme import QuantArgs, QuantizationPlan, SchemeGroup, make_scheme

    scheme = make_scheme(q["scheme"], group_size=q["group_size"], symmetric=q["symmetric"],
                         per_channel=bool(q["per_channel"]), observer=q["observer"], actorder=q["actorder"])
    kv = None
    if q.get("kv_cache"):
        if q["kv_cache"] not in KV_CHOICES:
            raise UserError(f"kv_cache {q['kv_cache']!r}: expected one of {', '.join(KV_CHOICES)}")
        strategy = {"head": "attn_head"}.get(q.get("kv_strategy") or "tensor", q.get("kv_strategy") or "tensor")
        kv = QuantArgs(8, "float" if q["kv_cache"] == "fp8" else "int", True, strategy, None)
    return QuantizationPlan([SchemeGroup(scheme, tuple(q["targets"]))], list(q["ignore"]), kv)
