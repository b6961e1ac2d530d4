"""The chunks of a layout: which consecutive global positions each rank holds, where, and in which order.

A token mixer that is not attention reads neighbours in sequence order: a causal convolution the k-1
tokens before each token, a linear recurrence every earlier token through its state. Both ask the same
questions of a layout, answered here for every rank at once (the answers are the same on every rank,
so a rank can work out what its peers hold and send without asking them):

- ``chunks``: per rank, its slots cut into chunks of consecutive global positions (zigzag: two,
  contiguous: one, packed documents: two per document, the real tokens of each a prefix of its slots);
- ``sequence_order``: the rows of every rank's slots, concatenated in rank order, that put the real
  tokens in global sequence order, padding slots last.

A layout is named as the ops name it (``"zigzag"``, ``"contiguous"``) or, for packed documents, given by
its global ``cu_seqlens`` (which decide alone: the per-document layout, whatever the name beside them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import layout_named
from .packed import check_cu_seqlens, packed_local_len, sequence_permutation


class Chunk(NamedTuple):
    """Slots ``slot .. slot + slots - 1`` of a rank; the first ``real`` of them hold global positions
    ``start .. start + real - 1`` of document ``doc``, the rest are padding."""

    slot: int
    slots: int
    real: int
    start: int
    doc: int


def _key(cu_seqlens) -> Optional[tuple[int, ...]]:
    return None if cu_seqlens is None else tuple(check_cu_seqlens(cu_seqlens))


@functools.lru_cache(maxsize=256)
def _chunks(layout: str, local_len: int, world_size: int, cu: Optional[tuple[int, ...]]):
    if cu is None:
        named = layout_named(layout)
        pieces = named.chunks_per_rank(world_size)
        if local_len % pieces:
            raise ValueError(f"{local_len} local tokens do not split into the {layout} layout's {pieces} chunks")
        size = local_len // pieces
        return tuple(
            tuple(Chunk(i * size, size, size, g * size, 0) for i, g in enumerate(named.rank_chunks(r, world_size)))
            for r in range(world_size)
        )
    if packed_local_len(cu, world_size) != local_len:
        raise ValueError(
            f"cu_seqlens {list(cu)} gives {packed_local_len(cu, world_size)} slots per rank over C={world_size}, "
            f"but the tensor holds {local_len}: it is not a shard of these documents"
        )
    two_c = 2 * world_size
    per_rank = []
    for rank in range(world_size):
        chunks, slot = [], 0
        for doc, (a, b) in enumerate(zip(cu, cu[1:])):
            size = (b - a + two_c - 1) // two_c
            for g in (rank, two_c - 1 - rank):
                real = max(0, min(size, b - a - g * size))
                chunks.append(Chunk(slot, size, real, a + g * size, doc))
                slot += size
        per_rank.append(tuple(chunks))
    return tuple(per_rank)


def chunks(layout: str, local_len: int, world_size: int, cu_seqlens=None) -> tuple[tuple[Chunk, ...], ...]:
    """Per rank, its chunks in local order; every rank has as many (padding-only or empty ones included)."""
    return _chunks(layout, local_len, world_size, _key(cu_seqlens))


def chunk_count(layout: str, world_size: int, cu_seqlens=None) -> int:
    """Chunks per rank, from the layout and the number of documents alone (what a fake op can know)."""
    if cu_seqlens is not None:
        return 2 * (len(cu_seqlens) - 1)
    return len(layout_named(layout).rank_chunks(0, world_size))


@functools.lru_cache(maxsize=256)
def _sequence_order(layout: str, local_len: int, world_size: int, cu: Optional[tuple[int, ...]]):
    if cu is not None:
        order = sequence_permutation(cu, world_size)
        return order, cu[-1]
    total = local_len * world_size
    return layout_named(layout).all_positions(total, world_size).argsort(), total


def sequence_order(layout: str, local_len: int, world_size: int, cu_seqlens=None) -> tuple[Tensor, int]:
    """(order, real): ``rank_major[order]`` holds the real tokens in global order in its first ``real`` rows
    and the padding slots after them."""
    return _sequence_order(layout, local_len, world_size, _key(cu_seqlens))


def real_slots(layout: str, local_len: int, world_size: int, cu_seqlens=None) -> Tensor:
    """Per rank and slot, whether the slot holds a token (``[C, L]`` bool)."""
    mask = torch.zeros(world_size, local_len, dtype=torch.bool)
    for rank, rank_chunks in enumerate(chunks(layout, local_len, world_size, cu_seqlens)):
        for c in rank_chunks:
            mask[rank, c.slot : c.slot + c.real] = True
    return mask


__all__ = ["Chunk", "chunk_count", "chunks", "real_slots", "sequence_order"]
