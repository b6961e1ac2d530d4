"""Any token mixer over the whole sequence: the route for a module with mixing code of its own.

``gather_sequence`` all-gathers this rank's shard into the whole sequence in global order, the same tensor on
every rank; the mixer runs on it as one process runs it; ``rank_rows`` keeps this rank's rows of its output.
The gather's backward is a reduce-scatter: each rank's backward through the mixer gives the gradient that its
own rows send to every token, and the sum over the ranks is the one-process gradient. Exact for any mixer,
at C times its compute and activation memory, receiving (C-1)/C of the sequence per call (and sending as
much back in the backward).

``cp::gather_sequence``: ``[B, L, ...]`` (this rank's L slots) -> ``[B, C*L, ...]``, the real tokens in global
order first and the padding slots (packed documents) after them, zeroed; ``gather_sequence`` cuts the
padding off, so a mixer sees no token that one process would not. The reorder is the same on every rank and
``rank_rows`` picks the rank's rows with ``cp::rank_slice``, so a compiled graph never holds the rank.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..comm.gather import gather_dim0, reduce_scatter_dim0
from ..comm.groups import resolve_group
from . import Sharding
from .heads import _in_global_order, _in_rank_order, _setup, rank_slice


@torch.library.custom_op("cp::gather_sequence", mutates_args=())
def gather_sequence_op(x: Tensor, group_name: str, layout: str, cu_seqlens: Optional[Tensor]) -> Tensor:
    """``[B, L, ...]`` shard -> ``[B, C*L, ...]`` on every rank: global order, padding slots last (zero)."""
    rows = gather_dim0(x.movedim(1, 0), group_name, resolve_group(group_name).size())  # [C*L, B, ...] rank-major
    return _in_global_order(rows, group_name, layout, cu_seqlens).movedim(0, 1).contiguous()


@torch.library.custom_op("cp::gather_sequence_backward", mutates_args=())
def gather_sequence_backward(grad: Tensor, group_name: str, layout: str, cu_seqlens: Optional[Tensor]) -> Tensor:
    """Every rank's gradient of the gathered sequence, summed, for this rank's slots."""
    rank_major = _in_rank_order(grad.movedim(1, 0), group_name, layout, cu_seqlens)
    return reduce_scatter_dim0(rank_major, group_name, resolve_group(group_name).size()).movedim(0, 1).contiguous()


@gather_sequence_op.register_fake
def _(x, group_name, layout, cu_seqlens):
    return x.new_empty(x.shape[0], x.shape[1] * resolve_group(group_name).size(), *x.shape[2:])


@gather_sequence_backward.register_fake
def _(grad, group_name, layout, cu_seqlens):
    return grad.new_empty(grad.shape[0], grad.shape[1] // resolve_group(group_name).size(), *grad.shape[2:])


gather_sequence_op.register_autograd(
    lambda ctx, grad: (None if grad is None else gather_sequence_backward(grad, *ctx.settings), None, None, None),
    setup_context=_setup,
)


@torch.library.custom_op("cp::to_rank_major", mutates_args=())
def to_rank_major(rows: Tensor, group_name: str, layout: str, cu_seqlens: Optional[Tensor]) -> Tensor:
    """``[C*L, ...]`` slots in global order (the real tokens first, the padding slots after them) -> every rank's
    slots in rank order: a permutation, the same on every rank."""
    return _in_rank_order(rows, group_name, layout, cu_seqlens)


@torch.library.custom_op("cp::from_rank_major", mutates_args=())
def from_rank_major(rows: Tensor, group_name: str, layout: str, cu_seqlens: Optional[Tensor]) -> Tensor:
    """The inverse of ``to_rank_major``, its padding slots zeroed: its backward."""
    return _in_global_order(rows, group_name, layout, cu_seqlens)


for _op in (to_rank_major, from_rank_major):
    _op.register_fake(lambda rows, group_name, layout, cu_seqlens: torch.empty_like(rows))
to_rank_major.register_autograd(
    lambda ctx, grad: (None if grad is None else from_rank_major(grad, *ctx.settings), None, None, None),
    setup_context=_setup,
)


def _real(local_len: int, sharding: Sharding) -> int:
    """How many of the whole sequence's ``C * local_len`` slots hold tokens (the padding slots of packed documents
    come after them)."""
    if sharding.cu_seqlens is None:
        return local_len * sharding.world_size
    return int(sharding.cu_seqlens[-1])


def gather_sequence(x: Tensor, dim: int, sharding: Sharding, padding_last: bool = False) -> Tensor:
    """The whole sequence in global order, padding dropped, from this rank's shard ``x`` (tokens along ``dim``),
    the same on every rank; differentiable (the gradient of every rank's copy comes back to the row's rank).
    ``padding_last``: the padding slots of packed documents kept after the tokens, zeroed, so that the length does
    not depend on the documents (a compiled graph's shapes); exact for a mixer in which no token sees a later one."""
    sharding.agree("gather_sequence", (x, x, x), f"dim={dim}")
    ordered = gather_sequence_op(x.movedim(dim, 1), *sharding.op_args)
    if not padding_last:
        ordered = ordered.narrow(1, 0, _real(x.shape[dim], sharding))
    return ordered.movedim(1, dim)


def rank_rows(full: Tensor, dim: int, local_len: int, sharding: Sharding) -> Tensor:
    """This rank's ``local_len`` rows (zeros in its padding slots) of ``full``, a whole sequence along ``dim`` that
    every rank holds the same (with or without the padding slots after it)."""
    rows = full.movedim(dim, 0)
    padded = torch.cat([rows, rows.new_zeros(sharding.world_size * local_len - rows.shape[0], *rows.shape[1:])])
    # back to every rank's slots in rank order (the padding slots take the zeros after the real rows)
    rank_major = to_rank_major(padded, *sharding.op_args)
    return rank_slice(rank_major, sharding.group_name).movedim(0, dim)


__all__ = [
    "from_rank_major",
    "gather_sequence",
    "gather_sequence_backward",
    "gather_sequence_op",
    "rank_rows",
    "to_rank_major",
]
