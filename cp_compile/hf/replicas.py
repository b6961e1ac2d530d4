"""A trainer's cross-process reductions as the processes of a run without context parallelism make them.

Under context parallelism the C ranks of a data-parallel replica hold the same rows, so a reduction over every
process counts each row C times. Where that matters (TRL's ``GRPOTrainer`` normalises rewards by statistics of
the gathered batch, with Bessel's correction, and takes its rows back by process index), the trainer is shown
``ReplicaAccelerator``: one process per replica, its index the replica's, its gathers and reductions over the
ranks that hold the same position in every replica (one from each). Every rank of a replica then computes what
the process it stands for computes in a run of R processes without CP (one process for R = 1).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import UnsupportedAttention
from ..plan import ContextParallel


def data_parallel_group(plan: ContextParallel, replicas: int) -> Optional[dist.ProcessGroup]:
    """The ranks at this rank's position in every replica (None for one replica). A collective: every rank makes
    every group, in the same order."""
    if replicas == 1:
        return None
    size, mine = plan.world_size, None
    for position in range(size):
        group = dist.new_group([replica * size + position for replica in range(replicas)])
        if position == plan.rank:
            mine = group
    return mine


class ReplicaAccelerator:
    """``accelerate.Accelerator`` as the process of replica ``replica`` of ``replicas`` sees it: ``process_index``,
    ``num_processes``, and ``gather``, ``gather_for_metrics``, ``reduce`` and ``pad_across_processes`` over
    ``group`` (one rank per replica). The rest is the accelerator's own."""

    def __init__(self, accelerator: Any, replica: int, replicas: int, group: Optional[dist.ProcessGroup]):
        self._accelerator, self._group = accelerator, group
        self.process_index, self.num_processes = replica, replicas

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def gather(self, tensor: Tensor) -> Tensor:
        if self._group is None:  # as accelerate without distribution: the tensor itself
            return tensor
        local = (tensor[None] if tensor.dim() == 0 else tensor).contiguous()
        wire = local.to(torch.uint8) if local.dtype == torch.bool else local  # gloo gathers no bool
        parts = [torch.empty_like(wire) for _ in range(self.num_processes)]
        dist.all_gather(parts, wire, group=self._group)
        return torch.cat(parts).to(local.dtype)

    def gather_for_metrics(self, tensor: Tensor, use_gather_object: bool = False) -> Tensor:
        return self.gather(tensor)

    def reduce(self, tensor: Tensor, reduction: str = "mean", scale: float = 1.0) -> Tensor:
        reduced = tensor.clone()
        if self._group is not None:
            op = dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM
            dist.all_reduce(reduced, op, group=self._group)
        return reduced / self.num_processes if reduction == "mean" else reduced

    def pad_across_processes(self, tensor: Tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        if self._group is None:
            return tensor
        longest = torch.tensor(tensor.shape[dim], device=tensor.device)
        dist.all_reduce(longest, dist.ReduceOp.MAX, group=self._group)
        missing = int(longest) - tensor.shape[dim]
        if missing == 0:
            return tensor
        pad = tensor.new_full((*tensor.shape[:dim], missing, *tensor.shape[dim + 1 :]), pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim)


def one_copy_per_replica(every: Tensor, size: int, replicas: int) -> Tensor:
    """Values gathered from every process (rank order, the ranks of a replica alike) -> one copy per replica, as
    R processes gather them.

    Raises:
        UnsupportedAttention: the ranks of a replica computed different values (a reward function that is not
            deterministic: the C ranks of a replica score the same completions, each with its own call).
    """
    copies = every.reshape(replicas, size, -1, *every.shape[1:])
    first = copies[:, :1].expand_as(copies)
    if not bool(torch.isclose(copies, first, rtol=0, atol=0, equal_nan=True).all()):
        raise UnsupportedAttention(
            "the ranks of a context-parallel replica computed different rewards for the same completions: every rank "
            "calls the reward functions on the replica's completions, so a reward function must be deterministic "
            "(seed any randomness of its own from its inputs)"
        )
    return copies[:, 0].reshape(-1, *every.shape[1:])


# What TRL's GRPOTrainer keeps for its completions table from tensors the mixin already reduced to one copy per
# replica (the rewards, and the advantages computed from them); the rest of its ``_logs`` it gathers from every
# process with accelerate's ``gather_object``: C copies of each replica's
_ONE_COPY_PER_REPLICA = ("rewards", "advantages")


@contextlib.contextmanager
def completions_logged_once(trainer, size: int):
    """Inside, ``trainer._logs`` (GRPOTrainer's completions table, deques of a bounded length) is a fresh unbounded
    copy; after, what was logged there goes to the trainer's own, each completion once: of the entries gathered
    from every process, those of each replica's first rank. Bounded deques would drop the start of C copies."""
    kept = trainer._logs
    trainer._logs = {
        key: defaultdict(deque) if isinstance(value, defaultdict) else deque() for key, value in kept.items()
    }
    try:
        yield
    finally:
        logged, trainer._logs = trainer._logs, kept
        for key, value in logged.items():
            columns = value.items() if isinstance(value, defaultdict) else [(None, value)]
            for column, entries in columns:
                once = list(entries) if key in _ONE_COPY_PER_REPLICA else _first_of_each_replica(entries, size)
                (kept[key] if column is None else kept[key][column]).extend(once)


def _first_of_each_replica(entries, size: int) -> list:
    """The entries an all-gather over every process returned (each rank's, in rank order), those of the ranks
    that are first in their replica."""
    entries, processes = list(entries), dist.get_world_size()
    per_rank = len(entries) // processes
    return [e for rank in range(0, processes, size) for e in entries[rank * per_rank : (rank + 1) * per_rank]]


__all__ = ["ReplicaAccelerator", "completions_logged_once", "data_parallel_group", "one_copy_per_replica"]
