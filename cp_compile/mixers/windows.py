"""Keys pooled from windows of the sequence (DeepSeek-V4's compressed attention, Qwen4-exp's indexer blocks), over a
shard.

A compressor pools each window of ``rate`` consecutive tokens, from position 0 on (or from each document's start),
into one key (DeepSeek-V4: a softmax-gated sum of the window's projections, and, where its windows overlap, of the
``rate`` tokens before it too: a span of ``2 * rate``; Qwen4-exp: their mean). Every query reads the keys of the
windows before it, so every rank needs the sequence's pooled keys; none needs its tokens:

- ``windows_ending_here``: the span of tokens that ends at each of this rank's slots that close a window
  (``cp::window_ends``), from its shard and the ``span - 1`` tokens before each of its chunks (``halo``);
- the caller pools them;
- ``gather_windows``: every rank's pooled keys, all-gathered and put in window order (``cp::gather_windows``:
  ``T / rate`` rows, 1/rate of the tokens' bytes); the backward sends each key's gradient, summed over the ranks
  that read it, back to the rank that pooled it.

Which slots close a window, and where each rank's keys go, depend on the layout, the local length, C and the rate
alone (tables, the same on every rank). Each rank keeps ``L // rate`` rows plus one per chunk for its keys, a bound
the fake ops know without the documents' offsets; the rows no window fills stay unread. A compiled graph holds the
group's name, never the rank.
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..comm.groups import resolve_group
from ..layout.runs import _key, chunk_count, chunks
from . import Sharding
from .conv import with_halo, without_halo
from .halo import gather_picked, picked_grad
from .indexed import sequence_slots


class WindowTables(NamedTuple):
    ends: Tensor  # [C, R]: each rank's slots that close a window, in window order, -1 for none
    sources: Tensor  # [N]: the row of every rank's keys (rank order; C * R: a zero row) that holds window w's key
    windows: int  # the windows of the sequence's tokens (the rows of ``sources`` after them: zero keys)


def _rows_per_rank(local_len: int, rate: int, world_size: int, layout: str, cu_seqlens) -> int:
    """Rows each rank keeps for the keys it pools: a chunk of n tokens closes at most ``n // rate + 1`` windows."""
    return local_len // rate + chunk_count(layout, world_size, cu_seqlens)


def _windows(local_len: int, world_size: int, rate: int) -> int:
    """Windows of the longest sequence the shards can hold (those past its real tokens: zero keys)."""
    return local_len * world_size // rate


def _closes(place: int, rate: int, starts: tuple[int, ...]) -> bool:
    """Whether the token at ``place`` is the last of a window: windows counted from position 0, or from the start of
    its document (``starts``: the documents' first positions, ascending; empty: one sequence)."""
    start = starts[bisect.bisect_right(starts, place) - 1] if starts else 0
    return (place - start + 1) % rate == 0


@functools.lru_cache(maxsize=256)
def _tables(layout: str, local_len: int, world_size: int, rate: int, cu, restart: bool) -> WindowTables:
    per_rank = chunks(layout, local_len, world_size, cu)
    starts = tuple(cu[:-1]) if restart and cu is not None else ()
    rows = _rows_per_rank(local_len, rate, world_size, layout, cu)
    closing = [
        sorted(
            (c.start + t, c.slot + t) for c in rank_chunks for t in range(c.real) if _closes(c.start + t, rate, starts)
        )
        for rank_chunks in per_rank
    ]
    window = {place: w for w, place in enumerate(sorted(place for ends in closing for place, _ in ends))}
    ends = torch.full((world_size, rows), -1, dtype=torch.int64)
    sources = torch.full((_windows(local_len, world_size, rate),), world_size * rows, dtype=torch.int64)
    for rank, rank_ends in enumerate(closing):
        for row, (place, slot) in enumerate(rank_ends):
            ends[rank, row] = slot
            sources[window[place]] = rank * rows + row
    return WindowTables(ends, sources, len(window))


def window_tables(
    layout: str, local_len: int, world_size: int, rate: int, cu_seqlens=None, restart: bool = False
) -> WindowTables:
    return _tables(layout, local_len, world_size, rate, _key(cu_seqlens), bool(restart and cu_seqlens is not None))


@torch.library.custom_op("cp::window_ends", mutates_args=())
def window_ends(
    shard: Tensor, rate: int, restart: bool, group_name: str, layout: str, cu_seqlens: Optional[Tensor]
) -> Tensor:
    """``[R]`` int64: this rank's slots (``shard``'s dim 1) that hold the last token of a window, in window order; -1
    in the rows left over. ``restart``: windows counted from each document's start."""
    group = resolve_group(group_name)
    tables = window_tables(layout, shard.shape[1], group.size(), rate, cu_seqlens, restart)
    return tables.ends[group.rank()].to(shard.device)


@window_ends.register_fake
def _(shard, rate, restart, group_name, layout, cu_seqlens):
    rows = _rows_per_rank(shard.shape[1], rate, resolve_group(group_name).size(), layout, cu_seqlens)
    return shard.new_empty(rows, dtype=torch.int64)


@torch.library.custom_op("cp::gather_windows", mutates_args=())
def gather_windows_op(
    keys: Tensor, local_len: int, rate: int, restart: bool, group_name: str, layout: str, cu_seqlens: Optional[Tensor]
) -> Tensor:
    """``[B, R, ...]`` this rank's pooled keys (``window_ends``' rows) -> ``[B, N, ...]`` every window's, in order."""
    c = resolve_group(group_name).size()
    sources = window_tables(layout, local_len, c, rate, cu_seqlens, restart).sources.to(keys.device)
    return gather_picked(keys.movedim(1, 0), sources, group_name, c).movedim(0, 1).contiguous()


@torch.library.custom_op("cp::gather_windows_backward", mutates_args=())
def gather_windows_backward(
    grad: Tensor, local_len: int, rate: int, restart: bool, group_name: str, layout: str, cu_seqlens: Optional[Tensor]
) -> Tensor:
    """The gradient of this rank's pooled keys: every rank's gradient of the gathered keys, summed."""
    c = resolve_group(group_name).size()
    tables = window_tables(layout, local_len, c, rate, cu_seqlens, restart)
    rows = tables.ends.shape[1]
    mine = picked_grad(grad.movedim(1, 0), tables.sources.to(grad.device), rows, group_name, c)
    return mine.movedim(0, 1).contiguous()


@gather_windows_op.register_fake
def _(keys, local_len, rate, restart, group_name, layout, cu_seqlens):
    windows = _windows(local_len, resolve_group(group_name).size(), rate)
    return keys.new_empty(keys.shape[0], windows, *keys.shape[2:])


@gather_windows_backward.register_fake
def _(grad, local_len, rate, restart, group_name, layout, cu_seqlens):
    rows = _rows_per_rank(local_len, rate, resolve_group(group_name).size(), layout, cu_seqlens)
    return grad.new_empty(grad.shape[0], rows, *grad.shape[2:])


def _setup(ctx, inputs, output):
    ctx.settings = inputs[1:]
    ctx.set_materialize_grads(False)


gather_windows_op.register_autograd(
    lambda ctx, grad: (None if grad is None else gather_windows_backward(grad, *ctx.settings), *(None,) * 6),
    setup_context=_setup,
)


class ClosingWindows(NamedTuple):
    """The spans that end at this rank's slots that close a window: ``spans [B, R, span, ...]`` and ``places [R]``,
    the global position of each span's last token (-1 in the rows left over, whose spans are unread)."""

    spans: Tensor
    places: Tensor


def windows_ending_here(x: Tensor, rate: int, span: int, sharding: Sharding, restart: bool = False) -> ClosingWindows:
    """The ``span`` tokens (``x [B, L, ...]``: this rank's shard) that end at each window this rank closes; tokens
    before position 0 are zero rows. ``restart``: windows counted from each document's start (a span reaching before
    it reads the document before). Differentiable."""
    local_len = x.shape[1]
    ends = window_ends(x, rate, restart, *sharding.op_args)
    places = sequence_slots(x, *sharding.op_args)
    end_places = torch.where(ends >= 0, places.index_select(0, ends.clamp(min=0)), -1)
    if span == 1:
        return ClosingWindows(x.index_select(1, ends.clamp(min=0)).unsqueeze(2), end_places)
    sharding.agree("windows", (x, x, x), f"rate={rate} span={span} restart={restart}")
    extended = with_halo(x, 1, span, sharding)
    # each slot's row in the extended tensor: the span before it there is its own
    at = without_halo(torch.arange(extended.shape[1], device=x.device), 0, span, sharding, local_len)
    last = at.index_select(0, ends.clamp(min=0))
    rows = last[:, None] + torch.arange(1 - span, 1, device=x.device)[None, :]
    spans = extended.index_select(1, rows.flatten()).unflatten(1, rows.shape)
    return ClosingWindows(spans, end_places)


def gather_windows(keys: Tensor, local_len: int, rate: int, sharding: Sharding, restart: bool = False) -> Tensor:
    """``[B, N, ...]``: every window's key from every rank's (``keys [B, R, ...]``, one per ``windows_ending_here``
    row), in window order: the N windows of the sequence's tokens, or, compiled on packed documents, as many as the
    slots could hold (those past the tokens' windows: zero keys, which no query may read)."""
    whole = gather_windows_op(keys, local_len, rate, restart, *sharding.op_args)
    if sharding.cu_seqlens is None or torch.compiler.is_compiling():
        return whole
    tables = window_tables(sharding.layout, local_len, sharding.world_size, rate, sharding.cu_seqlens, restart)
    return whole.narrow(1, 0, tables.windows)


__all__ = ["ClosingWindows", "gather_windows", "window_ends", "window_tables", "windows_ending_here"]
