"""The halo of a causal convolution: the k-1 tokens before each chunk, from the ranks that hold them.

A causal convolution of width k reads, for each token, the k-1 tokens before it. On a shard, every
chunk of consecutive global positions (``layout.runs``) lacks the k-1 tokens before its first one.
``cp::halo_extend`` returns this rank's tokens with those tokens put in front of every chunk, in
sequence order, so that the unmodified convolution (a fused kernel or the torch body) run over the
extended tensor gives every token of the shard exactly its one-process value; the caller then keeps
the rows the op names (``keep``) and drops the halos' outputs.

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

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..comm import resolve_group
from ..comm.gather import gather_dim0, reduce_scatter_dim0
from ..layout.runs import Chunk, _key, chunk_count, chunks


class HaloTables(NamedTuple):
    tails: Tensor  # [C, n*(k-1)] each rank's slots whose tokens it exports, -1 for none (a zero row)
    sources: Tensor  # [C, n*(k-1)] row of [every rank's exports; a zero row] that fills each halo row
    assembly: Tensor  # [L + n*(k-1)] rows of [x; halo] in extended order (the same on every rank)
    keep: Tensor  # [L] rows of the extended tensor that hold x's rows


def _doc_of(position: int, rank_chunks) -> int:
    for c in rank_chunks:
        if c.start <= position < c.start + c.real:
            return c.doc
    raise AssertionError(position)


@functools.lru_cache(maxsize=256)
def _tables(layout: str, local_len: int, world_size: int, width: int, cu, reset: bool) -> HaloTables:
    h = width - 1
    per_rank: tuple[tuple[Chunk, ...], ...] = chunks(layout, local_len, world_size, cu)
    n = len(per_rank[0])
    tails = torch.full((world_size, n * h), -1, dtype=torch.int64)
    exported: dict[int, int] = {}  # global position -> row of the gathered exports
    for rank, rank_chunks in enumerate(per_rank):
        for j, c in enumerate(rank_chunks):
            for t in range(h):  # right-aligned: tail row h-1 is the chunk's last token
                back = h - 1 - t
                if back < c.real:
                    tails[rank, j * h + t] = c.slot + c.real - 1 - back
                    exported[c.start + c.real - 1 - back] = (rank * n + j) * h + t
    zero = world_size * n * h
    everything = [c for rank_chunks in per_rank for c in rank_chunks]
    sources = torch.full((world_size, n * h), zero, dtype=torch.int64)
    for rank, rank_chunks in enumerate(per_rank):
        for j, c in enumerate(rank_chunks):
            if not c.real:
                continue
            for t in range(h):
                position = c.start - h + t
                if position < 0 or (reset and _doc_of(position, everything) != c.doc):
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
    c = group.size()
    return group.rank(), c, halo_tables(layout, local_len, c, width, cu_seqlens, reset)


def _extend(x: Tensor, dim: int, width: int, group_name: str, layout: str, cu_seqlens, reset: bool):
    rank, c, tables = _tables_for(x.shape[dim], width, group_name, layout, cu_seqlens, reset)
    device = x.device
    seq = x.movedim(dim, 0)  # [L, ...]
    tails = tables.tails[rank].to(device)
    exports = seq.index_select(0, tails.clamp(min=0)) * (tails >= 0).view(-1, *[1] * (seq.dim() - 1)).to(seq)
    gathered = gather_dim0(exports, group_name, c) if c > 1 else exports
    gathered = torch.cat([gathered.reshape(-1, *seq.shape[1:]), seq.new_zeros(1, *seq.shape[1:])])
    halo = gathered.index_select(0, tables.sources[rank].to(device))
    extended = torch.cat([seq, halo]).index_select(0, tables.assembly.to(device))
    return extended.movedim(0, dim).contiguous(), tables.keep.to(device)


def _extend_backward(grad: Tensor, dim: int, width: int, group_name: str, layout: str, cu_seqlens, reset: bool):
    halo_rows = chunk_count(layout, resolve_group(group_name).size(), cu_seqlens) * (width - 1)
    rank, c, tables = _tables_for(grad.shape[dim] - halo_rows, width, group_name, layout, cu_seqlens, reset)
    device = grad.device
    seq = grad.movedim(dim, 0)
    local_len = tables.keep.numel()
    rows = seq.new_zeros(local_len + tables.sources.shape[1], *seq.shape[1:])
    rows.index_add_(0, tables.assembly.to(device), seq)
    local, halo = rows[:local_len], rows[local_len:]
    exports = seq.new_zeros(c * tables.tails.shape[1] + 1, *seq.shape[1:])
    exports.index_add_(0, tables.sources[rank].to(device), halo)
    exports = exports[:-1].reshape(c, -1, *seq.shape[1:])
    mine = reduce_scatter_dim0(exports, group_name, c).reshape(-1, *seq.shape[1:]) if c > 1 else exports[0]
    tails = tables.tails[rank].to(device)
    local = local.index_add(0, tails.clamp(min=0), mine * (tails >= 0).view(-1, *[1] * (seq.dim() - 1)).to(mine))
    return local.movedim(0, dim).contiguous()


@torch.library.custom_op("cp::halo_extend", mutates_args=())
def halo_extend(
    x: Tensor, dim: int, width: int, group_name: str, layout: str, cu_seqlens: Optional[Tensor], reset: bool
) -> tuple[Tensor, Tensor]:
    """``x`` (this rank's tokens along ``dim``) with the ``width - 1`` tokens before each of its chunks in front
    of the chunk, and the rows of the result that hold ``x``'s tokens (``keep``)."""
    return _extend(x, dim, width, group_name, layout, cu_seqlens, reset)


@torch.library.custom_op("cp::halo_extend_backward", mutates_args=())
def halo_extend_backward(
    grad: Tensor, dim: int, width: int, group_name: str, layout: str, cu_seqlens: Optional[Tensor], reset: bool
) -> Tensor:
    return _extend_backward(grad, dim, width, group_name, layout, cu_seqlens, reset)


def _extended_shape(x: Tensor, dim: int, width: int, group_name: str, layout: str, cu_seqlens) -> list:
    n = chunk_count(layout, resolve_group(group_name).size(), cu_seqlens)
    shape = list(x.shape)
    shape[dim] = shape[dim] + n * (width - 1)
    return shape


@halo_extend.register_fake
def _(x, dim, width, group_name, layout, cu_seqlens, reset):
    shape = _extended_shape(x, dim, width, group_name, layout, cu_seqlens)
    return x.new_empty(shape), x.new_empty(x.shape[dim], dtype=torch.int64)


@halo_extend_backward.register_fake
def _(grad, dim, width, group_name, layout, cu_seqlens, reset):
    shape = list(grad.shape)
    n = chunk_count(layout, resolve_group(group_name).size(), cu_seqlens)
    shape[dim] -= n * (width - 1)
    return grad.new_empty(shape)


def _setup(ctx, inputs, output):
    ctx.settings = inputs[1:]
    ctx.set_materialize_grads(False)


def _grad(ctx, grad, _grad_keep):
    if grad is None:
        return (None,) * 7
    return (halo_extend_backward(grad, *ctx.settings), *(None,) * 6)


halo_extend.register_autograd(_grad, setup_context=_setup)


__all__ = ["halo_extend", "halo_tables"]
