"""Load balances: which global tokens each rank holds, one class per balance.

Every layout answers the same questions for a group of C ranks: the global
``positions`` of a rank's tokens, a rank's ``shard`` of a global tensor, and
the global tensor again from every rank's shard (``unshard``).
``ContextParallel`` holds one and asks it; op schemas carry a layout by its
``name``, and ``layout_named`` gives the object back.

``Zigzag``      the sequence is cut into 2C equal chunks and rank r holds chunks r
                and 2C-1-r, concatenated. Under a causal mask every rank then has
                the same amount of visible work at every ring step.
``Contiguous``  C equal chunks, rank r holds chunk r.
``Packed``      per-document zigzag for packed documents (``layout.packed``).
``Balanced``    a BlockMask's blocks dealt by their visible work (``layout.blockmask``).
"""

from __future__ import annotations

import torch
from torch import Tensor


class Layout:
    """One load balance: where each of a sequence's tokens lives among C ranks."""

    name: str

    def positions(self, seq_len: int, rank: int, world_size: int, device=None) -> Tensor:
        """Global positions (LongTensor) of ``rank``'s tokens of a ``seq_len``-token sequence, in local order."""
        raise NotImplementedError

    def chunk(self, seq_len: int, world_size: int) -> int:
        """Tokens per run of consecutive global positions that a rank holds: the granularity of skipped work."""
        raise NotImplementedError

    def all_positions(self, seq_len: int, world_size: int) -> Tensor:
        """Global positions of every rank's tokens, in rank order then local order."""
        return torch.cat([self.positions(seq_len, r, world_size) for r in range(world_size)])

    def shard(self, x: Tensor, seq_dim: int, rank: int, world_size: int) -> Tensor:
        index = self.positions(x.shape[seq_dim], rank, world_size, x.device)
        return x.index_select(seq_dim, index).contiguous()

    def unshard(self, shards: list[Tensor], seq_dim: int) -> Tensor:
        """The global tensor from every rank's shard (in rank order)."""
        gathered = torch.cat(shards, dim=seq_dim)
        perm = self.all_positions(gathered.shape[seq_dim], len(shards)).to(gathered.device)
        return torch.empty_like(gathered).index_copy_(seq_dim, perm, gathered)


class Chunked(Layout):
    """The sequence cut into equal chunks, each rank holding the chunks ``rank_chunks`` names."""

    def num_chunks(self, world_size: int) -> int:
        raise NotImplementedError

    def rank_chunks(self, rank: int, world_size: int) -> list[int]:
        """Global chunk indices held by ``rank``, in local order."""
        raise NotImplementedError

    def chunk(self, seq_len: int, world_size: int) -> int:
        n = self.num_chunks(world_size)
        if seq_len % n:
            raise ValueError(
                f"sequence length {seq_len} does not split into {n} equal chunks "
                f"({self.name} layout over C={world_size} ranks needs a multiple of {n}); pad the sequence"
            )
        return seq_len // n

    def positions(self, seq_len: int, rank: int, world_size: int, device=None) -> Tensor:
        length = self.chunk(seq_len, world_size)
        starts = torch.tensor(self.rank_chunks(rank, world_size), device=device) * length
        return (starts.view(-1, 1) + torch.arange(length, device=device)).flatten()


class Zigzag(Chunked):
    name = "zigzag"

    def num_chunks(self, world_size: int) -> int:
        return 2 * world_size

    def rank_chunks(self, rank: int, world_size: int) -> list[int]:
        return [rank, 2 * world_size - 1 - rank]


class Contiguous(Chunked):
    name = "contiguous"

    def num_chunks(self, world_size: int) -> int:
        return world_size

    def rank_chunks(self, rank: int, world_size: int) -> list[int]:
        return [rank]


_NAMED: dict[str, Chunked] = {layout.name: layout for layout in (Zigzag(), Contiguous())}
LOAD_BALANCERS = tuple(_NAMED)


def layout_named(name: str) -> Chunked:
    """The load balance a plan or an op names (``zigzag`` or ``contiguous``)."""
    if name not in _NAMED:
        raise ValueError(f"unknown load balancer {name!r}; expected one of {LOAD_BALANCERS}")
    return _NAMED[name]
