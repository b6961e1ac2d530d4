"""Sharding a global FlexAttention BlockMask for one rank, and the facts every rank shares about it.

``shard_block_mask`` returns an ordinary ``BlockMask`` for this rank's local
q/k (so ``flex_attention`` accepts it inside the model) whose ``mask_mod`` is a
``ShardedMaskMod``: the global mask_mod read through an index table,

    table = [MAGIC, chunk, digest, positions of my tokens (S_local), positions of every rank's tokens (S),
             scores per tile, visible scores of each (rank, K/V source) tile (C x C)]
    mask_mod(b, h, i, j) = global_mod(b, h, table[3 + i], table[3 + j])

Local indices ``i < S_local`` thus mean this rank's tokens, exactly as the
local BlockMask says, and the CP ops evaluate the global mask at any global
pair by passing ``S_local + t`` (t indexes the all-ranks region). The table is
an ordinary tensor: the traced graph holds no rank, and everything CP reads
from it beyond the first ``S_local`` entries is the same on every rank. The
digest is of the global mask's blocks: with the rest of the rank-agnostic
part, what the ranks compare before a call (``kinds.flex``), so that a rank
holding another mask, or one for another length, raises on every rank.

The tile counts, from the global BlockMask's block counts (identical on every
rank), are what the cost model (``cost.masked``) chooses a schedule from: the
table travels with the mask into every call, so an eager call and a compiled
one (which reads the table's value in the call being compiled) cost the mask
they are given.
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


def tile_counts(block_mask: BlockMask, perm: Tensor, world_size: int) -> Tensor:
    """[scores per tile, then for each rank r and K/V source j (row-major) the scores between r's queries and j's
    keys in visible blocks (full or partial)], over batch and heads: integers, the same on every rank."""
    dense = block_mask.to_dense().to(device="cpu", dtype=torch.int64)  # [B, H, q blocks, kv blocks]
    b, h, n_q, n_kv = dense.shape
    bq, bkv = block_mask.BLOCK_SIZE
    perm = perm.to("cpu")
    local = perm.numel() // world_size
    mine = [perm[r * local : (r + 1) * local] for r in range(world_size)]
    q_blocks = torch.stack([torch.bincount(p // bq, minlength=n_q) for p in mine])  # tokens per block and rank
    kv_blocks = torch.stack([torch.bincount(p // bkv, minlength=n_kv) for p in mine])
    pairs = q_blocks @ dense.sum((0, 1)) @ kv_blocks.t()
    return torch.cat([torch.tensor([b * h * local * local]), pairs.flatten()])


def tile_fractions(counts: Tensor, world_size: int) -> tuple[tuple[float, ...], ...]:
    """tiles[r][j]: the fraction of rank r's queries' scores against rank j's keys in visible blocks."""
    whole, *pairs = counts.tolist()
    return tuple(tuple(n / whole for n in pairs[r * world_size : (r + 1) * world_size]) for r in range(world_size))


class ShardedMaskMod:
    """The mask_mod of a rank's shard of a global BlockMask: the global ``mask_mod`` at the global positions
    the index ``table`` gives (``shard_block_mask``)."""

    def __init__(self, global_mod: Callable, table: Tensor, tiles: tuple):
        # tiles: the fractions the table's tail holds (``tile_fractions``), read once, so that an eager call's
        # schedule choice does not read the table back from its device
        self.global_mod, self.table, self.tiles = global_mod, table, tiles
        # the mask as a call's mods, made here outside any compiled region: Dynamo takes an opaque object it
        # finds as a graph input, but cannot make one
        self.mods = Mods(lambda b, h, i, j, *table: self(b, h, i, j), None, 1)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.global_mod(b, h, self.table[HEADER + q_idx], self.table[HEADER + kv_idx])

    def tiles_for(self, local_len: int, world_size: int) -> Optional[tuple[tuple[float, ...], ...]]:
        """The tile fractions for a call of ``local_len`` tokens a rank over ``world_size`` ranks; None where the
        table is not a shard of that length and C."""
        return self.tiles if self.table.numel() == table_length(local_len, world_size) else None


def shard_block_mask(block_mask: BlockMask, rank: int, world_size: int, perm: Tensor, chunk: int) -> BlockMask:
    """This rank's BlockMask for a global ``block_mask`` under the layout given by ``perm``."""
    q_len, kv_len = block_mask.seq_lengths
    if q_len != kv_len:
        raise ValueError(f"block_mask: CP shards self-attention, but the mask is {q_len} queries x {kv_len} keys")
    if perm.numel() != q_len:
        raise ValueError(f"block_mask covers {q_len} tokens but the layout covers {perm.numel()}")
    if isinstance(block_mask.mask_mod, ShardedMaskMod):
        raise ValueError("block_mask is already sharded; pass the global BlockMask to plan.shard")
    local = q_len // world_size
    device = block_mask.kv_num_blocks.device
    perm = perm.to(device=device, dtype=torch.int64)
    header = torch.tensor([MAGIC, chunk, _block_digest(block_mask)], dtype=torch.int64, device=device)
    tiles = tile_counts(block_mask, perm, world_size)
    table = torch.cat([header, perm[rank * local : (rank + 1) * local], perm, tiles.to(device)])
    mask_mod = ShardedMaskMod(block_mask.mask_mod, table, tile_fractions(tiles, world_size))
    batch, heads = block_mask.kv_num_blocks.shape[:2]
    return create_block_mask(mask_mod, batch, heads, local, local, device=device, BLOCK_SIZE=block_mask.BLOCK_SIZE)


def sharded_mask_mod(block_mask) -> Optional[ShardedMaskMod]:
    """The mask_mod ``shard_block_mask`` gave ``block_mask``; None for no mask or one not sharded for CP."""
    mod = None if block_mask is None else block_mask.mask_mod
    return mod if isinstance(mod, ShardedMaskMod) else None


def table_length(local_len: int, world_size: int) -> int:
    return HEADER + local_len * (world_size + 1) + 1 + world_size**2


def is_table_length(numel: int, local_len: int) -> bool:
    """Whether a table of ``numel`` entries can be a shard's of ``local_len`` tokens, over some C."""
    return any(table_length(local_len, c) == numel for c in range(1, (numel - HEADER) // max(local_len, 1) + 1))


def mask_tiles(table: Optional[Tensor], local_len: int, world_size: int) -> Optional[tuple[tuple[float, ...], ...]]:
    """The tile fractions a sharded mask's table carries; None for what is not the table of a shard of
    ``local_len`` tokens over ``world_size`` ranks."""
    if table is None or table.numel() != table_length(local_len, world_size):
        return None
    return tile_fractions(table[-(1 + world_size**2) :], world_size)
