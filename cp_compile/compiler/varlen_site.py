"""Attention site pattern "varlen": torch's ``varlen_attn`` over packed documents.

In a Dynamo graph ``torch.nn.attention.varlen.varlen_attn`` appears as its
custom op ``torch.ops.torch_attn._varlen_attn`` (the Python wrapper is traced
through; the op has a fake implementation, so this works on CPU, where the op
itself has no kernel). It returns (out, lse [H, T], rng_state). The wrapper
passes ``is_causal = window_size == (-1, 0)`` and the window as a list.

``num_splits`` (how many pieces the CUDA kernel splits the keys into;
torchtitan passes 1) is a kernel hint that does not change the result: it is
accepted and ignored, as are ``max_q`` / ``max_k`` (the CP ops compute what
they need from ``cu_seqlens``).

The rewrite inserts the chosen schedule's whole op with the ``"packed"`` kind
(the head-sharding schedules on ``[1, H, T, D]`` views, as the eager
``varlen_attention``); its ``cu_seqlens`` is the model's own global ``cu_seq_q``.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from ..errors import UnsupportedAttention
from ..kinds.call import Call
from ..kinds.packed import PackedSettings, bhsd, thd, window_of
from ..schedules import HEAD_SCHEDULES
from .choose import choose_schedule
from .site import AttentionSite, SitePattern, constant, insert_schedule


@functools.cache
def _varlen_op():
    """torch's ``varlen_attn`` op, registered on the first graph looked at: its module imports Dynamo (2 s),
    which ``import cp_compile`` need not pay."""
    import torch.nn.attention.varlen  # noqa: F401  (registers torch.ops.torch_attn)

    return torch.ops.torch_attn._varlen_attn


# Arguments torch 2.13 added to the op, absent from 2.11's; enable_gqa None: from the head counts (see _check_varlen)
_NEWER_ARGUMENTS = {"enable_gqa": None, "seqused_k": None, "block_table": None, "num_splits": None}


def _match_varlen(node: fx.Node) -> Optional[dict[str, Any]]:
    op = _varlen_op()
    if node.target not in (op, op.default):
        return None
    schema = op.default._schema
    args = dict(_NEWER_ARGUMENTS)
    args.update({a.name: a.default_value if a.has_default_value() else None for a in schema.arguments})
    args.update(zip([a.name for a in schema.arguments], node.args))
    args.update(node.kwargs)
    return args


def _check_varlen(site: AttentionSite) -> None:
    args, where = site.args, f"at {site.source}"
    for name in ("is_causal", "scale", "window_size", "enable_gqa", "num_splits"):
        args[name] = constant(args[name])
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
    if args["enable_gqa"] is None:  # torch 2.11's op has no enable_gqa: fewer key/value heads are its GQA
        args["enable_gqa"] = site.shape("query")[1] != site.shape("key")[1]
    window = list(args["window_size"] or (-1, -1))
    args["window_left"], args["window_right"] = window_of(window, bool(args["is_causal"]))


def _rewrite_varlen(site: AttentionSite, plan) -> None:
    args = site.args
    left, right = args["window_left"], args["window_right"]
    site.decision = choose_schedule(site, plan, right == 0)
    schedule = site.decision.schedule
    head_dim = site.shape("query")[-1]
    scale = float(args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(head_dim))
    graph = site.owner.graph
    qkv = [args[name] for name in ("query", "key", "value")]
    heads = schedule in HEAD_SCHEDULES  # they exchange [B, H, S, D]: the packed tensors as [1, H, T, D] views
    if heads:
        with graph.inserting_before(site.node):
            qkv = [graph.call_function(bhsd, (t,)) for t in qkv]
    call = Call("packed", plan.groups(schedule), False, "packed", scale, PackedSettings(left, right))
    _, out, lse = insert_schedule(site, schedule, *qkv, [args["cu_seq_q"]], call, args["enable_gqa"])
    if heads:
        with graph.inserting_before(site.node):
            out, lse = (graph.call_function(thd, (t,)) for t in (out, lse))
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


VARLEN_PATTERN = SitePattern("varlen", _match_varlen, _check_varlen, _rewrite_varlen)
