"""Communication ops for CP schedules.

``cp::ring_shift`` starts an asynchronous shift of tensors around the ring and
returns the receive buffers; ``torch.ops._c10d_functional.wait_tensor`` on a
buffer completes it, exactly as for a functional collective. The op reads the
rank and the peers from the group at run time: a compiled graph holds only the
group name and the shift, so its code is the same on every rank. (The stock
functional p2p ops take the peer as a constant, which would bake the rank into
the graph.)

``cp::agree`` makes every rank check every rank's q/k/v shapes and options
before the first transfer, so a mismatch raises the same error everywhere
instead of leaving some ranks waiting in a collective.

Both talk to other ranks, so both are registered side-effectful: the compiler
must never drop or duplicate them on one rank only.

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

import contextlib
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..torch_compat import PythonCallbackWork, assume_constant_result, register_work, resolve_process_group


def resolve_group(group_name: str) -> dist.ProcessGroup:
    return resolve_process_group(group_name)


# ----------------------------------------------------------------------------
# Traffic accounting: what this process really sent, eager or compiled.
# ----------------------------------------------------------------------------


@dataclass
class Traffic:
    shifts: int = 0  # ring_shift calls
    tensors_sent: int = 0
    bytes_sent: int = 0
    by_tag: dict = field(default_factory=dict)  # tag -> number of shifts


_active_traffic: list[Traffic] = []


@contextlib.contextmanager
def open_count(active: list, count):
    """``count`` kept in ``active`` (what this process's ops add to) for the block; yields it."""
    active.append(count)
    try:
        yield count
    finally:
        active.remove(count)


def count_traffic() -> contextlib.AbstractContextManager[Traffic]:
    """Count ring transfers issued by this process inside the block."""
    return open_count(_active_traffic, Traffic())


def _record(tensors: list[Tensor], tag: int) -> None:
    for t in _active_traffic:
        t.shifts += 1
        t.tensors_sent += len(tensors)
        t.bytes_sent += sum(x.numel() * x.element_size() for x in tensors)
        t.by_tag[tag] = t.by_tag.get(tag, 0) + 1


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
    _record(tensors, tag)

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


# ----------------------------------------------------------------------------
# Cross-rank agreement on the arguments of one attention call.
# ----------------------------------------------------------------------------

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_PER_TENSOR = 6  # ndim, the first 4 dims, dtype
_DESC_LEN = 3 * _PER_TENSOR + 2  # then device type, options crc


# The options of a rank that refused a call before its first collective (``refuse_together``): its row then
# differs from every rank that did not, and the agreement names the refusing ranks.
REFUSED = "\0refused"


def _describe(tensors: list[Tensor], options: str) -> list[int]:
    desc: list[int] = []
    for t in tensors:
        dims = list(t.shape)[:4]
        desc += [t.dim()] + dims + [-1] * (4 - len(dims))
        desc.append(_DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1)
    desc.append(0 if tensors[0].device.type == "cpu" else 1)
    desc.append(-1 if options == REFUSED else zlib.crc32(options.encode()))
    return desc


def _fmt(row: list[int], names) -> str:
    described = []
    for i, name in enumerate(names):
        ndim, *dims, dtype = row[_PER_TENSOR * i : _PER_TENSOR * (i + 1)]
        shape = str(tuple(dims[: min(max(ndim, 0), 4)])) if ndim <= 4 else f"<{ndim}-D>"
        described.append(f"{name}{shape} {_DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else 'unsupported dtype'}")
    return ", ".join(described)


def check_agreement(rows: list[list[int]], what: str, names=("q", "k", "v")) -> None:
    """Raise the same error on every rank if the ranks' descriptors differ.

    Every rank runs this on the same gathered data, so every rank reaches the
    same verdict and the same message.
    """
    first = rows[0]
    bad = [r for r, row in enumerate(rows) if row != first]
    if not bad:
        return
    refused = [r for r, row in enumerate(rows) if row[-1] == -1]
    if refused:
        others = ", the others did not" if len(refused) < len(rows) else " (with different inputs)"
        raise ValueError(
            f"{what}: ranks {refused} refused this call before its first transfer{others}: those ranks' errors "
            "say why (every rank must pass the same shapes, dtypes and options)"
        )
    detail = "; ".join(f"rank {r}: {_fmt(row, names)}" for r, row in enumerate(rows))
    if any(row[-1] != first[-1] for row in rows):
        detail += (
            "; the ranks also passed different options (compiled: or a later attention site of the graph "
            "differs, which this first agreement of the graph covers)"
        )
    if any(row[-2] != first[-2] for row in rows):
        detail += "; the ranks hold tensors on different device types"
    raise ValueError(
        f"{what}: ranks disagree on their inputs ({detail}). Every rank must pass the same shapes, dtypes and options."
    )


def refuse_together(error: Exception, q, k, v, group_name: str) -> None:
    """Raise ``error``, a check's verdict on this rank's call before the call's first collective, on every rank
    of the group: a rank that raised alone would leave the others waiting in the schedule's first collective.

    Only the refusing ranks run this: it is the agreement the other ranks' schedule opens with, with a row
    that cannot match theirs, so every rank raises there, the refusing ranks their own error after it. Where
    every rank refused, the rows match and each raises its own."""
    group = resolve_group(group_name)
    if group.size() > 1:
        tensors = [t if isinstance(t, Tensor) else torch.empty(0) for t in (q, k, v)]
        try:
            torch.ops.cp.agree(*tensors, group_name, REFUSED)
        except ValueError as disagreement:
            raise ValueError(f"{disagreement}. This rank's error: {type(error).__name__}: {error}") from error
    raise error


def every_rank(values: list[int], group, device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (as many on every rank), in rank order: one small all-gather and a host read,
    the step every agreement is made of (gloo groups exchange on the CPU)."""
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = torch.empty(group.size() * len(values), dtype=torch.int64, device=device)
    dist.all_gather_single(everyone, mine, group=group)
    return everyone.view(group.size(), len(values)).tolist()


@torch.library.custom_op("cp::agree", mutates_args=())
def agree(q: Tensor, k: Tensor, v: Tensor, group_name: str, options: str) -> None:
    """All-gather a small descriptor of (q, k, v, options); raise if ranks differ.

    A token mixer's call (``cp_compile.mixers``) agrees through it too, its options starting with
    ``mixer=<name>``: the compiler then folds every agreement of a graph alike."""
    rows = every_rank(_describe([q, k, v], options), resolve_group(group_name), q.device)
    if options.startswith("mixer="):
        check_agreement(rows, f"cp_compile {options.split()[0][6:]}", ("input 1 ", "input 2 ", "input 3 "))
    else:
        check_agreement(rows, "cp_compile attention")


@agree.register_fake
def _(q, k, v, group_name, options):
    return None


@torch.library.custom_op("cp::agree_tensors", mutates_args=())
def agree_tensors(tensors: list[Tensor], group_name: str, what: str) -> None:
    """Every rank holds the same ``tensors`` (shapes, dtypes and contents: a digest of each, read on the host),
    or every rank raises the same ValueError naming ``what``. For small tensors that steer a call, such as a
    sharded BlockMask's tables: ranks that read different ones would run different work."""
    digests = [
        zlib.crc32(repr((tuple(t.shape), str(t.dtype))).encode() + t.detach().contiguous().cpu().numpy().tobytes())
        for t in tensors
    ]
    group = resolve_group(group_name)
    device = tensors[0].device if tensors else torch.device("cpu")
    rows = every_rank([len(tensors), zlib.crc32(str(digests).encode())], group, device)
    if any(row != rows[0] for row in rows):
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        raise ValueError(
            f"cp_compile attention: ranks disagree on the {what}: ranks {differ} hold another one than rank 0 "
            "(another mask, or one sharded for another length). Every rank passes its own shard of the same one"
        )


@agree_tensors.register_fake
def _(tensors, group_name, what):
    return None


for _op in (torch.ops.cp.ring_shift.default, torch.ops.cp.agree.default, torch.ops.cp.agree_tensors.default):
    torch.fx.node.has_side_effect(_op)


# ----------------------------------------------------------------------------
# Groups as users name them.
# ----------------------------------------------------------------------------


def is_2d_mesh(group) -> bool:
    """A 2-D (ring, a2a) DeviceMesh: eagerly only the hybrid schedule runs on one."""
    return hasattr(group, "get_group") and group.ndim == 2


@assume_constant_result
def _default_group_name() -> str:
    # Dynamo cannot read a ProcessGroup's name while tracing (an eager function called with group=None inside
    # torch.compile); the default group's name is fixed for the process and the same on every rank
    return dist.group.WORLD.group_name


def group_name_of(group) -> str:
    """Name of a ProcessGroup, a 1-D DeviceMesh, a group name, or None (the default group)."""
    if isinstance(group, str):
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group it was given: "
            "dist.new_group returns a placeholder to the ranks it leaves out; build the plan, and run CP "
            "attention, only on the group's members"
        )
    if group is None:
        return _default_group_name()
    if hasattr(group, "get_group"):  # DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"ring attention needs a 1-D DeviceMesh, got {group.ndim}-D")
        group = group.get_group()
    return group.group_name


def mesh_groups(mesh) -> tuple[str, str, str]:
    """(flattened group, ring group, all-to-all group) names of a 2-D ``(ring, a2a)`` DeviceMesh."""
    if mesh.ndim != 2:
        raise ValueError(f"the hybrid schedule needs a 2-D DeviceMesh (ring, a2a), got {mesh.ndim}-D")
    names = mesh.mesh_dim_names
    if names is not None and (names[0] in ("a2a", "ulysses") or names[1] == "ring"):
        raise ValueError(
            f"mesh_dim_names={names}: dim 0 must be the ring and dim 1 the all-to-all group "
            "(the all-to-all runs within groups of consecutive ranks); build the mesh as (ring, a2a)"
        )
    return (mesh._flatten().get_group().group_name, mesh.get_group(0).group_name, mesh.get_group(1).group_name)
