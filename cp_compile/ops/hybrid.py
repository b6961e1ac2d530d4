"""Hybrid attention on a 2-D mesh: all-to-all inside a group, ring across groups.

The mesh is ``(ring, a2a)``: dim 0 is the ring, dim 1 the all-to-all group
(consecutive ranks, e.g. the GPUs of one node, where the all-to-all's many
messages are cheap; the ring's few large transfers cross the slower links and
hide under compute). The plan shards the sequence over the flattened mesh
(rank ``ring_rank * A + a2a_rank``, C = R x A) with the plan's layout.

Why that composes: under zigzag, flattened rank f holds chunks f and 2C-1-f
of 2C. The all-to-all group of ring rank j is ranks jA .. jA+A-1, so after the
exchange (``heads.seq_to_heads``, which orders the group's tokens) each rank
holds, for H/A heads, chunks jA .. jA+A-1 followed by (2R-1-j)A .. (2R-1-j)A+A-1:
exactly ring chunks j and 2R-1-j of a zigzag over R ranks. The causal ring
over R is then balanced as usual (``ring.ring_forward`` on the ring group),
and so is the whole mesh. The contiguous layout composes the same way.

Per rank the all-to-all moves 4/A of the activations once, and the ring
sends R-1 K/V blocks of the local size, overlapped with compute.

The forward op returns the head-sharded q, k, v, out and lse and the
backward keeps them: inside the all-to-all group the backward moves only
dout (and dlse) in and dq, dk, dv out; K/V and dK/dV travel the ring again.

Any ``ops.ulysses.INNER`` entry with a ring runs here (``inner``, ``extra``,
``options`` as for ``cp::ulysses_attention``): ``"sdpa"`` is the causal or
full ring of ``ops.ring``; ``"flex"`` and ``"packed"`` (``ops.ulysses_masks``)
exchange in rank order and evaluate their mask between this group's tokens
and the visiting group's at each ring step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .comm import resolve_group
from .heads import check_heads
from .registry import Traceable, register_schedule
from .ulysses import (
    HeadsCall, _distinct, backward_tensors, exchange_backward, exchange_forward, head_sharded_results, inner_entry,
    register_head_sharded_autograd, sequence_sharded_grads, split_backward_tensors,
)


def _options(is_causal, layout, scale, enable_gqa, ring_group, a2a_group) -> str:
    ring, a2a = resolve_group(ring_group).size(), resolve_group(a2a_group).size()
    return f"hybrid ring={ring} a2a={a2a} causal={is_causal} layout={layout} scale={scale!r} gqa={enable_gqa}"


def _ring_entry(inner: str):
    entry = inner_entry(inner)
    if entry.ring_forward is None:
        raise ValueError(f"inner attention {inner!r} has no hybrid ring")
    return entry


def hybrid_forward(
    q: Tensor, k: Tensor, v: Tensor, extra: list[Tensor], *, group_name: str, ring_group: str, a2a_group: str,
    is_causal: bool, layout: str, scale: float, enable_gqa: bool, inner: str, options: str,
) -> tuple[Tensor, ...]:
    """(out, lse) sequence-sharded, then the head-sharded (q, k, v, out, lse) the backward keeps."""
    entry = _ring_entry(inner)
    rings, group = resolve_group(ring_group).size(), resolve_group(a2a_group).size()
    call = HeadsCall(group_name, a2a_group, ring_group, is_causal, layout, scale, options)
    entry.start(q, k, v, extra, call, rings * group, enable_gqa,
                f"{_options(is_causal, layout, scale, enable_gqa, ring_group, a2a_group)} inner={inner}")
    check_heads(q.shape[1], group, "the query")
    return exchange_forward(q, k, v, a2a_group, group, entry.exchange_layout(layout),
                            lambda qh, kh, vh: entry.ring_forward(qh, kh, vh, extra, call))


def hybrid_backward(
    dout: Tensor, dlse: Optional[Tensor], qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor,
    extra: list[Tensor], *, group_name: str, ring_group: str, a2a_group: str, is_causal: bool, layout: str,
    scale: float, kv_heads: int, inner: str, options: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ring's backward on the kept head-sharded tensors; only dout (dlse) in and dq, dk, dv out
    cross the all-to-all group."""
    entry = _ring_entry(inner)
    call = HeadsCall(group_name, a2a_group, ring_group, is_causal, layout, scale, options)

    def attend_backward(dout_h, dlse_h):
        grads = entry.ring_backward(dout_h, qh, kh, vh, out_h, lse_h, dlse_h, extra, call)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (qh, kh, vh)))

    return exchange_backward(dout, dlse, a2a_group, resolve_group(a2a_group).size(), entry.exchange_layout(layout),
                             kv_heads, attend_backward)


@torch.library.custom_op("cp::hybrid_attention", mutates_args=())
def hybrid_attention_op(
    q: Tensor, k: Tensor, v: Tensor, extra: list[Tensor], group_name: str, ring_group: str, a2a_group: str,
    is_causal: bool, layout: str, scale: float, enable_gqa: bool, inner: str, options: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse) of this rank's queries, plus the head-sharded q, k, v, out, lse kept for backward."""
    res = hybrid_forward(q, k, v, list(extra), group_name=group_name, ring_group=ring_group, a2a_group=a2a_group,
                         is_causal=is_causal, layout=layout, scale=scale, enable_gqa=enable_gqa, inner=inner,
                         options=options)
    return _distinct(res, (q, k, v))


@hybrid_attention_op.register_fake
def _(q, k, v, extra, group_name, ring_group, a2a_group, is_causal, layout, scale, enable_gqa, inner,
      options):
    _ring_entry(inner)
    return head_sharded_results(q, k, v, resolve_group(a2a_group).size())


@torch.library.custom_op("cp::hybrid_attention_backward", mutates_args=())
def hybrid_attention_backward_op(
    dout: Tensor, dlse: Optional[Tensor], qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor,
    extra: list[Tensor], group_name: str, ring_group: str, a2a_group: str, is_causal: bool, layout: str,
    scale: float, kv_heads: int, inner: str, options: str,
) -> tuple[Tensor, Tensor, Tensor]:
    res = hybrid_backward(dout, dlse, qh, kh, vh, out_h, lse_h, list(extra), group_name=group_name,
                          ring_group=ring_group, a2a_group=a2a_group, is_causal=is_causal, layout=layout,
                          scale=scale, kv_heads=kv_heads, inner=inner, options=options)
    return _distinct(res, (dout, dlse, qh, kh, vh, out_h, lse_h))


@hybrid_attention_backward_op.register_fake
def _(dout, dlse, qh, kh, vh, out_h, lse_h, extra, group_name, ring_group, a2a_group, is_causal, layout, scale,
      kv_heads, inner, options):
    return sequence_sharded_grads(dout, qh, kh, vh, resolve_group(a2a_group).size(), kv_heads)


def _hybrid_backward_options(kv_heads, group_name, ring_group, a2a_group, is_causal, layout, scale, enable_gqa,
                             inner, options):
    return a2a_group, (group_name, ring_group, a2a_group, is_causal, layout, scale, kv_heads, inner, options)


register_head_sharded_autograd(hybrid_attention_op, torch.ops.cp.hybrid_attention_backward,
                               _hybrid_backward_options)


def _world(ring_group: str, a2a_group: str) -> int:
    return resolve_group(ring_group).size() * resolve_group(a2a_group).size()


def _expand_forward(args) -> Traceable:
    q, k, v, extra, group_name, ring_group, a2a_group, is_causal, layout, scale, enable_gqa, inner, options = args

    def fn(q, k, v, *extra):
        return hybrid_forward(q, k, v, list(extra), group_name=group_name, ring_group=ring_group,
                              a2a_group=a2a_group, is_causal=is_causal, layout=layout, scale=scale,
                              enable_gqa=enable_gqa, inner=inner, options=options)

    return Traceable("forward", _world(ring_group, a2a_group), fn, [q, k, v, *extra])


def _expand_backward(args) -> Traceable:
    (dout, dlse, qh, kh, vh, out_h, lse_h, extra, group_name, ring_group, a2a_group, is_causal, layout, scale,
     kv_heads, inner, options) = args
    n_extra = len(extra)

    def fn(*tensors):
        dout, dlse, qh, kh, vh, out_h, lse_h, extra = split_backward_tensors(tensors, n_extra)
        return hybrid_backward(dout, dlse, qh, kh, vh, out_h, lse_h, extra, group_name=group_name,
                               ring_group=ring_group, a2a_group=a2a_group, is_causal=is_causal, layout=layout,
                               scale=scale, kv_heads=kv_heads, inner=inner, options=options)

    return Traceable("backward", _world(ring_group, a2a_group), fn,
                     backward_tensors(dout, dlse, qh, kh, vh, out_h, lse_h, extra))


register_schedule(
    torch.ops.cp.hybrid_attention.default, _expand_forward,
    torch.ops.cp.hybrid_attention_backward.default, _expand_backward,
    {},  # its compute ops are the ring's (and the masks' ring steps, registered with them)
)


def mesh_groups(mesh) -> tuple[str, str, str]:
    """(flattened group, ring group, all-to-all group) names of a 2-D ``(ring, a2a)`` DeviceMesh."""
    if mesh.ndim != 2:
        raise ValueError(f"the hybrid schedule needs a 2-D DeviceMesh (ring, a2a), got {mesh.ndim}-D")
    names = mesh.mesh_dim_names
    if names is not None and (names[0] in ("a2a", "ulysses") or names[1] == "ring"):
        raise ValueError(
            f"mesh_dim_names={names}: dim 0 must be the ring and dim 1 the all-to-all group "
            "(the all-to-all runs within groups of consecutive ranks); build the mesh as (ring, a2a)"
        )
    return (mesh._flatten().get_group().group_name, mesh.get_group(0).group_name, mesh.get_group(1).group_name)


def hybrid_attention(
    q: Tensor, k: Tensor, v: Tensor, mesh, is_causal: bool = False, scale: Optional[float] = None,
    enable_gqa: bool = False, layout: str = "zigzag",
) -> Tensor:
    """Hybrid attention over a 2-D ``(ring, a2a)`` DeviceMesh; shards as ``ContextParallel(mesh).shard`` makes them.

    Query heads must divide by the all-to-all group size. Differentiable.
    """
    group_name, ring_group, a2a_group = mesh if isinstance(mesh, tuple) else mesh_groups(mesh)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return hybrid_attention_op(q, k, v, [], group_name, ring_group, a2a_group, bool(is_causal), layout, scale,
                               bool(enable_gqa), "sdpa", "")[0]
