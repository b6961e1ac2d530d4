"""All-gather attention: every rank gathers the whole K/V, then attends its own Q.

Forward: all-gather K and V along the sequence, put the chunks in sequence
order, and let each local Q chunk attend to the prefix of keys it can see
(bottom-right-aligned causal mask: a chunk's last query sees up to its own
position). The output is final; nothing is merged. Backward: gather K/V again
(they are not saved: the forward keeps only the local shards), compute dQ and
the full-length dK/dV in fp32, and reduce-scatter dK/dV back to their owners.

The schedule is one collective pair per direction, so there is no overlap to
pin; its cost is O(C) memory for the gathered K/V, which is why it pays for
few K/V heads (GQA) or short windows, where the gathered K/V is small or most
of a ring's steps would be empty.

Which key prefix a local chunk sees depends on the rank: ``cp::allgather_block_attn``
reads it at run time, so the traced schedule holds no rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .block import _lse_grad, _tile_bwd, acc_dtype, block_attn_impl, dense_like, result_like
from .comm import resolve_group
from .registry import Traceable, register_schedule
from .ring import check_ring_args, group_name_of, register_attention_autograd

_fc = torch.ops._c10d_functional


# ----------------------------------------------------------------------------
# Shared collectives (also used by the packed-sequence schedules).
# ----------------------------------------------------------------------------


def gather_dim0(t: Tensor, group_name: str, world_size: int) -> Tensor:
    """Every rank's ``t`` stacked along dim 0, in rank order."""
    if world_size == 1:
        return t
    return _fc.wait_tensor(_fc.all_gather_into_tensor(t.contiguous(), world_size, group_name))


def reduce_scatter_dim0(t: Tensor, group_name: str, world_size: int) -> Tensor:
    """Sum ``t`` over ranks and keep this rank's slice of dim 0."""
    if world_size == 1:
        return t
    return _fc.wait_tensor(_fc.reduce_scatter_tensor(t.contiguous(), "sum", world_size, group_name))


def _sequence_order(world_size: int, layout: str) -> list[int]:
    """order[g] = index, in the gathered (rank-major) chunks, of global chunk g."""
    if layout == "contiguous":
        return list(range(world_size))
    order = [0] * (2 * world_size)
    for rank in range(world_size):
        order[rank], order[2 * world_size - 1 - rank] = 2 * rank, 2 * rank + 1
    return order


def _permute_chunks(t: Tensor, order: list[int], dim: int) -> Tensor:
    chunks = t.chunk(len(order), dim=dim)
    return torch.cat([chunks[i] for i in order], dim=dim)


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for g, i in enumerate(order):
        inv[i] = g
    return inv


def gather_sequence(t: Tensor, group_name: str, world_size: int, layout: str) -> Tensor:
    """``[B, H, L, D]`` shards -> the global ``[B, H, C*L, D]`` in sequence order."""
    gathered = gather_dim0(t.movedim(2, 0), group_name, world_size).movedim(0, 2)
    return _permute_chunks(gathered, _sequence_order(world_size, layout), 2)


def scatter_sequence(t: Tensor, group_name: str, world_size: int, layout: str) -> Tensor:
    """Inverse of ``gather_sequence`` for gradients: sum over ranks, keep this rank's shard."""
    gathered = _permute_chunks(t, _inverse(_sequence_order(world_size, layout)), 2)
    return reduce_scatter_dim0(gathered.movedim(2, 0), group_name, world_size).movedim(0, 2)


# ----------------------------------------------------------------------------
# Per-rank compute: local Q chunks against their visible prefix.
# ----------------------------------------------------------------------------


def _q_chunks(q_len: int, rank: int, world_size: int, is_causal: bool, layout: str):
    """(local q rows, number of visible global keys, mask) per local chunk."""
    if not is_causal:
        return [(slice(0, q_len), None, "none")]
    if layout == "contiguous":
        return [(slice(0, q_len), (rank + 1) * q_len, "causal_bottom_right")]
    half = q_len // 2
    return [
        (slice(0, half), (rank + 1) * half, "causal_bottom_right"),
        (slice(half, q_len), (2 * world_size - rank) * half, "causal_bottom_right"),
    ]


def _chunks_at(q: Tensor, group_name: str, is_causal: bool, layout: str):
    group = resolve_group(group_name)
    return _q_chunks(q.shape[2], group.rank(), group.size(), is_causal, layout)


@torch.library.custom_op("cp::allgather_block_attn", mutates_args=())
def allgather_block_attn(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, is_causal: bool, layout: str, scale: float
) -> tuple[Tensor, Tensor]:
    """This rank's Q against the gathered, sequence-ordered K/V: final (out, lse)."""
    outs, lses = [], []
    for rows, visible, mask in _chunks_at(q, group_name, is_causal, layout):
        cols = slice(0, k.shape[2] if visible is None else visible)
        out, lse = block_attn_impl(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2).contiguous(), torch.cat(lses, 2).contiguous()


@allgather_block_attn.register_fake
def _(q, k, v, group_name, is_causal, layout, scale):
    return result_like(q, v)


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


@torch.library.custom_op("cp::allgather_block_attn_backward", mutates_args=())
def allgather_block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    group_name: str, is_causal: bool, layout: str, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ (q's dtype) and the full-length dK/dV in the accumulator dtype, ready to reduce-scatter.

    Each tile's gradients are its exact share given the final out and lse.
    """
    dt = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=k.device)
    dv = torch.zeros(v.shape, dtype=dt, device=v.device)
    for rows, visible, mask in _chunks_at(q, group_name, is_causal, layout):
        q_r, out_r, dout_r = q[:, :, rows], out[:, :, rows], dout[:, :, rows].contiguous()
        lse_r = lse[:, :, rows].contiguous()
        width = q_r.shape[2]
        for cols, causal in _key_tiles(q_r.shape[2], k.shape[2] if visible is None else visible, mask, width):
            k_c, v_c = k[:, :, cols], v[:, :, cols]
            tq, tk, tv = _tile_bwd(dout_r, q_r, k_c, v_c, out_r, lse_r, causal, scale)
            if dlse is not None:
                eq, ek = _lse_grad(dlse[:, :, rows], q_r, k_c, lse_r, causal, scale)
                tq, tk = tq + eq, tk + ek
            dq[:, :, rows] += tq
            dk[:, :, cols] += tk
            dv[:, :, cols] += tv
            del tq, tk, tv
    return dq.to(q.dtype), dk, dv


@allgather_block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, group_name, is_causal, layout, scale):
    dt = acc_dtype(q.dtype)
    return dense_like(q), k.new_empty(k.shape, dtype=dt), v.new_empty(v.shape, dtype=dt)


# ----------------------------------------------------------------------------
# The schedule (one definition, eager and compiled).
# ----------------------------------------------------------------------------


def allgather_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group_name: str, world_size: int,
    is_causal: bool, layout: str, scale: float, enable_gqa: bool,
) -> tuple[Tensor, Tensor]:
    if world_size > 1:
        torch.ops.cp.agree(q, k, v, group_name, f"allgather causal={is_causal} layout={layout} scale={scale!r} "
                           f"gqa={enable_gqa}")
    check_ring_args(q, k, v, world_size, is_causal, layout, enable_gqa)
    k_all = gather_sequence(k, group_name, world_size, layout)
    v_all = gather_sequence(v, group_name, world_size, layout)
    return torch.ops.cp.allgather_block_attn(q, k_all, v_all, group_name, is_causal, layout, scale)


def allgather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor], *,
    group_name: str, world_size: int, is_causal: bool, layout: str, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    k_all = gather_sequence(k, group_name, world_size, layout)
    v_all = gather_sequence(v, group_name, world_size, layout)
    dq, dk_all, dv_all = torch.ops.cp.allgather_block_attn_backward(
        dout, q, k_all, v_all, out, lse, dlse, group_name, is_causal, layout, scale
    )
    del k_all, v_all
    dk = scatter_sequence(dk_all, group_name, world_size, layout)
    dv = scatter_sequence(dv_all, group_name, world_size, layout)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------
# The schedule as one differentiable op.
# ----------------------------------------------------------------------------


@torch.library.custom_op("cp::allgather_attention", mutates_args=())
def allgather_attention_op(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, is_causal: bool, layout: str, scale: float, enable_gqa: bool
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries over the whole sharded sequence: (out, lse)."""
    out, lse = allgather_forward(
        q, k, v, group_name=group_name, world_size=resolve_group(group_name).size(),
        is_causal=is_causal, layout=layout, scale=scale, enable_gqa=enable_gqa,
    )
    return out.contiguous(), lse.contiguous()


@allgather_attention_op.register_fake
def _(q, k, v, group_name, is_causal, layout, scale, enable_gqa):
    return result_like(q, v)


@torch.library.custom_op("cp::allgather_attention_backward", mutates_args=())
def allgather_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    group_name: str, is_causal: bool, layout: str, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = allgather_backward(
        dout, q, k, v, out, lse, dlse, group_name=group_name, world_size=resolve_group(group_name).size(),
        is_causal=is_causal, layout=layout, scale=scale,
    )
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@allgather_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, group_name, is_causal, layout, scale):
    return dense_like(q), dense_like(k), dense_like(v)


# the forward saves only the local shards: the backward gathers again
register_attention_autograd(allgather_attention_op, torch.ops.cp.allgather_attention_backward)


def _expand_forward(args) -> Traceable:
    q, k, v, group_name, is_causal, layout, scale, enable_gqa = args
    world_size = resolve_group(group_name).size()

    def fn(q, k, v):
        return allgather_forward(q, k, v, group_name=group_name, world_size=world_size, is_causal=is_causal,
                                 layout=layout, scale=scale, enable_gqa=enable_gqa)

    return Traceable("forward", world_size, fn, [q, k, v])


def _expand_backward(args) -> Traceable:
    dout, q, k, v, out, lse, dlse, group_name, is_causal, layout, scale = args
    world_size = resolve_group(group_name).size()

    def fn(*tensors):
        dlse = tensors[6] if len(tensors) > 6 else None
        return allgather_backward(*tensors[:6], dlse, group_name=group_name, world_size=world_size,
                                  is_causal=is_causal, layout=layout, scale=scale)

    return Traceable("backward", world_size, fn, [dout, q, k, v, out, lse] + ([dlse] if dlse is not None else []))


# listing names must not start with "attend": those carry a step number
register_schedule(
    torch.ops.cp.allgather_attention.default, _expand_forward,
    torch.ops.cp.allgather_attention_backward.default, _expand_backward,
    {torch.ops.cp.allgather_block_attn.default: "gathered attend",
     torch.ops.cp.allgather_block_attn_backward.default: "gathered attend_backward"},
)


def allgather_attention(
    q: Tensor, k: Tensor, v: Tensor, group=None, is_causal: bool = False, scale: Optional[float] = None,
    enable_gqa: bool = False, layout: str = "zigzag",
) -> Tensor:
    """All-gather CP attention over ``[B, H, S_local, D]`` shards (see ``ring_attention``). Differentiable."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, _ = allgather_attention_op(q, k, v, group_name_of(group), bool(is_causal), layout, scale, bool(enable_gqa))
    return out
