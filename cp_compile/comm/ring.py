"""The ring's point-to-point hop.

``cp::ring_shift`` starts an asynchronous shift of tensors around the ring and
returns the receive buffers; ``torch.ops._c10d_functional.wait_tensor`` on a
buffer completes it, exactly as for a functional collective. The op reads the
rank and the peers from the group at run time: a compiled graph holds only the
group name and the shift, so its code is the same on every rank. (The stock
functional p2p ops take the peer as a constant, which would bake the rank into
the graph.)

It talks to other ranks, so it is registered side-effectful: the compiler must never drop or duplicate it on one
rank only.

Transport rules (what keeps a hop correct on NCCL as well as on gloo)
--------------------------------------------------------------------
* One hop is one grouped operation. Every tensor of a ``ring_shift`` is sent
  to rank + shift and received from rank - shift inside one
  ``dist.batch_isend_irecv`` (an NCCL group). NCCL matches point-to-point
  messages by order, ignores tags, and may block a send until its receive is
  posted, so two ranks that each post "send, then receive" as separate
  operations can deadlock; inside one group NCCL runs them as one sendrecv.
  gloo has no groups and runs the same list as individual tagged operations.
* Concurrent hops stay matched by order. The backward has a K/V hop and a
  dK/dV hop on the wire at once, both to rank + 1. Tags tell them apart on
  gloo; on NCCL they are matched because every rank posts its hops in the same
  program order (the SPMD rule), and within a hop the tensors are posted in
  list order on both sides.
* Streams (CUDA). NCCL runs the group on its own stream, ordered after the
  work already queued on the current stream when the hop is posted (so the
  sent tensors are complete). ``wait`` (``_c10d_functional.wait_tensor``)
  makes the *current* stream wait for the transfer; the host does not block.
  Reading a received buffer or writing a sent one is therefore only legal
  after its ``wait``, and the schedules wait on both.
* Memory of a tensor in flight. Eager: the NCCL work keeps its tensors
  (including ``contiguous()`` copies made here) alive until it is waited, and
  the wait orders the current stream after the transfer, so the caching
  allocator can only hand the memory out again to work that runs after the
  transfer. Compiled: Inductor frees a buffer after its last use in the graph;
  the schedules wait on every sent tensor after the overlapped compute, which
  makes that wait the last use.
* gloo with device tensors. gloo moves host memory only, so a hop of CUDA
  tensors over gloo (several processes sharing one GPU, as the CUDA tests do)
  is staged: the sent tensors are copied to the host when the hop is posted
  (the copy waits for the current stream) and each received buffer is filled
  from its host copy inside ``wait``, on the current stream. NCCL never takes
  this path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..counters import record_shift
from ..torch_compat import PythonCallbackWork, register_work
from .groups import resolve_group

# Tags keep concurrently travelling streams apart (K/V vs dK/dV in backward).
TAG_KV = 0
TAG_DKV = 1
_MAX_TENSORS_PER_SHIFT = 64


def _wire_tag(tag: int, index: int) -> int:
    if index >= _MAX_TENSORS_PER_SHIFT:
        raise ValueError(f"ring_shift moves at most {_MAX_TENSORS_PER_SHIFT} tensors at once")
    return tag * _MAX_TENSORS_PER_SHIFT + index


def _stages_through_host(group: dist.ProcessGroup, tensors: list[Tensor]) -> bool:
    """True when gloo carries device tensors (see the module docstring)."""
    on_device = [t.device.type != "cpu" for t in tensors]
    if not any(on_device):
        return False
    if not all(on_device) or len({t.device for t in tensors}) > 1:
        raise ValueError(f"ring_shift moves tensors of one device; got {sorted({str(t.device) for t in tensors})}")
    return dist.get_backend(group) == "gloo"


@torch.library.custom_op("cp::ring_shift", mutates_args=())
def ring_shift(tensors: list[Tensor], group_name: str, shift: int, tag: int) -> list[Tensor]:
    """Send ``tensors`` to rank + shift, receive the same shapes from rank - shift.

    Returns the receive buffers at once; complete the transfer with ``wait``
    (``torch.ops._c10d_functional.wait_tensor`` on every received and every
    sent tensor) before reading a received one or reusing a sent one.
    """
    group = resolve_group(group_name)
    size, rank = group.size(), group.rank()
    dst = dist.get_global_rank(group, (rank + shift) % size)
    src = dist.get_global_rank(group, (rank - shift) % size)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    staged = _stages_through_host(group, tensors)
    wire_sent = [t.cpu() if staged else t.contiguous() for t in tensors]
    wire_received = [torch.empty(t.shape, dtype=t.dtype) for t in tensors] if staged else received
    hop = []
    for i, (t, buf) in enumerate(zip(wire_sent, wire_received)):
        # tags only matter to gloo (NCCL matches by order, which the list order fixes on both sides)
        hop.append(dist.P2POp(dist.isend, t, dst, group=group, tag=_wire_tag(tag, i)))
        hop.append(dist.P2POp(dist.irecv, buf, src, group=group, tag=_wire_tag(tag, i)))
    works = list(dist.batch_isend_irecv(hop)) if hop else []
    record_shift(tensors, tag)

    # What the wait still needs; emptied once it has run, so that a registration nobody
    # waits on (the registry keeps the work) does not keep the hop's buffers alive.
    pending = [(buf, host) for buf, host in zip(received, wire_received)] if staged else []

    def wait_all(timeout=None):
        # every buffer shares this work, and a gloo work waited twice blocks forever
        while works:
            works.pop(0).wait()
        for buf, host in pending:
            buf.copy_(host)
        pending.clear()
        return True

    # One work for every buffer: the functional wait_tensor looks works up by storage.
    # The sent tensors are registered too, and the schedule waits on them: that use
    # keeps a compiled graph from reusing their memory while the send is in flight.
    done = PythonCallbackWork(wait_all)
    for buf in [*received, *tensors]:
        register_work(buf, done)
    return received


@ring_shift.register_fake
def _(tensors, group_name, shift, tag):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]


@torch.library.custom_op("cp::send_buffers", mutates_args=())
def send_buffers(tensors: list[Tensor]) -> list[Tensor]:
    """Contiguous copies of ``tensors`` for a compiled graph's first hop to send.

    In a compiled graph a schedule's inputs may be views of values Inductor has
    not materialised (a cast of a fused q/k/v, recomputed under selective
    checkpointing); Inductor then gives each consumer its own copy, so the wait
    on "the sent tensor" runs on another buffer than the one in flight, and the
    real one can be reused before its transfer is done. The outputs of this
    opaque op are one buffer each, shared by the hop and its wait.
    """
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors]


@send_buffers.register_fake
def _(tensors):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]


def first_hop_buffers(tensors: list[Tensor]) -> list[Tensor]:
    """What the first hop of a schedule sends: the inputs themselves eagerly (the
    transfer's work keeps them alive), buffers of their own when traced into a graph."""
    from torch._subclasses.fake_tensor import FakeTensor

    if any(isinstance(t, FakeTensor) for t in tensors):
        return list(torch.ops.cp.send_buffers(tensors))
    return list(tensors)


def wait(received: list[Tensor], sent: list[Tensor] = ()) -> list[Tensor]:
    """Complete a ``ring_shift``: the received tensors, ready to read.

    Pass the shift's ``sent`` tensors too: waiting on them is what tells a
    compiler they are still in use until the transfer is done.
    """
    for t in sent:
        torch.ops._c10d_functional.wait_tensor(t)
    return [torch.ops._c10d_functional.wait_tensor(t) for t in received]


torch.fx.node.has_side_effect(torch.ops.cp.ring_shift.default)
