"""One FlexAttention tile under CP: local queries against a set of keys, by global position.

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

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..counters import record_blocks
from ..layout import layout_named
from ..layout.blockmask import HEADER, MAGIC, Mods, table_length
from ..torch_compat import flex_index_helpers
from .block import repeat_kv, sum_kv_groups
from .merge import acc_dtype, pivot


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


def resolve_mask_call(
    q: Tensor, buffers: list, mods: Mods, world_size: int, layout: str, mask_b: int, mask_h: int, scale: float
) -> MaskCall:
    local = q.shape[2]
    if mods.mask is not None:
        table = buffers[0]
        if table.dim() != 1 or table.numel() != table_length(local, world_size) or int(table[0]) != MAGIC:
            raise ValueError(
                "block_mask: not a mask sharded for this group and length; build the BlockMask for the global "
                "sequence and pass it through ContextParallel.shard(block_mask)"
            )
        perm, chunk = table[HEADER + local : HEADER + local * (world_size + 1)], int(table[1])
    else:
        balance = layout_named(layout)
        perm = balance.all_positions(local * world_size, world_size).to(q.device)
        chunk = balance.chunk(local * world_size, world_size)
    return MaskCall(mods, list(buffers), perm, local, chunk, mask_b, mask_h, scale)


def _evaluate(fn: Callable, prefix: tuple, b: int, h: int, q: Tensor, k: Tensor) -> Tensor:
    """A mod over every (b, h, q, k): elementwise on broadcast index tensors when it allows that,
    else vmapped as FlexAttention does. (Broadcasting first: vmap cannot run inside an op that a
    dispatch mode is watching, as on a compiled graph's first run.)"""
    shape = (b, h, q.numel(), k.numel())
    batches, heads = torch.arange(b, device=q.device), torch.arange(h, device=q.device)
    try:
        out = fn(*prefix, batches.view(-1, 1, 1, 1), heads.view(1, -1, 1, 1), q.view(1, 1, -1, 1), k.view(1, 1, 1, -1))
        if out.dim() == 4:
            return out.expand(shape)
    except (RuntimeError, IndexError, TypeError):
        pass
    index_transform, vmap_for_bhqkv = flex_index_helpers()
    with index_transform():
        return vmap_for_bhqkv(fn, prefix=(0,) * len(prefix))(*prefix, batches, heads, q, k)


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
    raw = torch.matmul(q.to(dt), repeat_kv(q, k.to(dt)).transpose(-1, -2)) * call.scale
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


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    return torch.exp(s - pivot(lse).unsqueeze(-1))


def _pieces(call: MaskCall, q_len: int, rows: Tensor, cols: Tensor, direction: str):
    """(row slice, key token indices, mask) per query chunk that sees anything."""
    mask = _dense_mask(call, rows, cols)
    c = call.chunk
    # [query chunks, key chunks]: which pairs have a visible pair
    pairs = mask.flatten(0, 1).any(0).view(rows.numel() // c, c, cols.numel() // c, c).any(3).any(1)
    record_blocks(direction, int(pairs.sum()), pairs.numel() - int(pairs.sum()))
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
    for r, keys, mask in _pieces(call, lq, rows, cols, "forward"):
        s, _ = _scores(call, q[:, :, r], k[:, :, keys], rows[r], cols[keys], mask)
        part_lse = torch.logsumexp(s, dim=-1)
        out[:, :, r] = torch.matmul(_probs(s, part_lse), repeat_kv(q, v[:, :, keys].to(dt)))
        lse[:, :, r] = part_lse
    return out.to(q.dtype), lse


def tile_backward(call: MaskCall, dout, q, k, v, out, lse, dlse, rows: Tensor, cols: Tensor):
    """(dq, dk, dv) of one tile given the final out/lse, in the accumulator dtype."""
    dt = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=dt, device=q.device) for t in (q, k, v))
    for r, keys, mask in _pieces(call, q.shape[2], rows, cols, "backward"):
        s, pullback = _scores(call, q[:, :, r], k[:, :, keys], rows[r], cols[keys], mask, vjp=True)
        p = _probs(s, lse[:, :, r].to(dt))
        do = dout[:, :, r].to(dt)
        kk, vv = (repeat_kv(q, t[:, :, keys].to(dt)) for t in (k, v))
        delta = (do * out[:, :, r].to(dt)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta)
        if dlse is not None:
            ds = ds + p * dlse[:, :, r].to(dt).unsqueeze(-1)
        if pullback is not None:
            (ds,) = pullback(ds.masked_fill(~mask, 0.0))
        ds = ds * call.scale
        dq[:, :, r] = torch.matmul(ds, kk)
        dk[:, :, keys] += sum_kv_groups(torch.matmul(ds.transpose(-1, -2), q[:, :, r].to(dt)), k.shape[1])
        dv[:, :, keys] += sum_kv_groups(torch.matmul(p.transpose(-1, -2), do), k.shape[1])
    return dq, dk, dv
