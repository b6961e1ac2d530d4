"""A KV cache shard for a batch of sequences of different lengths (left-padded prompts decoded together).

Each row is first a ``CacheShard`` of its own: its prompt, padding left out, is prefilled sharded as one
sequence, so row b's slots carry row b's positions from 0. ``RowsShard.take_row`` copies each such row into
its place on the batch dimension, with the bookkeeping that ``CacheShard`` keeps as scalars (tokens seen, where round
robin starts, this rank's next slot) kept per row, so that decoding appends one token to every row in one
step: token p of row b goes to rank ``(p - start_b) % C``, as the row's own shard would have placed it.
Attention masks by each row's own positions (``cp::cached_attention`` with ``[B, L]`` positions); padding
was never stored, so no padding mask is needed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.masked import EMPTY_POSITION
from .cache import CacheShard, Step


class RowsShard(CacheShard):
    """``CacheShard`` whose rows are sequences of their own lengths; filled by ``start_rows`` and ``take_row``,
    then appended to."""

    def start_rows(self, batch: int, width: int) -> None:
        """Hold ``batch`` rows, each empty until ``take_row`` (a one-token prompt's row stays so: nothing to
        prefill); ``width``: the tokens of the padded batch they stand for."""
        self.positions = torch.full((batch, self.capacity + 1), EMPTY_POSITION, dtype=torch.int64)
        for name in ("seen", "_append_start", "_append_slot"):
            setattr(self, name, torch.zeros(batch, dtype=torch.int64))
        # the padded batch's width, which the model is told the cache holds (transformers slices its next input by it)
        self.host_seen = width

    def take_row(self, row: int, shard: CacheShard) -> None:
        """Copy ``shard`` (one sequence, as its sharded prefill left it) into row ``row``, and free its K/V: rows
        added one at a time keep one row's copy at most beside the batch's buffers."""
        if shard.keys is None:
            return
        if self.keys is None:
            batch = self.positions.shape[0]
            self.keys = shard.keys.new_zeros(batch, *shard.keys.shape[1:])
            self.values = shard.values.new_zeros(batch, *shard.values.shape[1:])
            for name in ("positions", "_rank", "seen", "_append_start", "_append_slot"):
                setattr(self, name, getattr(self, name).to(shard.keys.device))
        self.keys[row], self.values[row] = shard.keys[0], shard.values[0]
        for name in ("positions", "seen", "_append_start", "_append_slot"):
            getattr(self, name)[row] = getattr(shard, name)
        shard.keys = shard.values = None

    def prefill(self, k: Tensor, v: Tensor, positions: Tensor, tokens: int) -> None:
        raise ValueError("a cache of rows is made from prefilled rows (RowsShard.take_row), not prefilled itself")

    def stored(self) -> int:
        return self.host_seen  # the padded width: each row's own count is on the device, per row

    def written(self) -> Optional[int]:
        return None  # each row holds its own number of slots: attention masks every row by its positions

    def append(self, k: Tensor, v: Tensor) -> Step:
        """Add ``L`` tokens to every row (``[B, Hkv, L, D]``, the same on every rank), each at its row's next
        position; returns what their attention reads, with ``[B, L]`` query and ``[B, S]`` key positions."""
        if self.keys is None:
            self._allocate(k, v)
        length = k.shape[2]
        if self.host_seen + length > self.max_tokens:
            raise ValueError(
                f"the cache holds {self.max_tokens} tokens a row; the padded rows are {self.host_seen} long and "
                f"{length} more arrived (make the cache for the generation's max_length)"
            )
        self.host_seen += length
        new = self.seen[:, None] + torch.arange(length, device=self.seen.device)
        turn = new - self._append_start[:, None]
        mine = turn % self.world_size == self._rank
        self.seen.add_(length)
        if self.ring is None:
            self._write_rows(k, v, new, mine, self._append_slot[:, None] + turn // self.world_size)
            return Step(self.keys, self.values, self.positions, new)
        # read before written, as ``CacheShard.append``'s ring is
        step = Step(
            torch.cat([self.keys, k.to(self.keys.dtype)], 2),
            torch.cat([self.values, v.to(self.values.dtype)], 2),
            torch.cat([self.positions, torch.where(mine, new, EMPTY_POSITION)], 1),
            new,
        )
        last = slice(max(0, length - self.ring * self.world_size), None)
        slot = self._append_slot[:, None] + (turn[:, last] // self.world_size) % self.ring
        self._write_rows(k[:, :, last], v[:, :, last], new[:, last], mine[:, last], slot)
        return step

    def _write_rows(self, k: Tensor, v: Tensor, positions: Tensor, mine: Tensor, slot: Tensor) -> None:
        slot = torch.where(mine, slot, self.capacity)  # tokens other ranks keep go to the scratch slot
        rows = torch.arange(k.shape[0], device=slot.device)[:, None].expand_as(slot)
        # [B, S, H, D] views of the buffers: one (row, slot) index pair per token writes all its heads
        self.keys.transpose(1, 2).index_put_((rows, slot), k.transpose(1, 2).to(self.keys.dtype))
        self.values.transpose(1, 2).index_put_((rows, slot), v.transpose(1, 2).to(self.values.dtype))
        self.positions.index_put_((rows, slot), torch.where(mine, positions, EMPTY_POSITION))
