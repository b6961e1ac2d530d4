"""Ring attention: K/V travel around a ring, each unit attends its queries to every block.

The schedule is written once, below, as plain Python over custom ops
(``cp::ring_shift`` + ``wait_tensor`` for transfers, ``cp::attend`` for
compute, ``cp::merge_`` for the online softmax, in place), for every kind of
attention. The eager op runs it directly; the compiler traces the very same
functions into the graph. Which part of a step's tile is visible depends on
the rank and on which rank's K/V arrived; the kind reads both at run time
(``kinds.base``), so a traced schedule holds the step number but never the
rank. The hybrid schedule runs the same ring over its all-to-all groups.

Memory: the forward holds the current and the incoming K/V and one fp32
accumulator whatever C is. The backward holds the current K/V, an fp32 dQ
accumulator, and either the incoming K/V or the travelling fp32 dK/dV (sent and
received), never both: a step after the first runs its heads in two halves,
one per transfer (``ring_pass_backward``), unless the kind reads head indices.
A 2-ring peaks as high as a long one.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..comm.ring import TAG_DKV, TAG_KV, first_hop_buffers, wait
from ..kernels.merge import acc_dtype, start_accumulator
from ..kinds.base import kind_entry
from ..kinds.call import Call
from .whole import sequence_schedule, world_size_of


class RingHops:
    """How a ring pass moves its blocks: ``cp::ring_shift`` to the next rank of ``group_name``,
    completed by ``wait``. (``bench.virtual`` passes hops that move nothing, to time one rank's
    compute in the ring's order.)"""

    def __init__(self, group_name: str):
        self.group_name = group_name

    def first(self, tensors: list[Tensor]) -> list[Tensor]:
        return first_hop_buffers(tensors)

    def shift(self, tensors: list[Tensor], tag: int) -> list[Tensor]:
        return torch.ops.cp.ring_shift(tensors, self.group_name, 1, tag)

    def wait(self, received: list[Tensor], sent: list[Tensor]) -> list[Tensor]:
        return wait(received, sent=sent)


def ring_pass_forward(q: Tensor, k: Tensor, v: Tensor, attend, *, world_size: int, hops):
    """The ring's forward over any per-step compute (SDPA, packed, flex sections alike).

    ``attend(step, k_block, v_block)`` returns the step's partial (out, lse),
    full-size for the local queries; ``hops`` moves the K/V (``RingHops``).
    Returns the fp32 (fp64) accumulator.
    """
    kv = hops.first([k, v]) if world_size > 1 else [k, v]
    acc = None
    for step in range(world_size):
        # next step's K/V is on the wire while this step computes
        incoming = hops.shift(kv, TAG_KV) if step + 1 < world_size else None
        part_out, part_lse = attend(step, kv[0], kv[1])
        if acc is None:
            acc = start_accumulator(part_out, part_lse)
        else:
            torch.ops.cp.merge_(acc[0], acc[1], part_out, part_lse, 0)  # in place: one fp32 accumulator
        # let the partial go now, not when the next step's result replaces it
        del part_out, part_lse
        if incoming is not None:
            kv = hops.wait(incoming, sent=kv)
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
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attend_backward,
    *,
    world_size: int,
    hops,
    q_side: tuple = (),
    split_heads: bool = False,
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
    kv = hops.first([k, v]) if world_size > 1 else [k, v]
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
                kv_incoming = hops.shift(kv, TAG_KV)
            q_heads = None if heads is None else slice(heads.start * group, heads.stop * group)
            grads = attend_backward(step, *_narrow_heads(heads, kv), *_narrow_heads(q_heads, q_side))
            if dkv_incoming is not None:
                dkv = hops.wait(dkv_incoming, sent=dkv_sent)  # ours now: never add into tensors in flight
                dkv_incoming, dkv_sent = None, []
            add(heads, *grads)
            del grads  # free this part's partials before the next part runs
        if world_size > 1:
            dkv_incoming, dkv_sent, dkv = hops.shift(dkv, TAG_DKV), dkv, None
        if kv_incoming is not None:
            kv, kv_incoming = hops.wait(kv_incoming, sent=kv), None
    dk, dv = hops.wait(dkv_incoming, sent=dkv_sent) if world_size > 1 else dkv
    return dq, dk, dv


def ring_over_units(
    q: Tensor, k: Tensor, v: Tensor, extra: list, call: Call, ring_group: str, a2a_size: int
) -> tuple[Tensor, Tensor]:
    """The ring's forward over ``ring_group``, each step one ``cp::attend`` with units of ``a2a_size`` ranks."""
    packed = q.dim() == 3  # [T, H, D] merges as a batch of one: cp::merge_ takes [B, H, S, D]

    def attend(step, k_block, v_block):
        out, lse = torch.ops.cp.attend(q, k_block, v_block, extra, *call.attend_args(step, a2a_size))
        return (out.unsqueeze(0), lse.unsqueeze(0)) if packed else (out, lse)

    out, lse = ring_pass_forward(q, k, v, attend, world_size=world_size_of(ring_group), hops=RingHops(ring_group))
    if packed:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return out.to(q.dtype), lse


def ring_over_units_backward(
    q_side: tuple, k, v, extra: list, call: Call, ring_group: str, a2a_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The mirror of ``ring_over_units``: K/V travel again, each block's dK/dV so far riding along. ``q_side``: what
    stays with the queries, ``(dout, q, out, lse, dlse)``."""
    q = q_side[1]

    def attend_backward(step, k_block, v_block, dout, q, out, lse, dlse):
        return torch.ops.cp.attend_backward(
            dout, q, k_block, v_block, out, lse, dlse, extra, *call.attend_args(step, a2a_size)
        )

    dq, dk, dv = ring_pass_backward(
        q,
        k,
        v,
        attend_backward,
        world_size=world_size_of(ring_group),
        hops=RingHops(ring_group),
        q_side=q_side,
        split_heads=kind_entry(call.kind).split_heads,
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_forward(q, k, v, extra: list, call: Call, world_size: int, enable_gqa: bool):
    kind_entry(call.kind).start(q, k, v, extra, call, world_size, enable_gqa, f"ring gqa={enable_gqa}")
    return ring_over_units(q, k, v, extra, call, call.group_name, 1)


def ring_backward(dout, q, k, v, out, lse, dlse, extra: list, call: Call, world_size: int):
    return ring_over_units_backward((dout, q, out, lse, dlse), k, v, extra, call, call.group_name, 1)


ring_attention_op = sequence_schedule("ring", ring_forward, ring_backward)
