"""Sequence sharding <-> head sharding with one all-to-all (the Ulysses exchange).

``seq_to_heads`` takes this rank's ``[B, H, S_local, ...]`` shard and returns
``[B, H/C, S_local*C, ...]``: all of the group's tokens for this rank's H/C
heads, in the group's global sequence order. ``heads_to_seq`` is its inverse.
Both are written over ``_c10d_functional.all_to_all_single`` + ``wait_tensor``
with equal splits, so a traced exchange holds the group name and C, never the
rank: which head group a rank keeps is implied by the all-to-all itself.

Order after the exchange: source rank i contributes its local chunks in
layout order, and the layout's ``gathered_order`` puts them in sequence order
(no order: rank order is the order kept). The reorder is slicing and ``cat``
only (no index tensors), so it traces into any graph.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .gather import inverse, permute_chunks


def check_heads(heads: int, world_size: int, what: str) -> None:
    if heads % world_size:
        raise ValueError(
            f"{what} has {heads} heads, which do not split over C={world_size} ranks: the all-to-all "
            "schedules (ulysses, hybrid) shard heads, so heads must divide by C (query heads) "
            "or are replicated up to a multiple of C (key/value heads); use schedule='ring' or 'auto'"
        )


def _exchange(x: Tensor, group_name: str, world_size: int) -> Tensor:
    """all_to_all over dim 0 (one equal slice per rank), completed."""
    splits = [x.shape[0] // world_size] * world_size
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), splits, splits, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def seq_to_heads(x: Tensor, group_name: str, world_size: int, order: Optional[list[int]]) -> Tensor:
    """[B, H, S_local, ...] sequence shard -> [B, H/C, S, ...] head shard, the chunks in ``order`` (a layout's
    ``gathered_order``; None: rank order)."""
    c = world_size
    if c == 1:
        return x
    b, h = x.shape[0], x.shape[1]
    # dim 0 = destination rank = head group
    parts = x.reshape(b, c, h // c, *x.shape[2:]).transpose(0, 1)
    received = _exchange(parts, group_name, c)  # dim 0 = source rank
    pieces = 1 if order is None else len(order) // c
    chunks = [piece for part in received for piece in part.chunk(pieces, dim=2)]
    return torch.cat(chunks if order is None else [chunks[i] for i in order], dim=2)


def heads_to_seq(y: Tensor, group_name: str, world_size: int, order: Optional[list[int]]) -> Tensor:
    """Inverse of ``seq_to_heads``: [B, H/C, S, ...] -> [B, H, S_local, ...]."""
    c = world_size
    if c == 1:
        return y
    per_rank = permute_chunks(y, inverse(order), 2).unflatten(2, (c, -1)).movedim(2, 0)
    received = _exchange(per_rank, group_name, c)  # dim 0 = source head group
    b, hc = y.shape[0], y.shape[1]
    return received.transpose(0, 1).reshape(b, hc * c, *received.shape[3:])


def replicate_kv_heads(kv_heads: int, q_heads: int, world_size: int) -> int:
    """How many copies of each K/V head make them split over C (1: none needed).

    ``lcm(Hkv, C)`` heads split over C and still divide Hq, because Hq is a
    multiple of both Hkv and C.
    """
    import math

    return math.lcm(kv_heads, world_size) // kv_heads if q_heads % world_size == 0 else 1
