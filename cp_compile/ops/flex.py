"""FlexAttention under CP: any mask_mod / score_mod over global indices, as a ring or an all-gather.

The mods cannot travel as op arguments, so every op takes a string key into
``MODS`` (filled by the eager API with the user's callables, and by the
compiled rewrite with the flex op's traced subgraphs) plus the tensors the
mods read (``buffers``: mask buffers first, the shard's index table leading
them, then score buffers). The index table (``flex_mask``) gives every
token's global position, so a tile between this rank's queries and rank j's
keys is the global mask and score at those positions.

Skipped work: each tile is cut into layout chunks; a (query chunk, key chunk)
pair where the global mask shows no visible pair is not computed. The skip is
a function of the global mask alone, so it changes compute, never the
collectives: every rank issues the same transfers.

Kernels: the tile is evaluated densely (mask and score_mod via vmap over the
chunk's positions) with the math path, forward and backward, on any device;
score_mod gradients flow through autograd over the score_mod. Gradients of
tensors a mod captures are not computed.

Schedules (``schedule`` argument): ``ring`` (K/V travel as in the SDPA ring,
partials merge online, dK/dV ride home) and ``allgather`` (gather K/V once,
output final; backward re-gathers and reduce-scatters dK/dV), the whole op
``cp::flex_attention``; ``ulysses`` and ``hybrid`` shard heads and run as the
``"flex"`` inner attention of ``cp::ulysses_attention`` / ``cp::hybrid_attention``
(``ops.ulysses_masks``).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from ..torch_compat import flex_index_helpers
from ..flex_mask import HEADER, MAGIC, layout_chunk, layout_perm, shard_info
from .block import acc_dtype, dense_like, result_like
from .comm import resolve_group
from .registry import Traceable, register_schedule
from .ring import ring_pass_backward, ring_pass_forward

funcol = torch.ops._c10d_functional
# ulysses and hybrid run as cp::ulysses_attention / cp::hybrid_attention (inner "flex", ops.ulysses_masks)
FLEX_SCHEDULES = ("ring", "allgather", "ulysses", "hybrid")

# ----------------------------------------------------------------------------
# The mods a key names.
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mods:
    mask: Optional[Callable]  # (b, h, i, j, *mask_buffers) -> bool; None: every pair visible
    score: Optional[Callable]  # (score, b, h, q_pos, kv_pos, *score_buffers) -> score
    n_mask_buffers: int  # buffers[:n] belong to the mask (the index table first), the rest to the score


MODS: dict[str, Mods] = {}
# Eager keys hold the ids of the user's mods, so the objects are kept alive while their key is
# registered; only the most recent ones are, so fresh masks per batch do not pile up.
_EAGER_KEYS: "OrderedDict[str, tuple]" = OrderedDict()
MAX_EAGER_KEYS = 1024


def register_mods(key: str, mods: Mods) -> str:
    MODS[key] = mods
    return key


def _mods(key: str) -> Mods:
    if key not in MODS:
        raise KeyError(f"no FlexAttention mods registered under {key!r} in this process")
    return MODS[key]


# ----------------------------------------------------------------------------
# Counting the work: (query chunk, key chunk) pairs computed and skipped.
# ----------------------------------------------------------------------------


@dataclass
class BlockCount:
    computed: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    skipped: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})


_active_counts: list[BlockCount] = []


@contextlib.contextmanager
def count_blocks():
    """Count (query chunk, key chunk) pairs this process computes and skips inside the block."""
    count = BlockCount()
    _active_counts.append(count)
    try:
        yield count
    finally:
        _active_counts.remove(count)


def _record(direction: str, computed: int, skipped: int) -> None:
    for c in _active_counts:
        c.computed[direction] += computed
        c.skipped[direction] += skipped


# ----------------------------------------------------------------------------
# One tile: local queries against a set of keys, by global position.
# ----------------------------------------------------------------------------


@dataclass
class _Call:
    """Everything a tile needs, resolved at run time on this rank."""

    mods: Mods
    buffers: list
    perm: Tensor  # global positions, all ranks in rank order
    local: int
    chunk: int
    mask_b: int
    mask_h: int
    scale: float

    @property
    def has_table(self) -> bool:
        return self.mods.mask is not None


def _resolve(q: Tensor, buffers: list, key: str, group_name: str, layout: str, mask_b: int, mask_h: int,
             scale: float) -> tuple[_Call, int, int]:
    group = resolve_group(group_name)
    rank, size = group.rank(), group.size()
    mods = _mods(key)
    local = q.shape[2]
    if mods.mask is not None:
        table = buffers[0]
        if table.dim() != 1 or table.numel() != HEADER + local * (size + 1) or int(table[0]) != MAGIC:
            raise ValueError(
                "block_mask: not a mask sharded for this group and length; build the BlockMask for the global "
                "sequence and pass it through ContextParallel.shard(block_mask)"
            )
        perm, chunk = table[HEADER + local:], int(table[1])
    else:
        perm = layout_perm(local * size, size, layout).to(q.device)
        chunk = layout_chunk(local * size, size, layout)
    return _Call(mods, list(buffers), perm, local, chunk, mask_b, mask_h, scale), rank, size


def _bhqk(b: int, h: int, q: Tensor, k: Tensor) -> tuple[Tensor, ...]:
    dev = q.device
    return (torch.arange(b, device=dev).view(-1, 1, 1, 1), torch.arange(h, device=dev).view(1, -1, 1, 1),
            q.view(1, 1, -1, 1), k.view(1, 1, 1, -1))


def _evaluate(fn: Callable, prefix: tuple, b: int, h: int, q: Tensor, k: Tensor) -> Tensor:
    """A mod over every (b, h, q, k): elementwise on broadcast index tensors when it allows that,
    else vmapped as FlexAttention does. (Broadcasting first: vmap cannot run inside an op that a
    dispatch mode is watching, as on a compiled graph's first run.)"""
    shape = (b, h, q.numel(), k.numel())
    try:
        out = fn(*prefix, *_bhqk(b, h, q, k))
        if out.dim() == 4:
            return out.expand(shape)
    except (RuntimeError, IndexError, TypeError):
        pass
    idx = (torch.arange(b, device=q.device), torch.arange(h, device=q.device), q, k)
    index_transform, vmap_for_bhqkv = flex_index_helpers()
    with index_transform():
        return vmap_for_bhqkv(fn, prefix=(0,) * len(prefix))(*prefix, *idx)


def _dense_mask(call: _Call, rows: Tensor, cols: Tensor) -> Tensor:
    """[Bm, Hm, len(rows), len(cols)] visibility of perm-indexed rows/cols."""
    if not call.has_table:
        return torch.ones(1, 1, rows.numel(), cols.numel(), dtype=torch.bool, device=rows.device)
    mask, bufs = call.mods.mask, call.buffers[: call.mods.n_mask_buffers]
    # S_local + t reaches the all-ranks region of the table: global position perm[t]
    fn = lambda b_, h_, i, j: mask(b_, h_, i, j, *bufs)  # noqa: E731
    return _evaluate(fn, (), call.mask_b, call.mask_h, rows + call.local, cols + call.local).to(torch.bool)


def _scores(call: _Call, q: Tensor, k: Tensor, rows: Tensor, cols: Tensor, mask: Tensor, vjp: bool = False):
    """Masked scores [B, Hq, Lq, Lk] in the accumulator dtype; with ``vjp``, also the score_mod's
    vector-Jacobian product (a function of the score gradient), or None without a score_mod."""
    dt = acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    kk = k.to(dt).repeat_interleave(groups, dim=1) if groups > 1 else k.to(dt)
    raw = torch.matmul(q.to(dt), kk.transpose(-1, -2)) * call.scale
    pullback = None
    if call.mods.score is not None:
        bufs = call.buffers[call.mods.n_mask_buffers:]
        score, q_pos, k_pos = call.mods.score, call.perm[rows], call.perm[cols]

        def modded(x):
            fn = lambda s_, b_, h_, i, j: score(s_, b_, h_, i, j, *bufs)  # noqa: E731
            return _evaluate(fn, (x,), q.shape[0], q.shape[1], q_pos, k_pos)

        # torch.func, not autograd: an op's implementation runs below the autograd dispatch key
        if not vjp:
            return modded(raw).masked_fill(~mask, float("-inf")), None
        try:
            raw, pullback = torch.func.vjp(modded, raw)
        except (RuntimeError, NotImplementedError) as e:
            raise NotImplementedError(
                "flex_attention(score_mod=...): the score_mod gradient is taken with torch.func.vjp, which "
                "cannot run under an active dispatch mode (e.g. opcheck, or the custom-op aliasing check on a "
                "compiled graph's first run: torch._functorch.config.check_custom_op_aliasing = False skips it)"
            ) from e
    return raw.masked_fill(~mask, float("-inf")), pullback


def _chunk_pairs(call: _Call, mask: Tensor, n_rows: int, n_cols: int) -> Tensor:
    """[query chunks, key chunks]: which pairs have a visible pair."""
    c = call.chunk
    any_bh = mask.flatten(0, 1).any(0)
    return any_bh.view(n_rows // c, c, n_cols // c, c).any(3).any(1)


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    # rows seeing nothing have lse = -inf: weigh them against 0, never exp(-inf + inf)
    pivot = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - pivot.unsqueeze(-1))


def _pieces(call: _Call, q_len: int, rows: Tensor, cols: Tensor, direction: str):
    """(row slice, key token indices, mask) per query chunk that sees anything."""
    mask = _dense_mask(call, rows, cols)
    pairs = _chunk_pairs(call, mask, rows.numel(), cols.numel())
    _record(direction, int(pairs.sum()), pairs.numel() - int(pairs.sum()))
    c = call.chunk
    for a in range(pairs.shape[0]):
        visible = pairs[a].nonzero().flatten()
        if visible.numel() == 0:
            continue
        keys = (visible.unsqueeze(1) * c + torch.arange(c, device=rows.device)).flatten()
        yield slice(a * c, (a + 1) * c), keys, mask[:, :, a * c:(a + 1) * c][..., keys]


def tile_forward(call: _Call, q: Tensor, k: Tensor, v: Tensor, rows: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
    """Local queries (perm indices ``rows``) against keys ``cols``: (out, lse) over those keys."""
    dt = acc_dtype(q.dtype)
    b, hq, lq, _ = q.shape
    out = torch.zeros(b, hq, lq, v.shape[-1], dtype=dt, device=q.device)
    lse = torch.full((b, hq, lq), float("-inf"), dtype=dt, device=q.device)
    groups = hq // k.shape[1]
    for r, keys, mask in _pieces(call, lq, rows, cols, "forward"):
        s, _ = _scores(call, q[:, :, r], k[:, :, keys], rows[r], cols[keys], mask)
        part_lse = torch.logsumexp(s, dim=-1)
        vv = v[:, :, keys].to(dt)
        vv = vv.repeat_interleave(groups, dim=1) if groups > 1 else vv
        out[:, :, r] = torch.matmul(_probs(s, part_lse), vv)
        lse[:, :, r] = part_lse
    return out.to(q.dtype), lse


def tile_backward(call: _Call, dout, q, k, v, out, lse, dlse, rows: Tensor, cols: Tensor):
    """(dq, dk, dv) of one tile given the final out/lse, in the accumulator dtype."""
    dt = acc_dtype(q.dtype)
    hkv, groups = k.shape[1], q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=q.device)
    dv = torch.zeros(v.shape, dtype=dt, device=q.device)
    for r, keys, mask in _pieces(call, q.shape[2], rows, cols, "backward"):
        s, pullback = _scores(call, q[:, :, r], k[:, :, keys], rows[r], cols[keys], mask, vjp=True)
        p = _probs(s, lse[:, :, r].to(dt))
        do = dout[:, :, r].to(dt)
        kk, vv = k[:, :, keys].to(dt), v[:, :, keys].to(dt)
        if groups > 1:
            kk, vv = kk.repeat_interleave(groups, dim=1), vv.repeat_interleave(groups, dim=1)
        delta = (do * out[:, :, r].to(dt)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta)
        if dlse is not None:
            ds = ds + p * dlse[:, :, r].to(dt).unsqueeze(-1)
        if pullback is not None:
            (ds,) = pullback(ds.masked_fill(~mask, 0.0))
        ds = ds * call.scale
        dq[:, :, r] = torch.matmul(ds, kk)
        dk_part = torch.matmul(ds.transpose(-1, -2), q[:, :, r].to(dt))
        dv_part = torch.matmul(p.transpose(-1, -2), do)
        if groups > 1:
            dk_part = dk_part.unflatten(1, (hkv, groups)).sum(2)
            dv_part = dv_part.unflatten(1, (hkv, groups)).sum(2)
        dk[:, :, keys] += dk_part
        dv[:, :, keys] += dv_part
    return dq, dk, dv


def _span(rank: int, local: int, device) -> Tensor:
    return torch.arange(rank * local, (rank + 1) * local, device=device)


# ----------------------------------------------------------------------------
# Per-step ops (rank read at run time).
# ----------------------------------------------------------------------------

@torch.library.custom_op("cp::flex_block_attn", mutates_args=())
def flex_block_attn(
    q: Tensor, k: Tensor, v: Tensor, buffers: list[Tensor], step: int, group_name: str, mods: str, layout: str,
    mask_b: int, mask_h: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """Ring step ``step``: local queries against the K/V of rank (rank - step) mod C."""
    call, rank, size = _resolve(q, buffers, mods, group_name, layout, mask_b, mask_h, scale)
    source = (rank - step) % size
    out, lse = tile_forward(call, q, k, v, _span(rank, call.local, q.device), _span(source, call.local, q.device))
    return out.contiguous(), lse.contiguous()


@flex_block_attn.register_fake
def _(q, k, v, buffers, step, group_name, mods, layout, mask_b, mask_h, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::flex_block_attn_backward", mutates_args=())
def flex_block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    buffers: list[Tensor], step: int, group_name: str, mods: str, layout: str, mask_b: int, mask_h: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    call, rank, size = _resolve(q, buffers, mods, group_name, layout, mask_b, mask_h, scale)
    source = (rank - step) % size
    grads = tile_backward(call, dout, q, k, v, out, lse, dlse, _span(rank, call.local, q.device),
                          _span(source, call.local, q.device))
    return tuple(g.contiguous() for g in grads)


@flex_block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, buffers, step, group_name, mods, layout, mask_b, mask_h, scale):
    dt = acc_dtype(q.dtype)
    return tuple(torch.empty(t.shape, dtype=dt, device=t.device) for t in (q, k, v))


@torch.library.custom_op("cp::flex_gathered_attn", mutates_args=())
def flex_gathered_attn(
    q: Tensor, k_all: Tensor, v_all: Tensor, buffers: list[Tensor], group_name: str, mods: str, layout: str,
    mask_b: int, mask_h: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """Local queries against every rank's K/V (gathered, rank order): the final result."""
    call, rank, _ = _resolve(q, buffers, mods, group_name, layout, mask_b, mask_h, scale)
    cols = torch.arange(k_all.shape[2], device=q.device)
    out, lse = tile_forward(call, q, k_all, v_all, _span(rank, call.local, q.device), cols)
    return out.contiguous(), lse.contiguous()


@flex_gathered_attn.register_fake
def _(q, k_all, v_all, buffers, group_name, mods, layout, mask_b, mask_h, scale):
    return result_like(q, v_all)


@torch.library.custom_op("cp::flex_gathered_attn_backward", mutates_args=())
def flex_gathered_attn_backward(
    dout: Tensor, q: Tensor, k_all: Tensor, v_all: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    buffers: list[Tensor], group_name: str, mods: str, layout: str, mask_b: int, mask_h: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    call, rank, _ = _resolve(q, buffers, mods, group_name, layout, mask_b, mask_h, scale)
    cols = torch.arange(k_all.shape[2], device=q.device)
    grads = tile_backward(call, dout, q, k_all, v_all, out, lse, dlse, _span(rank, call.local, q.device), cols)
    return tuple(g.contiguous() for g in grads)


@flex_gathered_attn_backward.register_fake
def _(dout, q, k_all, v_all, out, lse, dlse, buffers, group_name, mods, layout, mask_b, mask_h, scale):
    dt = acc_dtype(q.dtype)
    return tuple(torch.empty(t.shape, dtype=dt, device=t.device) for t in (q, k_all, v_all))


# ----------------------------------------------------------------------------
# The schedules (one definition each, eager and compiled).
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FlexOptions:
    group_name: str
    world_size: int
    mods: str
    layout: str
    mask_b: int
    mask_h: int
    scale: float

    @property
    def step_args(self) -> tuple:
        return (self.mods, self.layout, self.mask_b, self.mask_h, self.scale)

    def agreed(self, schedule: str) -> str:
        # the mods key is per process (eager keys hold object ids): not compared
        return f"flex schedule={schedule} layout={self.layout} mask={self.mask_b}x{self.mask_h} scale={self.scale!r}"


def flex_ring_forward(q, k, v, buffers, o: FlexOptions) -> tuple[Tensor, Tensor]:
    ops, c = torch.ops.cp, o.world_size
    if c > 1:
        ops.agree(q, k, v, o.group_name, o.agreed("ring"))

    def attend(step, k_block, v_block):
        return ops.flex_block_attn(q, k_block, v_block, buffers, step, o.group_name, *o.step_args)

    out, lse = ring_pass_forward(q, k, v, attend, group_name=o.group_name, world_size=c)
    return out.to(q.dtype), lse


def flex_ring_backward(dout, q, k, v, out, lse, dlse, buffers, o: FlexOptions):
    """As the SDPA ring's backward: dK/dV accumulated so far ride home with the K/V."""
    # one part per step (no head split): a score_mod may index by head
    def attend_backward(step, k_block, v_block):
        return torch.ops.cp.flex_block_attn_backward(
            dout, q, k_block, v_block, out, lse, dlse, buffers, step, o.group_name, *o.step_args
        )

    dq, dk, dv = ring_pass_backward(q, k, v, attend_backward, group_name=o.group_name, world_size=o.world_size)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gather_seq(t: Tensor, o: FlexOptions) -> Tensor:
    """[B, H, S_local, D] of every rank -> [B, H, C * S_local, D] in rank order."""
    if o.world_size == 1:
        return t
    g = funcol.wait_tensor(funcol.all_gather_into_tensor(t.contiguous(), o.world_size, o.group_name))
    return g.view(o.world_size, *t.shape).permute(1, 2, 0, 3, 4).flatten(2, 3)


def _scatter_seq(t: Tensor, o: FlexOptions) -> Tensor:
    """Sum over ranks of [B, H, C * S_local, D], each rank keeping its own S_local slice."""
    if o.world_size == 1:
        return t
    b, h, s, d = t.shape
    per_rank = t.view(b, h, o.world_size, s // o.world_size, d).permute(2, 0, 1, 3, 4).contiguous()
    flat = per_rank.flatten(0, 1)
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(flat, "sum", o.world_size, o.group_name))


def flex_allgather_forward(q, k, v, buffers, o: FlexOptions) -> tuple[Tensor, Tensor]:
    ops = torch.ops.cp
    if o.world_size > 1:
        ops.agree(q, k, v, o.group_name, o.agreed("allgather"))
    k_all, v_all = _gather_seq(k, o), _gather_seq(v, o)
    return ops.flex_gathered_attn(q, k_all, v_all, buffers, o.group_name, *o.step_args)


def flex_allgather_backward(dout, q, k, v, out, lse, dlse, buffers, o: FlexOptions):
    """Re-gather K/V (not kept from the forward: memory O(C) only while this runs), reduce-scatter dK/dV."""
    k_all, v_all = _gather_seq(k, o), _gather_seq(v, o)
    dq, dk_all, dv_all = torch.ops.cp.flex_gathered_attn_backward(
        dout, q, k_all, v_all, out, lse, dlse, buffers, o.group_name, *o.step_args
    )
    dk, dv = _scatter_seq(dk_all, o), _scatter_seq(dv_all, o)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


FORWARD = {"ring": flex_ring_forward, "allgather": flex_allgather_forward}
BACKWARD = {"ring": flex_ring_backward, "allgather": flex_allgather_backward}


def _options(group_name, mods, layout, mask_b, mask_h, scale) -> FlexOptions:
    return FlexOptions(group_name, resolve_group(group_name).size(), mods, layout, mask_b, mask_h, scale)


def _check_schedule(schedule: str) -> None:
    if schedule not in FLEX_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: FlexAttention under CP runs as one of {FLEX_SCHEDULES}")
    if schedule not in FORWARD:
        raise ValueError(f"schedule={schedule!r} shards heads: it runs as cp::{schedule}_attention with "
                         f"inner='flex' (ops.ulysses_masks.flex_heads_attention), not as cp::flex_attention")


# ----------------------------------------------------------------------------
# The whole schedule as one differentiable op.
# ----------------------------------------------------------------------------


@torch.library.custom_op("cp::flex_attention", mutates_args=())
def flex_attention_op(
    q: Tensor, k: Tensor, v: Tensor, buffers: list[Tensor], group_name: str, schedule: str, mods: str,
    layout: str, mask_b: int, mask_h: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """FlexAttention of this rank's queries over the whole sharded sequence: (out, lse)."""
    _check_schedule(schedule)
    o = _options(group_name, mods, layout, mask_b, mask_h, scale)
    out, lse = FORWARD[schedule](q, k, v, buffers, o)
    return out.contiguous(), lse.contiguous()


@flex_attention_op.register_fake
def _(q, k, v, buffers, group_name, schedule, mods, layout, mask_b, mask_h, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::flex_attention_backward", mutates_args=())
def flex_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    buffers: list[Tensor], group_name: str, schedule: str, mods: str, layout: str, mask_b: int, mask_h: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_schedule(schedule)
    o = _options(group_name, mods, layout, mask_b, mask_h, scale)
    dq, dk, dv = BACKWARD[schedule](dout, q, k, v, out, lse, dlse, buffers, o)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@flex_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, buffers, group_name, schedule, mods, layout, mask_b, mask_h, scale):
    return dense_like(q), dense_like(k), dense_like(v)


def register_flex_autograd(forward_op, backward_op) -> None:
    """Autograd for a whole flex op ``(q, k, v, buffers, *options) -> (out, lse)`` whose backward op takes
    ``(dout, q, k, v, out, lse, dlse, buffers, *options)``; the mods' buffers get no gradient."""

    def setup(ctx, inputs, output):
        q, k, v, buffers, *options = inputs
        ctx.save_for_backward(q, k, v, *output, *buffers)
        ctx.n_buffers, ctx.options = len(buffers), options
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *buffers = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward_op(dout, q, k, v, out, lse, dlse, buffers, *ctx.options)
        return (dq, dk, dv, [None] * ctx.n_buffers) + (None,) * len(ctx.options)

    forward_op.register_autograd(backward, setup_context=setup)


register_flex_autograd(flex_attention_op, torch.ops.cp.flex_attention_backward)


def _expand_forward(args) -> Traceable:
    q, k, v, buffers, group_name, schedule, *rest = args
    o = _options(group_name, *rest)
    n = len(buffers)

    def fn(q, k, v, *buffers):
        return FORWARD[schedule](q, k, v, list(buffers), o)

    return Traceable("forward", o.world_size, fn, [q, k, v, *buffers][: 3 + n])


def _expand_backward(args) -> Traceable:
    dout, q, k, v, out, lse, dlse, buffers, group_name, schedule, *rest = args
    o = _options(group_name, *rest)
    has_dlse = dlse is not None

    def fn(*tensors):
        dout, q, k, v, out, lse = tensors[:6]
        dl = tensors[6] if has_dlse else None
        return BACKWARD[schedule](dout, q, k, v, out, lse, dl, list(tensors[6 + has_dlse:]), o)

    tensors = [dout, q, k, v, out, lse] + ([dlse] if has_dlse else []) + list(buffers)
    return Traceable("backward", o.world_size, fn, tensors)


register_schedule(
    torch.ops.cp.flex_attention.default, _expand_forward,
    torch.ops.cp.flex_attention_backward.default, _expand_backward,
    {
        torch.ops.cp.flex_block_attn.default: "attend",
        torch.ops.cp.flex_block_attn_backward.default: "attend_backward",
        torch.ops.cp.flex_gathered_attn.default: "gathered",
        torch.ops.cp.flex_gathered_attn_backward.default: "gathered_backward",
    },
)


# ----------------------------------------------------------------------------
# Eager API.
# ----------------------------------------------------------------------------


def eager_mods(block_mask, score_mod) -> tuple[str, list[Tensor], int, int]:
    """Register the user's callables; returns (key, buffers, mask B, mask H)."""
    info = shard_info(block_mask)
    if block_mask is not None and info is None:
        raise ValueError(
            "block_mask: this BlockMask was not sharded for CP; build it for the global sequence and pass "
            "it through ContextParallel.shard(block_mask)"
        )
    mask = None
    buffers: list[Tensor] = []
    mask_b = mask_h = 1
    if block_mask is not None:
        local_mod = block_mask.mask_mod
        mask = lambda b, h, i, j, *bufs: local_mod(b, h, i, j)  # noqa: E731  (the table is its closure's)
        buffers = [info.table]
        mask_b, mask_h = block_mask.kv_num_blocks.shape[:2]
    score = None if score_mod is None else (lambda s, b, h, i, j, *bufs: score_mod(s, b, h, i, j))
    key = f"eager:{id(block_mask.mask_mod) if block_mask is not None else 0}:{id(score_mod)}"
    register_mods(key, Mods(mask, score, len(buffers)))
    _EAGER_KEYS[key] = (block_mask, score_mod)
    _EAGER_KEYS.move_to_end(key)
    while len(_EAGER_KEYS) > MAX_EAGER_KEYS:
        old, _ = _EAGER_KEYS.popitem(last=False)
        MODS.pop(old, None)
    return key, buffers, int(mask_b), int(mask_h)


def flex_attention(
    q: Tensor, k: Tensor, v: Tensor, score_mod=None, block_mask=None, scale: Optional[float] = None,
    enable_gqa: bool = False, return_lse: bool = False, *, group=None, schedule: str = "auto",
    layout: str = "zigzag", machine=None,
):
    """FlexAttention over a sequence sharded across ``group``, with torch's signature.

    ``q, k, v`` are this rank's ``[B, H, S_local, D]`` shards; ``block_mask``
    comes from ``ContextParallel.shard(global_block_mask)``; ``score_mod`` reads
    global indices. ``schedule`` is ``"auto"`` (the cost model's choice,
    ``passes.masked.choose_flex``, from the global mask's block counts recorded
    by the shard and ``machine``, a ``cp_compile.Machine``, default: the device
    type's profile; the same choice a compiled site makes), ``"ring"``,
    ``"allgather"``, ``"ulysses"`` (query heads must divide by C) or ``"hybrid"``
    (``group`` a 2-D (ring, a2a) DeviceMesh, query heads divide by its a2a
    size); ``layout`` matters only without a block_mask.
    Differentiable (mask and score mods; tensors the mods capture get no gradient).
    """
    from .ring import group_name_of, is_2d_mesh

    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(
            f"q has {q.shape[1]} heads but k/v have {k.shape[1]}; pass enable_gqa=True for grouped-query attention"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"local q and k/v lengths differ ({q.shape[2]} vs {k.shape[2]}); CP shards them alike")
    key, buffers, mask_b, mask_h = eager_mods(block_mask, score_mod)
    if schedule == "auto":
        from ..passes.masked import choose_flex

        schedule = "hybrid" if is_2d_mesh(group) else choose_flex(
            q, k, v, block_mask, resolve_group(group_name_of(group)).size(), machine)[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if schedule in ("ulysses", "hybrid"):
        from .ulysses_masks import flex_heads_attention

        out, lse = flex_heads_attention(q, k, v, buffers, group, schedule, key, layout, mask_b, mask_h, scale,
                                        q.shape[1] != k.shape[1])
    else:
        _check_schedule(schedule)
        out, lse = flex_attention_op(q, k, v, buffers, group_name_of(group), schedule, key, layout, mask_b, mask_h,
                                     scale)
    return (out, lse) if return_lse else out
