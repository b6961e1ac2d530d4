"""Stage 2: expand each CP op in the partitioned forward/backward graphs into its schedule.

After AOTAutograd has split the joint graph, every whole-schedule CP node
(``cp::ring_attention`` in the forward graph, ``cp::ring_attention_backward``
in the backward graph, and the other schedules in ``schedules.registry``) is
replaced by its steps, obtained by tracing the very functions the eager op
runs (``ring_forward`` / ``ring_backward`` for the ring). The graph then shows the
C steps: each step's ``cp::ring_shift`` ahead of the previous step's
``cp::attend`` and its ``wait_tensor`` after it.

The order is then pinned so the scheduler cannot hoist a wait above the
compute it should overlap with (``pin_overlap_order``).

Only the step number, the group name and C (the same on every rank) enter the
graph; the rank is read inside the ops at run time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from ..schedules.registry import EXPANSIONS


@dataclass
class Expansion:
    """One expanded CP node: what it was and the schedule nodes that replaced it."""

    direction: str  # "forward" | "backward"
    world_size: int
    nodes: list[fx.Node]

    def count(self, target) -> int:
        return sum(1 for n in self.nodes if n.target == target)


def _trace(fn, inputs: list[fx.Node]) -> fx.GraphModule:
    """make_fx of a schedule function over the graph's own fake tensors."""
    from torch._inductor.decomposition import select_decomp_table

    vals = [n.meta["val"] for n in inputs]
    # post-grad graphs hold decomposed aten only (Inductor rejects e.g. aten.transpose.int there)
    with detect_fake_mode(vals):
        return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="real")(*vals)


def _inline(graph: fx.Graph, node: fx.Node, schedule: fx.GraphModule, inputs: list[fx.Node]) -> list[fx.Node]:
    """Copy ``schedule``'s nodes in before ``node``; route ``node``'s users to its outputs."""
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in schedule.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs))
    added = []
    outputs = None
    with graph.inserting_before(node):
        for sub in schedule.graph.nodes:
            if sub.op == "placeholder":
                continue
            if sub.op == "output":
                outputs = fx.map_arg(sub.args[0], lambda n: env[n])
                continue
            new = graph.node_copy(sub, lambda n: env[n])
            new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "seq_nr")})
            env[sub] = new
            added.append(new)
    for user in list(node.users):
        if user.op == "call_function" and user.target == operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        else:
            raise RuntimeError(f"unexpected user {user.format_node()} of {node.format_node()}")
    graph.erase_node(node)
    return added


def expand_cp_ops(graph: fx.Graph) -> list[Expansion]:
    """Replace every CP attention node in ``graph`` with its inlined schedule."""
    expansions = []
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in EXPANSIONS]:
        call = EXPANSIONS[node.target](node.args)
        schedule = _trace(call.fn, call.tensors)
        expansions.append(Expansion(call.direction, call.world_size, _inline(graph, node, schedule, call.tensors)))
    if expansions:
        graph.lint()
    return expansions
