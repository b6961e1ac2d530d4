"""Sequence sharding <-> head-group sharding around a per-head token mixer (a linear recurrence's scan).

A linear recurrence (Gated DeltaNet, Mamba2's SSD, ...) runs every head on its own. One all-to-all gives
each rank the whole sequence, in global order, for 1/C of the head groups; the unmodified scan (a fused
kernel or transformers' torch body) runs on it exactly as on one process, with the same chunking and the
same document boundaries; a second all-to-all brings the output back to sequence sharding.

``cp::to_head_groups``: ``[B, L, G, W]`` (this rank's L slots, G head groups of W features; G a multiple of
C) -> ``[B, C*L, G/C, W]``: every rank's slots for this rank's G/C groups, the real tokens in global order
first and the padding slots (packed documents) after them, zeroed. ``cp::from_head_groups`` is its
inverse, and each is the other's backward (both zero the padding slots, so each is the other's adjoint).
``cp::rank_slice`` keeps this rank's 1/C of a replicated per-group tensor (a scan's per-head parameters);
its gradient is zero outside the slice, and summing gradients over the ranks (as data parallelism does)
completes it. ``cp::gather_groups`` is the all-gather back from group sharding (a final state).

Which groups a rank holds follows from the all-to-all itself (rank r receives the r-th slice) and the
reorder is the same on every rank, so a compiled graph never holds the rank.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..comm.gather import gather_dim0, reduce_scatter_dim0
from ..comm.groups import resolve_group
from ..layout.runs import sequence_order

_fc = torch.ops._c10d_functional


def _all_to_all(x: Tensor, group_name: str, world_size: int) -> Tensor:
    splits = [x.shape[0] // world_size] * world_size
    return _fc.wait_tensor(_fc.all_to_all_single(x.contiguous(), splits, splits, group_name))


def _order(local_len: int, world_size: int, layout: str, cu_seqlens, device):
    order, real = sequence_order(layout, local_len, world_size, cu_seqlens)
    mask = torch.arange(order.numel()) < real
    return order.to(device), mask.to(device)


def _in_global_order(rows: Tensor, group_name: str, layout: str, cu_seqlens) -> Tensor:
    """``[C*L, ...]`` every rank's slots in rank order -> global order, the real tokens first and the padding slots
    after them, zeroed."""
    c = resolve_group(group_name).size()
    order, real = _order(rows.shape[0] // c, c, layout, cu_seqlens, rows.device)
    return rows.index_select(0, order) * real.view(-1, *[1] * (rows.dim() - 1)).to(rows)


def _in_rank_order(rows: Tensor, group_name: str, layout: str, cu_seqlens) -> Tensor:
    """The inverse of ``_in_global_order`` (and its adjoint): ``[C*L, ...]`` in global order -> every rank's slots
    in rank order, the padding slots zeroed."""
    c = resolve_group(group_name).size()
    order, real = _order(rows.shape[0] // c, c, layout, cu_seqlens, rows.device)
    return torch.empty_like(rows).index_copy_(0, order, rows * real.view(-1, *[1] * (rows.dim() - 1)).to(rows))


def _to_groups(x: Tensor, group_name: str, layout: str, cu_seqlens) -> Tensor:
    c = resolve_group(group_name).size()
    b, local_len, g = x.shape[:3]
    if g % c:
        raise ValueError(f"{g} head groups do not split over C={c} ranks; pad them to a multiple of C first")
    parts = x.reshape(b, local_len, c, g // c, *x.shape[3:]).permute(2, 1, 0, *range(3, x.dim() + 1))
    received = _all_to_all(parts, group_name, c) if c > 1 else parts  # [C (source), L, B, G/C, W]
    rows = received.reshape(c * local_len, *received.shape[2:])
    return _in_global_order(rows, group_name, layout, cu_seqlens).movedim(0, 1).contiguous()


def _from_groups(y: Tensor, group_name: str, layout: str, cu_seqlens) -> Tensor:
    c = resolve_group(group_name).size()
    b, total, gc = y.shape[:3]
    local_len = total // c
    rank_major = _in_rank_order(y.movedim(1, 0), group_name, layout, cu_seqlens)  # back to every rank's slots
    parts = rank_major.reshape(c, local_len, *rank_major.shape[1:])  # [C (destination), L, B, G/C, W]
    received = _all_to_all(parts, group_name, c) if c > 1 else parts  # [C (source group), L, B, G/C, W]
    return received.permute(2, 1, 0, *range(3, received.dim())).reshape(b, local_len, c * gc, *y.shape[3:]).contiguous()


@torch.library.custom_op("cp::to_head_groups", mutates_args=())
def to_head_groups(x: Tensor, group_name: str, layout: str, cu_seqlens: Optional[Tensor]) -> Tensor:
    """``[B, L, G, ...]`` sequence shard -> ``[B, C*L, G/C, ...]``: global order, padding slots last (zero)."""
    return _to_groups(x, group_name, layout, cu_seqlens)


@torch.library.custom_op("cp::from_head_groups", mutates_args=())
def from_head_groups(y: Tensor, group_name: str, layout: str, cu_seqlens: Optional[Tensor]) -> Tensor:
    """Inverse of ``to_head_groups``: ``[B, C*L, G/C, ...]`` -> ``[B, L, G, ...]`` (padding slots zero)."""
    return _from_groups(y, group_name, layout, cu_seqlens)


@to_head_groups.register_fake
def _(x, group_name, layout, cu_seqlens):
    c = resolve_group(group_name).size()
    return x.new_empty(x.shape[0], x.shape[1] * c, x.shape[2] // c, *x.shape[3:])


@from_head_groups.register_fake
def _(y, group_name, layout, cu_seqlens):
    c = resolve_group(group_name).size()
    return y.new_empty(y.shape[0], y.shape[1] // c, y.shape[2] * c, *y.shape[3:])


def _setup(ctx, inputs, output):
    ctx.settings = inputs[1:]
    ctx.set_materialize_grads(False)


def _to_grad(ctx, grad):
    return None if grad is None else from_head_groups(grad, *ctx.settings), None, None, None


def _from_grad(ctx, grad):
    return None if grad is None else to_head_groups(grad, *ctx.settings), None, None, None


to_head_groups.register_autograd(_to_grad, setup_context=_setup)
from_head_groups.register_autograd(_from_grad, setup_context=_setup)


@torch.library.custom_op("cp::rank_slice", mutates_args=())
def rank_slice(x: Tensor, group_name: str) -> Tensor:
    """This rank's 1/C of dim 0 of a tensor every rank holds whole."""
    group = resolve_group(group_name)
    return x.chunk(group.size())[group.rank()].clone()


@torch.library.custom_op("cp::rank_slice_backward", mutates_args=())
def rank_slice_backward(grad: Tensor, group_name: str) -> Tensor:
    group = resolve_group(group_name)
    out = grad.new_zeros(grad.shape[0] * group.size(), *grad.shape[1:])
    out[grad.shape[0] * group.rank() : grad.shape[0] * (group.rank() + 1)] = grad
    return out


@rank_slice.register_fake
def _(x, group_name):
    return x.new_empty(x.shape[0] // resolve_group(group_name).size(), *x.shape[1:])


@rank_slice_backward.register_fake
def _(grad, group_name):
    return grad.new_empty(grad.shape[0] * resolve_group(group_name).size(), *grad.shape[1:])


def _slice_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


rank_slice.register_autograd(
    lambda ctx, grad: (rank_slice_backward(grad, ctx.group_name), None), setup_context=_slice_setup
)


@torch.library.custom_op("cp::gather_groups", mutates_args=())
def gather_groups(x: Tensor, group_name: str) -> Tensor:
    """Every rank's ``x`` along dim 1 (``[B, G/C, ...]`` -> ``[B, G, ...]``), in rank order."""
    c = resolve_group(group_name).size()
    if c == 1:
        return x.clone()
    return gather_dim0(x.movedim(1, 0), group_name, c).movedim(0, 1).contiguous()


@gather_groups.register_fake
def _(x, group_name):
    return x.new_empty(x.shape[0], x.shape[1] * resolve_group(group_name).size(), *x.shape[2:])


def _gather_grad(ctx, grad):  # each rank's copy of the gathered tensor may carry gradient: their sum
    c = resolve_group(ctx.group_name).size()
    return reduce_scatter_dim0(grad.movedim(1, 0), ctx.group_name, c).movedim(0, 1), None


gather_groups.register_autograd(_gather_grad, setup_context=_slice_setup)


__all__ = ["from_head_groups", "gather_groups", "rank_slice", "to_head_groups"]
