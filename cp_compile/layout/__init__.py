"""Load balances: which global tokens each rank holds, one class per balance.

Every layout answers the same questions for a group of C ranks: the global
``positions`` of a rank's tokens, a rank's ``shard`` of a global tensor, and
the global tensor again from every rank's shard (``unshard``). A layout of
equal chunks also says where each chunk lies among the gathered shards
(``gathered_order``), which prefix of the sequence each of a rank's chunks
sees under a causal mask (``visible_prefixes``) and which part of another
rank's keys a rank's queries see (``causal_section``): the attention kinds and
the gathers ask it, and branch on no layout's name.
``ContextParallel`` holds one and asks it; op schemas carry a layout by its
``name``, and ``layout_named`` gives the object back.

``Zigzag``      the sequence is cut into 2C equal chunks and rank r holds chunks r
                and 2C-1-r, concatenated. Under a causal mask every rank then has
                the same amount of visible work at every ring step.
``Contiguous``  C equal chunks, rank r holds chunk r.
``Packed``      per-document zigzag for packed documents (``layout.packed``).
``Balanced``    a BlockMask's blocks dealt by their visible work (``layout.balanced``).
"""

from __future__ import annotations

import torch
from torch import Tensor

# the part of a rank's causal tile against another rank's K/V that has visible keys (``Chunked.causal_section``)
FULL, DIAGONAL, KV_FIRST_HALF, Q_SECOND_HALF, SKIP = "full", "diagonal", "kv_first_half", "q_second_half", "skip"


class Layout:
    """One load balance: where each of a sequence's tokens lives among C ranks."""

    name: str
    # rank 0 holds the sequence's first tokens in order: a shard numbered from 0 looks right there
    starts_on_rank_zero = False
    # equal rows, each a document of the packed layout (per-document zigzag), are this layout's shards of them
    rows_are_packed_documents = False

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

    def chunks_per_rank(self, world_size: int) -> int:
        return self.num_chunks(world_size) // world_size

    def gathered_order(self, world_size: int) -> list[int]:
        """``order[g]``: where global chunk ``g`` lies among every rank's chunks, concatenated in rank order."""
        per_rank = self.chunks_per_rank(world_size)
        order = [0] * self.num_chunks(world_size)
        for rank in range(world_size):
            for j, g in enumerate(self.rank_chunks(rank, world_size)):
                order[g] = rank * per_rank + j
        return order

    def visible_prefixes(self, local_len: int, rank: int, world_size: int) -> list[tuple[slice, int]]:
        """Under a causal mask, each of ``rank``'s chunks: its local rows and how many global keys its last row
        sees (a prefix of the sequence)."""
        size = local_len // self.chunks_per_rank(world_size)
        chunks = self.rank_chunks(rank, world_size)
        return [(slice(j * size, (j + 1) * size), (g + 1) * size) for j, g in enumerate(chunks)]

    def causal_section(self, rank: int, source: int) -> str:
        """Which part of ``rank``'s queries sees which part of another rank's (``source``) keys, causally."""
        raise NotImplementedError


class Zigzag(Chunked):
    name = "zigzag"
    rows_are_packed_documents = True

    def num_chunks(self, world_size: int) -> int:
        return 2 * world_size

    def rank_chunks(self, rank: int, world_size: int) -> list[int]:
        return [rank, 2 * world_size - 1 - rank]

    def causal_section(self, rank: int, source: int) -> str:
        # an earlier rank's first chunk precedes both of ours and its second follows both; a later rank's two
        # chunks lie between ours
        return KV_FIRST_HALF if source < rank else Q_SECOND_HALF


class Contiguous(Chunked):
    name = "contiguous"
    starts_on_rank_zero = True

    def num_chunks(self, world_size: int) -> int:
        return world_size

    def rank_chunks(self, rank: int, world_size: int) -> list[int]:
        return [rank]

    def causal_section(self, rank: int, source: int) -> str:
        return FULL if source < rank else SKIP


_NAMED: dict[str, Chunked] = {layout.name: layout for layout in (Zigzag(), Contiguous())}
LOAD_BALANCERS = tuple(_NAMED)


def layout_named(name: str) -> Chunked:
    """The load balance a plan or an op names (``zigzag`` or ``contiguous``)."""
    if name not in _NAMED:
        raise ValueError(f"unknown load balancer {name!r}; expected one of {LOAD_BALANCERS}")
    return _NAMED[name]
