"""Which linears of a decoder layer read the same input tensor.

q/k/v all read the attention norm's output and gate/up the MLP norm's output, so their
input statistics (GPTQ's Hessian, AWQ's channel magnitudes) are identical: collect them once on
the first linear of the group and share them. A linear that reads its own input is its own group.
"""

from __future__ import annotations

SHARED_INPUTS: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


def input_groups(names: list[str] | tuple[str, ...]) -> list[tuple[str, ...]]:
    """Partition `names` (local linear names) into groups sharing one input, in layer order.
    The first name of each group is the one whose input gets hooked."""
    remaining = list(names)
    groups: list[tuple[str, ...]] = []
    for shared in SHARED_INPUTS:
        members = tuple(n for n in shared if n in remaining)
        if members:
            groups.append(members)
            for n in members:
                remaining.remove(n)
    groups += [(n,) for n in remaining]
    order = {n: i for i, n in enumerate(names)}
    return sorted(groups, key=lambda g: min(order[n] for n in g))
