"""Pin the overlap order of expanded ring schedules in post-grad graphs.

The expansion places each ``cp::ring_shift`` before the block compute it should
overlap with and the shift's ``wait_tensor`` after it. Inductor's scheduler sees
our comm ops as opaque kernels, so nothing stops a later reordering from
hoisting a wait above that compute (no overlap) or sinking a shift below it.
This pass records the two edges per shift as explicit control dependencies
(Inductor's ``preserve_node_ordering``):

    compute(step i)   after  ring_shift(for step i+1)
    waits             after  compute(step i), on the received and the sent tensors

and one more for memory: a shift issued after a wait stays after it. The
backward waits for the travelling dK/dV before it starts the next K/V hop, so
the two pairs of receive buffers are never held at once; nothing else orders
those two.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils._ordered_set import OrderedSet

from ..kinds.attend import listing_name
from ..schedules.registry import COMPUTE_OPS

cp = torch.ops.cp
WAIT = torch.ops._c10d_functional.wait_tensor.default


def overlap_edges(graph: fx.Graph) -> dict[fx.Node, OrderedSet[fx.Node]]:
    """For each shift: the compute issued after it, and the waits that must follow that compute."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    pending: list[fx.Node] = []  # shifts issued since the last compute
    waited: list[fx.Node] = []  # waits issued since the last compute
    for node in graph.nodes:
        if node.target == WAIT:
            waited.append(node)
        elif node.target == cp.ring_shift.default:
            pending.append(node)
            # a wait the shift reads from orders itself; pin only the others
            for wait in waited:
                if wait not in node.all_input_nodes:  # nodes inside the tensor list included
                    deps.setdefault(node, OrderedSet()).add(wait)
        elif node.target in COMPUTE_OPS:
            for shift in pending:
                _pin_to_compute(shift, node, position, deps)
            pending, waited = [], []
    return deps  # shifts still pending (the last dK/dV hop) have nothing to overlap with


def _pin_to_compute(shift, compute, position, deps) -> None:
    deps.setdefault(compute, OrderedSet()).add(shift)
    received = [item for item in shift.users if item.target == operator.getitem]
    sent = [t for t in shift.args[0] if isinstance(t, fx.Node)]
    for tensor in received + sent:
        for wait in tensor.users:
            if wait.target == WAIT and position[wait] > position[compute]:
                deps.setdefault(wait, OrderedSet()).add(compute)


def pin_overlap_order(graph: fx.Graph) -> int:
    """Make the overlap order explicit; returns the number of pinned edges."""
    from ..torch_compat import preserve_node_ordering

    deps = overlap_edges(graph)
    if deps:
        preserve_node_ordering()(graph, deps)
    return sum(len(v) for v in deps.values())


def _unwrapped(node: fx.Node) -> fx.Node:
    """The node itself, or the op inside Inductor's control_deps wrapper."""
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "control_deps":
        subgraph, owner = node.args[1], node.graph.owning_module
        if isinstance(subgraph, fx.Node) and subgraph.op == "get_attr" and owner is not None:
            inner = [n for n in getattr(owner, subgraph.target).graph.nodes if n.op == "call_function"]
            if inner:
                return inner[0]
    return node


_COMM_NAMES = {
    cp.ring_shift.default: "shift",
    cp.merge.default: "merge",
    cp.merge_.default: "merge",
    cp.agree.default: "agree",
    torch.ops._c10d_functional.all_to_all_single.default: "all_to_all",
    WAIT: "wait",
    torch.ops._c10d_functional.all_gather_into_tensor.default: "gather",
    torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
}


def schedule_listing(graph: fx.Graph) -> list[str]:
    """The CP ops of a graph in order, e.g. ``["agree", "shift", "attend step=0", "wait", ...]``."""
    listing = []
    for node in map(_unwrapped, graph.nodes):
        if node.target in COMPUTE_OPS:
            listing.append(listing_name(node))
        elif node.target in _COMM_NAMES:
            listing.append(_COMM_NAMES[node.target])
    return listing
