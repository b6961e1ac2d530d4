"""Dense attention (``F.scaled_dot_product_attention``): causal or not, over ``[B, H, S, D]``.

Visibility comes from positions alone, so a tile is one of a few sections of
the dense block, each run by the fused kernels of ``kernels.block``.

Ring steps (zigzag layout: rank r holds global chunks r and 2C-1-r; causal;
keys of unit j = (r - i) mod R at step i, a unit being one rank or, for the
hybrid, one all-to-all group whose exchange put its tokens in sequence order):

- j == r:  local causal attention over both halves (``diagonal``);
- j < r:   all of Q against the first K/V half, no mask;
- j > r:   the second Q half against all of K/V, no mask.

Every step thus costs the same half-size work on every rank. The contiguous
layout (rank r holds chunk r) is supported; under causality it leaves rank 0
idle for most steps. Non-causal attention is full Q against full K/V. Ulysses
(``WHOLE``: one unit holding the whole sequence) is the diagonal step.

Gathered keys are in sequence order: each local query chunk sees a prefix of
them (bottom-right-aligned causal), computed in tiles no wider than a chunk,
so the backward holds the gathered K/V and fp32 dK/dV and little else. A
short block on CPU runs as one masked call of the fused kernel instead: there
the tiles' calls and merges cost more than the attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.block import (
    _lse_grad,
    _tile_bwd,
    block_attn_backward_impl,
    block_attn_impl,
    check_block_args,
    dense_like,
)
from ..kernels.masked import all_finite, fused_masked_attn, fused_masked_attn_backward, fused_masked_ready
from ..kernels.merge import acc_dtype
from ..layout import DIAGONAL, FULL, KV_FIRST_HALF, Q_SECOND_HALF, layout_named
from .base import GATHERED, Kind, Units, check_heads_and_lengths, register_kind
from .call import Call


def ring_section(is_causal: bool, layout: str, rank: int, source: int) -> str:
    """The part of the tile unit ``rank`` computes against K/V from unit ``source``."""
    if not is_causal:
        return FULL
    if source == rank:
        return DIAGONAL
    return layout_named(layout).causal_section(rank, source)


def _halves(length: int) -> tuple[slice, slice]:
    return slice(0, length // 2), slice(length // 2, length)


def section_attn(q: Tensor, k: Tensor, v: Tensor, section: str, scale: float) -> tuple[Tensor, Tensor]:
    """Full-size (out, lse) for one section; rows it does not touch are out=0, lse=-inf."""
    if section in (FULL, DIAGONAL):
        return block_attn_impl(q, k, v, "causal" if section == DIAGONAL else "none", scale)
    if section == KV_FIRST_HALF:
        first, _ = _halves(k.shape[2])
        return block_attn_impl(q, k[:, :, first], v[:, :, first], "none", scale)
    out, lse = block_attn_impl(q, k, v, "empty", scale)
    if section == Q_SECOND_HALF:
        _, second = _halves(q.shape[2])
        out[:, :, second], lse[:, :, second] = block_attn_impl(q[:, :, second], k, v, "none", scale)
    return out, lse


def section_attn_backward(dout, q, k, v, out, lse, dlse, section: str, scale: float):
    """Full-size (dq, dk, dv) of one section, given the final out and lse."""
    if section in (FULL, DIAGONAL):
        mask = "causal" if section == DIAGONAL else "none"
        return block_attn_backward_impl(dout, q, k, v, out, lse, mask, scale, dlse)
    # zeros only where the section leaves gradients untouched: each full-size
    # temporary here is one more local-q unit at the backward's peak
    if section == KV_FIRST_HALF:
        first, _ = _halves(k.shape[2])
        dq, dk_half, dv_half = block_attn_backward_impl(
            dout, q, k[:, :, first], v[:, :, first], out, lse, "none", scale, dlse
        )
        dk, dv = (torch.cat([g, g.new_zeros(g.shape)], dim=2) for g in (dk_half, dv_half))
        return dq, dk, dv
    if section == Q_SECOND_HALF:
        _, rows = _halves(q.shape[2])
        dq_half, dk, dv = block_attn_backward_impl(
            dout[:, :, rows],
            q[:, :, rows],
            k,
            v,
            out[:, :, rows],
            lse[:, :, rows].contiguous(),
            "none",
            scale,
            None if dlse is None else dlse[:, :, rows],
        )
        return torch.cat([dq_half.new_zeros(dq_half.shape), dq_half], dim=2), dk, dv
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


# ----------------------------------------------------------------------------
# Gathered keys: local Q chunks against their visible prefix.
# ----------------------------------------------------------------------------


def _q_chunks(q_len: int, rank: int, world_size: int, is_causal: bool, layout: str):
    """(local q rows, number of visible global keys, mask) per local chunk."""
    if not is_causal:
        return [(slice(0, q_len), None, "none")]
    prefixes = layout_named(layout).visible_prefixes(q_len, rank, world_size)
    return [(rows, visible, "causal_bottom_right") for rows, visible in prefixes]


def _key_tiles(q_len: int, visible: int, mask: str, width: int):
    """(key columns, causal) tiles covering a chunk's visible keys, each at most ``width`` wide.

    Narrow tiles keep each kernel's dK/dV temporaries one chunk in size, so
    the backward holds the gathered K/V and fp32 dK/dV and little else, at
    any C. Bottom-right causal is a visible prefix plus a top-left causal
    square ending at ``visible``.
    """
    end = visible - q_len if mask == "causal_bottom_right" else visible
    tiles = [(slice(a, min(a + width, end)), False) for a in range(0, end, width)]
    if mask == "causal_bottom_right":
        tiles.append((slice(end, visible), True))
    return tiles


# A gathered block of at most this many query x key entries runs as one masked call (``_gathered_visible``).
# The masked kernel computes the masked half of a causal block too, so it pays only where the tiles' calls
# and merges cost more: forward + backward of 128 local queries against 256 keys (4/2 heads of 32, one
# thread) took 1.4 ms against 1.6 to 1.8 in tiles, 256 against 512 took 4.3 against 3.1 to 3.4.
ONE_CALL_ENTRIES = 1 << 15


def _gathered_visible(q, k, v, units: Units, call: Call):
    """[Lq, Lk] bool of what the local queries see of the gathered keys, where one masked call of the fused
    kernel serves the whole block (short, on CPU); None where the tiles run."""
    lq, lk = q.shape[2], k.shape[2]
    if lq * lk > ONE_CALL_ENTRIES or not fused_masked_ready(q, k, v) or not all_finite(k):
        return None  # (a NaN key the mask hides would pass the fused kernel's additive mask)
    visible = torch.zeros(lq, lk, dtype=torch.bool, device=q.device)
    for rows, seen, _ in _q_chunks(lq, units.rank, units.world_size, call.is_causal, call.layout):
        if seen is None:  # every key
            visible[rows] = True
        else:  # bottom-right causal over the first ``seen`` keys
            n = rows.stop - rows.start
            visible[rows, :seen] = torch.ones(n, seen, dtype=torch.bool, device=q.device).tril(seen - n)
    return visible


def gathered_attn(q, k, v, units: Units, call: Call):
    visible = _gathered_visible(q, k, v, units, call)
    if visible is not None:
        return fused_masked_attn(q, k, v, visible, call.scale)
    outs, lses = [], []
    for rows, visible, mask in _q_chunks(q.shape[2], units.rank, units.world_size, call.is_causal, call.layout):
        cols = slice(0, k.shape[2] if visible is None else visible)
        out, lse = block_attn_impl(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask, call.scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def gathered_attn_backward(dout, q, k, v, out, lse, dlse, units: Units, call: Call):
    """dQ (q's dtype) and the full-length dK/dV in the accumulator dtype, ready to reduce-scatter."""
    visible = None if dlse is not None else _gathered_visible(q, k, v, units, call)
    if visible is not None:
        return fused_masked_attn_backward(dout, q, k, v, out, lse, visible, call.scale)
    dt = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=k.device)
    dv = torch.zeros(v.shape, dtype=dt, device=v.device)
    chunks = _q_chunks(q.shape[2], units.rank, units.world_size, call.is_causal, call.layout)
    for rows, visible, mask in chunks:
        q_r, out_r, dout_r = q[:, :, rows], out[:, :, rows], dout[:, :, rows].contiguous()
        lse_r = lse[:, :, rows].contiguous()
        width = q_r.shape[2]
        for cols, causal in _key_tiles(q_r.shape[2], k.shape[2] if visible is None else visible, mask, width):
            k_c, v_c = k[:, :, cols], v[:, :, cols]
            tq, tk, tv = _tile_bwd(dout_r, q_r, k_c, v_c, out_r, lse_r, causal, call.scale)
            if dlse is not None:
                eq, ek = _lse_grad(dlse[:, :, rows], q_r, k_c, lse_r, causal, call.scale)
                tq, tk = tq + eq, tk + ek
            dq[:, :, rows] += tq
            dk[:, :, cols] += tk
            dv[:, :, cols] += tv
            del tq, tk, tv
    return dq.to(q.dtype), dk, dv


def check_sdpa_args(
    q: Tensor, k: Tensor, v: Tensor, world_size: int, is_causal: bool, layout: str, enable_gqa: bool
) -> None:
    """Local checks; identical inputs on every rank give identical verdicts."""
    pieces = layout_named(layout).chunks_per_rank(world_size)
    check_block_args(q, k, v, "none")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    check_heads_and_lengths(q, k, enable_gqa)
    if is_causal and world_size > 1 and q.shape[2] % pieces:
        raise ValueError(
            f"the {layout} layout holds {pieces} equal chunks per rank, but the local length {q.shape[2]} does not "
            f"split into them; shard with ContextParallel.shard so the sequence splits into {pieces}*C chunks"
        )


class Sdpa(Kind):
    name = "sdpa"

    def attend(self, q, k, v, extra, units: Units, call: Call):
        if units.gathered:
            return gathered_attn(q, k, v, units, call)
        section = ring_section(call.is_causal, call.layout, units.q_unit, units.k_unit)
        return section_attn(q, k, v, section, call.scale)

    def attend_backward(self, dout, q, k, v, out, lse, dlse, extra, units: Units, call: Call):
        if units.gathered:
            return gathered_attn_backward(dout, q, k, v, out, lse, dlse, units, call)
        section = ring_section(call.is_causal, call.layout, units.q_unit, units.k_unit)
        return section_attn_backward(dout, q, k, v, out, lse, dlse, section, call.scale)

    def grads_like(self, q, k, v, step):
        if step == GATHERED:  # dK/dV in the accumulator dtype, for the reduce-scatter
            dt = acc_dtype(q.dtype)
            return dense_like(q), k.new_empty(k.shape, dtype=dt), v.new_empty(v.shape, dtype=dt)
        return dense_like(q), dense_like(k), dense_like(v)

    def agreed(self, call: Call) -> str:
        return f"causal={call.is_causal} layout={call.layout} scale={call.scale!r}"

    def check(self, q, k, v, call: Call, world_size: int, enable_gqa: bool) -> None:
        check_sdpa_args(q, k, v, world_size, call.is_causal, call.layout, enable_gqa)


SDPA = register_kind(Sdpa())
