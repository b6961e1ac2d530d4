"""FlexAttention masks under CP: any mask_mod / score_mod over global indices.

A call's mods reach the ops as an argument of their own
(``layout.blockmask.Mods``, ``Call.mods``: the user's callables in an eager
call, the flex op's traced subgraphs in a compiled one; ``options`` carries
``mask=<B>x<H>``), and the tensors the mods read as the call's ``extra`` (mask
buffers first, the shard's index table leading them, then score buffers). The
index table (``layout.blockmask``) gives every
token's global position, so a tile between one unit's queries and another's
keys is the global mask and score at those positions. Every exchange and
gather keeps rank order: the table's all-ranks region is in that order.

Skipped work: each tile is cut into layout chunks; a (query chunk, key chunk)
pair where the global mask shows no visible pair is not computed. The skip is
a function of the global mask alone, so it changes compute, never the
collectives: every rank issues the same transfers.

Kernels: the tile is evaluated densely (mask and score_mod via vmap over the
chunk's positions) with the math path, forward and backward, on any device;
score_mod gradients flow through ``torch.func.vjp`` over the score_mod.
Gradients of tensors a mod captures are not computed. Under head sharding the
mods see global head indices: the rank's first head is its head block times
the heads it holds, read at run time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..comm.traffic import open_count
from ..kernels.merge import acc_dtype, pivot
from ..layout import layout_named
from ..layout.blockmask import HEADER, MAGIC, Mods, shard_info
from ..torch_compat import flex_index_helpers
from .base import Kind, Units, check_heads_and_lengths, register_kind
from .call import Call, Settings

# ----------------------------------------------------------------------------
# Counting the work: (query chunk, key chunk) pairs computed and skipped.
# ----------------------------------------------------------------------------


@dataclass
class BlockCount:
    computed: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    skipped: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})


_active_counts: list[BlockCount] = []


def count_blocks() -> contextlib.AbstractContextManager[BlockCount]:
    """Count (query chunk, key chunk) pairs this process computes and skips inside the block."""
    return open_count(_active_counts, BlockCount())


def _record(direction: str, computed: int, skipped: int) -> None:
    for c in _active_counts:
        c.computed[direction] += computed
        c.skipped[direction] += skipped


# ----------------------------------------------------------------------------
# One tile: local queries against a set of keys, by global position.
# ----------------------------------------------------------------------------


@dataclass
class MaskCall:
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


def _resolve(
    q: Tensor, buffers: list, mods: Mods, world_size: int, layout: str, mask_b: int, mask_h: int, scale: float
) -> MaskCall:
    local = q.shape[2]
    if mods.mask is not None:
        table = buffers[0]
        if table.dim() != 1 or table.numel() != HEADER + local * (world_size + 1) or int(table[0]) != MAGIC:
            raise ValueError(
                "block_mask: not a mask sharded for this group and length; build the BlockMask for the global "
                "sequence and pass it through ContextParallel.shard(block_mask)"
            )
        perm, chunk = table[HEADER + local :], int(table[1])
    else:
        balance = layout_named(layout)
        perm = balance.all_positions(local * world_size, world_size).to(q.device)
        chunk = balance.chunk(local * world_size, world_size)
    return MaskCall(mods, list(buffers), perm, local, chunk, mask_b, mask_h, scale)


def _bhqk(b: int, h: int, q: Tensor, k: Tensor) -> tuple[Tensor, ...]:
    dev = q.device
    return (
        torch.arange(b, device=dev).view(-1, 1, 1, 1),
        torch.arange(h, device=dev).view(1, -1, 1, 1),
        q.view(1, 1, -1, 1),
        k.view(1, 1, 1, -1),
    )


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


def _dense_mask(call: MaskCall, rows: Tensor, cols: Tensor) -> Tensor:
    """[Bm, Hm, len(rows), len(cols)] visibility of perm-indexed rows/cols."""
    if not call.has_table:
        return torch.ones(1, 1, rows.numel(), cols.numel(), dtype=torch.bool, device=rows.device)
    mask, bufs = call.mods.mask, call.buffers[: call.mods.n_mask_buffers]
    # S_local + t reaches the all-ranks region of the table: global position perm[t]
    fn = lambda b_, h_, i, j: mask(b_, h_, i, j, *bufs)  # noqa: E731
    return _evaluate(fn, (), call.mask_b, call.mask_h, rows + call.local, cols + call.local).to(torch.bool)


def _scores(call: MaskCall, q: Tensor, k: Tensor, rows: Tensor, cols: Tensor, mask: Tensor, vjp: bool = False):
    """Masked scores [B, Hq, Lq, Lk] in the accumulator dtype; with ``vjp``, also the score_mod's
    vector-Jacobian product (a function of the score gradient), or None without a score_mod."""
    dt = acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    kk = k.to(dt).repeat_interleave(groups, dim=1) if groups > 1 else k.to(dt)
    raw = torch.matmul(q.to(dt), kk.transpose(-1, -2)) * call.scale
    pullback = None
    if call.mods.score is not None:
        bufs = call.buffers[call.mods.n_mask_buffers :]
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


def _chunk_pairs(call: MaskCall, mask: Tensor, n_rows: int, n_cols: int) -> Tensor:
    """[query chunks, key chunks]: which pairs have a visible pair."""
    c = call.chunk
    any_bh = mask.flatten(0, 1).any(0)
    return any_bh.view(n_rows // c, c, n_cols // c, c).any(3).any(1)


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    return torch.exp(s - pivot(lse).unsqueeze(-1))


def _pieces(call: MaskCall, q_len: int, rows: Tensor, cols: Tensor, direction: str):
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
        yield slice(a * c, (a + 1) * c), keys, mask[:, :, a * c : (a + 1) * c][..., keys]


def tile_forward(call: MaskCall, q: Tensor, k: Tensor, v: Tensor, rows: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
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


def tile_backward(call: MaskCall, dout, q, k, v, out, lse, dlse, rows: Tensor, cols: Tensor):
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


# ----------------------------------------------------------------------------
# The kind: a unit's tokens are table entries [u * n, (u + 1) * n), n = tokens per unit.
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FlexSettings(Settings):
    """A flex call's BlockMask batch and head counts (1 where it broadcasts)."""

    mask_b: int = 1
    mask_h: int = 1


def _mask_call(q: Tensor, buffers: list, units: Units, call: Call) -> MaskCall:
    """The tile description for this rank's unit and heads."""
    if not isinstance(call.mods, Mods):
        raise ValueError(f"a flex call needs its mods (a cp_compile.layout.blockmask.Mods); got {call.mods!r}")
    mask_b, mask_h = call.settings.mask_b, call.settings.mask_h
    # _resolve validates the index table against the local length: a unit's tokens / its ranks
    local = q.narrow(2, 0, q.shape[2] // units.a2a)
    tile = _resolve(local, buffers, call.mods, units.world_size, call.layout, mask_b, mask_h, call.scale)
    if units.a2a == 1:
        return tile
    heads = q.shape[1]
    if mask_h not in (1, heads * units.a2a):
        raise ValueError(f"block_mask has {mask_h} heads; expected 1 or the {heads * units.a2a} query heads")
    first = units.head_block * heads
    mods = tile.mods
    mask = mods.mask
    if mask is not None and mask_h > 1:
        mask = lambda b, h, i, j, *bufs: mods.mask(b, h + first, i, j, *bufs)  # noqa: E731
    score = mods.score
    if score is not None:
        score = lambda s, b, h, i, j, *bufs: mods.score(s, b, h + first, i, j, *bufs)  # noqa: E731
    return dataclasses.replace(tile, mods=Mods(mask, score, mods.n_mask_buffers), mask_h=heads if mask_h > 1 else 1)


def _spans(q: Tensor, k: Tensor, units: Units) -> tuple[Tensor, Tensor]:
    """Table indices of the queries' and the keys' tokens."""
    n = q.shape[2]
    rows = torch.arange(units.q_unit * n, (units.q_unit + 1) * n, device=q.device)
    if units.gathered:
        return rows, torch.arange(k.shape[2], device=q.device)
    return rows, torch.arange(units.k_unit * n, (units.k_unit + 1) * n, device=q.device)


class Flex(Kind):
    name = "flex"
    settings = FlexSettings
    split_heads = False  # a score_mod may read the head index
    rank_order = True

    def attend(self, q, k, v, extra, units: Units, call: Call):
        return tile_forward(_mask_call(q, extra, units, call), q, k, v, *_spans(q, k, units))

    def attend_backward(self, dout, q, k, v, out, lse, dlse, extra, units: Units, call: Call):
        return tile_backward(_mask_call(q, extra, units, call), dout, q, k, v, out, lse, dlse, *_spans(q, k, units))

    def agreed(self, call: Call) -> str:
        return f"{call.options} layout={call.layout} scale={call.scale!r}"

    def agree_extra(self, q, extra, call: Call) -> None:
        # the mask's index table (its digest of the global mask, every rank's positions) and the tensors the
        # mods read steer which tiles run and what they mean: a rank holding another mask, or one sharded for
        # another length, would run other work. Only a rank's own positions in the table are its own.
        shared = list(extra)
        if shared and isinstance(call.mods, Mods) and call.mods.mask is not None:
            table = shared[0]
            shared[0] = torch.cat([table[:HEADER], table[HEADER + q.shape[2] :]])
        torch.ops.cp.agree_tensors(shared, call.group_name, "block_mask (or the tensors its mods read)")

    def check(self, q, k, v, call: Call, world_size: int, enable_gqa: bool) -> None:
        check_heads_and_lengths(q, k, enable_gqa)


FLEX = register_kind(Flex())


NO_MODS = Mods(None, None, 0)  # no block_mask and no score_mod: every pair visible, scores as they are


def eager_mods(block_mask, score_mod) -> tuple[Mods, list[Tensor], int, int]:
    """The call's mods: the sharded mask's own (``ShardInfo.mods``) with the user's score_mod, if any, added
    (a new object: inside ``torch.compile``, a graph break); returns (mods, buffers, mask B, mask H)."""
    info = shard_info(block_mask)
    if block_mask is not None and info is None:
        raise ValueError(
            "block_mask: this BlockMask was not sharded for CP; build it for the global sequence and pass "
            "it through ContextParallel.shard(block_mask)"
        )
    if block_mask is None:
        mods, buffers, (mask_b, mask_h) = NO_MODS, [], (1, 1)
    else:
        mods, buffers, (mask_b, mask_h) = info.mods, [info.table], block_mask.kv_num_blocks.shape[:2]
    if score_mod is not None:  # read no member of ``mods``: under Dynamo it is an opaque graph input
        mask = None if block_mask is None else (lambda b, h, i, j, *bufs: block_mask.mask_mod(b, h, i, j))
        mods = Mods(mask, lambda s, b, h, i, j, *bufs: score_mod(s, b, h, i, j), len(buffers))
    return mods, buffers, int(mask_b), int(mask_h)
