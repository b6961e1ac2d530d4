"""Ulysses (all-to-all) for FlexAttention masks and packed documents.

After the exchange every rank holds every token of the group for H/C heads.
A dense mask kernel does not care in which order those tokens sit, so the
exchange here skips the zigzag reorder of ``heads.seq_to_heads`` and keeps
the plain rank-order concatenation of every rank's shard (the
``"contiguous"`` exchange). Two reasons: for a BlockMask sharded by the plan
the index table's all-ranks region is already in that order (whatever the
layout, a mask-balanced one included), and for packed input the per-document
zigzag has no sequence order to restore at all. The mask is then evaluated
at those slots:

- flex: global positions from the sharded BlockMask's index table (or the
  layout's positions when there is no mask), the same on every rank. The
  mask_mod and score_mod see global head indices: the rank's first head is
  ``rank * H/C``, read at run time inside the op.
- packed: the runs of real tokens of every rank's slots in rank order
  (``layout.packed_segments``), computed from ``cu_seqlens`` alone and the
  same on every rank; ``ops.tiles`` attends per document over them.

Hybrid (2-D ``(ring, a2a)`` mesh): the same exchange inside each all-to-all
group, then a K/V ring across the groups; each ring step evaluates the mask
between this group's tokens and the visiting group's (sections below).

The schedule ops (``cp::flex_attention``, ``cp::varlen_attention``) keep the
sequence-sharded q, k, v, out and lse for their backward, so the Ulysses
backward exchanges them again (five all-to-alls more than the SDPA Ulysses op,
which keeps the head-sharded copies instead).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..layout import check_cu_seqlens, packed_local_len, packed_segments
from . import flex, varlen
from .block import acc_dtype, dense_like, result_like
from .comm import resolve_group
from .heads import check_heads, seq_to_heads
from .ring import ring_pass_backward, ring_pass_forward
from .tiles import plan_tiles, tiles_attn, tiles_attn_backward
from .ulysses import exchange_backward, exchange_forward, kv_copies

# the exchange without the zigzag reorder: every rank's shard in rank order
RANK_ORDER = "contiguous"


def _head_sharded(q, k, v, out, lse, group_name: str, world_size: int) -> tuple[Tensor, ...]:
    """The forward's head-sharded q, k, v, out, lse again (K/V heads replicated as the forward did)."""
    copies = kv_copies(q.shape[1], k.shape[1], world_size)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    return tuple(seq_to_heads(t, group_name, world_size, RANK_ORDER) for t in (q, k, v, out, lse))


# ----------------------------------------------------------------------------
# FlexAttention.
# ----------------------------------------------------------------------------


def _flex_call(q: Tensor, buffers, key, group_name, a2a_group, layout, mask_b, mask_h, scale):
    """The tile description for the tokens of this rank's all-to-all group and this rank's heads,
    and the group's index (its ring rank; 0 for plain Ulysses, where the group is everyone)."""
    a2a = resolve_group(a2a_group)
    group_size = a2a.size()
    # _resolve validates the index table against the local length: this group's tokens / its size
    call, rank, _ = flex._resolve(q.narrow(2, 0, q.shape[2] // group_size), buffers, key, group_name, layout,
                                  mask_b, mask_h, scale)
    heads = q.shape[1]
    if mask_h not in (1, heads * group_size):
        raise ValueError(f"block_mask has {mask_h} heads; expected 1 or the {heads * group_size} query heads")
    first = a2a.rank() * heads
    mods = call.mods
    mask = mods.mask
    if mask is not None and mask_h > 1:
        mask = lambda b, h, i, j, *bufs: mods.mask(b, h + first, i, j, *bufs)  # noqa: E731
    score = mods.score
    if score is not None:
        score = lambda s, b, h, i, j, *bufs: mods.score(s, b, h + first, i, j, *bufs)  # noqa: E731
    call = dataclasses.replace(call, mods=flex.Mods(mask, score, mods.n_mask_buffers),
                               mask_h=heads if mask_h > 1 else 1)
    return call, rank // group_size


def _flex_span(q: Tensor, group: int) -> Tensor:
    """Table indices of all-to-all group ``group``'s tokens (rank order)."""
    return torch.arange(group * q.shape[2], (group + 1) * q.shape[2], device=q.device)


@torch.library.custom_op("cp::flex_heads_attn", mutates_args=())
def flex_heads_attn(
    q: Tensor, k: Tensor, v: Tensor, buffers: list[Tensor], group_name: str, mods: str, layout: str,
    mask_b: int, mask_h: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """All of the group's tokens (rank order) for this rank's heads: the final (out, lse)."""
    call, _ = _flex_call(q, buffers, mods, group_name, group_name, layout, mask_b, mask_h, scale)
    every = _flex_span(q, 0)
    out, lse = flex.tile_forward(call, q, k, v, every, every)
    return out.contiguous(), lse.contiguous()


@flex_heads_attn.register_fake
def _(q, k, v, buffers, group_name, mods, layout, mask_b, mask_h, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::flex_heads_attn_backward", mutates_args=())
def flex_heads_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    buffers: list[Tensor], group_name: str, mods: str, layout: str, mask_b: int, mask_h: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    call, _ = _flex_call(q, buffers, mods, group_name, group_name, layout, mask_b, mask_h, scale)
    every = _flex_span(q, 0)
    grads = flex.tile_backward(call, dout, q, k, v, out, lse, dlse, every, every)
    return tuple(g.contiguous() for g in grads)


@flex_heads_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, buffers, group_name, mods, layout, mask_b, mask_h, scale):
    dt = acc_dtype(q.dtype)
    return tuple(torch.empty(t.shape, dtype=dt, device=t.device) for t in (q, k, v))


def flex_ulysses_forward(q, k, v, buffers, o: flex.FlexOptions) -> tuple[Tensor, Tensor]:
    ops, c = torch.ops.cp, o.world_size
    if c > 1:
        ops.agree(q, k, v, o.group_name, o.agreed("ulysses"))
    check_heads(q.shape[1], c, "the query")

    def attend(qh, kh, vh):
        return ops.flex_heads_attn(qh, kh, vh, buffers, o.group_name, *o.step_args)

    out, lse = exchange_forward(q, k, v, o.group_name, c, RANK_ORDER, attend)[:2]
    return out, lse


def flex_ulysses_backward(dout, q, k, v, out, lse, dlse, buffers, o: flex.FlexOptions):
    c = o.world_size
    qh, kh, vh, out_h, lse_h = _head_sharded(q, k, v, out, lse, o.group_name, c)

    def attend_backward(dout_h, dlse_h):
        return torch.ops.cp.flex_heads_attn_backward(dout_h, qh, kh, vh, out_h, lse_h, dlse_h, buffers,
                                                     o.group_name, *o.step_args)

    dq, dk, dv = exchange_backward(dout, dlse, o.group_name, c, RANK_ORDER, k.shape[1], attend_backward)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


flex.FORWARD["ulysses"] = flex_ulysses_forward
flex.BACKWARD["ulysses"] = flex_ulysses_backward


# ----------------------------------------------------------------------------
# Packed documents: [T, H, D] travels as [1, H, T, D].
# ----------------------------------------------------------------------------


def _bhsd(t: Tensor) -> Tensor:
    """[T, H, ...] -> [1, H, T, ...]"""
    return t.transpose(0, 1).unsqueeze(0)


def _thd(t: Tensor) -> Tensor:
    """[1, H, T, ...] -> [T, H, ...]"""
    return t.squeeze(0).transpose(0, 1)


def group_tiles(q: Tensor, cu_seqlens: Tensor, group_name: str, left: int, right: int) -> list:
    """Tiles between every rank's slots, rank order: from cu_seqlens alone, the same on every rank."""
    size = resolve_group(group_name).size()
    cu = check_cu_seqlens(cu_seqlens)
    expected = packed_local_len(cu, size) * size
    if q.shape[2] != expected:
        raise ValueError(
            f"head-sharded q has {q.shape[2]} slots but cu_seqlens={cu} gives {expected} over C={size}; "
            "shard packed inputs with ContextParallel.shard(x, 0, cu_seqlens=...)"
        )
    runs = packed_segments(cu, range(size), size)
    return plan_tiles(runs, runs, left, right)


@torch.library.custom_op("cp::varlen_heads_attn", mutates_args=())
def varlen_heads_attn(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, group_name: str, window_left: int, window_right: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Every rank's slots ([1, H/C, C*T_local, D], rank order) for this rank's heads: (out, lse [1, H/C, T])."""
    tiles = group_tiles(q, cu_seqlens, group_name, window_left, window_right)
    out, lse = tiles_attn(_thd(q), _thd(k), _thd(v), tiles, scale)
    return _bhsd(out).contiguous(), _bhsd(lse).contiguous()


@varlen_heads_attn.register_fake
def _(q, k, v, cu_seqlens, group_name, window_left, window_right, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::varlen_heads_attn_backward", mutates_args=())
def varlen_heads_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    cu_seqlens: Tensor, group_name: str, window_left: int, window_right: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    tiles = group_tiles(q, cu_seqlens, group_name, window_left, window_right)
    grads = tiles_attn_backward(_thd(dout), _thd(q), _thd(k), _thd(v), _thd(out), _thd(lse),
                                None if dlse is None else _thd(dlse), tiles, scale)
    return tuple(_bhsd(g).contiguous() for g in grads)


@varlen_heads_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, group_name, window_left, window_right, scale):
    dt = acc_dtype(q.dtype)
    return tuple(torch.empty(t.shape, dtype=dt, device=t.device) for t in (q, k, v))


def packed_ulysses_forward(q, k, v, cu_seqlens, *, group_name, world_size, window, scale, enable_gqa):
    varlen._start(q, k, v, cu_seqlens, group_name, world_size, "ulysses", *window, scale, enable_gqa)
    check_heads(q.shape[1], world_size, "the query")

    def attend(qh, kh, vh):
        return torch.ops.cp.varlen_heads_attn(qh, kh, vh, cu_seqlens, group_name, *window, scale)

    out, lse = exchange_forward(_bhsd(q), _bhsd(k), _bhsd(v), group_name, world_size, RANK_ORDER, attend)[:2]
    return _thd(out), _thd(lse)


def packed_ulysses_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, *, group_name, world_size, window, scale):
    qh, kh, vh, out_h, lse_h = _head_sharded(*(_bhsd(t) for t in (q, k, v, out, lse)), group_name, world_size)

    def attend_backward(dout_h, dlse_h):
        return torch.ops.cp.varlen_heads_attn_backward(dout_h, qh, kh, vh, out_h, lse_h, dlse_h, cu_seqlens,
                                                       group_name, *window, scale)

    grads = exchange_backward(_bhsd(dout), None if dlse is None else _bhsd(dlse), group_name, world_size,
                              RANK_ORDER, k.shape[1], attend_backward)
    return tuple(_thd(g).to(t.dtype) for g, t in zip(grads, (q, k, v)))


varlen._FORWARD["ulysses"] = packed_ulysses_forward
varlen._BACKWARD["ulysses"] = packed_ulysses_backward


# ----------------------------------------------------------------------------
# Packed documents on a 2-D (ring, a2a) mesh: all-to-all inside a group, ring across groups.
#
# Flattened rank f = j * A + a (ring rank j, all-to-all rank a) holds the
# packed slots of rank f of C = R * A. After the rank-order exchange inside
# group j a rank holds the slots of ranks jA .. jA+A-1 for H/A heads; at ring
# step i the K/V block is group (j - i) mod R's. Both slot lists come from
# cu_seqlens and the ring rank, read at run time.
# ----------------------------------------------------------------------------


def _group_runs(cu: list[int], group: int, a2a: int, world_size: int) -> tuple:
    return packed_segments(cu, range(group * a2a, (group + 1) * a2a), world_size)


def hybrid_step_tiles(q: Tensor, cu_seqlens: Tensor, step: int, ring_group: str, a2a_group: str,
                      left: int, right: int) -> list:
    ring = resolve_group(ring_group)
    j, rings, a2a = ring.rank(), ring.size(), resolve_group(a2a_group).size()
    cu = check_cu_seqlens(cu_seqlens)
    expected = packed_local_len(cu, rings * a2a) * a2a
    if q.shape[2] != expected:
        raise ValueError(
            f"head-sharded q has {q.shape[2]} slots but cu_seqlens={cu} gives {expected} per all-to-all group "
            f"of {a2a} over C={rings * a2a}; shard packed inputs with ContextParallel(mesh).shard(x, 0, cu_seqlens=...)"
        )
    source = (j - step) % rings
    mine = _group_runs(cu, j, a2a, rings * a2a)
    theirs = _group_runs(cu, source, a2a, rings * a2a)
    return plan_tiles(mine, theirs, left, right)


@torch.library.custom_op("cp::varlen_hybrid_block_attn", mutates_args=())
def varlen_hybrid_block_attn(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, step: int, ring_group: str, a2a_group: str,
    window_left: int, window_right: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """This group's slots against the K/V of group (ring rank - step) mod R, for this rank's heads."""
    tiles = hybrid_step_tiles(q, cu_seqlens, step, ring_group, a2a_group, window_left, window_right)
    out, lse = tiles_attn(_thd(q), _thd(k), _thd(v), tiles, scale)
    return _bhsd(out).contiguous(), _bhsd(lse).contiguous()


@varlen_hybrid_block_attn.register_fake
def _(q, k, v, cu_seqlens, step, ring_group, a2a_group, window_left, window_right, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::varlen_hybrid_block_attn_backward", mutates_args=())
def varlen_hybrid_block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    cu_seqlens: Tensor, step: int, ring_group: str, a2a_group: str, window_left: int, window_right: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    tiles = hybrid_step_tiles(q, cu_seqlens, step, ring_group, a2a_group, window_left, window_right)
    grads = tiles_attn_backward(_thd(dout), _thd(q), _thd(k), _thd(v), _thd(out), _thd(lse),
                                None if dlse is None else _thd(dlse), tiles, scale)
    return tuple(_bhsd(g).contiguous() for g in grads)


@varlen_hybrid_block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, step, ring_group, a2a_group, window_left, window_right, scale):
    dt = acc_dtype(q.dtype)
    return tuple(torch.empty(t.shape, dtype=dt, device=t.device) for t in (q, k, v))


def _ring_forward(qh, kh, vh, ring_group: str, attend_step):
    """The K/V ring over the R groups, ``attend_step(q, k, v, step) -> (out, lse)`` merged online."""
    out, lse = ring_pass_forward(qh, kh, vh, lambda step, k, v: attend_step(qh, k, v, step),
                                 group_name=ring_group, world_size=resolve_group(ring_group).size())
    return out.to(qh.dtype), lse


def _ring_backward(kh, vh, ring_group: str, attend_step_backward):
    """K/V travel the ring again, each block's dK/dV so far riding along;
    ``attend_step_backward(k, v, step) -> (dq, dk, dv)``."""
    # the first argument only sets the accumulation dtype, which q shares with k
    return ring_pass_backward(kh, kh, vh, lambda step, k, v: attend_step_backward(k, v, step),
                              group_name=ring_group, world_size=resolve_group(ring_group).size())


def packed_hybrid_forward(q, k, v, cu_seqlens, *, group_name, ring_group, a2a_group, window, scale, enable_gqa):
    a2a = resolve_group(a2a_group).size()
    world_size = resolve_group(ring_group).size() * a2a
    varlen._start(q, k, v, cu_seqlens, group_name, world_size, f"hybrid a2a={a2a}", *window, scale, enable_gqa)
    check_heads(q.shape[1], a2a, "the query")

    def attend_step(q, k, v, step):
        return torch.ops.cp.varlen_hybrid_block_attn(q, k, v, cu_seqlens, step, ring_group, a2a_group, *window,
                                                     scale)

    def attend(qh, kh, vh):
        return _ring_forward(qh, kh, vh, ring_group, attend_step)

    out, lse = exchange_forward(_bhsd(q), _bhsd(k), _bhsd(v), a2a_group, a2a, RANK_ORDER, attend)[:2]
    return _thd(out), _thd(lse)


def packed_hybrid_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, *, ring_group, a2a_group, window, scale):
    a2a = resolve_group(a2a_group).size()
    qh, kh, vh, out_h, lse_h = _head_sharded(*(_bhsd(t) for t in (q, k, v, out, lse)), a2a_group, a2a)

    def attend_backward(dout_h, dlse_h):
        def step_backward(k, v, step):
            return torch.ops.cp.varlen_hybrid_block_attn_backward(dout_h, qh, k, v, out_h, lse_h, dlse_h, cu_seqlens,
                                                                  step, ring_group, a2a_group, *window, scale)

        return _ring_backward(kh, vh, ring_group, step_backward)

    grads = exchange_backward(_bhsd(dout), None if dlse is None else _bhsd(dlse), a2a_group, a2a, RANK_ORDER,
                              k.shape[1], attend_backward)
    return tuple(_thd(g).to(t.dtype) for g, t in zip(grads, (q, k, v)))


@torch.library.custom_op("cp::varlen_hybrid_attention", mutates_args=())
def varlen_hybrid_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, group_name: str, ring_group: str, a2a_group: str,
    window_left: int, window_right: int, scale: float, enable_gqa: bool,
) -> tuple[Tensor, Tensor]:
    """Packed attention of this rank's slots on a (ring, a2a) mesh: (out, lse [T, H])."""
    out, lse = packed_hybrid_forward(q, k, v, cu_seqlens, group_name=group_name, ring_group=ring_group,
                                     a2a_group=a2a_group, window=(window_left, window_right), scale=scale,
                                     enable_gqa=enable_gqa)
    return out.contiguous(), lse.contiguous()


@varlen_hybrid_attention_op.register_fake
def _(q, k, v, cu_seqlens, group_name, ring_group, a2a_group, window_left, window_right, scale, enable_gqa):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("cp::varlen_hybrid_attention_backward", mutates_args=())
def varlen_hybrid_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    cu_seqlens: Tensor, ring_group: str, a2a_group: str, window_left: int, window_right: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = packed_hybrid_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, ring_group=ring_group,
                                        a2a_group=a2a_group, window=(window_left, window_right), scale=scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@varlen_hybrid_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, ring_group, a2a_group, window_left, window_right, scale):
    return dense_like(q), dense_like(k), dense_like(v)


def _hybrid_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, _, ring_group, a2a_group, left, right, scale, _ = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.options = (ring_group, a2a_group, left, right, scale)
    ctx.set_materialize_grads(False)


def _hybrid_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.cp.varlen_hybrid_attention_backward(dout, q, k, v, out, lse, dlse, cu_seqlens,
                                                               *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None


varlen_hybrid_attention_op.register_autograd(_hybrid_backward, setup_context=_hybrid_setup)


def varlen_hybrid_attention(q, k, v, cu_seqlens, mesh, left: int, right: int, scale: float, enable_gqa: bool):
    """``varlen_attention(..., group=mesh, schedule="hybrid")``: ``mesh`` is a 2-D (ring, a2a) DeviceMesh
    or its (flattened, ring, a2a) group names."""
    from .hybrid import mesh_groups

    group_name, ring_group, a2a_group = mesh if isinstance(mesh, tuple) else mesh_groups(mesh)
    return varlen_hybrid_attention_op(q, k, v, cu_seqlens, group_name, ring_group, a2a_group, left, right, scale,
                                      enable_gqa)[0]


# ----------------------------------------------------------------------------
# FlexAttention on a 2-D (ring, a2a) mesh. The group's tokens are the index
# table's entries jA*S_local .. (j+1)A*S_local (rank order); at ring step i the
# K/V are group (j - i) mod R's. j and the head offset are read at run time.
# ----------------------------------------------------------------------------


def _flex_hybrid_tile(q, buffers, step, group_name, a2a_group, mods, layout, mask_b, mask_h, scale):
    call, group = _flex_call(q, buffers, mods, group_name, a2a_group, layout, mask_b, mask_h, scale)
    rings = resolve_group(group_name).size() // resolve_group(a2a_group).size()
    return call, _flex_span(q, group), _flex_span(q, (group - step) % rings)


@torch.library.custom_op("cp::flex_hybrid_block_attn", mutates_args=())
def flex_hybrid_block_attn(
    q: Tensor, k: Tensor, v: Tensor, buffers: list[Tensor], step: int, group_name: str, a2a_group: str, mods: str,
    layout: str, mask_b: int, mask_h: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """This all-to-all group's tokens against group (ring rank - step) mod R's K/V, this rank's heads."""
    call, rows, cols = _flex_hybrid_tile(q, buffers, step, group_name, a2a_group, mods, layout, mask_b, mask_h,
                                         scale)
    out, lse = flex.tile_forward(call, q, k, v, rows, cols)
    return out.contiguous(), lse.contiguous()


@flex_hybrid_block_attn.register_fake
def _(q, k, v, buffers, step, group_name, a2a_group, mods, layout, mask_b, mask_h, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::flex_hybrid_block_attn_backward", mutates_args=())
def flex_hybrid_block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    buffers: list[Tensor], step: int, group_name: str, a2a_group: str, mods: str, layout: str, mask_b: int,
    mask_h: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    call, rows, cols = _flex_hybrid_tile(q, buffers, step, group_name, a2a_group, mods, layout, mask_b, mask_h,
                                         scale)
    grads = flex.tile_backward(call, dout, q, k, v, out, lse, dlse, rows, cols)
    return tuple(g.contiguous() for g in grads)


@flex_hybrid_block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, buffers, step, group_name, a2a_group, mods, layout, mask_b, mask_h, scale):
    dt = acc_dtype(q.dtype)
    return tuple(torch.empty(t.shape, dtype=dt, device=t.device) for t in (q, k, v))


def flex_hybrid_forward(q, k, v, buffers, group_name, ring_group, a2a_group, mods, layout, mask_b, mask_h, scale):
    ops, a2a = torch.ops.cp, resolve_group(a2a_group).size()
    if resolve_group(group_name).size() > 1:
        ops.agree(q, k, v, group_name, f"flex hybrid a2a={a2a} layout={layout} mask={mask_b}x{mask_h} scale={scale!r}")
    check_heads(q.shape[1], a2a, "the query")
    step_args = (group_name, a2a_group, mods, layout, mask_b, mask_h, scale)

    def attend(qh, kh, vh):
        return _ring_forward(qh, kh, vh, ring_group,
                             lambda q_, k_, v_, step: ops.flex_hybrid_block_attn(q_, k_, v_, buffers, step, *step_args))

    return exchange_forward(q, k, v, a2a_group, a2a, RANK_ORDER, attend)[:2]


def flex_hybrid_backward(dout, q, k, v, out, lse, dlse, buffers, group_name, ring_group, a2a_group, mods, layout,
                         mask_b, mask_h, scale):
    a2a = resolve_group(a2a_group).size()
    qh, kh, vh, out_h, lse_h = _head_sharded(q, k, v, out, lse, a2a_group, a2a)
    step_args = (group_name, a2a_group, mods, layout, mask_b, mask_h, scale)

    def attend_backward(dout_h, dlse_h):
        def step_backward(k_, v_, step):
            return torch.ops.cp.flex_hybrid_block_attn_backward(dout_h, qh, k_, v_, out_h, lse_h, dlse_h, buffers,
                                                                step, *step_args)

        return _ring_backward(kh, vh, ring_group, step_backward)

    dq, dk, dv = exchange_backward(dout, dlse, a2a_group, a2a, RANK_ORDER, k.shape[1], attend_backward)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("cp::flex_hybrid_attention", mutates_args=())
def flex_hybrid_attention_op(
    q: Tensor, k: Tensor, v: Tensor, buffers: list[Tensor], group_name: str, ring_group: str, a2a_group: str,
    mods: str, layout: str, mask_b: int, mask_h: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """FlexAttention of this rank's queries on a (ring, a2a) mesh: (out, lse)."""
    out, lse = flex_hybrid_forward(q, k, v, buffers, group_name, ring_group, a2a_group, mods, layout, mask_b,
                                   mask_h, scale)
    return out.contiguous(), lse.contiguous()


@flex_hybrid_attention_op.register_fake
def _(q, k, v, buffers, group_name, ring_group, a2a_group, mods, layout, mask_b, mask_h, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::flex_hybrid_attention_backward", mutates_args=())
def flex_hybrid_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    buffers: list[Tensor], group_name: str, ring_group: str, a2a_group: str, mods: str, layout: str, mask_b: int,
    mask_h: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = flex_hybrid_backward(dout, q, k, v, out, lse, dlse, buffers, group_name, ring_group, a2a_group,
                                      mods, layout, mask_b, mask_h, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@flex_hybrid_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, buffers, group_name, ring_group, a2a_group, mods, layout, mask_b, mask_h,
      scale):
    return dense_like(q), dense_like(k), dense_like(v)


flex.register_flex_autograd(flex_hybrid_attention_op, torch.ops.cp.flex_hybrid_attention_backward)


def flex_hybrid_attention(q, k, v, buffers, mesh, mods: str, layout: str, mask_b: int, mask_h: int, scale: float):
    """``flex_attention(..., group=mesh, schedule="hybrid")``: (out, lse); ``mesh`` is a 2-D (ring, a2a)
    DeviceMesh or its (flattened, ring, a2a) group names."""
    from .hybrid import mesh_groups

    names = mesh if isinstance(mesh, tuple) else mesh_groups(mesh)
    return flex_hybrid_attention_op(q, k, v, buffers, *names, mods, layout, mask_b, mask_h, scale)
