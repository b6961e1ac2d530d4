"""A load balance for one FlexAttention mask: its query blocks dealt to ranks by their visible work."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from . import Layout


@dataclass(frozen=True)
class Balanced(Layout):
    """Rank r holds ``perm[r * S_local:(r + 1) * S_local]`` (global positions, ascending): a BlockMask's
    query blocks dealt by ``balance_blocks``, for that mask's length and C only."""

    perm: Tensor
    world_size: int
    block: int  # tokens per block
    loads: list  # visible blocks per rank
    name = "balanced"

    def all_positions(self, seq_len: int, world_size: int) -> Tensor:
        if seq_len != self.perm.numel() or world_size != self.world_size:
            raise ValueError(
                f"the plan balances a {self.perm.numel()}-token mask over C={self.world_size}; "
                f"got {seq_len} tokens over C={world_size}"
            )
        return self.perm

    def positions(self, seq_len: int, rank: int, world_size: int, device=None) -> Tensor:
        local = seq_len // world_size
        return self.all_positions(seq_len, world_size)[rank * local : (rank + 1) * local].to(device)

    def chunk(self, seq_len: int, world_size: int) -> int:
        return self.block


def balance_blocks(block_mask: BlockMask, world_size: int) -> Balanced:
    """Give every rank the same number of query blocks and about the same number of visible blocks.

    A query block's work is its visible key blocks (full + partial, over batch
    and heads) in the global BlockMask. Heaviest blocks go first, each to the
    least loaded rank with room left. Under a causal document mask this pairs
    the late (heavy) blocks of each document with early (light) ones, as a
    per-document zigzag does, whatever the document lengths.
    """
    bq, bkv = block_mask.BLOCK_SIZE
    q_len = block_mask.seq_lengths[0]
    if bq != bkv or q_len % bq:
        raise ValueError(
            f"block_mask: balancing needs square blocks that tile the sequence; got BLOCK_SIZE={block_mask.BLOCK_SIZE} "
            f"for {q_len} tokens"
        )
    n_blocks = q_len // bq
    if n_blocks % world_size:
        raise ValueError(
            f"block_mask: {n_blocks} query blocks of {bq} tokens do not split evenly over C={world_size} ranks; "
            "choose a BLOCK_SIZE so that the block count divides by C"
        )
    work = block_mask.kv_num_blocks.sum((0, 1))
    if block_mask.full_kv_num_blocks is not None:
        work = work + block_mask.full_kv_num_blocks.sum((0, 1))
    work = work.tolist()
    per_rank = n_blocks // world_size
    loads, owned = [0] * world_size, [[] for _ in range(world_size)]
    for block in sorted(range(n_blocks), key=lambda i: (-work[i], i)):
        rank = min((r for r in range(world_size) if len(owned[r]) < per_rank), key=lambda r: (loads[r], r))
        owned[rank].append(block)
        loads[rank] += work[block]
    starts = torch.tensor([b for blocks in owned for b in sorted(blocks)]) * bq
    perm = (starts.view(-1, 1) + torch.arange(bq)).flatten()
    return Balanced(perm, world_size, bq, loads)
