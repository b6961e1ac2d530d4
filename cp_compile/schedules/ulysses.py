"""Ulysses (all-to-all) attention: trade sequence sharding for head sharding.

Forward: one all-to-all each for q, k and v turns this rank's tokens of all
heads into all tokens of H/C heads (``comm.exchange.seq_to_heads``); the kind
attends over the whole sequence (one ``cp::attend`` with ``step=WHOLE``: any
mask the kind supports); one all-to-all brings the output back to sequence
sharding (and one small one the lse). Every tensor crosses the wire once and
(C-1)/C of it leaves the rank: 4/C of the activations per rank in the
forward, against C-1 full K/V blocks for the ring.

The head-sharded q, k, v, out and lse are extra outputs of the forward op and
are what the backward keeps (``whole.heads_schedule``), so the backward moves
dout in and dq, dk, dv out (and dlse if the caller differentiates lse),
nothing else. The gradients travel in the inputs' dtype.

GQA: K/V heads are sharded like query heads when they divide by C. When they
do not, each K/V head is repeated ``lcm(Hkv, C) / Hkv`` times before the
exchange (``explain`` says so) and its gradients are summed back afterwards.
Query heads must divide by C (``ValueError`` otherwise; ``auto`` then picks
another schedule).

The exchange restores sequence order for dense attention; kinds that
evaluate a mask at known slots keep every rank's tokens in rank order
(``Kind.rank_order``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from ..comm.exchange import check_heads, heads_to_seq, replicate_kv_heads, seq_to_heads
from ..kernels.merge import acc_dtype
from ..kinds.base import WHOLE, kind_entry
from ..kinds.call import Call
from .whole import heads_schedule, world_size_of


def exchange_forward(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, world_size: int, order: Optional[list[int]], attend: Callable
) -> tuple[Tensor, ...]:
    """Head-shard q, k, v over the group, ``attend(qh, kh, vh) -> (out_h, lse_h)``, sequence-shard back.

    Returns (out, lse) sequence-sharded, then the head-sharded (q, k, v, out, lse) the backward needs.
    """
    copies = replicate_kv_heads(k.shape[1], q.shape[1], world_size)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    qh, kh, vh = (seq_to_heads(t, group_name, world_size, order) for t in (q, k, v))
    out_h, lse_h = attend(qh, kh, vh)
    out = heads_to_seq(out_h, group_name, world_size, order)
    lse = heads_to_seq(lse_h, group_name, world_size, order)
    return out, lse, qh, kh, vh, out_h, lse_h


def exchange_backward(
    dout: Tensor,
    dlse: Optional[Tensor],
    group_name: str,
    world_size: int,
    order: Optional[list[int]],
    kv_heads: int,
    attend_backward: Callable,
) -> tuple[Tensor, Tensor, Tensor]:
    """The mirror: dout (and dlse) to head sharding, ``attend_backward(dout_h, dlse_h)``, gradients back.

    The gradients travel in the dtype ``attend_backward`` returns them in; replicated K/V heads'
    gradients are summed in the accumulation dtype."""
    dout_h = seq_to_heads(dout, group_name, world_size, order)
    dlse_h = None if dlse is None else seq_to_heads(dlse, group_name, world_size, order)
    grads = attend_backward(dout_h, dlse_h)
    dq, dk, dv = (heads_to_seq(t, group_name, world_size, order) for t in grads)
    copies = dk.shape[1] // kv_heads
    if copies > 1:  # the replicated heads' gradients, summed back onto each original head
        b, _, s, _ = dk.shape
        acc = acc_dtype(dk.dtype)
        dk = dk.view(b, kv_heads, copies, s, dk.shape[-1]).sum(2, dtype=acc).to(dk.dtype)
        dv = dv.view(b, kv_heads, copies, s, dv.shape[-1]).sum(2, dtype=acc).to(dv.dtype)
    return dq, dk, dv


def ulysses_forward(q, k, v, extra: list, call: Call, enable_gqa: bool) -> tuple[Tensor, ...]:
    """(out, lse) sequence-sharded, then the head-sharded (q, k, v, out, lse) the backward needs."""
    kind, world_size = kind_entry(call.kind), world_size_of(call.group_name)
    kind.start(q, k, v, extra, call, world_size, enable_gqa, f"ulysses gqa={enable_gqa}")
    check_heads(q.shape[1], world_size, "the query")

    def attend(qh, kh, vh):
        return torch.ops.cp.attend(qh, kh, vh, extra, *call.attend_args(WHOLE, world_size))

    return exchange_forward(q, k, v, call.group_name, world_size, kind.chunk_order(call, world_size), attend)


def ulysses_backward(dout, dlse, qh, kh, vh, out_h, lse_h, extra: list, call: Call, kv_heads: int):
    world_size = world_size_of(call.group_name)

    def attend_backward(dout_h, dlse_h):
        return torch.ops.cp.attend_backward(
            dout_h, qh, kh, vh, out_h, lse_h, dlse_h, extra, *call.attend_args(WHOLE, world_size)
        )

    order = kind_entry(call.kind).chunk_order(call, world_size)
    return exchange_backward(dout, dlse, call.group_name, world_size, order, kv_heads, attend_backward)


ulysses_attention_op = heads_schedule("ulysses", ("group_name",), 0, ulysses_forward, ulysses_backward)
