"""Ring attention: K/V travel around the ring, each rank attends its Q to every block.

The schedule is written once, below, as plain Python over custom ops
(``cp::ring_shift`` + ``wait_tensor`` for transfers, ``cp::ring_block_attn`` for
compute, ``cp::merge_`` for the online softmax, in place). The eager op runs it directly;
the compiler traces the very same functions into the graph.

Which part of a step's tile is visible depends on the rank and on which rank's
K/V arrived; ``cp::ring_block_attn`` reads both at run time, so a traced
schedule holds the step number but never the rank.

Zigzag layout (rank r holds global chunks r and 2C-1-r), causal, step i, K/V
of rank j = (r - i) mod C:

- i = 0       (j == r): local causal attention over both halves;
- j < r:      all of Q against the first K/V half, no mask;
- j > r:      the second Q half against all of K/V, no mask.

Every step thus costs the same half-size work on every rank. The contiguous
layout (rank r holds chunk r) is supported; under causality it leaves rank 0
idle for most steps. Non-causal attention is full Q against full K/V.

Memory: the forward holds the current and the incoming K/V and one fp32
accumulator whatever C is. The backward holds the current K/V, an fp32 dQ
accumulator, and either the incoming K/V or the travelling fp32 dK/dV (sent and
received), never both: a step after the first runs its heads in two halves,
one per transfer (``ring_pass_backward``). A 2-ring peaks as high as a long one.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .block import (
    acc_dtype, block_attn_backward_impl, block_attn_impl, check_block_args, dense_like, result_like,
)
from ..layout import check_layout
from .comm import TAG_DKV, TAG_KV, first_hop_buffers, resolve_group, wait
from .merge import start_accumulator
from .registry import Traceable, register_schedule

# ----------------------------------------------------------------------------
# Sections: which part of the (local Q, arriving K/V) tile a step computes.
# ----------------------------------------------------------------------------

FULL, DIAGONAL, KV_FIRST_HALF, Q_SECOND_HALF, SKIP = "full", "diagonal", "kv_first_half", "q_second_half", "skip"


def ring_section(is_causal: bool, layout: str, rank: int, source: int) -> str:
    """The part of the tile rank ``rank`` computes against K/V from ``source``."""
    if not is_causal:
        return FULL
    if source == rank:
        return DIAGONAL
    if layout == "zigzag":
        return KV_FIRST_HALF if source < rank else Q_SECOND_HALF
    return FULL if source < rank else SKIP


def _section_at(step: int, group_name: str, is_causal: bool, layout: str) -> str:
    group = resolve_group(group_name)
    rank, size = group.rank(), group.size()
    return ring_section(is_causal, layout, rank, (rank - step) % size)


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
            dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows].contiguous(), "none", scale,
            None if dlse is None else dlse[:, :, rows],
        )
        return torch.cat([dq_half.new_zeros(dq_half.shape), dq_half], dim=2), dk, dv
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@torch.library.custom_op("cp::ring_block_attn", mutates_args=())
def ring_block_attn(
    q: Tensor, k: Tensor, v: Tensor, step: int, group_name: str, is_causal: bool, layout: str, scale: float
) -> tuple[Tensor, Tensor]:
    """One ring step's attention, its section chosen from this rank at run time."""
    out, lse = section_attn(q, k, v, _section_at(step, group_name, is_causal, layout), scale)
    return out.contiguous(), lse.contiguous()


@ring_block_attn.register_fake
def _(q, k, v, step, group_name, is_causal, layout, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::ring_block_attn_backward", mutates_args=())
def ring_block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    step: int, group_name: str, is_causal: bool, layout: str, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    section = _section_at(step, group_name, is_causal, layout)
    dq, dk, dv = section_attn_backward(dout, q, k, v, out, lse, dlse, section, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@ring_block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, step, group_name, is_causal, layout, scale):
    return dense_like(q), dense_like(k), dense_like(v)


# ----------------------------------------------------------------------------
# The schedule (one definition, eager and compiled).
# ----------------------------------------------------------------------------


def _options(is_causal: bool, layout: str, scale: float, enable_gqa: bool) -> str:
    return f"ring causal={is_causal} layout={layout} scale={scale!r} gqa={enable_gqa}"


def check_ring_args(q: Tensor, k: Tensor, v: Tensor, world_size: int, is_causal: bool, layout: str, enable_gqa: bool):
    """Local checks; identical inputs on every rank give identical verdicts."""
    check_layout(layout)
    check_block_args(q, k, v, "none")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(
            f"q has {q.shape[1]} heads but k/v have {k.shape[1]}; pass enable_gqa=True for grouped-query attention"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"local q and k/v lengths differ ({q.shape[2]} vs {k.shape[2]}); CP shards them alike")
    if is_causal and layout == "zigzag" and world_size > 1 and q.shape[2] % 2:
        raise ValueError(
            f"zigzag layout holds two equal chunks per rank, but the local length {q.shape[2]} is odd; "
            "shard with ContextParallel.shard so the sequence splits into 2*C chunks"
        )


def ring_pass_forward(q: Tensor, k: Tensor, v: Tensor, attend, *, group_name: str, world_size: int):
    """The ring's forward over any per-step compute (SDPA, packed, flex sections alike).

    ``attend(step, k_block, v_block)`` returns the step's partial (out, lse),
    full-size for the local queries. Returns the fp32 (fp64) accumulator.
    """
    ops = torch.ops.cp
    kv = first_hop_buffers([k, v]) if world_size > 1 else [k, v]
    acc = None
    for step in range(world_size):
        # next step's K/V is on the wire while this step computes
        incoming = ops.ring_shift(kv, group_name, 1, TAG_KV) if step + 1 < world_size else None
        part_out, part_lse = attend(step, kv[0], kv[1])
        if acc is None:
            acc = start_accumulator(part_out, part_lse)
        else:
            ops.merge_(acc[0], acc[1], part_out, part_lse, 0)  # in place: one fp32 accumulator, no copies
        # let the partial go now, not when the next step's result replaces it
        del part_out, part_lse
        if incoming is not None:
            kv = wait(incoming, sent=kv)
    return acc


def _head_halves(kv_heads: int) -> list[Optional[slice]]:
    """The K/V heads of a backward step in two parts, or one part (``None``: all) for a single head."""
    if kv_heads < 2:
        return [None]
    return [slice(0, kv_heads // 2), slice(kv_heads // 2, kv_heads)]


def _narrow_heads(heads: Optional[slice], tensors) -> list[Optional[Tensor]]:
    """The heads (dim 1, in both [B, H, S, D] and packed [T, H, D]) of each tensor; ``None`` stays."""
    if heads is None:
        return list(tensors)
    return [None if t is None else t.narrow(1, heads.start, heads.stop - heads.start) for t in tensors]


def ring_pass_backward(
    q: Tensor, k: Tensor, v: Tensor, attend_backward, *, group_name: str, world_size: int,
    q_side: tuple = (), split_heads: bool = False,
):
    """The ring's backward over any per-step gradient compute.

    K/V go around the ring again; each block's dK/dV accumulated so far rides
    along with it and, after C steps, arrives back at its owner.
    ``attend_backward(step, k_block, v_block, *q_side)`` returns the step's
    (dq, dk, dv); the sums come back in the accumulation dtype. ``q_side`` are
    the per-query-head tensors the step reads (dout, q, out, lse, dlse: heads at
    dim 1, ``None`` allowed).

    With ``split_heads``, a step after the first computes its heads in two
    halves (``k_block``/``v_block`` and ``q_side`` narrowed alike): the first
    half while the previous step's dK/dV hop finishes, the second while the next
    K/V block arrives. The incoming K/V and the travelling dK/dV are then never
    on the wire at once, so a middle step of a long ring holds no more than the
    last step of a 2-ring: peak memory is the same for every C. The transfers
    still overlap compute, each with half a step.
    """
    ops = torch.ops.cp
    dt = acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kv = first_hop_buffers([k, v]) if world_size > 1 else [k, v]
    dq = dkv = dkv_incoming = kv_incoming = None
    dkv_sent: list[Tensor] = []

    def add(heads, dq_i, dk_i, dv_i):
        nonlocal dq, dkv
        if dq is None:
            dq = dq_i.to(dt)
        else:
            ops.accumulate_(dq, dq_i, 0 if heads is None else heads.start * group)
        if dkv is None:
            dkv = [dk_i.to(dt), dv_i.to(dt)]
        else:
            for acc, grad in zip(dkv, (dk_i, dv_i)):
                ops.accumulate_(acc, grad, 0 if heads is None else heads.start)

    for step in range(world_size):
        parts = _head_halves(k.shape[1]) if split_heads and dkv_incoming is not None else [None]
        for n, heads in enumerate(parts):
            if n == len(parts) - 1 and step + 1 < world_size:
                kv_incoming = ops.ring_shift(kv, group_name, 1, TAG_KV)
            q_heads = None if heads is None else slice(heads.start * group, heads.stop * group)
            grads = attend_backward(step, *_narrow_heads(heads, kv), *_narrow_heads(q_heads, q_side))
            if dkv_incoming is not None:
                dkv = wait(dkv_incoming, sent=dkv_sent)  # ours now: never add into tensors in flight
                dkv_incoming, dkv_sent = None, []
            add(heads, *grads)
            del grads  # free this part's partials before the next part runs
        if world_size > 1:
            dkv_incoming, dkv_sent, dkv = ops.ring_shift(dkv, group_name, 1, TAG_DKV), dkv, None
        if kv_incoming is not None:
            kv, kv_incoming = wait(kv_incoming, sent=kv), None
    dk, dv = wait(dkv_incoming, sent=dkv_sent) if world_size > 1 else dkv
    return dq, dk, dv


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group_name: str, world_size: int,
    is_causal: bool, layout: str, scale: float, enable_gqa: bool,
) -> tuple[Tensor, Tensor]:
    ops = torch.ops.cp
    if world_size > 1:
        ops.agree(q, k, v, group_name, _options(is_causal, layout, scale, enable_gqa))
    check_ring_args(q, k, v, world_size, is_causal, layout, enable_gqa)

    def attend(step, k_block, v_block):
        return ops.ring_block_attn(q, k_block, v_block, step, group_name, is_causal, layout, scale)

    out, lse = ring_pass_forward(q, k, v, attend, group_name=group_name, world_size=world_size)
    return out.to(q.dtype), lse


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor], *,
    group_name: str, world_size: int, is_causal: bool, layout: str, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    def attend_backward(step, k_block, v_block, dout, q, out, lse, dlse):
        return torch.ops.cp.ring_block_attn_backward(
            dout, q, k_block, v_block, out, lse, dlse, step, group_name, is_causal, layout, scale
        )

    dq, dk, dv = ring_pass_backward(q, k, v, attend_backward, group_name=group_name, world_size=world_size,
                                    q_side=(dout, q, out, lse, dlse), split_heads=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------
# The ring as one differentiable op.
# ----------------------------------------------------------------------------


@torch.library.custom_op("cp::ring_attention", mutates_args=())
def ring_attention_op(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, is_causal: bool, layout: str, scale: float, enable_gqa: bool
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries over the whole sharded sequence: (out, lse)."""
    world_size = resolve_group(group_name).size()
    out, lse = ring_forward(
        q, k, v, group_name=group_name, world_size=world_size,
        is_causal=is_causal, layout=layout, scale=scale, enable_gqa=enable_gqa,
    )
    return out.contiguous(), lse.contiguous()


@ring_attention_op.register_fake
def _(q, k, v, group_name, is_causal, layout, scale, enable_gqa):
    return result_like(q, v)


@torch.library.custom_op("cp::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    group_name: str, is_causal: bool, layout: str, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    world_size = resolve_group(group_name).size()
    dq, dk, dv = ring_backward(
        dout, q, k, v, out, lse, dlse, group_name=group_name, world_size=world_size,
        is_causal=is_causal, layout=layout, scale=scale,
    )
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, group_name, is_causal, layout, scale):
    return dense_like(q), dense_like(k), dense_like(v)


def register_attention_autograd(forward_op, backward_op) -> None:
    """Autograd for a whole-schedule op ``(q, k, v, group_name, is_causal, layout, scale, enable_gqa) -> (out, lse)``
    whose backward op takes ``(dout, q, k, v, out, lse, dlse, group_name, is_causal, layout, scale)``."""

    def setup(ctx, inputs, output):
        q, k, v, group_name, is_causal, layout, scale, _ = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.options = (group_name, is_causal, layout, scale)
        # an unused lse must arrive as None, not zeros: its gradient path is dense
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward_op(dout, q, k, v, out, lse, dlse, *ctx.options)
        return dq, dk, dv, None, None, None, None, None

    forward_op.register_autograd(backward, setup_context=setup)


register_attention_autograd(ring_attention_op, torch.ops.cp.ring_attention_backward)


def _expand_forward(args) -> Traceable:
    q, k, v, group_name, is_causal, layout, scale, enable_gqa = args
    world_size = resolve_group(group_name).size()

    def fn(q, k, v):
        return ring_forward(
            q, k, v, group_name=group_name, world_size=world_size, is_causal=is_causal,
            layout=layout, scale=scale, enable_gqa=enable_gqa,
        )

    return Traceable("forward", world_size, fn, [q, k, v])


def _expand_backward(args) -> Traceable:
    dout, q, k, v, out, lse, dlse, group_name, is_causal, layout, scale = args
    world_size = resolve_group(group_name).size()

    def fn(*tensors):  # a fixed arity for tracing: dlse is there or not
        dout, q, k, v, out, lse = tensors[:6]
        dlse = tensors[6] if len(tensors) > 6 else None
        return ring_backward(
            dout, q, k, v, out, lse, dlse, group_name=group_name, world_size=world_size,
            is_causal=is_causal, layout=layout, scale=scale,
        )

    return Traceable("backward", world_size, fn, [dout, q, k, v, out, lse] + ([dlse] if dlse is not None else []))


register_schedule(
    torch.ops.cp.ring_attention.default, _expand_forward,
    torch.ops.cp.ring_attention_backward.default, _expand_backward,
    {torch.ops.cp.ring_block_attn.default: "attend", torch.ops.cp.ring_block_attn_backward.default: "attend_backward"},
)

# The whole-ring ops are deliberately *not* registered side-effectful: they only
# appear in graphs that are the same on every rank, so a compiler that drops an
# unused one drops it everywhere, and AOTAutograd's partitioner copies
# side-effectful forward nodes into the backward graph (re-running the ring).
# The ops that really talk, cp::ring_shift and cp::agree, are side-effectful.


# ----------------------------------------------------------------------------
# Eager API.
# ----------------------------------------------------------------------------


def is_2d_mesh(group) -> bool:
    """A 2-D (ring, a2a) DeviceMesh: eagerly only the hybrid schedule runs on one."""
    return hasattr(group, "get_group") and group.ndim == 2


def group_name_of(group) -> str:
    """Name of a ProcessGroup, a 1-D DeviceMesh, a group name, or None (the default group)."""
    if isinstance(group, str):
        return group
    if group is None:
        group = dist.group.WORLD
    if hasattr(group, "get_group"):  # DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"ring attention needs a 1-D DeviceMesh, got {group.ndim}-D")
        group = group.get_group()
    return group.group_name


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group=None, is_causal: bool = False, scale: Optional[float] = None,
    enable_gqa: bool = False, layout: str = "zigzag", dropout_p: float = 0.0,
) -> Tensor:
    """Ring attention over a sequence sharded across ``group``.

    ``q, k, v`` are this rank's ``[B, H, S_local, D]`` shards, laid out as
    ``layout`` says (``ContextParallel.shard`` produces them). ``is_causal``
    means causal over the whole global sequence. Differentiable.
    """
    if dropout_p:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: attention dropout under context parallelism is not supported; "
            "use dropout_p=0.0"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, _ = ring_attention_op(q, k, v, group_name_of(group), bool(is_causal), layout, scale, bool(enable_gqa))
    return out
