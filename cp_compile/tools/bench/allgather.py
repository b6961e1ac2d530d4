"""Benchmark variant "ours allgather": the all-gather schedule, eager.

Reported next to the ring so that the memory cost of gathering K/V (it grows
with C, where the ring's stays flat) is measured, not assumed. Its bytes per
rank are not metered (``count_traffic`` counts ring transfers only).
"""

from __future__ import annotations

import functools

from .variants import Inputs, Problem, Variant, fwd_bwd_step, register_variant

OURS_ALLGATHER = "ours allgather"


def _ours_allgather_setup(p: Problem, x: Inputs):
    import cp_compile

    return fwd_bwd_step(functools.partial(cp_compile.allgather_attention, is_causal=p.causal), (x.q, x.k, x.v), x.do)


register_variant(
    Variant(
        name=OURS_ALLGATHER,
        setup=_ours_allgather_setup,
        description="all-gather schedule, eager: K/V gathered once per direction, dK/dV reduce-scattered",
        devices=("cpu", "cuda"),
    )
)
