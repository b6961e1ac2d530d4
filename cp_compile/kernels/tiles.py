"""Packed attention as per-document tiles over contiguous runs of tokens.

Packed tensors are ``[T, H, D]``; which rows hold which document positions
is described by runs (``layout.packed.Segment``: storage row, document, position,
length), computed from ``cu_seqlens`` alone. A query run and a key run of the
same document form a tile; the tile is trimmed to the rows that see some key
and the columns some row sees, then given the cheapest mask that is exact:

``none``    every pair visible (other documents' runs never pair)
``causal``  top-left causal: query a sees key b <= a
``band``    a window bounded behind (``left >= 0``): the math path, in blocks of
            at most ``BAND_ROWS`` queries, each against the keys its window
            reaches, so that a long run costs its length times the window,
            not its length squared

A causal tile shifted by ``right`` ahead (``left = -1``: causal, or causal
plus a few keys ahead) is split into a fully visible part and a top-left
causal part, so it never takes the math path. ``none`` and ``causal`` tiles
go to the fused kernels of ``block.py`` on strided views of the packed
tensors (rows are selected by offsets, never copied), so memory is per tile,
not (local slots x key slots). Each row's tiles merge through
the online softmax into an fp32 (fp64) accumulator; the backward runs the
same tiles against the final out and lse.

Padding rows are in no run: out = 0, lse = -inf, zero gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..layout.packed import Segment
from .block import (
    block_attn_backward_parts,
    block_attn_impl,
    math_attn_backward_impl,
    math_attn_impl,
    tile_visible,
)
from .merge import acc_dtype, merge_into_


class Tile(NamedTuple):
    q_row: int
    k_row: int
    q_len: int
    k_len: int
    mask: str  # "none" | "causal" | "band"
    offset: int  # position of the tile's first query minus that of its first key
    window: tuple[int, int]  # (left, right) as given: what a "band" tile evaluates


# queries per block of a band tile (``_tiles``): the math path holds heads x BAND_ROWS x (BAND_ROWS + window) scores
BAND_ROWS = 256


def _tiles(qs: Segment, ks: Segment, left: int, right: int) -> list[Tile]:
    """The part of (query run, key run) where anything is visible, as at most two tiles (a long band: a few per block
    of ``BAND_ROWS`` queries)."""
    k_lo, k_hi = ks.pos, ks.pos + ks.length
    q_lo, q_hi = qs.pos, qs.pos + qs.length
    if left >= 0:  # query i sees keys from i - left
        q_hi = min(q_hi, k_hi + left)
    if right >= 0:  # ... up to i + right
        q_lo = max(q_lo, k_lo - right)
    if q_lo >= q_hi:
        return []
    if left >= 0:
        k_lo = max(k_lo, q_lo - left)
    if right >= 0:
        k_hi = min(k_hi, q_hi + right)

    def tile(q0, q1, k0, k1, mask):
        return Tile(qs.row + q0 - qs.pos, ks.row + k0 - ks.pos, q1 - q0, k1 - k0, mask, q0 - k0, (left, right))

    if (left < 0 or q_hi - 1 - k_lo <= left) and (right < 0 or k_hi - 1 - q_lo <= right):
        return [tile(q_lo, q_hi, k_lo, k_hi, "none")]
    if left < 0 and right >= 0:  # causal, shifted by ``right``: only the fused kernels
        edge = q_lo + right + 1  # the first key the first query cannot see
        if k_lo == edge - 1:
            return [tile(q_lo, q_hi, k_lo, k_hi, "causal")]
        # keys before the edge are seen by every query; past it, query q_lo + 1 + a sees a + 1 of them
        return [tile(q_lo, q_hi, k_lo, edge, "none"), tile(q_lo + 1, q_hi, edge, k_hi, "causal")]
    if left >= 0 and q_hi - q_lo > BAND_ROWS:  # each block of queries against the keys its window reaches
        blocks = range(q_lo, q_hi, BAND_ROWS)
        runs = (Segment(qs.row + a - qs.pos, qs.doc, a, min(BAND_ROWS, q_hi - a)) for a in blocks)
        return [t for run in runs for t in _tiles(run, ks, left, right)]
    return [tile(q_lo, q_hi, k_lo, k_hi, "band")]


def _coalesce(tiles: list[Tile], along_keys: bool) -> list[Tile]:
    """Join fully visible tiles that are adjacent in storage (keys of one query range, or
    queries of one key range): fewer, larger kernel calls and merges."""
    key = (lambda t: (t.q_row, t.q_len, t.k_row)) if along_keys else (lambda t: (t.k_row, t.k_len, t.q_row))
    joined: list[Tile] = []
    for t in sorted(tiles, key=key):
        last = joined[-1] if joined else None
        if last is not None and last.mask == t.mask == "none":
            if along_keys and (last.q_row, last.q_len) == (t.q_row, t.q_len) and last.k_row + last.k_len == t.k_row:
                joined[-1] = last._replace(k_len=last.k_len + t.k_len)
                continue
            if not along_keys and (last.k_row, last.k_len) == (t.k_row, t.k_len) and last.q_row + last.q_len == t.q_row:
                joined[-1] = last._replace(q_len=last.q_len + t.q_len)
                continue
        joined.append(t)
    return joined


@functools.lru_cache(maxsize=256)
def plan_tiles(q_runs: tuple[Segment, ...], k_runs: tuple[Segment, ...], left: int, right: int) -> tuple[Tile, ...]:
    """Every tile with something visible (window ``(left, right)``, -1 unbounded).

    Cached: a step's forward and backward, and every layer of a model, plan the same tiles."""
    by_doc: dict[int, list[Segment]] = {}
    for ks in k_runs:
        by_doc.setdefault(ks.doc, []).append(ks)
    tiles = []
    for qs in q_runs:
        for ks in by_doc.get(qs.doc, ()):
            tiles += _tiles(qs, ks, left, right)
    return tuple(_coalesce(_coalesce(tiles, along_keys=True), along_keys=False))


def _bhld(t: Tensor, row: int, length: int) -> Tensor:
    """Rows [row, row + length) of a packed [T, H, ...] tensor as a [1, H, length, ...] view."""
    return t.narrow(0, row, length).transpose(0, 1).unsqueeze(0)


def _math(t: Tile, softcap: float) -> bool:
    """Band tiles, and every tile of soft-capped scores (no fused kernel caps), take the math path."""
    return t.mask == "band" or softcap > 0


def _visible(t: Tile, device):
    return tile_visible(t.mask, t.q_len, t.k_len, t.offset, t.window, device)


def tiles_attn(
    q: Tensor, k: Tensor, v: Tensor, tiles: Sequence[Tile], scale: float, softcap: float = 0.0
) -> tuple[Tensor, Tensor]:
    """(out [Tq, Hq, Dv] in q's dtype, lse [Tq, Hq] fp32/fp64); ``softcap > 0`` caps the scores."""
    dt = acc_dtype(q.dtype)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=dt, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=dt, device=q.device)
    reach = 0  # rows from here on hold no earlier tile's result
    for t in tiles:
        qt = _bhld(q, t.q_row, t.q_len)
        kt, vt = _bhld(k, t.k_row, t.k_len), _bhld(v, t.k_row, t.k_len)
        if _math(t, softcap):
            part_out, part_lse = math_attn_impl(qt, kt, vt, _visible(t, q.device), scale, softcap)
        else:
            part_out, part_lse = block_attn_impl(qt, kt, vt, t.mask, scale)
        rows_out, rows_lse = _bhld(out, t.q_row, t.q_len), _bhld(lse, t.q_row, t.q_len)
        if t.q_row >= reach:  # the first result for these rows: a copy, not a merge with the empty start
            rows_out.copy_(part_out)
            rows_lse.copy_(part_lse)
        else:
            merge_into_(rows_out, rows_lse, part_out, part_lse)
        reach = max(reach, t.q_row + t.q_len)
    return out.to(q.dtype), lse


def tiles_attn_backward(dout, q, k, v, out, lse, dlse, tiles: Sequence[Tile], scale: float, softcap: float = 0.0):
    """(dq, dk, dv) in the accumulator dtype, given the final out and lse (and an lse gradient)."""
    dt = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=dt, device=t.device) for t in (q, k, v))
    for t in tiles:
        rows = lambda x: _bhld(x, t.q_row, t.q_len)  # noqa: E731
        cols = lambda x: _bhld(x, t.k_row, t.k_len)  # noqa: E731
        args = (rows(dout), rows(q), cols(k), cols(v), rows(out), rows(lse))
        tile_dlse = None if dlse is None else rows(dlse)
        if _math(t, softcap):
            tq, tk, tv = math_attn_backward_impl(*args, _visible(t, q.device), scale, tile_dlse, softcap)
        else:
            tq, tk, tv = block_attn_backward_parts(*args, t.mask, scale, tile_dlse)
        rows(dq).add_(tq)
        cols(dk).add_(tk)
        cols(dv).add_(tv)
    return dq, dk, dv
