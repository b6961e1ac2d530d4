"""The halo of a causal convolution: the k-1 tokens before each chunk, from the ranks that hold them.

A causal convolution of width k reads, for each token, the k-1 tokens before it. On a shard, every
chunk of consecutive global positions (``layout.runs``) lacks the k-1 tokens before its first one.
``cp::halo`` returns those tokens, chunk after chunk; put in front of every chunk (``conv.py``: a
reshape for equal chunks, the rows ``cp::halo_rows`` names for packed documents), the unmodified
convolution (a fused kernel or the torch body) run over the extended tensor gives every token of the
shard exactly its one-process value, and the halos' outputs are dropped.

The exchange is one all-gather of every chunk's last k-1 real tokens (``[C, chunks, k-1]`` rows: bytes
independent of the sequence length). A chunk shorter than k-1 tokens exports what it has, so a halo that
reaches back over several short chunks, on several ranks, is found among the exports all the same: the
token t positions before a chunk's start lies in a chunk that ends before that start, so it is one of
that chunk's last k-1 tokens. Halo rows before position 0, and with ``reset`` rows of another document,
are zero: what the one-process convolution reads there (its zero padding, or a kernel's reset at a
document boundary). The backward reduce-scatters each halo row's gradient back to the rank that holds
the token.

The tables depend on the layout, the local length, C and k only, the same on every rank; the op reads
the rank at run time, so a compiled graph holds the group's name, never the rank.
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..comm.gather import gather_dim0, reduce_scatter_dim0
from ..comm.groups import resolve_group
from ..layout.runs import Chunk, _key, chunk_count, chunks
from . import Sharding


class HaloTables(NamedTuple):
    tails: Tensor  # [C, n*(k-1)] each rank's slots whose tokens it exports, -1 for none (a zero row)
    sources: Tensor  # [C, n*(k-1)] row of [every rank's exports; a zero row] that fills each halo row
    assembly: Tensor  # [L + n*(k-1)] rows of [x; halo] in extended order (the same on every rank)
    keep: Tensor  # [L] rows of the extended tensor that hold x's rows


@functools.lru_cache(maxsize=256)
def _exported(layout: str, local_len: int, world_size: int, count: int, cu):
    """What every rank exports (each chunk's last ``count`` real tokens, right-aligned: ``[C, chunks*count]``
    slots, -1 for none) and, for each exported global position, its row among every rank's exports."""
    per_rank: tuple[tuple[Chunk, ...], ...] = chunks(layout, local_len, world_size, cu)
    n = len(per_rank[0])
    tails = torch.full((world_size, n * count), -1, dtype=torch.int64)
    exported: dict[int, int] = {}  # global position -> row of the gathered exports
    for rank, rank_chunks in enumerate(per_rank):
        for j, c in enumerate(rank_chunks):
            for t in range(count):  # row count-1 of a chunk's export is its last token
                back = count - 1 - t
                if back < c.real:
                    tails[rank, j * count + t] = c.slot + c.real - 1 - back
                    exported[c.start + c.real - 1 - back] = (rank * n + j) * count + t
    return per_rank, tails, exported


@functools.lru_cache(maxsize=256)
def _tables(layout: str, local_len: int, world_size: int, width: int, cu, reset: bool) -> HaloTables:
    h = width - 1
    per_rank, tails, exported = _exported(layout, local_len, world_size, h, cu)
    n = len(per_rank[0])
    zero = world_size * n * h
    sources = torch.full((world_size, n * h), zero, dtype=torch.int64)
    for rank, rank_chunks in enumerate(per_rank):
        for j, c in enumerate(rank_chunks):
            if not c.real:
                continue
            for t in range(h):
                position = c.start - h + t
                if position < 0 or (reset and bisect.bisect_right(cu, position) - 1 != c.doc):  # its document
                    continue
                sources[rank, j * h + t] = exported[position]
    assembly, keep = [], []
    for j, c in enumerate(per_rank[0]):
        assembly += range(local_len + j * h, local_len + (j + 1) * h)
        keep += range(len(assembly), len(assembly) + c.slots)
        assembly += range(c.slot, c.slot + c.slots)
    return HaloTables(tails, sources, torch.tensor(assembly), torch.tensor(keep, dtype=torch.int64))


def halo_tables(layout: str, local_len: int, world_size: int, width: int, cu_seqlens=None, reset=False):
    return _tables(layout, local_len, world_size, width, _key(cu_seqlens), bool(reset and cu_seqlens is not None))


def _tables_for(local_len: int, width: int, group_name: str, layout: str, cu_seqlens, reset: bool):
    group = resolve_group(group_name)
    return group.rank(), group.size(), halo_tables(layout, local_len, group.size(), width, cu_seqlens, reset)


def gather_picked(rows: Tensor, sources: Tensor, group_name: str, world_size: int) -> Tensor:
    """``[N, ...]``: every rank's ``rows`` (``[R, ...]``, the same R on every rank) stacked in rank order with a zero
    row after them, read at ``sources [N]`` (a row of that stack each, ``C * R`` for a zero row)."""
    gathered = gather_dim0(rows, group_name, world_size).reshape(-1, *rows.shape[1:])
    return torch.cat([gathered, rows.new_zeros(1, *rows.shape[1:])]).index_select(0, sources)


def picked_grad(grad: Tensor, sources: Tensor, per_rank: int, group_name: str, world_size: int) -> Tensor:
    """``[R, ...]``: the gradient of this rank's ``rows`` given that of ``gather_picked``'s output (``grad [N, ...]``),
    every rank's reads of them summed."""
    stacked = grad.new_zeros(world_size * per_rank + 1, *grad.shape[1:]).index_add_(0, sources, grad)
    stacked = stacked[:-1].reshape(world_size, per_rank, *grad.shape[1:])
    if world_size == 1:
        return stacked[0]
    return reduce_scatter_dim0(stacked, group_name, world_size).reshape(per_rank, *grad.shape[1:])


def _exports(seq: Tensor, tails: Tensor) -> Tensor:
    """This rank's exported rows of ``seq`` (``[L, ...]``; ``tails``: its slots, -1 a zero row)."""
    mask = (tails >= 0).view(-1, *[1] * (seq.dim() - 1)).to(seq)
    return seq.index_select(0, tails.clamp(min=0)) * mask


def sequence_tail(x: Tensor, dim: int, count: int, sharding: Sharding) -> Tensor:
    """Every rank's copy of the sequence's last ``count`` tokens (zeros before its first), from this rank's shard
    ``x`` (tokens along ``dim``): a convolution's state after a sharded prefill. Not differentiable."""
    group_name, world_size = sharding.group_name, sharding.world_size
    rank = resolve_group(group_name).rank()
    per_rank, tails, exported = _exported(sharding.layout, x.shape[dim], world_size, count, _key(sharding.cu_seqlens))
    # the real tokens fill positions [0, total) (an empty chunk can start past them, in the layout's padding)
    total = sum(c.real for rank_chunks in per_rank for c in rank_chunks)
    zero = world_size * tails.shape[1]
    rows = torch.tensor([exported.get(p, zero) if p >= 0 else zero for p in range(total - count, total)])
    exports = _exports(x.detach().movedim(dim, 0), tails[rank].to(x.device))
    return gather_picked(exports, rows.to(x.device), group_name, world_size).movedim(0, dim).contiguous()


def _halo(x: Tensor, dim: int, width: int, group_name: str, layout: str, cu_seqlens, reset: bool) -> Tensor:
    rank, c, tables = _tables_for(x.shape[dim], width, group_name, layout, cu_seqlens, reset)
    exports = _exports(x.movedim(dim, 0), tables.tails[rank].to(x.device))
    return gather_picked(exports, tables.sources[rank].to(x.device), group_name, c).movedim(0, dim).contiguous()


def _halo_backward(grad: Tensor, local_len: int, dim: int, width: int, group_name: str, layout: str, cu, reset):
    rank, c, tables = _tables_for(local_len, width, group_name, layout, cu, reset)
    halo = grad.movedim(dim, 0)
    mine = picked_grad(halo, tables.sources[rank].to(grad.device), tables.tails.shape[1], group_name, c)
    tails = tables.tails[rank].to(grad.device)
    mine = mine * (tails >= 0).view(-1, *[1] * (halo.dim() - 1)).to(mine)
    local = halo.new_zeros(local_len, *halo.shape[1:]).index_add_(0, tails.clamp(min=0), mine)
    return local.movedim(0, dim).contiguous()


@torch.library.custom_op("cp::halo", mutates_args=())
def halo(
    x: Tensor, dim: int, width: int, group_name: str, layout: str, cu_seqlens: Optional[Tensor], reset: bool
) -> Tensor:
    """The ``width - 1`` tokens before each of the chunks of ``x`` (this rank's tokens along ``dim``), chunk after
    chunk along ``dim``: ``[..., chunks * (width - 1), ...]``."""
    return _halo(x, dim, width, group_name, layout, cu_seqlens, reset)


@torch.library.custom_op("cp::halo_backward", mutates_args=())
def halo_backward(
    grad: Tensor,
    local_len: int,
    dim: int,
    width: int,
    group_name: str,
    layout: str,
    cu_seqlens: Optional[Tensor],
    reset: bool,
) -> Tensor:
    """The gradient of ``x`` that the gradient of its halo (``grad``) holds: each halo row's gradient sent back to
    the rank whose token it is, added at that token."""
    return _halo_backward(grad, local_len, dim, width, group_name, layout, cu_seqlens, reset)


@halo.register_fake
def _(x, dim, width, group_name, layout, cu_seqlens, reset):
    shape = list(x.shape)
    shape[dim] = chunk_count(layout, resolve_group(group_name).size(), cu_seqlens) * (width - 1)
    return x.new_empty(shape)


@halo_backward.register_fake
def _(grad, local_len, dim, width, group_name, layout, cu_seqlens, reset):
    shape = list(grad.shape)
    shape[dim] = local_len
    return grad.new_empty(shape)


def _setup(ctx, inputs, output):
    x, *settings = inputs
    ctx.local_len, ctx.settings = x.shape[settings[0]], settings
    ctx.set_materialize_grads(False)


def _grad(ctx, grad):
    if grad is None:
        return (None,) * 7
    return (halo_backward(grad, ctx.local_len, *ctx.settings), *(None,) * 6)


halo.register_autograd(_grad, setup_context=_setup)


@torch.library.custom_op("cp::halo_rows", mutates_args=())
def halo_rows(cu_seqlens: Tensor, local_len: int, world_size: int, width: int) -> tuple[Tensor, Tensor]:
    """For packed documents (chunks of unequal sizes): the rows of ``cat([x, halo])`` in extended order (each
    chunk's halo, then the chunk), and the rows of the extended tensor that hold ``x``'s tokens."""
    tables = halo_tables("packed", local_len, world_size, width, cu_seqlens)
    return tables.assembly.to(cu_seqlens.device), tables.keep.to(cu_seqlens.device)


@halo_rows.register_fake
def _(cu_seqlens, local_len, world_size, width):
    extended = local_len + chunk_count("packed", world_size, cu_seqlens) * (width - 1)
    return cu_seqlens.new_empty(extended, dtype=torch.int64), cu_seqlens.new_empty(local_len, dtype=torch.int64)


__all__ = ["gather_picked", "halo", "halo_rows", "halo_tables", "picked_grad", "sequence_tail"]
