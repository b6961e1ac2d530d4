"""Benchmark variant "ours compiled": plain SDPA compiled with the CP backend (Inductor).

Imported by ``cp_compile.tools.bench`` when present; the function handed to
``torch.compile`` is written for one device, as a user's model would be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .builtin import _ours_meter, _stub_our_kernels
from .variants import Inputs, Problem, Variant, fwd_bwd_step, register_variant

OURS_COMPILED = "ours compiled"


def _ours_compiled_setup(p: Problem, x: Inputs):
    import cp_compile

    plan = cp_compile.ContextParallel(schedule="ring")  # "the same ring, expanded in the graph"
    torch._dynamo.reset()

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=p.causal)

    return fwd_bwd_step(
        torch.compile(attention, backend=plan.backend("inductor"), fullgraph=True), (x.q, x.k, x.v), x.do
    )


register_variant(
    Variant(
        name=OURS_COMPILED,
        setup=_ours_compiled_setup,
        description="the user's SDPA compiled with plan.backend('inductor'): the same ring, expanded in the graph",
        meter=_ours_meter,
        warmup=3,
        stub=_stub_our_kernels,  # the compiled graph calls the same block ops, so the same stand-ins apply
    )
)
