"""Sequence sharding <-> head sharding with one all-to-all (the Ulysses exchange).

``seq_to_heads`` takes this rank's ``[B, H, S_local, ...]`` shard and returns
``[B, H/C, S_local*C, ...]``: all of the group's tokens for this rank's H/C
heads, in the group's global sequence order. ``heads_to_seq`` is its inverse.
Both are written over ``_c10d_functional.all_to_all_single`` + ``wait_tensor``
with equal splits, so a traced exchange holds the group name and C, never the
rank: which head group a rank keeps is implied by the all-to-all itself.

Order after the exchange. Source rank i contributes its local chunks in
layout order. zigzag: rank i holds chunks i and 2C-1-i, so the group's
sequence is the first halves in rank order followed by the second halves in
reverse rank order. contiguous: rank order is sequence order. The reorder is
slicing and ``cat`` only (no index tensors), so it traces into any graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import layout_named


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


def _local_pieces(layout: str, world_size: int) -> int:
    return len(layout_named(layout).rank_chunks(0, world_size)) if world_size > 1 else 1


def seq_to_heads(x: Tensor, group_name: str, world_size: int, layout: str) -> Tensor:
    """[B, H, S_local, ...] sequence shard -> [B, H/C, S, ...] head shard, sequence order."""
    c = world_size
    if c == 1:
        return x
    b, h = x.shape[0], x.shape[1]
    # dim 0 = destination rank = head group
    parts = x.reshape(b, c, h // c, *x.shape[2:]).transpose(0, 1)
    received = _exchange(parts, group_name, c)  # dim 0 = source rank
    pieces = _local_pieces(layout, c)
    per_rank = [received[i].chunk(pieces, dim=2) for i in range(c)]
    ordered = [p[0] for p in per_rank]
    if pieces == 2:
        ordered += [p[1] for p in reversed(per_rank)]
    return torch.cat(ordered, dim=2)


def heads_to_seq(y: Tensor, group_name: str, world_size: int, layout: str) -> Tensor:
    """Inverse of ``seq_to_heads``: [B, H/C, S, ...] -> [B, H, S_local, ...]."""
    c = world_size
    if c == 1:
        return y
    pieces = _local_pieces(layout, c)
    chunks = y.chunk(c * pieces, dim=2)
    if pieces == 2:
        per_rank = [torch.cat([chunks[i], chunks[2 * c - 1 - i]], dim=2) for i in range(c)]
    else:
        per_rank = list(chunks)
    received = _exchange(torch.stack(per_rank), group_name, c)  # dim 0 = source head group
    b, hc = y.shape[0], y.shape[1]
    return received.transpose(0, 1).reshape(b, hc * c, *received.shape[3:])


def replicate_kv_heads(kv_heads: int, q_heads: int, world_size: int) -> int:
    """How many copies of each K/V head make them split over C (1: none needed).

    ``lcm(Hkv, C)`` heads split over C and still divide Hq, because Hq is a
    multiple of both Hkv and C.
    """
    import math

    return math.lcm(kv_heads, world_size) // kv_heads if q_heads % world_size == 0 else 1
