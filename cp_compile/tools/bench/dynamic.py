"""Benchmark variants "ours packed static" and "ours packed dynamic": does one graph for every split cost time?

Both compile ``varlen_attn`` with ``plan.backend("inductor")`` on the packed
problem of ``cp_compile.tools.bench.packed``. "static" hands the compiled function
unmarked tensors, so its graph is specialised to the local slot count and the
number of documents; "dynamic" marks those sizes as ``plan.shard(...,
cu_seqlens=)`` does, so its graph would serve any split. Equal times mean a
static mode (a fixed slot count per step) buys nothing but the one recompile
it avoids. Not loaded by default: ``--import cp_compile.tools.bench.dynamic``.
"""

from __future__ import annotations

import functools

import torch

from .builtin import _ours_meter
from .packed import documents, packed_step
from .variants import Inputs, Problem, Variant, register_variant

OURS_PACKED_STATIC = "ours packed static"
OURS_PACKED_DYNAMIC = "ours packed dynamic"


def _compiled_setup(dynamic: bool, p: Problem, x: Inputs):
    from torch.nn.attention.varlen import varlen_attn

    import cp_compile

    plan = cp_compile.ContextParallel(schedule="ring")
    torch._dynamo.reset()
    cu = documents(p, x)
    window = (-1, 0) if p.causal else (-1, -1)
    compiled = torch.compile(
        lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, p.seq_len, p.seq_len, window_size=window),
        backend=plan.backend("inductor"),
        fullgraph=True,
    )

    def attention(q, k, v):
        if dynamic:  # the step's leaves are new tensors each setup: mark them as plan.shard marks shards
            for t in (q, k, v, cu):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        with plan:
            return compiled(q, k, v, cu)

    return packed_step(attention, x)


for _name, _dynamic in ((OURS_PACKED_STATIC, False), (OURS_PACKED_DYNAMIC, True)):
    register_variant(
        Variant(
            name=_name,
            setup=functools.partial(_compiled_setup, _dynamic),  # picklable: sent to the ranks
            description="varlen_attn compiled with plan.backend('inductor'), sizes "
            + ("dynamic" if _dynamic else "static"),
            meter=_ours_meter,
            warmup=3,
        )
    )
