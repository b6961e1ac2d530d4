"""Hybrid attention on a 2-D mesh: all-to-all inside a group, ring across groups.

The mesh is ``(ring, a2a)``: dim 0 is the ring, dim 1 the all-to-all group
(consecutive ranks, e.g. the GPUs of one node, where the all-to-all's many
messages are cheap; the ring's few large transfers cross the slower links and
hide under compute). The plan shards the sequence over the flattened mesh
(rank ``ring_rank * A + a2a_rank``, C = R x A) with the plan's layout.

Why that composes: under zigzag, flattened rank f holds chunks f and 2C-1-f
of 2C. The all-to-all group of ring rank j is ranks jA .. jA+A-1, so after the
exchange (``comm.exchange.seq_to_heads``, which orders the group's tokens) each rank
holds, for H/A heads, chunks jA .. jA+A-1 followed by (2R-1-j)A .. (2R-1-j)A+A-1:
exactly ring chunks j and 2R-1-j of a zigzag over R ranks. The causal ring
over R is then balanced as usual (``ring.ring_over_units``, with units of A
ranks), and so is the whole mesh. The contiguous layout composes the same way.

Per rank the all-to-all moves 4/A of the activations once, and the ring
sends R-1 K/V blocks of the local size, overlapped with compute.

The forward op returns the head-sharded q, k, v, out and lse and the
backward keeps them: inside the all-to-all group the backward moves only
dout (and dlse) in and dq, dk, dv out; K/V and dK/dV travel the ring again.

Every kind runs here: dense attention exchanges into sequence order and
rings as above; kinds that exchange in rank order (masks, packed documents)
evaluate their mask between this group's tokens and the visiting group's at
each ring step (``kinds.base``: units of A ranks).
"""

from __future__ import annotations

from torch import Tensor

from ..comm.exchange import check_heads
from ..kinds.base import kind_entry
from ..kinds.call import Call
from .ring import ring_over_units, ring_over_units_backward
from .ulysses import exchange_backward, exchange_forward
from .whole import heads_schedule, world_size_of


def hybrid_forward(q, k, v, extra: list, call: Call, enable_gqa: bool) -> tuple[Tensor, ...]:
    """(out, lse) sequence-sharded, then the head-sharded (q, k, v, out, lse) the backward keeps."""
    _, ring_group, a2a_group = call.groups
    kind, rings, a2a = kind_entry(call.kind), world_size_of(ring_group), world_size_of(a2a_group)
    kind.start(q, k, v, extra, call, rings * a2a, enable_gqa, f"hybrid ring={rings} a2a={a2a} gqa={enable_gqa}")
    check_heads(q.shape[1], a2a, "the query")
    return exchange_forward(
        q,
        k,
        v,
        a2a_group,
        a2a,
        kind.chunk_order(call, a2a),
        lambda qh, kh, vh: ring_over_units(qh, kh, vh, extra, call, ring_group, a2a),
    )


def hybrid_backward(dout, dlse, qh, kh, vh, out_h, lse_h, extra: list, call: Call, kv_heads: int):
    """The ring's backward on the kept head-sharded tensors; only dout (dlse) in and dq, dk, dv out
    cross the all-to-all group."""
    _, ring_group, a2a_group = call.groups
    a2a = world_size_of(a2a_group)

    def attend_backward(dout_h, dlse_h):  # in the inputs' dtype, as the ring's backward returns them
        return ring_over_units_backward((dout_h, qh, out_h, lse_h, dlse_h), kh, vh, extra, call, ring_group, a2a)

    return exchange_backward(
        dout, dlse, a2a_group, a2a, kind_entry(call.kind).chunk_order(call, a2a), kv_heads, attend_backward
    )


hybrid_attention_op = heads_schedule(
    "hybrid", ("group_name", "ring_group", "a2a_group"), 2, hybrid_forward, hybrid_backward
)
