"""ContextParallel: the group a sequence is sharded over, and how."""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import layout as _layout
from .ops.ring import group_name_of, ring_attention


class ContextParallel:
    """A context-parallel plan over a process group, a 1-D DeviceMesh or a 2-D ``(ring, a2a)`` DeviceMesh.

    ``load_balance`` is ``"zigzag"`` (default: rank r holds chunks r and 2C-1-r
    of 2C, balancing causal work) or ``"contiguous"``. ``schedule`` is
    ``"auto"`` (default: chosen per attention site; ``explain`` says which and
    why) or a schedule name to use for every site: ``"ring"``, ``"ulysses"``,
    ``"hybrid"`` (2-D mesh: all-to-all along dim 1, ring along dim 0; the
    sequence is sharded over the flattened mesh).

    ``machine`` (a ``cp_compile.Machine``) is what the cost model assumes;
    by default the profile of the device type, or with ``calibrate=True`` one
    measured now on this group (every rank must construct the plan).
    """

    def __init__(self, group_or_mesh: Union[dist.ProcessGroup, "torch.distributed.DeviceMesh", None] = None,
                 load_balance: str = "zigzag", schedule: str = "auto", machine=None, calibrate: bool = False):
        from .passes.cost import check_schedule

        if not dist.is_initialized():
            raise RuntimeError("ContextParallel needs torch.distributed to be initialised (init_process_group)")
        _layout.check_layout(load_balance)
        check_schedule(schedule)
        self.schedule = schedule
        self.mesh_groups: tuple = ()
        if getattr(group_or_mesh, "ndim", 1) == 2:
            from .ops.hybrid import mesh_groups

            self.group_name, *groups = mesh_groups(group_or_mesh)
            self.mesh_groups = tuple(groups)
        else:
            self.group_name = group_name_of(group_or_mesh)
            if schedule == "hybrid":
                raise ValueError("schedule='hybrid' needs a 2-D DeviceMesh (ring, a2a) as group_or_mesh")
        self.group = dist.distributed_c10d._resolve_process_group(self.group_name)
        self.load_balance = load_balance
        self.machine = machine
        if calibrate:
            from .calibrate import calibrate as _calibrate

            self.machine = _calibrate(self)

    @property
    def world_size(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return self.group.rank()

    def __repr__(self) -> str:
        return f"ContextParallel(C={self.world_size}, rank={self.rank}, load_balance={self.load_balance!r})"

    def shard(self, x: Tensor, seq_dim: int) -> Tensor:
        """This rank's shard of ``x`` (the full tensor, the same on every rank)."""
        return _layout.shard(x, seq_dim, self.rank, self.world_size, self.load_balance)

    def unshard(self, x_local: Tensor, seq_dim: int) -> Tensor:
        """The full tensor, on every rank, from each rank's shard."""
        parts = [torch.empty_like(x_local) for _ in range(self.world_size)]
        dist.all_gather(parts, x_local.contiguous(), group=self.group)
        return _layout.unshard(parts, seq_dim, self.load_balance)

    def positions(self, seq_len: int, device=None) -> Tensor:
        """Global positions (LongTensor) of this rank's tokens."""
        return _layout.positions(seq_len, self.rank, self.world_size, self.load_balance, device)

    def backend(self, inner: str = "inductor"):
        """A ``torch.compile`` backend that rewrites attention into CP schedules.

        ``inner`` is ``"inductor"`` (default) or ``"aot_eager"`` (no code generation).
        """
        from .backend import CPBackend

        return CPBackend(self.group_name, self.load_balance, inner, self.schedule, self.mesh_groups, self.machine)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False,
                  scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
        """Eager CP attention over this plan's group and layout (the plan's schedule; ``auto``: the ring)."""
        if self.schedule == "ulysses":
            from .ops.ulysses import ulysses_attention

            return ulysses_attention(q, k, v, self.group_name, is_causal, scale, enable_gqa, self.load_balance)
        if self.schedule == "hybrid":
            from .ops.hybrid import hybrid_attention

            return hybrid_attention(q, k, v, (self.group_name, *self.mesh_groups), is_causal, scale, enable_gqa,
                                    self.load_balance)
        return ring_attention(q, k, v, self.group_name, is_causal, scale, enable_gqa, self.load_balance)
