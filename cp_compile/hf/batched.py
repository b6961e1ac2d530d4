"""One ``ShardedCache`` for a batch of left-padded prompts, made from one sharded prefill per prompt.

A plan's sharded prefill takes one sequence (its padding-free packed layout has no padding mask), so
``cp_compile.hf.generate`` given a batch prefills each prompt's real tokens on its own, into a single-row
cache, and ``CacheOfRows`` stacks those rows, one at a time, into the cache that ``model.generate`` then decodes
the batch with: each attention layer an ``inference.rows.RowsShard`` (every row its own positions and round robin), each
convolution or recurrent state the rows' states stacked on the batch dimension. The padding is in no cache
slot and in no state, which is what one process's padding mask achieves.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import DummyLayer

from ..inference.rows import RowsShard
from ..plan import ContextParallel
from .cache import ReplicatedLinearLayer, ShardedCache, ShardedHybridLayer, ShardedIndexedLayer, ShardedLayer


class ShardedRowsLayer(ShardedLayer, RowsShard):
    """A ``ShardedLayer`` whose batch rows are sequences of their own lengths."""


class ShardedHybridRowsLayer(ShardedHybridLayer, RowsShard):
    """A ``ShardedHybridLayer`` whose batch rows are sequences of their own lengths."""


def why_not_in_rows(cache: ShardedCache) -> Optional[str]:
    """Why the rows of ``cache``'s kind cannot be decoded as one batch, or None."""
    why = getattr(cache, "why_one_sequence", None)
    if why is not None:
        return why
    if type(cache) is not ShardedCache:
        return f"its cache ({type(cache).__name__}) keeps layers of its own kind, one sequence's"
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, ShardedIndexedLayer):
            return f"layer {index} is indexed sparse attention, whose indexer keys are kept per sequence"
        if isinstance(layer, ShardedLayer) and (layer.decoding_window is not None or layer.shares_keys):
            return f"layer {index} shares its keys or windows them at decoding only"
        if not isinstance(layer, (ShardedLayer, ReplicatedLinearLayer, DummyLayer)):
            return f"layer {index} is {type(layer).__name__}"
    return None


def _stack_states(target: ReplicatedLinearLayer, rows: list[ReplicatedLinearLayer]) -> None:
    """The rows' convolution and recurrent states, stacked into ``target``; a row whose prompt was one token (no
    prefill) starts from zeros, which is the state one process reaches over that row's left padding."""
    for index in range(target.number_of_states):
        for kind in ("conv", "recurrent"):
            states = [getattr(row, f"{kind}_states")[index] for row in rows]
            made = [s for s in states if s is not None]
            if not made:
                continue
            getattr(target, f"{kind}_states")[index] = torch.cat(
                [s if s is not None else torch.zeros_like(made[0]) for s in states]
            )
            getattr(target, f"is_{kind}_states_initialized")[index] = True
        target.has_previous_state[index] = any(row.has_previous_state[index] for row in rows)
        kernels = [row.conv_kernel_size[index] for row in rows if row.conv_kernel_size[index] is not None]
        target.conv_kernel_size[index] = kernels[0] if kernels else None
    held = [row for row in rows if row.device is not None]
    if held:
        target.device, target.dtype = held[0].device, held[0].dtype


def _rows_layer(plan: ContextParallel, first, batch: int, width: int):
    """The batch's layer in the place of ``first``, one sequence's layer."""
    if isinstance(first, ShardedHybridLayer):
        layer = ShardedHybridRowsLayer(plan, first.max_tokens, first.window, first.number_of_states)
    elif isinstance(first, ShardedLayer):
        layer = ShardedRowsLayer(plan, first.max_tokens, first.window)
    elif isinstance(first, ReplicatedLinearLayer):
        return ReplicatedLinearLayer(plan, first.number_of_states)
    else:
        return first  # nothing kept
    layer.start_rows(batch, width)
    return layer


class CacheOfRows:
    """One cache for a batch of ``batch`` sequences, standing for a left-padded batch whose ``width`` tokens the
    model is told it holds; ``add`` takes each sequence's single-row cache in turn (prefilled, or empty for a
    one-token prompt), whose K/V are copied into the batch's buffers and freed at once."""

    def __init__(self, plan: ContextParallel, batch: int, width: int):
        self.plan, self.batch, self.width = plan, batch, width
        self.first: Optional[ShardedCache] = None
        self.layers: list = []
        self.rows: list[list] = []  # per layer, each sequence's layer (its K/V freed; its states kept)

    def add(self, single: ShardedCache) -> None:
        if self.first is None:
            self.first = single
            self.layers = [_rows_layer(self.plan, layer, self.batch, self.width) for layer in single.layers]
            self.rows = [[] for _ in single.layers]
        row = len(self.rows[0])
        for layer, mine, rows in zip(self.layers, single.layers, self.rows):
            if isinstance(layer, RowsShard):
                layer.take_row(row, mine)
                layer.is_initialized = layer.keys is not None
            rows.append(mine)

    def cache(self) -> ShardedCache:
        """The batch's cache, once every sequence was added (the first sequence's cache, its layers replaced)."""
        cache = self.first
        for layer, rows in zip(self.layers, self.rows):
            if isinstance(layer, ReplicatedLinearLayer):
                _stack_states(layer, rows)
        cache.layers = self.layers
        for index, layer in enumerate(cache.layers):
            layer.agreement, layer.index = cache.agreement, index
        return cache
