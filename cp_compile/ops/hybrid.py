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
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .block import result_like
from .comm import resolve_group
from .heads import check_heads
from .registry import Traceable, register_schedule
from .ring import check_ring_args, ring_backward, ring_forward
from .ulysses import _distinct, _head_sharded_like, exchange_backward, exchange_forward, kv_copies


def _options(is_causal, layout, scale, enable_gqa, ring_group, a2a_group) -> str:
    ring, a2a = resolve_group(ring_group).size(), resolve_group(a2a_group).size()
    return f"hybrid ring={ring} a2a={a2a} causal={is_causal} layout={layout} scale={scale!r} gqa={enable_gqa}"


def hybrid_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group_name: str, ring_group: str, a2a_group: str, is_causal: bool,
    layout: str, scale: float, enable_gqa: bool,
) -> tuple[Tensor, ...]:
    rings, group = resolve_group(ring_group).size(), resolve_group(a2a_group).size()
    if rings * group > 1:
        torch.ops.cp.agree(q, k, v, group_name, _options(is_causal, layout, scale, enable_gqa, ring_group, a2a_group))
    check_ring_args(q, k, v, rings * group, is_causal, layout, enable_gqa)
    check_heads(q.shape[1], group, "the query")

    def attend(qh, kh, vh):
        return ring_forward(qh, kh, vh, group_name=ring_group, world_size=rings, is_causal=is_causal,
                            layout=layout, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1])

    return exchange_forward(q, k, v, a2a_group, group, layout, attend)


def hybrid_backward(
    dout: Tensor, dlse: Optional[Tensor], qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor, *,
    ring_group: str, a2a_group: str, is_causal: bool, layout: str, scale: float, kv_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    rings, group = resolve_group(ring_group).size(), resolve_group(a2a_group).size()

    def attend_backward(dout_h, dlse_h):
        return ring_backward(dout_h, qh, kh, vh, out_h, lse_h, dlse_h, group_name=ring_group, world_size=rings,
                             is_causal=is_causal, layout=layout, scale=scale)

    return exchange_backward(dout, dlse, a2a_group, group, layout, kv_heads, attend_backward)


@torch.library.custom_op("cp::hybrid_attention", mutates_args=())
def hybrid_attention_op(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, ring_group: str, a2a_group: str, is_causal: bool,
    layout: str, scale: float, enable_gqa: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse) of this rank's queries, plus the head-sharded q, k, v, out, lse kept for backward."""
    res = hybrid_forward(q, k, v, group_name=group_name, ring_group=ring_group, a2a_group=a2a_group,
                         is_causal=is_causal, layout=layout, scale=scale, enable_gqa=enable_gqa)
    return _distinct(res, (q, k, v))


@hybrid_attention_op.register_fake
def _(q, k, v, group_name, ring_group, a2a_group, is_causal, layout, scale, enable_gqa):
    a = resolve_group(a2a_group).size()
    out, lse = result_like(q, v)
    kv_heads = k.shape[1] * kv_copies(q.shape[1], k.shape[1], a)
    return (out, lse, _head_sharded_like(q, a), _head_sharded_like(k, a, kv_heads),
            _head_sharded_like(v, a, kv_heads), _head_sharded_like(out, a), _head_sharded_like(lse, a))


@torch.library.custom_op("cp::hybrid_attention_backward", mutates_args=())
def hybrid_attention_backward_op(
    dout: Tensor, dlse: Optional[Tensor], qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor,
    ring_group: str, a2a_group: str, is_causal: bool, layout: str, scale: float, kv_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    res = hybrid_backward(dout, dlse, qh, kh, vh, out_h, lse_h, ring_group=ring_group, a2a_group=a2a_group,
                          is_causal=is_causal, layout=layout, scale=scale, kv_heads=kv_heads)
    return _distinct(res, (dout, dlse, qh, kh, vh, out_h, lse_h))


@hybrid_attention_backward_op.register_fake
def _(dout, dlse, qh, kh, vh, out_h, lse_h, ring_group, a2a_group, is_causal, layout, scale, kv_heads):
    a = resolve_group(a2a_group).size()
    b, s = dout.shape[0], dout.shape[2]
    return (dout.new_empty(b, qh.shape[1] * a, s, qh.shape[-1]),
            dout.new_empty(b, kv_heads, s, kh.shape[-1]), dout.new_empty(b, kv_heads, s, vh.shape[-1]))


def _setup(ctx, inputs, output):
    _, k, _, _, ring_group, a2a_group, is_causal, layout, scale, _ = inputs
    ctx.save_for_backward(*output[2:])
    ctx.options = (ring_group, a2a_group, is_causal, layout, scale, k.shape[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, *_unused):
    qh, kh, vh, out_h, lse_h = ctx.saved_tensors
    if dout is None:
        a = resolve_group(ctx.options[1]).size()
        dout = out_h.new_zeros(out_h.shape[0], out_h.shape[1] * a, out_h.shape[2] // a, out_h.shape[3])
    dq, dk, dv = torch.ops.cp.hybrid_attention_backward(dout, dlse, qh, kh, vh, out_h, lse_h, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None


hybrid_attention_op.register_autograd(_backward, setup_context=_setup)


def _world(ring_group: str, a2a_group: str) -> int:
    return resolve_group(ring_group).size() * resolve_group(a2a_group).size()


def _expand_forward(args) -> Traceable:
    q, k, v, group_name, ring_group, a2a_group, is_causal, layout, scale, enable_gqa = args

    def fn(q, k, v):
        return hybrid_forward(q, k, v, group_name=group_name, ring_group=ring_group, a2a_group=a2a_group,
                              is_causal=is_causal, layout=layout, scale=scale, enable_gqa=enable_gqa)

    return Traceable("forward", _world(ring_group, a2a_group), fn, [q, k, v])


def _expand_backward(args) -> Traceable:
    dout, dlse, qh, kh, vh, out_h, lse_h, ring_group, a2a_group, is_causal, layout, scale, kv_heads = args

    def fn(*tensors):  # fixed arity for tracing: dlse is there or not
        return hybrid_backward(tensors[0], tensors[6] if len(tensors) > 6 else None, *tensors[1:6],
                               ring_group=ring_group, a2a_group=a2a_group, is_causal=is_causal, layout=layout,
                               scale=scale, kv_heads=kv_heads)

    tensors = [dout, qh, kh, vh, out_h, lse_h] + ([dlse] if dlse is not None else [])
    return Traceable("backward", _world(ring_group, a2a_group), fn, tensors)


register_schedule(
    torch.ops.cp.hybrid_attention.default, _expand_forward,
    torch.ops.cp.hybrid_attention_backward.default, _expand_backward,
    {},  # its compute ops are the ring's, registered with the ring
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
    return hybrid_attention_op(q, k, v, group_name, ring_group, a2a_group, bool(is_causal), layout, scale,
                               bool(enable_gqa))[0]
