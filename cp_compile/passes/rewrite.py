"""Stage 1: replace attention calls in the Dynamo graph with CP ops.

Runs on the graph a ``torch.compile`` backend receives, before AOTAutograd, so
the CP op's registered autograd becomes the backward graph. It walks every
graph module, including the bodies of higher-order ops (``torch.utils.checkpoint``
regions, SAC, other wrapped regions), which hang off the top-level module
as submodules.

The pass is match -> check -> rewrite:

- ``find_sites`` returns one ``AttentionSite`` per SDPA call;
- ``check_site`` raises ``UnsupportedAttention`` (naming the argument) for
  what CP cannot reproduce exactly: ``dropout_p > 0``, an ``attn_mask`` tensor;
- ``rewrite_site`` inserts ``cp::ring_attention``, reroutes the users of the
  old output and erases the SDPA node.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Stand-in with SDPA's documented signature, for binding graph arguments."""


_SDPA_SIGNATURE = inspect.signature(_sdpa_signature)


class UnsupportedAttention(NotImplementedError):
    """An attention call that CP cannot rewrite exactly."""


@dataclass
class AttentionSite:
    """One attention call found in a graph."""

    owner: fx.GraphModule  # the graph module whose graph holds the call (maybe a HOP body)
    owner_path: str  # its path under the top-level module, "" for the top level
    node: fx.Node
    args: dict[str, Any]  # SDPA arguments by name
    kind: str = "sdpa"
    decision: dict = field(default_factory=dict)  # filled by the rewrite: schedule and why

    @property
    def query(self) -> fx.Node:
        return self.args["query"]

    def shape(self, name: str) -> Optional[tuple[int, ...]]:
        val = _example(self.args[name])
        return tuple(val.shape) if val is not None else None

    def dtype(self) -> Optional[torch.dtype]:
        val = _example(self.query)
        return val.dtype if val is not None else None

    @property
    def source(self) -> str:
        """The user's source line, from the frame Dynamo recorded."""
        trace = self.node.meta.get("stack_trace") or ""
        lines = [ln.strip() for ln in trace.strip().splitlines()]
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith("File "):
                code = lines[i + 1] if i + 1 < len(lines) else ""
                return f"{lines[i]}: {code}"
        return f"{self.owner.__class__.__name__}.{self.node.name}"

    @property
    def location(self) -> str:
        return "top-level graph" if self.owner_path == "" else f"inside {self.owner_path}"


def _example(node) -> Optional[torch.Tensor]:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def _graph_modules(gm: fx.GraphModule):
    for path, module in gm.named_modules():
        if isinstance(module, fx.GraphModule):
            yield path, module


def find_sites(gm: fx.GraphModule) -> list[AttentionSite]:
    sites = []
    for path, module in _graph_modules(gm):
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in SDPA_TARGETS:
                bound = _SDPA_SIGNATURE.bind(*node.args, **node.kwargs)
                bound.apply_defaults()
                sites.append(AttentionSite(owner=module, owner_path=path, node=node, args=dict(bound.arguments)))
    return sites


def check_site(site: AttentionSite) -> None:
    args = site.args
    where = f"at {site.source}"
    if args["attn_mask"] is not None:
        raise UnsupportedAttention(
            f"scaled_dot_product_attention(attn_mask=...) {where}: an explicit attn_mask tensor is not supported "
            "under context parallelism (each rank holds only its shard of the sequence); use is_causal=True, "
            "or FlexAttention for custom masks"
        )
    dropout = args["dropout_p"]
    if isinstance(dropout, fx.Node) or dropout != 0.0:
        raise UnsupportedAttention(
            f"scaled_dot_product_attention(dropout_p={dropout}) {where}: attention dropout is not supported "
            "under context parallelism; use dropout_p=0.0 (e.g. model.eval() or dropout_p=0 in the module)"
        )
    for name in ("is_causal", "scale", "enable_gqa"):
        if isinstance(args[name], fx.Node):
            raise UnsupportedAttention(f"scaled_dot_product_attention({name}=<traced value>) {where}: must be a constant")
    q_shape, k_shape = site.shape("query"), site.shape("key")
    if q_shape is None or k_shape is None:
        raise UnsupportedAttention(f"scaled_dot_product_attention {where}: no example shapes in the graph")
    if len(q_shape) != 4:
        raise UnsupportedAttention(
            f"scaled_dot_product_attention {where}: CP needs [B, H, S, D] inputs, got a {len(q_shape)}-D query"
        )


def rewrite_site(site: AttentionSite, group_name: str, layout: str) -> fx.Node:
    """Replace the SDPA node with ``cp::ring_attention``; returns the new out node."""
    args = site.args
    head_dim = site.shape("query")[-1]
    scale = args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(head_dim)
    graph = site.owner.graph
    with graph.inserting_before(site.node):
        ring = graph.call_function(
            torch.ops.cp.ring_attention.default,
            (args["query"], args["key"], args["value"], group_name, bool(args["is_causal"]), layout,
             float(scale), bool(args["enable_gqa"])),
        )
        out = graph.call_function(operator.getitem, (ring, 0))
    for new in (ring, out):
        new.meta["stack_trace"] = site.node.meta.get("stack_trace")
    if "example_value" in site.node.meta:
        out.meta["example_value"] = site.node.meta["example_value"]
    site.node.replace_all_uses_with(out)
    graph.erase_node(site.node)
    site.decision = {
        "schedule": "ring",
        "why": "causal zigzag ring: equal work per rank and step, K/V transfer overlapped with compute"
        if args["is_causal"] else "ring: K/V transfer overlapped with compute",
        "is_causal": bool(args["is_causal"]),
        "scale": float(scale),
        "enable_gqa": bool(args["enable_gqa"]),
    }
    return out


def rewrite_attention(gm: fx.GraphModule, group_name: str, layout: str) -> list[AttentionSite]:
    """Stage 1 over a whole Dynamo graph module (HOP bodies included)."""
    sites = find_sites(gm)
    for site in sites:
        check_site(site)
    for site in sites:
        rewrite_site(site, group_name, layout)
    touched = {id(s.owner): s.owner for s in sites}
    for module in touched.values():
        module.graph.lint()
        module.recompile()
    return sites
