"""Ulysses (all-to-all) and hybrid schedules for FlexAttention masks and packed documents.

These are not schedules of their own: they are two inner attentions,
``"flex"`` and ``"packed"``, of the head-sharding ops ``cp::ulysses_attention``
and ``cp::hybrid_attention`` (``ops.ulysses.INNER``). Their tensors (the
mods' buffers, ``cu_seqlens``) travel as the ops' ``extra`` list and their
settings as the ``options`` string (``flex_options``, ``packed_options``).
So the exchange, the GQA head replication, the autograd and the compiled
expansion are the SDPA ones, written once, and so is what the backward keeps:
the forward op returns the head-sharded q, k, v, out and lse, the backward
keeps those and moves only dout (and dlse) in and dq, dk, dv out over the
all-to-all group (the hybrid's K/V and dK/dV still travel its ring).

After the exchange every rank holds every token of the group for H/C heads.
The masked kernels do not care in which order those tokens sit, so both
inner attentions exchange in plain rank order (``Inner.rank_order``: every
rank's shard concatenated, the ``"contiguous"`` exchange) rather than
restoring the zigzag's sequence order. Two reasons: for a BlockMask sharded
by the plan the index table's all-ranks region is already in that order
(whatever the layout, a mask-balanced one included), and for packed input
the per-document zigzag has no sequence order to restore at all. The mask is
then evaluated at those slots:

- flex: global positions from the sharded BlockMask's index table (or the
  layout's positions when there is no mask), the same on every rank. The
  mask_mod and score_mod see global head indices: the rank's first head is
  ``rank * H/C``, read at run time inside the op.
- packed: the runs of real tokens of every rank's slots in rank order
  (``layout.packed_segments``), computed from ``cu_seqlens`` alone and the
  same on every rank; ``ops.tiles`` attends per document over them.
  Packed tensors are THD ``[T, H, D]``; the ops see them as ``[1, H, T, D]``
  views (``_bhsd``), made outside the ops (in ``packed_heads_attention`` and
  the compiled varlen site), so the ops, their fakes and their expansion are
  the 4-D ones unchanged.

Hybrid (2-D ``(ring, a2a)`` mesh): the same exchange inside each all-to-all
group, then a K/V ring across the groups; each ring step evaluates the mask
between this group's tokens and the visiting group's (sections below).

``cp::flex_attention`` and ``cp::varlen_attention`` keep the ring and
all-gather schedules only (two outputs, sequence-sharded tensors saved): for
``schedule="ulysses"`` / ``"hybrid"`` the public entry points
(``flex_attention``, ``varlen_attention``, the compiled flex and varlen
sites) insert the head-sharding ops instead (``heads_schedule``), and the
whole ops refuse those names.

Why one op with a pluggable inner attention rather than Ulysses / hybrid ops
per mask kind: what differs between SDPA, a BlockMask and packed documents is
the kernel on head-sharded tensors (and the hybrid's per-step kernel), not
the schedule; a per-kind op pair would repeat the exchange, the saved-tensor
autograd, the fakes and the expansion, and differences in what the backward
keeps (as there were) creep in. The price is the stringly ``options``,
parsed by the entry (``HeadsCall.option``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..layout import check_cu_seqlens, packed_local_len, packed_segments
from . import flex, varlen
from .block import acc_dtype, result_like
from .comm import resolve_group
from .registry import register_compute_ops
from .ring import group_name_of, ring_pass_backward, ring_pass_forward
from .tiles import plan_tiles, tiles_attn, tiles_attn_backward
from .ulysses import INNER, HeadsCall, Inner

# the exchange without the zigzag reorder: every rank's shard in rank order
RANK_ORDER = "contiguous"
HEAD_SCHEDULES = ("ulysses", "hybrid")


def _ring_forward(qh, kh, vh, ring_group: str, attend_step):
    """The K/V ring over the R groups, ``attend_step(q, k, v, step) -> (out, lse)`` merged online."""
    out, lse = ring_pass_forward(qh, kh, vh, lambda step, k, v: attend_step(qh, k, v, step),
                                 group_name=ring_group, world_size=resolve_group(ring_group).size())
    return out.to(qh.dtype), lse


def _ring_backward(qh, kh, vh, ring_group: str, attend_step_backward, q_side: tuple = ()):
    """K/V travel the ring again, each block's dK/dV so far riding along;
    ``attend_step_backward(k, v, step, *q_side) -> (dq, dk, dv)``. Given ``q_side``
    (dout, q, out, lse, dlse), a step runs in head halves (``ring_pass_backward``)."""
    return ring_pass_backward(qh, kh, vh, lambda step, k, v, *q_part: attend_step_backward(k, v, step, *q_part),
                              group_name=ring_group, world_size=resolve_group(ring_group).size(),
                              q_side=q_side, split_heads=bool(q_side))


# ----------------------------------------------------------------------------
# FlexAttention.
# ----------------------------------------------------------------------------


def flex_options(mods: str, mask_b: int, mask_h: int) -> str:
    """The ``options`` of the ``"flex"`` inner attention: the mods key and the BlockMask's (B, H)."""
    return f"mods={mods} mask={int(mask_b)}x{int(mask_h)}"


def _flex_settings(call: HeadsCall) -> tuple[str, int, int]:
    mask_b, mask_h = call.option("mask").split("x")
    return call.option("mods"), int(mask_b), int(mask_h)


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


def _flex_heads_tile(q: Tensor, buffers: list, call: HeadsCall):
    mods, mask_b, mask_h = _flex_settings(call)
    tile, _ = _flex_call(q, buffers, mods, call.group_name, call.a2a_group, call.layout, mask_b, mask_h, call.scale)
    return tile, _flex_span(q, 0)


def flex_heads_forward(q, k, v, buffers, call: HeadsCall):
    """All of the group's tokens (rank order) for this rank's heads: the final (out, lse)."""
    tile, every = _flex_heads_tile(q, buffers, call)
    return flex.tile_forward(tile, q, k, v, every, every)


def flex_heads_backward(dout, q, k, v, out, lse, dlse, buffers, call: HeadsCall):
    tile, every = _flex_heads_tile(q, buffers, call)
    return flex.tile_backward(tile, dout, q, k, v, out, lse, dlse, every, every)


def _flex_start(q, k, v, buffers, call: HeadsCall, world_size: int, enable_gqa: bool, what: str) -> None:
    # the mods key is per process (eager keys hold object ids): not compared
    _, mask_b, mask_h = _flex_settings(call)
    if world_size > 1:
        torch.ops.cp.agree(q, k, v, call.group_name, f"flex {what} mask={mask_b}x{mask_h}")


# ----------------------------------------------------------------------------
# Packed documents: [T, H, D] travels as [1, H, T, D].
# ----------------------------------------------------------------------------


def packed_options(window_left: int, window_right: int) -> str:
    """The ``options`` of the ``"packed"`` inner attention: the window (left, right)."""
    return f"window={int(window_left)},{int(window_right)}"


def _window(call: HeadsCall) -> tuple[int, int]:
    left, right = call.option("window").split(",")
    return int(left), int(right)


def _bhsd(t: Tensor) -> Tensor:
    """[T, H, ...] -> [1, H, T, ...]"""
    return t.transpose(0, 1).unsqueeze(0)


def _thd(t: Tensor) -> Tensor:
    """[1, H, T, ...] -> [T, H, ...]"""
    return t.squeeze(0).transpose(0, 1)


def group_tiles(q: Tensor, cu_seqlens: Tensor, group_name: str, left: int, right: int) -> tuple:
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


def varlen_heads_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, group_name: str, window_left: int,
                         window_right: int, scale: float) -> tuple[Tensor, Tensor]:
    """Every rank's slots ([1, H/C, C*T_local, D], rank order) for this rank's heads: (out, lse [1, H/C, T])."""
    tiles = group_tiles(q, cu_seqlens, group_name, window_left, window_right)
    out, lse = tiles_attn(_thd(q), _thd(k), _thd(v), tiles, scale)
    return _bhsd(out), _bhsd(lse)


def varlen_heads_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          dlse: Optional[Tensor], cu_seqlens: Tensor, group_name: str, window_left: int,
                          window_right: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    tiles = group_tiles(q, cu_seqlens, group_name, window_left, window_right)
    grads = tiles_attn_backward(_thd(dout), _thd(q), _thd(k), _thd(v), _thd(out), _thd(lse),
                                None if dlse is None else _thd(dlse), tiles, scale)
    return tuple(_bhsd(g) for g in grads)


def _packed_start(q, k, v, extra, call: HeadsCall, world_size: int, enable_gqa: bool, what: str) -> None:
    (cu_seqlens,) = extra
    varlen._start(_thd(q), _thd(k), _thd(v), cu_seqlens, call.group_name, world_size, what, *_window(call),
                  call.scale, enable_gqa)


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
                      left: int, right: int) -> tuple:
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


def _packed_ring_forward(qh, kh, vh, extra, call: HeadsCall):
    (cu_seqlens,) = extra

    def attend_step(q, k, v, step):
        return torch.ops.cp.varlen_hybrid_block_attn(q, k, v, cu_seqlens, step, call.ring_group, call.a2a_group,
                                                     *_window(call), call.scale)

    return _ring_forward(qh, kh, vh, call.ring_group, attend_step)


def _packed_ring_backward(dout, qh, kh, vh, out, lse, dlse, extra, call: HeadsCall):
    (cu_seqlens,) = extra

    def step_backward(k, v, step, dout, q, out, lse, dlse):
        return torch.ops.cp.varlen_hybrid_block_attn_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, step,
                                                              call.ring_group, call.a2a_group, *_window(call),
                                                              call.scale)

    # the tiles depend on tokens only, so a step splits into head halves as the SDPA ring's does
    return _ring_backward(qh, kh, vh, call.ring_group, step_backward, q_side=(dout, qh, out, lse, dlse))


INNER["packed"] = Inner(
    forward=lambda q, k, v, extra, call: varlen_heads_forward(q, k, v, extra[0], call.group_name, *_window(call),
                                                              call.scale),
    backward=lambda dout, q, k, v, out, lse, dlse, extra, call: varlen_heads_backward(
        dout, q, k, v, out, lse, dlse, extra[0], call.group_name, *_window(call), call.scale),
    start=_packed_start,
    ring_forward=_packed_ring_forward,
    ring_backward=_packed_ring_backward,
    rank_order=True,
)


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


def _flex_step_args(call: HeadsCall) -> tuple:
    mods, mask_b, mask_h = _flex_settings(call)
    return (call.group_name, call.a2a_group, mods, call.layout, mask_b, mask_h, call.scale)


def _flex_ring_forward(qh, kh, vh, buffers, call: HeadsCall):
    args = _flex_step_args(call)
    return _ring_forward(qh, kh, vh, call.ring_group, lambda q, k, v, step: torch.ops.cp.flex_hybrid_block_attn(
        q, k, v, buffers, step, *args))


def _flex_ring_backward(dout, qh, kh, vh, out, lse, dlse, buffers, call: HeadsCall):
    args = _flex_step_args(call)

    def step_backward(k, v, step):  # one part per step: a score_mod may read the head index
        return torch.ops.cp.flex_hybrid_block_attn_backward(dout, qh, k, v, out, lse, dlse, buffers, step, *args)

    return _ring_backward(qh, kh, vh, call.ring_group, step_backward)


INNER["flex"] = Inner(
    forward=flex_heads_forward,
    backward=flex_heads_backward,
    start=_flex_start,
    ring_forward=_flex_ring_forward,
    ring_backward=_flex_ring_backward,
    rank_order=True,
)

# listing names starting with "attend" carry the step number, the first int argument
register_compute_ops({
    torch.ops.cp.flex_hybrid_block_attn.default: "attend",
    torch.ops.cp.flex_hybrid_block_attn_backward.default: "attend_backward",
    torch.ops.cp.varlen_hybrid_block_attn.default: "packed attend",
    torch.ops.cp.varlen_hybrid_block_attn_backward.default: "packed attend_backward",
})


# ----------------------------------------------------------------------------
# Entry points: which op a "ulysses" or "hybrid" flex / packed call becomes.
# ----------------------------------------------------------------------------


def heads_schedule(schedule: str, group_name: str, mesh_groups: tuple = ()):
    """(whole forward op, its group arguments) for ``schedule`` over the plan's group: the op is
    called as ``op(q, k, v, extra, *groups, is_causal, layout, scale, enable_gqa, inner, options)``."""
    if schedule == "ulysses":
        return torch.ops.cp.ulysses_attention.default, (group_name,)
    if schedule == "hybrid":
        if len(mesh_groups) != 2:
            raise ValueError("schedule='hybrid' needs a 2-D DeviceMesh (ring, a2a) as the group")
        return torch.ops.cp.hybrid_attention.default, (group_name, *mesh_groups)
    raise ValueError(f"schedule {schedule!r} does not shard heads; expected one of {HEAD_SCHEDULES}")


def _groups_of(group, schedule: str) -> tuple[str, tuple]:
    """(group name, mesh groups) of an eager call's ``group``: a group (name) or, for the hybrid,
    a 2-D (ring, a2a) DeviceMesh or its (flattened, ring, a2a) group names."""
    if schedule != "hybrid":
        return group_name_of(group), ()
    from .hybrid import mesh_groups

    names = group if isinstance(group, tuple) else mesh_groups(group)
    return names[0], tuple(names[1:])


def flex_heads_attention(q, k, v, buffers, group, schedule: str, mods: str, layout: str, mask_b: int, mask_h: int,
                         scale: float, enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """``flex_attention(..., schedule="ulysses" | "hybrid")``: (out, lse)."""
    op, groups = heads_schedule(schedule, *_groups_of(group, schedule))
    res = op(q, k, v, list(buffers), *groups, False, layout, scale, bool(enable_gqa), "flex",
             flex_options(mods, mask_b, mask_h))
    return res[0], res[1]


def packed_heads_attention(q, k, v, cu_seqlens, group, schedule: str, left: int, right: int, scale: float,
                           enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """``varlen_attention(..., schedule="ulysses" | "hybrid")``: (out [T, H, D], lse [T, H])."""
    op, groups = heads_schedule(schedule, *_groups_of(group, schedule))
    # causality is the window's (right = 0); the slots are per-document zigzag whatever the plan's layout
    res = op(_bhsd(q), _bhsd(k), _bhsd(v), [cu_seqlens], *groups, False, RANK_ORDER, scale, bool(enable_gqa),
             "packed", packed_options(left, right))
    return _thd(res[0]), _thd(res[1])
