"""All-gather attention: every rank gathers the whole K/V, then attends its own Q.

Forward: all-gather K and V (``Kind.gather`` puts them in the order the kind
reads: sequence order for dense attention, so each local query chunk sees a
prefix; rank order for masks; global packed order for documents) and let the
local queries attend to them in one ``cp::attend`` (``step=GATHERED``). The
output is final; nothing is merged. Backward: gather K/V again (they are not
saved: the forward keeps only the local shards), compute dQ and the
full-length dK/dV in fp32, and return dK/dV to their owners with one
reduce-scatter (``Kind.scatter``).

K and V travel side by side in one collective (dK and dV too): the schedule
is one collective forward and two backward, so there is no overlap to pin;
its cost is O(C) memory for the gathered K/V, which is why it pays for
few K/V heads (GQA) or short windows, where the gathered K/V is small or most
of a ring's steps would be empty.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kinds.base import GATHERED, kind_entry
from ..kinds.call import Call
from .whole import sequence_schedule


def _both(exchange, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``exchange`` of ``a`` and of ``b``, side by side in one collective where they differ only in their last
    dim: each collective costs a latency of its own, which is what a short sequence's step is made of."""
    if a.dtype != b.dtype or a.shape[:-1] != b.shape[:-1]:
        return exchange(a), exchange(b)
    both = exchange(torch.cat([a, b], dim=-1))
    return both[..., : a.shape[-1]].contiguous(), both[..., a.shape[-1] :].contiguous()


def allgather_forward(q, k, v, extra: list, call: Call, world_size: int, enable_gqa: bool):
    kind = kind_entry(call.kind)
    kind.start(q, k, v, extra, call, world_size, enable_gqa, f"allgather gqa={enable_gqa}")
    k_all, v_all = _both(lambda t: kind.gather(t, extra, call, world_size), k, v)
    return torch.ops.cp.attend(q, k_all, v_all, extra, *call.attend_args(GATHERED, 1))


def allgather_backward(dout, q, k, v, out, lse, dlse, extra: list, call: Call, world_size: int):
    kind = kind_entry(call.kind)
    k_all, v_all = _both(lambda t: kind.gather(t, extra, call, world_size), k, v)
    dq, dk_all, dv_all = torch.ops.cp.attend_backward(
        dout, q, k_all, v_all, out, lse, dlse, extra, *call.attend_args(GATHERED, 1)
    )
    del k_all, v_all
    dk, dv = _both(lambda t: kind.scatter(t, extra, call, world_size), dk_all, dv_all)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


allgather_attention_op = sequence_schedule("allgather", allgather_forward, allgather_backward)
