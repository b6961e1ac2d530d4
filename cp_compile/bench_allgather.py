"""Benchmark variant "ours allgather": the all-gather schedule, eager.

Reported next to the ring so that the memory cost of gathering K/V (it grows
with C, where the ring's stays flat) is measured, not assumed. Its bytes per
rank are not metered (``count_traffic`` counts ring transfers only).
"""

from __future__ import annotations

from .bench import Inputs, Problem, Variant, _take_grads, register_variant

OURS_ALLGATHER = "ours allgather"


def _ours_allgather_setup(p: Problem, x: Inputs):
    import cp_compile

    leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]

    def step():
        out = cp_compile.allgather_attention(*leaves, is_causal=p.causal)
        out.backward(x.do)
        return (out.detach(), *_take_grads(leaves))

    return step


register_variant(Variant(
    name=OURS_ALLGATHER,
    setup=_ours_allgather_setup,
    description="all-gather schedule, eager: K/V gathered once per direction, dK/dV reduce-scattered",
    devices=("cpu", "cuda"),
))
