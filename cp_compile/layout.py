"""Load balancers: which global chunks of the sequence each rank holds.

zigzag      the sequence is cut into 2C equal chunks and rank r holds chunks r
            and 2C-1-r, concatenated. Under a causal mask every rank then has
            the same amount of visible work at every ring step.
contiguous  C equal chunks, rank r holds chunk r.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOAD_BALANCERS = ("zigzag", "contiguous")


def check_layout(layout: str) -> None:
    if layout not in LOAD_BALANCERS:
        raise ValueError(f"unknown load balancer {layout!r}; expected one of {LOAD_BALANCERS}")


def num_chunks(world_size: int, layout: str) -> int:
    check_layout(layout)
    return 2 * world_size if layout == "zigzag" else world_size


def rank_chunks(rank: int, world_size: int, layout: str) -> list[int]:
    """Global chunk indices held by ``rank``, in local order."""
    check_layout(layout)
    return [rank, 2 * world_size - 1 - rank] if layout == "zigzag" else [rank]


def chunk_length(seq_len: int, world_size: int, layout: str) -> int:
    n = num_chunks(world_size, layout)
    if seq_len % n:
        raise ValueError(
            f"sequence length {seq_len} does not split into {n} equal chunks "
            f"({layout} layout over C={world_size} ranks needs a multiple of {n}); pad the sequence"
        )
    return seq_len // n


def shard(x: Tensor, seq_dim: int, rank: int, world_size: int, layout: str) -> Tensor:
    length = chunk_length(x.shape[seq_dim], world_size, layout)
    parts = [x.narrow(seq_dim, c * length, length) for c in rank_chunks(rank, world_size, layout)]
    return torch.cat(parts, dim=seq_dim).contiguous()


def unshard(shards: list[Tensor], seq_dim: int, layout: str) -> Tensor:
    """Reassemble the global tensor from every rank's shard (in rank order)."""
    world_size = len(shards)
    n_local = len(rank_chunks(0, world_size, layout))
    chunks: list = [None] * num_chunks(world_size, layout)
    for rank, local in enumerate(shards):
        for piece, c in zip(local.chunk(n_local, dim=seq_dim), rank_chunks(rank, world_size, layout)):
            chunks[c] = piece
    return torch.cat(chunks, dim=seq_dim)


def positions(seq_len: int, rank: int, world_size: int, layout: str, device=None) -> Tensor:
    return shard(torch.arange(seq_len, device=device), 0, rank, world_size, layout)
