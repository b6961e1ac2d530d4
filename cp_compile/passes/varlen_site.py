"""Attention site kind "varlen": torch's ``varlen_attn`` over packed documents.

In a Dynamo graph ``torch.nn.attention.varlen.varlen_attn`` appears as its
custom op ``torch.ops.torch_attn._varlen_attn`` (the Python wrapper is traced
through; the op has a fake implementation, so this works on CPU, where the op
itself has no kernel). It returns (out, lse [H, T], rng_state). The wrapper
passes ``is_causal = window_size == (-1, 0)`` and the window as a list.

``num_splits`` (how many pieces the CUDA kernel splits the keys into;
torchtitan passes 1) is a kernel hint that does not change the result: it is
accepted and ignored, as are ``max_q`` / ``max_k`` (the CP ops compute what
they need from ``cu_seqlens``).

The rewrite inserts one ``cp::varlen_attention`` with the schedule chosen for
the site (ring, all-gather), or for the head-sharding schedules one
``cp::ulysses_attention`` / ``cp::hybrid_attention`` (a 2-D mesh plan) with the
``"packed"`` inner attention on ``[1, H, T, D]`` views; its ``cu_seqlens`` is
the model's own global ``cu_seq_q``.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.attention.varlen  # noqa: F401  (registers torch.ops.torch_attn)

from ..ops.varlen import PACKED_SCHEDULES
from .rewrite import SITE_KINDS, AttentionSite, CPOptions, SiteKind, UnsupportedAttention, replace_node

VARLEN_OP = torch.ops.torch_attn._varlen_attn
_SCHEMA = VARLEN_OP.default._schema


def _match_varlen(node: fx.Node) -> Optional[dict[str, Any]]:
    if node.target not in (VARLEN_OP, VARLEN_OP.default):
        return None
    args = {a.name: a.default_value if a.has_default_value() else None for a in _SCHEMA.arguments}
    args.update(zip([a.name for a in _SCHEMA.arguments], node.args))
    args.update(node.kwargs)
    return args


def _check_varlen(site: AttentionSite) -> None:
    args, where = site.args, f"at {site.source}"
    if args["cu_seq_k"] is not args["cu_seq_q"]:
        raise UnsupportedAttention(
            f"varlen_attn(cu_seq_k=...) {where}: CP needs self-attention over the same documents "
            "(pass the same cu_seqlens tensor as cu_seq_q and cu_seq_k)"
        )
    for name in ("seqused_k", "block_table"):
        if args[name] is not None:
            raise UnsupportedAttention(f"varlen_attn({name}=...) {where}: not supported under context parallelism")
    splits = args["num_splits"]
    if not (splits is None or isinstance(splits, fx.Node) or (isinstance(splits, int) and splits >= 0)):
        raise UnsupportedAttention(f"varlen_attn(num_splits={splits!r}) {where}: expected None or an int >= 0")
    for name in ("is_causal", "scale", "window_size", "enable_gqa"):
        value = args[name]
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, fx.Node) for v in items):
            raise UnsupportedAttention(f"varlen_attn({name}=<traced value>) {where}: must be a constant")
    if site.shape("query") is None or len(site.shape("query")) != 3:
        raise UnsupportedAttention(f"varlen_attn {where}: CP needs packed [tokens, heads, dim] inputs")
    for user in site.node.users:  # a checkpoint body keeps unused getitems: those are harmless
        if user.target != operator.getitem or (user.args[1] == 2 and user.users):
            raise UnsupportedAttention(f"varlen_attn {where}: only its output and lse may be used")
    from ..ops.varlen import window_of

    window = list(args["window_size"] or (-1, -1))
    args["window_left"], args["window_right"] = window_of(window, bool(args["is_causal"]))


def _rewrite_varlen(site: AttentionSite, options: CPOptions) -> None:
    from .cost import choose_schedule

    args = site.args
    schedule, why = choose_schedule(site, options)
    if schedule not in PACKED_SCHEDULES:
        raise UnsupportedAttention(
            f"schedule {schedule!r} is not available for varlen_attn at {site.source}; available: {PACKED_SCHEDULES}"
        )
    head_dim = site.shape("query")[-1]
    scale = float(args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(head_dim))
    left, right = args["window_left"], args["window_right"]
    graph = site.owner.graph
    if schedule in ("ulysses", "hybrid"):
        op, out, lse = _replace_with_heads_op(site, options, schedule, scale, left, right)
    else:
        op, out, lse = replace_node(site, torch.ops.cp.varlen_attention.default, (
            args["query"], args["key"], args["value"], args["cu_seq_q"], options.group_name, schedule,
            left, right, scale, bool(args["enable_gqa"]),
        ), n_outputs_used=2)
    for user in list(site.node.users):
        if not user.users:
            pass
        elif user.args[1] == 0:
            user.replace_all_uses_with(out)
        else:  # varlen_attn's lse is [H, T] fp32; ours is [T, H] in the accumulator dtype
            with graph.inserting_before(user):
                lse_ht = graph.call_function(torch.Tensor.float, (graph.call_function(torch.t, (lse,)),))
            user.replace_all_uses_with(lse_ht)
        graph.erase_node(user)
    graph.erase_node(site.node)
    site.decision.update({"schedule": schedule, "why": why, "is_causal": right == 0, "scale": scale,
                          "enable_gqa": bool(args["enable_gqa"]), "window": (left, right)})


def _replace_with_heads_op(site: AttentionSite, options: CPOptions, schedule: str, scale: float, left: int,
                           right: int):
    """The head-sharding op with the "packed" inner attention, on [1, H, T, D] views of the packed
    tensors (as ``ops.ulysses_masks.packed_heads_attention``); returns (op, out [T, H, D], lse [T, H])."""
    from ..ops.ulysses_masks import RANK_ORDER, heads_schedule, packed_options

    args, graph = site.args, site.owner.graph
    try:
        target, groups = heads_schedule(schedule, options.group_name, options.mesh_groups)
    except ValueError as e:
        raise UnsupportedAttention(f"varlen_attn at {site.source}: {e}") from None
    with graph.inserting_before(site.node):
        q, k, v = (graph.call_function(torch.unsqueeze, (graph.call_function(torch.transpose, (args[name], 0, 1)), 0))
                   for name in ("query", "key", "value"))
    op, out_h, lse_h = replace_node(site, target, (
        q, k, v, [args["cu_seq_q"]], *groups, False, RANK_ORDER, scale, bool(args["enable_gqa"]), "packed",
        packed_options(left, right),
    ), n_outputs_used=2)
    with graph.inserting_before(site.node):
        out, lse = (graph.call_function(torch.transpose, (graph.call_function(torch.squeeze, (t, 0)), 0, 1))
                    for t in (out_h, lse_h))
    return op, out, lse


SITE_KINDS.append(SiteKind("varlen", _match_varlen, _check_varlen, _rewrite_varlen, PACKED_SCHEDULES))
