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
import zlib
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from ..schedules.registry import EXPANSIONS
from ..torch_compat import node_argument


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

    # a get_attr input holds a flex call's mods
    vals = [getattr(n.graph.owning_module, n.target) if n.op == "get_attr" else n.meta["val"] for n in inputs]
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
        schedule = _trace(call.fn, call.inputs)
        expansions.append(Expansion(call.direction, call.world_size, _inline(graph, node, schedule, call.inputs)))
    if expansions:
        fold_agreements(graph)
        graph.lint()
    return expansions


def _described(node: fx.Node) -> str:
    """What a ``cp::agree`` compares, as this graph states it: q/k/v sizes (symbols for dynamic ones), dtype,
    options."""
    q, k, v, _, options = node.args
    return " ".join(f"{tuple(t.meta['val'].shape)} {t.meta['val'].dtype}" for t in (q, k, v)) + f" {options}"


def _symbols(node: fx.Node) -> set:
    """The graph's size symbols in the q/k/v sizes a ``cp::agree`` compares."""
    return {
        symbol
        for t in node.args[:3]
        for size in t.meta["val"].shape
        if isinstance(size, torch.SymInt)
        for symbol in size.node.expr.free_symbols
    }


def fold_agreements(graph: fx.Graph) -> None:
    """Of a graph's ``cp::agree`` per site, only those that compare something new stay.

    Each agreement is a collective and a host read. A later site's sizes are expressions over the graph's
    size symbols and its options are constants of the graph: once an earlier agreement compared every
    symbol it uses, it agrees whenever the ranks run the same graph. So the first agreement of each group
    carries a digest of every site's description as this graph states it, and a later one stays only if
    it uses a symbol no kept one compared. Ranks that compiled different graphs fail the first agreement,
    on every rank, before any transfer; ranks that run the same graph make the same choices.
    """
    per_group: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.cp.agree.default:
            per_group.setdefault(node_argument(node, "group_name"), []).append(node)
    for nodes in per_group.values():
        if len(nodes) < 2:
            continue
        digest = zlib.crc32("; ".join(_described(n) for n in nodes).encode())
        first, *later = nodes
        first.args = (*first.args[:4], f"{first.args[4]} graph_sites={len(nodes)}:{digest:08x}")
        compared = _symbols(first)
        for node in later:
            symbols = _symbols(node)
            if symbols <= compared:
                graph.erase_node(node)
            else:
                compared |= symbols
