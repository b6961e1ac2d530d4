"""What Stage 1 works with: an attention call found in a graph, what the rewrite decided, one pattern of call.

``SitePattern``s (``sdpa_site``, ``flex_site``, ``varlen_site``) match, check and
rewrite their op; ``insert_schedule`` is the rewrite they share: the chosen
schedule's whole op, with the attention ``kind`` the pattern's op means (``kinds``) and its settings.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from ..errors import UnsupportedAttention
from ..kinds.call import Call
from ..schedules import whole_op
from ..torch_compat import size_hint


@dataclass(frozen=True)
class Decision:
    """What the rewrite chose for a site, for ``explain``: the schedule and why, whether the call is causal (the
    packed kind's through its window), and the cost model's estimates and the machine they assume."""

    schedule: str
    why: str
    is_causal: bool = False
    estimates: tuple = ()  # ``cost.model.Estimate`` per schedule considered
    machine: Any = None


@dataclass
class AttentionSite:
    """One attention call found in a graph."""

    owner: fx.GraphModule  # the graph module whose graph holds the call (maybe a HOP body)
    owner_path: str  # its path under the top-level module, "" for the top level
    node: fx.Node
    args: dict[str, Any]  # SDPA arguments by name
    pattern: str = "sdpa"  # the site pattern that matched it (``SitePattern.name``)
    decision: Optional[Decision] = None  # the rewrite's
    # what some placeholders of the graphs hold in the call being compiled (``input_values``): the contents a
    # decision reads, e.g. a sharded mask's tile counts
    values: dict = field(default_factory=dict)

    @property
    def query(self) -> fx.Node:
        return self.args["query"]

    def shape(self, name: str) -> Optional[tuple[int, ...]]:
        """The argument's shape as ints (a dynamic dimension as its example value: what the cost model reads)."""
        val = _example(self.args[name])
        return tuple(size_hint(s) for s in val.shape) if val is not None else None

    def dtype(self) -> Optional[torch.dtype]:
        val = _example(self.query)
        return val.dtype if val is not None else None

    @property
    def source(self) -> str:
        """The user's source line, from the frame Dynamo recorded: the innermost frame outside torch and
        cp_compile (``varlen_attn`` and ``flex_attention`` are Python wrappers whose own lines say nothing,
        and so are cp_compile's integrations calling them for a model)."""
        trace = self.node.meta.get("stack_trace") or ""
        lines = [ln.strip() for ln in trace.strip().splitlines()]
        frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
        outside = [i for i in frames if not _in_library(lines[i])]
        for i in (outside or frames)[-1:]:
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}"
        return f"{self.owner.__class__.__name__}.{self.node.name}"

    @property
    def location(self) -> str:
        return "top-level graph" if self.owner_path == "" else f"inside {self.owner_path}"


_LIBRARY_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)  # torch, cp_compile


def _in_library(frame_line: str) -> bool:
    """Whether a 'File "...", line n, in f' line names a file of torch or of cp_compile."""
    return any(frame_line.startswith(f'File "{d}') for d in _LIBRARY_DIRS)


def traced_value(arg):
    """A graph node's example value (a fake tensor, a symbolic size), or ``arg`` itself when it is a constant."""
    return arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, fx.Node) else arg


def _example(node) -> Optional[torch.Tensor]:
    val = traced_value(node) if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


_SYMBOLIC = {torch.SymInt: int, torch.SymBool: bool, torch.SymFloat: float}


def constant(value):
    """``value`` as a Python constant where it is a traced symbolic scalar, else as it is.

    Compiled with dynamic shapes (``dynamic=True``), ints a model keeps as settings (a window, a flag
    computed from one) reach the graph as symbolic scalars; specialising one to its value adds a guard
    on it, which holds as long as the setting does. Tensors stay graph values.
    """
    if isinstance(value, (list, tuple)):
        return type(value)(constant(v) for v in value)
    example = traced_value(value)
    if type(example) in _SYMBOLIC:
        return _SYMBOLIC[type(example)](example)
    return value


def _graph_modules(gm: fx.GraphModule):
    for path, module in gm.named_modules():
        if isinstance(module, fx.GraphModule):
            yield path, module


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def input_values(gm: fx.GraphModule, example_inputs) -> dict[fx.Node, Any]:
    """Each placeholder's value in the call being compiled: the top-level graph's from the example inputs Dynamo
    gives a backend, a body's (a checkpoint region's) from the operands of the higher-order op that runs it."""
    values = {p: x for p, x in zip(placeholders(gm), example_inputs) if type(x) is torch.Tensor}  # not fake
    for _, module in _graph_modules(gm):  # parents before their bodies
        for node in module.graph.nodes:
            body = node.args[0] if node.op == "call_function" and node.args else None
            if isinstance(body, fx.Node) and body.op == "get_attr":
                operands = [a for a in node.args[1:] if isinstance(a, fx.Node)]
                inner = getattr(module, str(body.target), None)
                if isinstance(inner, fx.GraphModule):
                    values.update((p, values[a]) for p, a in zip(placeholders(inner), operands) if a in values)
    return values


def replace_node(site: AttentionSite, target, args: tuple, n_outputs_used: int = 1) -> list[fx.Node]:
    """Insert ``target(*args)`` (a tuple-valued CP op) before the site's node and
    route the old node's users to its first output; returns [op, out0, ...]."""
    graph = site.owner.graph
    with graph.inserting_before(site.node):
        op = graph.call_function(target, args)
        outs = [graph.call_function(operator.getitem, (op, i)) for i in range(n_outputs_used)]
    for new in [op] + outs:
        new.meta["stack_trace"] = site.node.meta.get("stack_trace")
    if "example_value" in site.node.meta and n_outputs_used == 1:
        outs[0].meta["example_value"] = site.node.meta["example_value"]
    return [op] + outs


def insert_schedule(
    site: AttentionSite,
    schedule: str,
    q,
    k,
    v,
    extra: list,
    call: Call,
    enable_gqa: bool,
    outputs_used: int = 2,
) -> list[fx.Node]:
    """Insert ``schedule``'s whole op for the site's ``call`` (see ``replace_node``); returns [op, out(, lse)]."""
    try:
        target = whole_op(schedule, call.groups)
    except ValueError as e:
        raise UnsupportedAttention(f"attention at {site.source}: {e}") from None
    return replace_node(
        site, target, (q, k, v, list(extra), *call.op_args(bool(enable_gqa))), n_outputs_used=outputs_used
    )


@dataclass(frozen=True)
class SitePattern:
    """One pattern of attention call in a graph (a torch op): how to find it, check it and rewrite it."""

    name: str
    match: Callable[[fx.Node], Optional[dict[str, Any]]]  # the call's arguments by name, or None
    check: Callable[[AttentionSite], None]
    rewrite: Callable[[AttentionSite, Any], None]  # given the site and the plan (``ContextParallel``)
