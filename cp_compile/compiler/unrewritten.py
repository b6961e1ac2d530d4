"""Attention that ``plan.backend()`` did not rewrite must never run on a shard.

Under a plan every rank holds a shard of the sequence, so a plain attention
call that reaches a kernel attends to this rank's tokens alone: plausible
numbers, silently wrong. ``cp_compile.guard`` watches attention calls inside
``with plan:``. Eagerly it raises ``LocalAttentionError`` at once. While Dynamo
traces, it puts ``cp::unrewritten`` in front of the call, on its query: Stage 1
of ``plan.backend()`` removes the marker (``strip_unrewritten``) as it rewrites
the call; any other backend keeps it, and the marker raises when the graph
runs, before the attention it guards. Every rank runs the same graph, so every
rank raises at the same point and none is left waiting in a collective.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

from ..errors import LocalAttentionError

_FIX = (
    "compile the model inside `with plan:` with torch.compile(model, backend=plan.backend(), fullgraph=True) "
    "so that the call is rewritten into a CP schedule; without compiling, call cp_compile's ops "
    "(plan.attention, cp_compile.varlen_attention, cp_compile.flex_attention) or, for Hugging Face models, "
    'load them with attn_implementation="cp_compile" (import cp_compile.hf)'
)


def eager_message(what: str) -> str:
    return (
        f"{what} ran eagerly inside `with plan:`: it would attend to this rank's shard of the sequence alone. "
        "Dynamo runs code eagerly that it did not compile: a frame past torch._dynamo.config.recompile_limit, a "
        "function under torch._dynamo.disable, the side of a graph break that holds the call, or a model that "
        f"is not compiled at all. Fix: {_FIX}."
    )


def compiled_message(what: str) -> str:
    return (
        f"{what} was compiled inside `with plan:` by a backend other than plan.backend() (for example "
        "torch.compile's default, \"aot_eager\", or FlexAttention's own compile of an eager call), so "
        f"nothing rewrote it: it would attend to this rank's shard of the sequence alone. Fix: {_FIX}."
    )


@torch.library.custom_op("cp::unrewritten", mutates_args=())
def unrewritten(query: Tensor, what: str) -> Tensor:
    """A marker that only a graph ``plan.backend()`` did not rewrite still holds: raises when it runs."""
    raise LocalAttentionError(compiled_message(what))


@unrewritten.register_fake
def _(query, what):
    return torch.empty_like(query)


def _backward(ctx, grad):
    return grad, None  # traced (AOTAutograd builds the joint graph), never run: the forward raises first


unrewritten.register_autograd(_backward)

MARKERS = (torch.ops.cp.unrewritten, torch.ops.cp.unrewritten.default, unrewritten)  # as Dynamo may record it


def strip_unrewritten(gm: fx.GraphModule) -> int:
    """Removes every marker from ``gm`` and the graph modules under it; returns how many."""
    removed = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        markers = [n for n in module.graph.nodes if n.op == "call_function" and n.target in MARKERS]
        for node in markers:
            node.replace_all_uses_with(node.args[0])
            module.graph.erase_node(node)
        if markers:
            module.recompile()
        removed += len(markers)
    return removed
