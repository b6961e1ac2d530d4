"""Packed documents (THD with cu_seqlens): per-document zigzag, and the runs of tokens it leaves.

Every document of length n is split on its own into 2C chunks of
ceil(n / 2C) slots (the tail of the last chunks is padding) and rank r holds
chunks r and 2C-1-r of every document, document after document. Every rank
then holds the same number of slots, and causal work is balanced within
each document. Lengths are computed exactly from cu_seqlens; a document
shorter than 2C leaves some ranks only padding, a zero-length one nothing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from . import Layout


def check_cu_seqlens(cu_seqlens, total: int | None = None) -> list[int]:
    """cu_seqlens as a list of ints, validated (starts at 0, never decreases, ends at ``total``)."""
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease; got {cu}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the packed sequence has {total} tokens")
    return cu


def packed_slots(cu_seqlens, rank: int, world_size: int) -> dict[str, Tensor]:
    """Per local slot of ``rank``: document id, position in the document, whether it
    is a real token, and its index in the packed global sequence (-1 for padding)."""
    cu = torch.tensor(check_cu_seqlens(cu_seqlens), dtype=torch.int64)
    n = cu[1:] - cu[:-1]
    two_c = 2 * world_size
    chunk = (n + two_c - 1) // two_c  # exact ceil in integers: lengths need not divide by 2C
    doc = torch.repeat_interleave(torch.arange(len(n)), 2 * chunk)
    first_slot = torch.cumsum(2 * chunk, 0) - 2 * chunk
    s = torch.arange(doc.numel()) - first_slot[doc]
    c = chunk[doc]
    second = s >= c
    global_chunk = torch.where(second, two_c - 1 - rank, rank)
    pos = global_chunk * c + s - torch.where(second, c, 0)
    real = pos < n[doc]
    index = torch.where(real, cu[:-1][doc] + pos, -1)
    return {"doc": doc, "pos": pos, "real": real, "index": index}


def packed_local_len(cu_seqlens, world_size: int) -> int:
    cu = check_cu_seqlens(cu_seqlens)
    two_c = 2 * world_size
    return sum(2 * ((b - a + two_c - 1) // two_c) for a, b in zip(cu, cu[1:]))


def shard_packed(x: Tensor, seq_dim: int, cu_seqlens, rank: int, world_size: int) -> Tensor:
    """This rank's slots of packed ``x``; padding slots are zero."""
    cu = check_cu_seqlens(cu_seqlens, x.shape[seq_dim])
    slots = packed_slots(cu, rank, world_size)
    index = slots["index"].clamp(min=0).to(x.device)
    local = x.index_select(seq_dim, index)
    shape = [1] * x.dim()
    shape[seq_dim] = -1
    return local.masked_fill(~slots["real"].to(x.device).view(shape), 0)  # zero, whatever the row held (NaN)


def unshard_packed(shards: list[Tensor], seq_dim: int, cu_seqlens) -> Tensor:
    """The packed global tensor, without padding, from every rank's slots (in rank order)."""
    cu = check_cu_seqlens(cu_seqlens)
    world_size = len(shards)
    shape = list(shards[0].shape)
    shape[seq_dim] = cu[-1]
    out = shards[0].new_zeros(shape)
    for rank, local in enumerate(shards):
        slots = packed_slots(cu, rank, world_size)
        keep = slots["real"].nonzero().flatten().to(local.device)
        out.index_copy_(seq_dim, slots["index"][slots["real"]].to(local.device), local.index_select(seq_dim, keep))
    return out


class Segment(NamedTuple):
    """A run of real tokens contiguous both in storage and inside one document."""

    row: int  # storage row of the run's first token
    doc: int
    pos: int  # position in the document of that token
    length: int


@functools.lru_cache(maxsize=256)
def _packed_segments(cu: tuple[int, ...], ranks: tuple[int, ...], world_size: int) -> tuple[Segment, ...]:
    two_c = 2 * world_size
    runs: list[Segment] = []
    row = 0
    for rank in ranks:
        for doc, (start, stop) in enumerate(zip(cu, cu[1:])):
            n = stop - start
            chunk = (n + two_c - 1) // two_c
            for c in (rank, two_c - 1 - rank):
                real = max(0, min(chunk, n - c * chunk))
                if real:
                    last = runs[-1] if runs else None
                    if (
                        last
                        and last.doc == doc
                        and last.row + last.length == row
                        and last.pos + last.length == c * chunk
                    ):
                        runs[-1] = last._replace(length=last.length + real)
                    else:
                        runs.append(Segment(row, doc, c * chunk, real))
                row += chunk
    return tuple(runs)


def packed_segments(cu_seqlens, ranks, world_size: int) -> tuple[Segment, ...]:
    """The real tokens of the slots of ``ranks`` concatenated in that order, as runs.

    A rank's real tokens of one document are always one prefix of its slots
    for that document (chunk r ends in padding only when chunk 2C-1-r is all
    padding), so a document gives at most two runs per rank, and one when its
    two chunks are adjacent in the document (C = 1).
    """
    return _packed_segments(tuple(check_cu_seqlens(cu_seqlens)), tuple(ranks), world_size)


def sequence_segments(cu_seqlens) -> tuple[Segment, ...]:
    """One run per non-empty document of a tensor in global packed order."""
    cu = check_cu_seqlens(cu_seqlens)
    return tuple(Segment(a, d, 0, b - a) for d, (a, b) in enumerate(zip(cu, cu[1:])) if b > a)


def sequence_permutation(cu_seqlens, world_size: int) -> Tensor:
    """Rows of the rank-order concatenation of every rank's slots, real tokens in global
    packed order first, then the padding slots: ``all_slots[perm]`` puts document d's
    tokens at rows ``cu[d]:cu[d+1]``."""
    cu = check_cu_seqlens(cu_seqlens)
    real, padding = [], []
    row = 0
    for rank in range(world_size):
        slots = packed_slots(cu, rank, world_size)
        rows = torch.arange(row, row + slots["real"].numel())
        real.append(torch.stack([slots["index"][slots["real"]], rows[slots["real"]]]))
        padding.append(rows[~slots["real"]])
        row += slots["real"].numel()
    index, rows = torch.cat(real, 1)
    return torch.cat([rows[index.argsort()], *padding])


class Packed(Layout):
    """Per-document zigzag over the documents ``cu_seqlens`` (global offsets) names; padding slots are zero.

    ``positions`` are each slot's position inside its document (padding slots continue their document)."""

    name = "packed"

    def __init__(self, cu_seqlens):
        self.cu_seqlens = check_cu_seqlens(cu_seqlens)

    def positions(self, seq_len: int, rank: int, world_size: int, device=None) -> Tensor:
        return packed_slots(self.cu_seqlens, rank, world_size)["pos"].to(device)

    def shard(self, x: Tensor, seq_dim: int, rank: int, world_size: int) -> Tensor:
        return shard_packed(x, seq_dim, self.cu_seqlens, rank, world_size)

    def unshard(self, shards: list[Tensor], seq_dim: int) -> Tensor:
        return unshard_packed(shards, seq_dim, self.cu_seqlens)
