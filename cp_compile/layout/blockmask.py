"""Sharding a global FlexAttention BlockMask for one rank, and the facts every rank shares about it.

``shard_block_mask`` returns an ordinary ``BlockMask`` for this rank's local
q/k (so ``flex_attention`` accepts it inside the model) whose ``mask_mod`` is
the global one read through an index table:

    table = [MAGIC, chunk, digest, positions of my tokens (S_local), positions of every rank's tokens (S)]
    local_mod(b, h, i, j) = global_mod(b, h, table[3 + i], table[3 + j])

Local indices ``i < S_local`` thus mean this rank's tokens, exactly as the
local BlockMask says, and the CP ops evaluate the global mask at any global
pair by passing ``S_local + t`` (t indexes the all-ranks region). The table is
an ordinary tensor: the traced graph holds no rank, and everything CP reads
from it beyond the first ``S_local`` entries is the same on every rank. The
digest is of the global mask's blocks: with the rest of the rank-agnostic
part, what the ranks compare before a call (``kinds.flex``), so that a rank
holding another mask, or one for another length, raises on every rank.

The shard also records, from the global BlockMask's block counts (identical on
every rank), how much of each (rank, K/V source) tile lies in visible blocks:
what the cost model (``cost.masked``) chooses a schedule from.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from ..torch_compat import OpaqueBase
from . import Layout

MAGIC = 0x43504D4B  # marks a table made here ("CPMK")
HEADER = 3


def _block_digest(block_mask: BlockMask) -> int:
    """A digest of the global mask's block tables and lengths: the same on every rank for the same mask."""
    parts = [repr((block_mask.seq_lengths, block_mask.BLOCK_SIZE)).encode()]
    tables = (
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
    )
    for t in tables:
        parts.append(b"-" if t is None else t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return zlib.crc32(b"|".join(parts))


@dataclass(frozen=True, eq=False)
class Mods(OpaqueBase):
    """A FlexAttention call's mask_mod and score_mod, which the ops take as an argument of their own (an
    opaque object: eager calls pass the user's callables, a compiled graph holds its traced mods as a
    constant), the tensors they read travelling as the call's ``extra``."""

    mask: Optional[Callable]  # (b, h, i, j, *mask_buffers) -> bool; None: every pair visible
    score: Optional[Callable]  # (score, b, h, q_pos, kv_pos, *score_buffers) -> score
    n_mask_buffers: int  # buffers[:n] belong to the mask (the index table first), the rest to the score


@dataclass(frozen=True)
class ShardInfo:
    """What a sharded BlockMask carries besides the local mask (on its mask_mod)."""

    table: Tensor
    world_size: int
    chunk: int  # tokens per layout chunk: the granularity of skipped work
    # tiles[r][j]: fraction of (query of rank r, key of rank j) pairs in visible blocks (global block counts)
    tiles: tuple
    # the local mask as a call's mods, made here outside any compiled region: Dynamo takes an opaque object
    # it finds as a graph input, but cannot make one
    mods: Mods


def rank_tiles(block_mask: BlockMask, perm: Tensor, world_size: int) -> tuple[tuple[float, ...], ...]:
    """tiles[r][j]: fraction of the scores between rank r's queries and rank j's keys that lie in visible
    blocks (full or partial), over batch and heads. Counted in integers: the same numbers on every rank."""
    dense = block_mask.to_dense().to(device="cpu", dtype=torch.int64)  # [B, H, q blocks, kv blocks]
    b, h, n_q, n_kv = dense.shape
    bq, bkv = block_mask.BLOCK_SIZE
    perm = perm.to("cpu")
    local = perm.numel() // world_size
    mine = [perm[r * local : (r + 1) * local] for r in range(world_size)]
    q_blocks = torch.stack([torch.bincount(p // bq, minlength=n_q) for p in mine])  # tokens per block and rank
    kv_blocks = torch.stack([torch.bincount(p // bkv, minlength=n_kv) for p in mine])
    pairs = q_blocks @ dense.sum((0, 1)) @ kv_blocks.t()
    whole = b * h * local * local
    return tuple(tuple(int(pairs[r, j]) / whole for j in range(world_size)) for r in range(world_size))


def shard_block_mask(block_mask: BlockMask, rank: int, world_size: int, perm: Tensor, chunk: int) -> BlockMask:
    """This rank's BlockMask for a global ``block_mask`` under the layout given by ``perm``."""
    q_len, kv_len = block_mask.seq_lengths
    if q_len != kv_len:
        raise ValueError(f"block_mask: CP shards self-attention, but the mask is {q_len} queries x {kv_len} keys")
    if perm.numel() != q_len:
        raise ValueError(f"block_mask covers {q_len} tokens but the layout covers {perm.numel()}")
    if getattr(block_mask.mask_mod, "cp_shard", None) is not None:
        raise ValueError("block_mask is already sharded; pass the global BlockMask to plan.shard")
    local = q_len // world_size
    device = block_mask.kv_num_blocks.device
    perm = perm.to(device=device, dtype=torch.int64)
    header = torch.tensor([MAGIC, chunk, _block_digest(block_mask)], dtype=torch.int64, device=device)
    table = torch.cat([header, perm[rank * local : (rank + 1) * local], perm])
    global_mod = block_mask.mask_mod

    def local_mod(b, h, q_idx, kv_idx):
        return global_mod(b, h, table[HEADER + q_idx], table[HEADER + kv_idx])

    batch, heads = block_mask.kv_num_blocks.shape[:2]
    sharded = create_block_mask(local_mod, batch, heads, local, local, device=device, BLOCK_SIZE=block_mask.BLOCK_SIZE)
    mods = Mods(lambda b, h, i, j, *table: local_mod(b, h, i, j), None, 1)  # the table is local_mod's closure's
    local_mod.cp_shard = ShardInfo(table, world_size, chunk, rank_tiles(block_mask, perm, world_size), mods)
    return sharded


def shard_info(block_mask) -> ShardInfo | None:
    return None if block_mask is None else getattr(block_mask.mask_mod, "cp_shard", None)


# ----------------------------------------------------------------------------
# Load balance for a given mask: deal its query blocks to ranks by visible work.
# ----------------------------------------------------------------------------


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
