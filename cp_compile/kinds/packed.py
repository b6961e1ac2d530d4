"""Packed documents (THD, ``cu_seqlens``) under CP.

Tensors are packed ``[T_local, H, D]``: this rank's slots under the
per-document zigzag (``layout.packed.packed_slots``): every document split into 2C
chunks on its own, rank r holding chunks r and 2C-1-r of each, padding at a
document's tail. ``cu_seqlens`` is the *global* int32 tensor of real document
lengths, the same on every rank, exactly what the model passes to
``varlen_attn`` on one device; it travels as the call's ``extra`` and the
window as its settings (``PackedSettings``).

Which query may see which key is decided from global facts only: the
document, the position inside it and whether the slot is a real token, all
computed exactly from ``cu_seqlens`` (never by dividing lengths by 2C). A key
is visible to a query when both are real, in the same document and inside
the window ``(left, right)`` (-1: unbounded; ``right = 0`` is causal), as in
``varlen_attn``. Padding rows get out = 0, lse = -inf and zero gradients, and
are never visible as keys.

A call turns the slots of the queries' unit and of the keys' unit into runs
of real tokens (``layout.packed.packed_segments``; a unit's slots are its ranks' in
rank order, gathered keys are in global packed order so that each query chunk
sees one contiguous range) and attends per document tile over strided views
(``kernels.tiles``): fused kernels for full and causal tiles, the math path
only for window edges, so memory is per tile. A ring step whose K/V block is
outside every query's window has no tile and computes nothing. Under head
sharding the tensors travel as ``[1, H, T, D]`` views (``bhsd``), which the
kind reads back as ``[T, H, D]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..comm.gather import gather_dim0, reduce_scatter_dim0
from ..kernels.tiles import plan_tiles, tiles_attn, tiles_attn_backward
from ..layout.packed import (
    Segment,
    check_cu_seqlens,
    packed_local_len,
    packed_segments,
    sequence_segments,
)
from .base import Kind, Units, register_kind
from .call import Call, Settings


def check_packed_args(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"packed q, k, v must be [tokens, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible packed q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads but k/v have {k.shape[1]}; pass enable_gqa=True")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


@dataclass(frozen=True)
class PackedSettings(Settings):
    """A packed call's window (left, right; -1 unbounded, right = 0 causal), and when set the chunk size (keys
    visible only inside the query's chunk of ``chunk`` positions of its document), the logit soft-cap, and ``across``
    = 1: the documents see each other, as one sequence (the window over positions in the packed row), while the
    tokens stay where the documents' layout put them (a model whose one-process mask ignores the documents)."""

    left: int
    right: int
    chunk: int = 0
    softcap: float = 0.0
    across: int = 0


def bhsd(t: Tensor) -> Tensor:
    """[T, H, ...] -> [1, H, T, ...]"""
    return t.transpose(0, 1).unsqueeze(0)


def thd(t: Tensor) -> Tensor:
    """[1, H, T, ...] -> [T, H, ...]"""
    return t.squeeze(0).transpose(0, 1)


def _unit_runs(cu: list[int], unit: int, units: Units) -> tuple:
    return packed_segments(cu, range(unit * units.a2a, (unit + 1) * units.a2a), units.world_size)


@functools.lru_cache(maxsize=256)
def _chunked(runs: tuple[Segment, ...], chunk: int) -> tuple[Segment, ...]:
    """Runs cut at every multiple of ``chunk`` positions, each piece its own (document, chunk):
    tiles then pair only keys of the query's chunk."""
    if not chunk:
        return runs
    pieces = []
    for run in runs:
        start, end = run.pos, run.pos + run.length
        while start < end:
            stop = min(end, (start // chunk + 1) * chunk)
            pieces.append(Segment(run.row + start - run.pos, (run.doc, start // chunk), start, stop - start))
            start = stop
    return tuple(pieces)


def _one_sequence(runs: tuple[Segment, ...], cu: list[int]) -> tuple[Segment, ...]:
    """Runs of the documents as runs of one sequence: each at its position in the packed row."""
    return tuple(Segment(run.row, 0, cu[run.doc] + run.pos, run.length) for run in runs)


def unit_tiles(
    q: Tensor,
    k: Tensor,
    cu_seqlens: Tensor,
    units: Units,
    left: int,
    right: int,
    chunk: int = 0,
    across: bool = False,
) -> tuple:
    """The tiles of the queries' unit against the keys ``units`` names, from cu_seqlens and the rank; ``across``: the
    documents as one sequence."""
    cu = check_cu_seqlens(cu_seqlens)
    local = packed_local_len(cu, units.world_size)
    if q.shape[0] != local * units.a2a:
        per = "rank" if units.a2a == 1 else f"all-to-all group of {units.a2a}"
        raise ValueError(
            f"q has {q.shape[0]} tokens but cu_seqlens={cu} gives {local * units.a2a} slots per {per} over "
            f"C={units.world_size}; shard packed inputs with ContextParallel.shard(x, 0, cu_seqlens=...)"
        )
    expected = local * (units.world_size if units.gathered else units.a2a)
    if k.shape[0] != expected:
        raise ValueError(f"k/v have {k.shape[0]} tokens; expected {expected} for step {units.step}")
    k_runs = sequence_segments(cu) if units.gathered else _unit_runs(cu, units.k_unit, units)
    q_runs = _unit_runs(cu, units.q_unit, units)
    if across:
        q_runs, k_runs = _one_sequence(q_runs, cu), _one_sequence(k_runs, cu)
    return plan_tiles(_chunked(q_runs, chunk), _chunked(k_runs, chunk), left, right)


def _call_tiles(q: Tensor, k: Tensor, extra: list, units: Units, call: Call) -> tuple[tuple, float]:
    """(tiles, soft-cap) of one packed call, from its options."""
    settings = call.settings
    tiles = unit_tiles(q, k, extra[0], units, settings.left, settings.right, settings.chunk, bool(settings.across))
    return tiles, settings.softcap


class Packed(Kind):
    name = "packed"
    settings = PackedSettings
    rank_order = True  # the per-document zigzag has no sequence order to restore

    def attend(self, q, k, v, extra, units: Units, call: Call):
        heads_view = q.dim() == 4
        if heads_view:
            q, k, v = thd(q), thd(k), thd(v)
        tiles, softcap = _call_tiles(q, k, extra, units, call)
        out, lse = tiles_attn(q, k, v, tiles, call.scale, softcap)
        return (bhsd(out), bhsd(lse)) if heads_view else (out, lse)

    def attend_backward(self, dout, q, k, v, out, lse, dlse, extra, units: Units, call: Call):
        heads_view = q.dim() == 4
        if heads_view:
            dout, q, k, v, out, lse = (thd(t) for t in (dout, q, k, v, out, lse))
            dlse = None if dlse is None else thd(dlse)
        tiles, softcap = _call_tiles(q, k, extra, units, call)
        grads = tiles_attn_backward(dout, q, k, v, out, lse, dlse, tiles, call.scale, softcap)
        return tuple(bhsd(g) for g in grads) if heads_view else grads

    def agreed(self, call: Call) -> str:
        return f"{call.options} scale={call.scale!r}"

    def agree_extra(self, q, extra, call: Call) -> None:
        torch.ops.cp.agree_cu_seqlens(extra[0], call.group_name)

    def check(self, q, k, v, call: Call, world_size: int, enable_gqa: bool) -> None:
        if q.dim() == 4:
            q, k, v = thd(q), thd(k), thd(v)
        check_packed_args(q, k, v, enable_gqa)

    def gather(self, t, extra, call: Call, world_size: int) -> Tensor:
        return torch.ops.cp.packed_sequence_order(
            gather_dim0(t, call.group_name, world_size), extra[0], world_size, False
        )

    def scatter(self, t, extra, call: Call, world_size: int) -> Tensor:
        in_rank_order = torch.ops.cp.packed_sequence_order(t, extra[0], world_size, True)
        return reduce_scatter_dim0(in_rank_order, call.group_name, world_size)


PACKED = register_kind(Packed())


def window_of(window_size, is_causal: bool) -> tuple[int, int]:
    """(left, right) as ``varlen_attn`` takes it; ``is_causal`` means right = 0."""
    if len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right); got {window_size}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {window_size}")
    if is_causal:
        if right > 0:
            raise ValueError(f"is_causal=True with window_size={tuple(window_size)}: a causal window has right = 0")
        right = 0
    return left, right
