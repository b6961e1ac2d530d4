"""All-gather and reduce-scatter along the sequence, for the schedules that gather K/V, and the order that puts
gathered chunks (a layout's ``gathered_order``) or packed slots (``cp::packed_sequence_order``) in sequence order.

Written over ``_c10d_functional`` collectives + ``wait_tensor``, so a traced
schedule holds the group name and C, never the rank.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..layout.packed import check_cu_seqlens, sequence_permutation

_fc = torch.ops._c10d_functional


def gather_dim0(t: Tensor, group_name: str, world_size: int) -> Tensor:
    """Every rank's ``t`` stacked along dim 0, in rank order."""
    if world_size == 1:
        return t
    return _fc.wait_tensor(_fc.all_gather_into_tensor(t.contiguous(), world_size, group_name))


def reduce_scatter_dim0(t: Tensor, group_name: str, world_size: int) -> Tensor:
    """Sum ``t`` over ranks and keep this rank's slice of dim 0."""
    if world_size == 1:
        return t
    return _fc.wait_tensor(_fc.reduce_scatter_tensor(t.contiguous(), "sum", world_size, group_name))


def permute_chunks(t: Tensor, order: Optional[list[int]], dim: int) -> Tensor:
    """``t`` cut into ``len(order)`` equal chunks along ``dim``, chunk ``order[g]`` put at place g (None: as is)."""
    if order is None:
        return t
    chunks = t.chunk(len(order), dim=dim)
    return torch.cat([chunks[i] for i in order], dim=dim)


def inverse(order: Optional[list[int]]) -> Optional[list[int]]:
    if order is None:
        return None
    inv = [0] * len(order)
    for g, i in enumerate(order):
        inv[i] = g
    return inv


def gather_sequence(t: Tensor, group_name: str, world_size: int, order: Optional[list[int]]) -> Tensor:
    """``[B, H, L, D]`` shards -> ``[B, H, C*L, D]``, the chunks in ``order`` (a layout's ``gathered_order``;
    None: rank order)."""
    gathered = gather_dim0(t.movedim(2, 0), group_name, world_size).movedim(0, 2)
    return permute_chunks(gathered, order, 2)


def scatter_sequence(t: Tensor, group_name: str, world_size: int, order: Optional[list[int]]) -> Tensor:
    """Inverse of ``gather_sequence`` for gradients: sum over ranks, keep this rank's shard."""
    if world_size == 1:
        return t
    # reordered along the sequence as dim 0: the cat is the one full-size copy the collective needs
    in_rank_order = permute_chunks(t.movedim(2, 0), inverse(order), 0)
    return reduce_scatter_dim0(in_rank_order, group_name, world_size).movedim(0, 2)


@functools.lru_cache(maxsize=64)
def _permutation(cu: tuple[int, ...], world_size: int, inverse: bool) -> Tensor:
    perm = sequence_permutation(list(cu), world_size)
    return perm.argsort() if inverse else perm


@torch.library.custom_op("cp::packed_sequence_order", mutates_args=())
def packed_sequence_order(x: Tensor, cu_seqlens: Tensor, world_size: int, inverse: bool) -> Tensor:
    """Every rank's slots (rank order) -> real tokens in global packed order, then padding; ``inverse`` undoes it."""
    perm = _permutation(tuple(check_cu_seqlens(cu_seqlens)), world_size, inverse)
    return x.index_select(0, perm.to(x.device))


@packed_sequence_order.register_fake
def _(x, cu_seqlens, world_size, inverse):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as the op returns it
