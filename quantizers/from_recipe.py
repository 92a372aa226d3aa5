"""The quantization plan a recipe describes: its `quantize` section turned into a
`QuantizationPlan` (which linears get which scheme, what is ignored, how the KV cache is stored).

Shared by the quantize job (`lmfoundry.calibration.job`) and the standalone `lmfoundry doctor`,
which must judge exactly the plan `quantize` would run: both build the plan, fit it to the model
and build the quantizer with these functions (`quantize` then hands the built objects to the
doctor's pre-flight instead of letting it build them again). (Not to be confused with the memory
plan of `lmfoundry plan`, see `lmfoundry.capacity_*`, or compile's kernel plan,
`lmfoundry.compile.kernel_selection`.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from lmfoundry.errors import UserError

if TYPE_CHECKING:
    from lmfoundry.model.config import ModelConfig
    from lmfoundry.quantformat.scheme import QuantizationPlan, Strategy
    from lmfoundry.quantizers.base import Quantizer
    from lmfoundry.recipe import QuantizeSection

KV_CHOICES = ("int8", "fp8")


def build_plan(q: QuantizeSection) -> QuantizationPlan:
    """The QuantizationPlan a recipe's `quantize` section describes."""
    from lmfoundry.quantformat.scheme import QuantArgs, QuantizationPlan, SchemeGroup, make_scheme

    scheme = make_scheme(q.scheme, group_size=q.group_size, symmetric=q.symmetric,
                         per_channel=bool(q.per_channel), observer=q.observer, actorder=q.actorder)
    kv = None
    if q.kv_cache:
        if q.kv_cache not in KV_CHOICES:
            raise UserError(f"kv_cache {q.kv_cache!r}: expected one of {', '.join(KV_CHOICES)}")
        # "head" is the recipe's word for per attention head; any other value goes through as it is
        # and the doctor refuses what the KV cache cannot store (check_kv_args), with its reason
        strategy = {"head": "attn_head"}.get(q.kv_strategy or "tensor", q.kv_strategy or "tensor")
        kv = QuantArgs(8, "float" if q.kv_cache == "fp8" else "int", True, cast("Strategy", strategy), None)
    groups = [SchemeGroup(scheme, tuple(q.targets))]
    ignore = list(q.ignore)
    if q.lm_head != "float":
        # a group of its own after the recipe's (a name outranks the class "Linear" in
        # compressed-tensors' matching, ours included): int8 per output channel, or int4 in the
        # recipe's groups
        head = make_scheme(q.lm_head, group_size=q.group_size if q.lm_head == "w4a16" else 0, symmetric=True)
        groups.append(SchemeGroup(head, ("lm_head",)))
        ignore = [p for p in ignore if p != "lm_head"]
    return QuantizationPlan(groups, ignore, kv)


def build_quantizer(q: QuantizeSection, plan: QuantizationPlan) -> Quantizer:
    """The quantizer of `q.method`, refused (UserError) when it cannot produce a scheme of the
    plan (e.g. smoothquant needs w8a8)."""
    from lmfoundry.quantizers.methods import get_quantizer

    quantizer = get_quantizer(q.method, q.options)
    for g in plan.groups:
        quantizer.validate(g.scheme)
    return quantizer


def fit_plan(plan: QuantizationPlan, config: ModelConfig) -> QuantizationPlan:
    """The plan for this model: an MoE router stays float and every loader is told so (added to
    `ignore`, which the checkpoint's quantization_config records)."""
    from lmfoundry.model.config import ROUTER_IGNORE

    if config.is_moe:
        plan.ignore += [p for p in ROUTER_IGNORE if p not in plan.ignore]
    return plan
