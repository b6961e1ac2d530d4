"""ContextParallel: the group a sequence is sharded over, and how."""

from __future__ import annotations

import contextlib
import operator
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .active import enter, leave, made
from .comm.agree import every_rank
from .comm.groups import group_name_of, mesh_groups
from .layout import Layout, layout_named
from .layout.packed import Packed, check_cu_seqlens, packed_local_len
from .torch_compat import resolve_process_group

if TYPE_CHECKING:
    from .compiler.backend import CPBackend
    from .cost.model import Machine


def _sequence_dim(x: Tensor, seq_dim: int, what: str) -> int:
    """``seq_dim`` as a dim of ``x`` (negative dims count from the end), or a ValueError naming both."""
    try:
        dim = operator.index(seq_dim)
    except TypeError:
        dim = None
    if dim is None or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: seq_dim={seq_dim!r} is not a dim of a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _dynamic(x: Tensor, dim: int) -> Tensor:
    """Marks ``dim`` of a per-batch tensor as dynamic for ``torch.compile``.

    Packed batches change their slot count and document count on almost every step; marked up
    front, the first compiled graph already serves every later split (otherwise Dynamo compiles
    the first shape, then a dynamic graph for each size that changes later, one at a time).
    """
    torch._dynamo.maybe_mark_dynamic(x, dim)
    return x


class ContextParallel:
    """A context-parallel plan over a process group, a 1-D DeviceMesh or a 2-D ``(ring, a2a)`` DeviceMesh.

    ``load_balance`` is ``"zigzag"`` (default: rank r holds chunks r and 2C-1-r
    of 2C, balancing causal work), ``"contiguous"``, or a global FlexAttention
    ``BlockMask``: its query blocks are dealt to ranks so that each holds the
    same number of visible blocks (FlexAttention only). The plan holds it as
    ``layout`` (a ``cp_compile.layout.Layout``: ``Zigzag``, ``Contiguous`` or
    ``Balanced``), and ``load_balance`` as its name. ``schedule`` is
    ``"auto"`` (default: chosen per attention site; ``explain`` says which and
    why) or a schedule name to use for every site: ``"ring"``, ``"allgather"``, ``"ulysses"``,
    ``"hybrid"`` (2-D mesh: all-to-all along dim 1, ring along dim 0; the
    sequence is sharded over the flattened mesh).

    ``machine`` (a ``cp_compile.Machine``) is what the cost model assumes;
    by default the profile of the device type, or with ``calibrate=True`` one
    measured now on this group (every rank must construct the plan).

    Args:
        group_or_mesh: the ranks the sequence is sharded over; None: the default process group.
        load_balance: ``"zigzag"``, ``"contiguous"`` or a global ``BlockMask`` (see above).
        schedule: ``"auto"`` or a schedule name for every attention site.
        machine: the ``cp_compile.Machine`` the cost model assumes; None: the device type's profile.
        calibrate: measure the machine now, on this group (a collective: every rank calls it).
        scan_route: how a hybrid model's linear recurrences run (``cp_compile.hf``): ``"auto"`` (the cost model's
            choice per call), ``"heads"`` (all-to-all to head groups) or ``"states"`` (state passing; one
            sequence per row only).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown load balance, schedule or scan route, ``"hybrid"`` without a 2-D mesh, or a
            BlockMask whose blocks do not split evenly over the ranks.
    """

    def __init__(
        self,
        group_or_mesh: Union[dist.ProcessGroup, torch.distributed.DeviceMesh, None] = None,
        load_balance: str = "zigzag",
        schedule: str = "auto",
        machine: Optional[Machine] = None,
        calibrate: bool = False,
        scan_route: str = "auto",
    ):
        from .cost.mixers import ROUTES
        from .cost.model import check_schedule

        if not dist.is_initialized():
            raise RuntimeError("ContextParallel needs torch.distributed to be initialised (init_process_group)")
        from torch.nn.attention.flex_attention import BlockMask

        check_schedule(schedule)
        if scan_route not in ("auto", *ROUTES):
            raise ValueError(f"unknown scan route {scan_route!r}; expected 'auto' or one of {ROUTES}")
        self.schedule = schedule
        self.scan_route = scan_route
        self.mesh_groups: tuple = ()
        if getattr(group_or_mesh, "ndim", 1) == 2:
            self.group_name, *groups = mesh_groups(group_or_mesh)
            self.mesh_groups = tuple(groups)
        else:
            self.group_name = group_name_of(group_or_mesh)
            if schedule == "hybrid":
                raise ValueError("schedule='hybrid' needs a 2-D DeviceMesh (ring, a2a) as group_or_mesh")
        self.group = resolve_process_group(self.group_name)
        self.layout: Layout
        if isinstance(load_balance, BlockMask):
            from .layout.balanced import balance_blocks

            self.layout = balance_blocks(load_balance, self.world_size)
        else:
            self.layout = layout_named(load_balance)
        self.load_balance: str = self.layout.name
        self.machine = machine
        # the packed batch of the innermost ``with plan.packed(cu)``: (global cu_seqlens, slots per rank)
        self._documents: Optional[tuple[Tensor, int]] = None
        if calibrate:
            from .calibrate import calibrate as _calibrate

            self.machine = _calibrate(self)

    @property
    def world_size(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def mesh_sizes(self) -> tuple[int, ...]:
        """The (ring, all-to-all) sizes of a 2-D plan; () for a 1-D one."""
        return tuple(resolve_process_group(name).size() for name in self.mesh_groups)

    def groups(self, schedule: str) -> tuple[str, ...]:
        """The group names ``schedule`` runs over: the plan's; the hybrid's the flattened mesh, ring, all-to-all."""
        from .schedules import schedule_groups

        return schedule_groups((self.group_name, *self.mesh_groups), schedule)

    def __enter__(self) -> ContextParallel:
        """``with plan:`` makes this the active plan (``cp_compile.active_plan()``), e.g. for a
        Hugging Face model using ``attn_implementation="cp_compile"`` (``cp_compile.hf``).

        It also arms ``cp_compile.guard``: inside, plain attention that ``plan.backend()`` did
        not rewrite raises ``LocalAttentionError`` instead of attending to the local shard alone
        (run eagerly, or compiled by another backend). Compile and run models inside it.
        """
        from .guard import LocalAttentionGuard

        enter(self, LocalAttentionGuard())
        return self

    def __exit__(self, *exc) -> None:
        leave(self, *exc)

    @property
    def documents(self) -> Optional[Tensor]:
        """The global ``cu_seqlens`` of the packed batch in force (the innermost ``with plan.packed(cu)``), or
        None outside every such block: what the batch being run is, for integrations that get only positions."""
        return None if self._documents is None else self._documents[0]

    @property
    def document_slots(self) -> Optional[int]:
        """Slots per rank of ``documents`` (None without), counted when the block began: reading it in traced
        code needs no ``tolist()`` of the tensor."""
        return None if self._documents is None else self._documents[1]

    @contextlib.contextmanager
    def packed(self, cu_seqlens: Tensor) -> Iterator[None]:
        """Inside, model calls run the packed documents ``cu_seqlens`` (global offsets, one row): for integrations
        that a framework calls without them (``cp_compile.hf``: a model given only ``position_ids``, and its
        convolutions and scans, which transformers hands no ``cu_seq_lens_q``). The block before is in force
        again after it. A backward that recomputes attention (activation checkpointing) runs inside the block too.

        Raises:
            ValueError: ``cu_seqlens`` does not start at 0 or decreases.
        """
        saved, cu = self._documents, check_cu_seqlens(cu_seqlens)
        if saved is None or saved[0].tolist() != cu:  # the same batch again (a step inside a step) keeps its tensor
            documents = torch.tensor(cu, dtype=torch.int32)
            self._documents = (_dynamic(documents, 0), packed_local_len(documents, self.world_size))
        try:
            yield
        finally:
            self._documents = saved

    def __repr__(self) -> str:
        return f"ContextParallel(C={self.world_size}, rank={self.rank}, load_balance={self.load_balance!r})"

    def shard(self, x: Tensor, seq_dim: Optional[int] = None, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """This rank's shard of ``x`` (the full tensor, the same on every rank).

        With ``cu_seqlens`` (packed documents), every document is split into 2C
        chunks on its own and this rank gets chunks r and 2C-1-r of each, padding
        slots zero (``layout.packed.Packed``). The slot dimension is marked dynamic
        for ``torch.compile``: packed batches change it on almost every step.

        A FlexAttention ``BlockMask`` built for the global sequence gives this
        rank's BlockMask: valid for the local q/k, meaning the global mask.

        Args:
            x: the global tensor (or ``BlockMask``), the same on every rank.
            seq_dim: the sequence dimension of a tensor.
            cu_seqlens: global document offsets of a packed sequence (``[0, ..., total]``).

        Returns:
            This rank's shard: a tensor, or a ``BlockMask`` for the local queries and keys.

        Raises:
            TypeError: ``seq_dim`` is missing for a tensor.
            ValueError: the length does not split into the layout's chunks, or ``cu_seqlens`` does not
                start at 0, decreases, or does not end at the sequence's length.
        """
        from torch.nn.attention.flex_attention import BlockMask

        if isinstance(x, BlockMask):
            from .layout.blockmask import shard_block_mask

            n, c = x.seq_lengths[0], self.world_size
            return shard_block_mask(x, self.rank, c, self.layout.all_positions(n, c), self.layout.chunk(n, c))
        if seq_dim is None:
            raise TypeError("shard(x, seq_dim): seq_dim is required for tensors")
        seq_dim = _sequence_dim(x, seq_dim, "shard")
        if cu_seqlens is not None:
            if isinstance(cu_seqlens, Tensor):  # passed on to the model too (varlen_attn, cu_seq_lens_q)
                _dynamic(cu_seqlens, 0)
            batch = Packed(cu_seqlens)
            local = made(self, batch.shard(x, seq_dim, self.rank, self.world_size), "shard", batch.cu_seqlens)
            return _dynamic(local, seq_dim)
        return made(self, self.layout.shard(x, seq_dim, self.rank, self.world_size), "shard")

    def unshard(self, x_local: Tensor, seq_dim: int, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """The full tensor, on every rank, from each rank's shard (packed: without padding).

        A collective: every rank of the plan calls it with its own shard.

        Args:
            x_local: this rank's shard, as ``shard`` made it.
            seq_dim: its sequence dimension.
            cu_seqlens: the global document offsets the shard was made with, for packed documents.

        Returns:
            The global tensor, the same on every rank.

        Raises:
            ValueError: ``seq_dim`` is not a dim of the shard; the ranks' shards differ in shape, dtype,
                ``seq_dim`` or ``cu_seqlens`` (on every rank, before the gather); the shard is not one of the
                layout's (a length the layout cannot give, slots that ``cu_seqlens`` does not give).
        """
        seq_dim = _sequence_dim(x_local, seq_dim, "unshard")
        self._agree_on_shards(x_local, seq_dim, cu_seqlens)
        length, c = x_local.shape[seq_dim], self.world_size
        if cu_seqlens is not None and length != packed_local_len(cu_seqlens, c):
            raise ValueError(
                f"unshard: the shard has {length} slots along dim {seq_dim}, but cu_seqlens gives every rank "
                f"{packed_local_len(cu_seqlens, c)} at C={c}; pass what plan.shard(x, seq_dim, cu_seqlens=cu) made"
            )
        if cu_seqlens is None:
            self.layout.chunk(length * c, c)  # a length the layout cannot give raises, naming it
        parts = [torch.empty_like(x_local) for _ in range(self.world_size)]
        dist.all_gather(parts, x_local.contiguous(), group=self.group)
        return (self.layout if cu_seqlens is None else Packed(cu_seqlens)).unshard(parts, seq_dim)

    def _agree_on_shards(self, x_local: Tensor, seq_dim: int, cu_seqlens) -> None:
        """Every rank's shard alike (shape, dtype, seq_dim, documents) or a ValueError on every rank: the gather
        of shards that differ aborts inside the process group, or returns rows from the wrong places."""
        shape = list(x_local.shape)[:6]
        documents = zlib.crc32(str(check_cu_seqlens(cu_seqlens)).encode()) if cu_seqlens is not None else -1
        mine = [x_local.dim(), *shape, *[-1] * (6 - len(shape)), zlib.crc32(str(x_local.dtype).encode()), seq_dim]
        rows = every_rank([*mine, documents], self.group, x_local.device)
        if all(row == rows[0] for row in rows):
            return
        shapes = "; ".join(
            f"rank {r}: {tuple(row[1 : 1 + min(row[0], 6)])}, seq_dim {row[8]}" for r, row in enumerate(rows)
        )
        also = [what for i, what in ((7, "dtypes"), (9, "cu_seqlens")) if any(row[i] != rows[0][i] for row in rows)]
        raise ValueError(
            f"unshard: ranks disagree on their shards ({shapes}{'; different ' + ' and '.join(also) if also else ''})"
            ". Every rank passes its own shard of the same tensor, with the same seq_dim and cu_seqlens"
        )

    def positions(
        self,
        seq_len: Optional[int] = None,
        device: Union[torch.device, str, None] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> Tensor:
        """Global positions (LongTensor) of this rank's tokens; with ``cu_seqlens``, each
        local slot's position inside its document (padding slots continue their document).

        The positions remember the batch they were made for: ``cp_compile.hf`` refuses a model
        given them while another batch is in force (``packed``).

        Args:
            seq_len: the global sequence length (without ``cu_seqlens``).
            device: where the positions are made.
            cu_seqlens: global document offsets of a packed sequence.

        Returns:
            A 1-D LongTensor, one entry per local token (slot).

        Raises:
            ValueError: neither ``seq_len`` nor ``cu_seqlens`` is given, or the length does not split
                into the layout's chunks.
        """
        if cu_seqlens is not None:
            batch = Packed(cu_seqlens)
            positions = batch.positions(batch.cu_seqlens[-1], self.rank, self.world_size, device)
            return _dynamic(made(self, positions, "positions", batch.cu_seqlens), 0)
        if seq_len is None:
            raise ValueError("positions needs seq_len (or cu_seqlens for packed documents)")
        if seq_len < 0:
            raise ValueError(f"positions: seq_len={seq_len} is negative")
        return made(self, self.layout.positions(seq_len, self.rank, self.world_size, device), "positions")

    def backend(self, inner: str = "inductor") -> CPBackend:
        """A ``torch.compile`` backend that rewrites attention into CP schedules.

        ``inner`` is ``"inductor"`` (default) or ``"aot_eager"`` (no code generation).

        Returns:
            The backend for ``torch.compile(model, backend=...)``; its ``explain()`` reports what it
                did to every graph it compiled.
        """
        from .compiler.backend import CPBackend

        return CPBackend(self, inner)

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        """Eager CP attention over this plan's group and layout (the plan's schedule; ``auto``: the ring)."""
        from .kinds.call import Call
        from .schedules import run_schedule, softmax_scale

        schedule = "ring" if self.schedule == "auto" else self.schedule
        call = Call("sdpa", self.groups(schedule), bool(is_causal), self.load_balance, softmax_scale(q, scale))
        return run_schedule(schedule, q, k, v, [], call, enable_gqa)[0]
