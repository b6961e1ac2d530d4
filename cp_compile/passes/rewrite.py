"""Stage 1: replace attention calls in the Dynamo graph with CP ops.

Runs on the graph a ``torch.compile`` backend receives, before AOTAutograd, so
the CP op's registered autograd becomes the backward graph. It walks every
graph module, including the bodies of higher-order ops (``torch.utils.checkpoint``
regions, SAC, other wrapped regions), which hang off the top-level module
as submodules.

The pass is match -> check -> rewrite:

- ``find_sites`` returns one ``AttentionSite`` per attention call, of any of
  the ``SITE_KINDS`` (each kind knows how to match, check and rewrite its op);
- the kind's ``check`` raises ``UnsupportedAttention`` (naming the argument)
  for what CP cannot reproduce exactly (for SDPA: ``dropout_p > 0``, an
  ``attn_mask`` tensor);
- ``passes.cost.choose_schedule`` picks the schedule, and the kind's
  ``rewrite`` inserts that schedule's CP op, reroutes the users of the old
  output and erases the attention node.
"""

from __future__ import annotations

import inspect
import math
import os
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Stand-in with SDPA's documented signature, for binding graph arguments."""


_SDPA_SIGNATURE = inspect.signature(_sdpa_signature)


class UnsupportedAttention(NotImplementedError):
    """An attention call that CP cannot rewrite exactly."""


@dataclass(frozen=True)
class CPOptions:
    """What the plan tells the passes: the same on every rank."""

    group_name: str
    layout: str
    schedule: str = "auto"  # "auto" or a schedule name forced for every site
    mesh_groups: tuple = ()  # (ring group, all-to-all group) of a 2-D plan, for the hybrid schedule
    machine: Any = None  # passes.cost.Machine the cost model assumes; None: defaults for the device

    @property
    def mesh_sizes(self) -> tuple:
        from ..ops.comm import resolve_group

        return tuple(resolve_group(g).size() for g in self.mesh_groups)


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
    def handler(self) -> "SiteKind":
        return next(k for k in SITE_KINDS if k.name == self.kind)

    @property
    def query(self) -> fx.Node:
        return self.args["query"]

    def shape(self, name: str) -> Optional[tuple[int, ...]]:
        """The argument's shape as ints (a dynamic dimension as its example value: what the cost model reads)."""
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        val = _example(self.args[name])
        return tuple(int(optimization_hint(s)) for s in val.shape) if val is not None else None

    def dtype(self) -> Optional[torch.dtype]:
        val = _example(self.query)
        return val.dtype if val is not None else None

    @property
    def source(self) -> str:
        """The user's source line, from the frame Dynamo recorded: the innermost frame outside torch
        itself (``varlen_attn`` and ``flex_attention`` are Python wrappers whose own lines say nothing)."""
        trace = self.node.meta.get("stack_trace") or ""
        lines = [ln.strip() for ln in trace.strip().splitlines()]
        frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
        outside = [i for i in frames if not _in_torch(lines[i])]
        for i in (outside or frames)[-1:]:
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}"
        return f"{self.owner.__class__.__name__}.{self.node.name}"

    @property
    def location(self) -> str:
        return "top-level graph" if self.owner_path == "" else f"inside {self.owner_path}"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _in_torch(frame_line: str) -> bool:
    """Whether a 'File "...", line n, in f' line names a file of torch itself."""
    return frame_line.startswith(f'File "{_TORCH_DIR}')


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
            if node.op != "call_function":
                continue
            for kind in SITE_KINDS:
                args = kind.match(node)
                if args is not None:
                    sites.append(AttentionSite(owner=module, owner_path=path, node=node, args=args, kind=kind.name))
                    break
    return sites


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


def _check_sdpa(site: AttentionSite) -> None:
    args = site.args
    where = f"at {site.source}"
    if args["attn_mask"] is not None:
        hint = "use is_causal=True, or FlexAttention for custom masks"
        if "transformers" in (site.node.meta.get("stack_trace") or ""):  # a mask built by Hugging Face
            hint = ('for a Hugging Face transformers model, `import cp_compile.hf` and load or switch it with '
                    'attn_implementation="cp_compile" (model.set_attn_implementation("cp_compile")), and run it '
                    'inside `with plan:`')
        raise UnsupportedAttention(
            f"scaled_dot_product_attention(attn_mask=...) {where}: an explicit attn_mask tensor is not supported "
            f"under context parallelism (each rank holds only its shard of the sequence); {hint}"
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


def _ring_sdpa(site: AttentionSite, options: CPOptions, scale: float):
    args = site.args
    return torch.ops.cp.ring_attention.default, (
        args["query"], args["key"], args["value"], options.group_name, bool(args["is_causal"]), options.layout,
        scale, bool(args["enable_gqa"]),
    )


def _ulysses_sdpa(site: AttentionSite, options: CPOptions, scale: float):
    args = site.args
    return torch.ops.cp.ulysses_attention.default, (
        args["query"], args["key"], args["value"], [], options.group_name, bool(args["is_causal"]),
        options.layout, scale, bool(args["enable_gqa"]), "sdpa", "",
    )


def _hybrid_sdpa(site: AttentionSite, options: CPOptions, scale: float):
    args = site.args
    return torch.ops.cp.hybrid_attention.default, (
        args["query"], args["key"], args["value"], [], options.group_name, *options.mesh_groups,
        bool(args["is_causal"]), options.layout, scale, bool(args["enable_gqa"]), "sdpa", "",
    )


# schedule name -> (site, options, scale) -> (whole forward op, its args); its output 0 is SDPA's output
SDPA_SCHEDULES: dict[str, Callable] = {"ring": _ring_sdpa, "ulysses": _ulysses_sdpa, "hybrid": _hybrid_sdpa}


def _allgather_sdpa(site: AttentionSite, options: CPOptions, scale: float):
    return torch.ops.cp.allgather_attention.default, _ring_sdpa(site, options, scale)[1]


SDPA_SCHEDULES["allgather"] = _allgather_sdpa


def _rewrite_sdpa(site: AttentionSite, options: CPOptions) -> None:
    """Replace the SDPA node with the chosen schedule's CP op."""
    from .cost import choose_schedule

    args = site.args
    head_dim = site.shape("query")[-1]
    scale = float(args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(head_dim))
    schedule, why = choose_schedule(site, options)
    if schedule not in SDPA_SCHEDULES:
        raise UnsupportedAttention(
            f"schedule {schedule!r} is not available for scaled_dot_product_attention at {site.source}; "
            f"available: {sorted(SDPA_SCHEDULES)}"
        )
    _, out = replace_node(site, *SDPA_SCHEDULES[schedule](site, options, scale))
    site.node.replace_all_uses_with(out)
    site.owner.graph.erase_node(site.node)
    site.decision.update({  # keeps the cost model's estimates
        "schedule": schedule, "why": why, "is_causal": bool(args["is_causal"]), "scale": scale,
        "enable_gqa": bool(args["enable_gqa"]),
    })


@dataclass(frozen=True)
class SiteKind:
    """One kind of attention call: how to find it, check it and rewrite it."""

    name: str
    match: Callable[[fx.Node], Optional[dict[str, Any]]]  # the call's arguments by name, or None
    check: Callable[[AttentionSite], None]
    rewrite: Callable[[AttentionSite, CPOptions], None]
    schedules: Optional[dict] = None  # schedule name -> builder; the cost model considers only these


def _match_sdpa(node: fx.Node) -> Optional[dict[str, Any]]:
    if node.target not in SDPA_TARGETS:
        return None
    bound = _SDPA_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


SITE_KINDS: list[SiteKind] = [SiteKind("sdpa", _match_sdpa, _check_sdpa, _rewrite_sdpa, SDPA_SCHEDULES)]


def check_site(site: AttentionSite) -> None:
    site.handler.check(site)


def rewrite_attention(gm: fx.GraphModule, options: CPOptions) -> list[AttentionSite]:
    """Stage 1 over a whole Dynamo graph module (HOP bodies included)."""
    sites = find_sites(gm)
    for site in sites:
        check_site(site)
    for site in sites:
        site.handler.rewrite(site, options)
    touched = {id(s.owner): s.owner for s in sites}
    for module in touched.values():
        module.graph.lint()
        module.recompile()
    return sites


from . import varlen_site  # noqa: E402,F401  (adds the "varlen" site kind)
