"""Stage 1 for FlexAttention: the ``flex_attention`` higher-order op becomes the chosen schedule's
whole op with the ``"flex"`` kind.

The HOP carries its mods as subgraphs (``get_attr`` submodules) and the
tensors they read as explicit buffers. The rewrite passes the subgraphs to the
op as a ``Mods`` constant of the graph (an opaque object, which Inductor's FX
graph cache does not restore: ``compiler.backend`` skips the cache for such a
graph) and the buffers as op arguments; the
BlockMask must come from ``ContextParallel.shard``, whose index table is the
mask's first buffer. The HOP's lse is base 2 (the traced ``flex_attention``
scales it by ln 2 afterwards), so the rewrite returns ours divided by ln 2.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Optional

import torch
import torch.fx as fx

from ..errors import UnsupportedAttention
from ..kinds.call import Call
from ..kinds.flex import FlexSettings
from ..layout.blockmask import Mods, is_table_length
from ..torch_compat import size_hint
from .choose import choose_schedule
from .site import (
    AttentionSite,
    SitePattern,
    _example,
    constant,
    insert_schedule,
    placeholders,
    traced_value,
)

FLEX_HOP = torch.ops.higher_order.flex_attention
_NAMES = (
    "query",
    "key",
    "value",
    "score_mod",
    "block_mask",
    "scale",
    "kernel_options",
    "score_mod_buffers",
    "mask_mod_buffers",
)


def _match_flex(node: fx.Node) -> Optional[dict[str, Any]]:
    if node.target is not FLEX_HOP:
        return None
    return dict(zip(_NAMES, node.args))


def _submodule(site: AttentionSite, node: fx.Node) -> fx.GraphModule:
    return getattr(site.owner, node.target)


def _is_identity_score(gm: fx.GraphModule) -> bool:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return output.args[0] is placeholders(gm)[0]


def _is_noop_mask(gm: fx.GraphModule) -> bool:
    """A mask that reads no index (e.g. the default when block_mask=None): every pair visible."""
    return all(not p.users for p in placeholders(gm))


def _check_flex(site: AttentionSite) -> None:
    where = f"at {site.source}"
    q, k = site.shape("query"), site.shape("key")
    if q is None or k is None or len(q) != 4:
        raise UnsupportedAttention(f"flex_attention {where}: CP needs [B, H, S, D] inputs with example shapes")
    if q[2] != k[2]:
        raise UnsupportedAttention(
            f"flex_attention {where}: local query and key lengths differ ({q[2]} vs {k[2]}); CP shards them alike"
        )
    if (site.args["kernel_options"] or {}).get("OUTPUT_MAX"):
        raise UnsupportedAttention(
            f"flex_attention(return_aux=AuxRequest(max_scores=True)) {where}: max scores are not supported under CP"
        )
    block_mask = site.args["block_mask"]
    local = _example(site.query).shape[2]  # symbolic under dynamic shapes: comparing guards the relation
    if not all(bool(traced_value(n) == local) for n in block_mask[:2]):
        raise UnsupportedAttention(
            f"flex_attention(block_mask=...) {where}: the mask covers {block_mask[1]} x {block_mask[0]} tokens, "
            f"the local q/k {q[2]}; pass plan.shard(block_mask)"
        )
    mask_gm = _submodule(site, block_mask[-1])
    buffers = site.args["mask_mod_buffers"]
    if not buffers:
        if not _is_noop_mask(mask_gm):
            raise UnsupportedAttention(
                f"flex_attention(block_mask=...) {where}: the mask was not sharded for CP; build the BlockMask "
                "for the global sequence and pass it through plan.shard(block_mask)"
            )
        return
    table = _example(buffers[0])
    if (
        table is None
        or table.dim() != 1
        or table.dtype != torch.int64
        or not is_table_length(size_hint(table.numel()), q[2])
    ):
        raise UnsupportedAttention(
            f"flex_attention(block_mask=...) {where}: the mask's first buffer is not a CP index table; "
            "pass plan.shard(block_mask)"
        )


def _mods_node(site: AttentionSite, mods: Mods) -> fx.Node:
    """``mods`` as a constant of the site's graph: an attribute of its module, read by a ``get_attr`` node."""
    owner = site.owner
    name = next(f"cp_mods_{i}" for i in itertools.count() if not hasattr(owner, f"cp_mods_{i}"))
    setattr(owner, name, mods)
    # create_node, not graph.get_attr: that one warns for any attribute that is not a module, parameter or buffer
    with owner.graph.inserting_before(site.node):
        return owner.graph.create_node("get_attr", name)


def _rewrite_flex(site: AttentionSite, plan) -> None:
    args = site.args
    block_mask = args["block_mask"]
    mask_gm, score_gm = _submodule(site, block_mask[-1]), _submodule(site, args["score_mod"])
    mask_buffers, score_buffers = list(args["mask_mod_buffers"]), list(args["score_mod_buffers"])
    mask = None if _is_noop_mask(mask_gm) and not mask_buffers else mask_gm
    score = None if _is_identity_score(score_gm) else score_gm
    mods = _mods_node(site, Mods(mask, score, len(mask_buffers)))
    mask_b, mask_h = _example(block_mask[2]).shape[:2]
    site.decision = choose_schedule(site, plan, False)
    schedule = site.decision.schedule
    scale = float(constant(args["scale"]))
    enable_gqa = site.shape("query")[1] != site.shape("key")[1]
    call = Call("flex", plan.groups(schedule), False, plan.load_balance, scale, FlexSettings(mask_b, mask_h), mods)
    buffers = mask_buffers + score_buffers
    _, out, lse = insert_schedule(site, schedule, args["query"], args["key"], args["value"], buffers, call, enable_gqa)
    graph = site.owner.graph
    with graph.inserting_before(site.node):
        lse2 = graph.call_function(torch.mul, (lse, 1.0 / math.log(2.0)))  # the HOP's lse is base 2
    lse2.meta["stack_trace"] = site.node.meta.get("stack_trace")
    example = site.node.meta.get("example_value")
    if example is not None:
        out.meta["example_value"] = example[0]
    for user in list(site.node.users):
        # output 2 (max scores) is only computed on request (OUTPUT_MAX, refused above), but a
        # checkpoint body may still pass it along: lse stands in, with the same shape and dtype
        user.replace_all_uses_with(out if user.args[1] == 0 else lse2)
        graph.erase_node(user)
    graph.erase_node(site.node)
    for attr in (block_mask[-1], args["score_mod"]):
        if not attr.users:
            graph.erase_node(attr)
    site.args = {**args, "is_causal": False, "enable_gqa": enable_gqa}


FLEX_PATTERN = SitePattern("flex", _match_flex, _check_flex, _rewrite_flex)
