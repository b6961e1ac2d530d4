"""The token mixers that are not attention in a captured graph (``cp_compile.mixers``), for ``explain``.

A convolution's halo (``cp::halo``) and a scan's exchanges to and from head groups
(``cp::to_head_groups`` / ``cp::from_head_groups``) or its summaries' all-gather (``cp::gather_groups``,
state passing), and the sequence gathered for a module with mixing code of its own (``cp::gather_sequence``: its
inputs, or the K/V its queries attend over),
are custom ops the model's code called under a plan;
the backend leaves them as they are and reports each: where it is, its route and why, and the bytes one
rank receives for it in the forward (the backward moves the same again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..cost.model import fmt_bytes
from ..layout.runs import chunk_count
from ..torch_compat import size_hint
from .site import _example, _graph_modules, _in_library

_ROUTES = {
    torch.ops.cp.halo.default: (
        "halo",
        "the k-1 tokens before each of the shard's chunks, one all-gather; bytes independent of the length",
    ),
    torch.ops.cp.to_head_groups.default: (
        "heads all-to-all",
        "the unmodified scan over the whole sequence for 1/C of the head groups (the one scan route built)",
    ),
    torch.ops.cp.from_head_groups.default: ("heads all-to-all (back)", "the scan's output back to the shard"),
    torch.ops.cp.gather_groups.default: (
        "states",
        "all-gather of one fp32 summary per chunk, folded in sequence order (state passing; or a final state)",
    ),
    torch.ops.cp.gather_sequence.default: (
        "gathered",
        "every rank's tokens of a tensor: the inputs of a module with mixing code of its own, run on every rank (C "
        "times its compute), or the K/V this rank's queries attend over under a module's own mask or bias",
    ),
}


@dataclass
class MixerReport:
    """One mixer op of a compiled graph."""

    source: str
    op: str
    route: str
    why: str
    shape: tuple
    dtype: str
    world_size: int
    received_bytes: int  # by one rank in the forward

    def __str__(self) -> str:
        return (
            f"{self.source}\n    mixer {self.op} {self.shape} {self.dtype}: {self.route} over C={self.world_size} "
            f"({self.why})\n    receives per rank: {fmt_bytes(self.received_bytes)} forward, as much backward"
        )


def _source(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ") and not _in_library(ln)]
    if not frames:
        return node.name
    i = frames[-1]
    return f"{lines[i]}: {lines[i + 1] if i + 1 < len(lines) else ''}"


def _shape(val: torch.Tensor) -> tuple[int, ...]:
    return tuple(size_hint(s) for s in val.shape)


def _received(node: fx.Node, shape: tuple[int, ...], itemsize: int, world_size: int) -> int:
    elements = math.prod(shape) * itemsize
    if node.target is torch.ops.cp.halo.default:
        _, dim, width, _, layout, cu = node.args[:6]
        chunks = chunk_count(layout, world_size, _example(cu) if cu is not None else None)
        return elements // shape[dim] * chunks * (width - 1) * world_size
    if node.target in (torch.ops.cp.gather_groups.default, torch.ops.cp.gather_sequence.default):
        return elements * (world_size - 1)
    return elements * (world_size - 1) // world_size


def find_mixers(gm: fx.GraphModule, world_size: int) -> list[MixerReport]:
    found = []
    for _, module in _graph_modules(gm):
        for node in module.graph.nodes:
            if node.op != "call_function" or node.target not in _ROUTES:
                continue
            route, why = _ROUTES[node.target]
            val = _example(node.args[0])
            shape = _shape(val)
            found.append(
                MixerReport(
                    source=_source(node),
                    op=node.target.name(),
                    route=route,
                    why=why,
                    shape=shape,
                    dtype=str(val.dtype).replace("torch.", ""),
                    world_size=world_size,
                    received_bytes=_received(node, shape, val.element_size(), world_size),
                )
            )
    return found


__all__ = ["MixerReport", "find_mixers"]
