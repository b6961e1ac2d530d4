"""CP schedules: how K/V (or heads) move between ranks, each written once over the kinds.

Each module is one schedule: plain Python over ``cp::attend`` and the comm ops
that the eager whole op runs and the compiler traces, defined as a whole op
pair by ``whole.sequence_schedule`` or ``whole.heads_schedule``. A new schedule
is one module here, imported by ``cp_compile.registration``, plus its name in ``SCHEDULES`` (and the
cost model's estimate in ``cost.model``, and its group arguments in
``whole_op``).

``whole_op`` names a schedule's op and ``run_schedule`` calls it with a ``kinds.call.Call``: the eager API, the plan's
``attention`` and the Hugging Face integration run schedules through them.

The decode schedule outside that family (queries every rank holds against a KV
cache sharded over the ranks) is ``cp_compile.inference.cached``.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from ..comm.groups import group_name_of, mesh_groups
from ..kinds.call import Call

SCHEDULES = ("ring", "allgather", "ulysses", "hybrid")
HEAD_SCHEDULES = ("ulysses", "hybrid")


def whole_op(schedule: str, groups: tuple):
    """The whole forward op of ``schedule`` over ``groups`` (``schedule_groups``), called as ``op(q, k, v, extra,
    *call.op_args(enable_gqa))``; its outputs 0 and 1 are (out, lse)."""
    import torch

    ops = torch.ops.cp
    if schedule == "hybrid":
        if len(groups) != 3:
            raise ValueError("schedule='hybrid' needs a 2-D DeviceMesh (ring, a2a) as the group")
        return ops.hybrid_attention.default
    check_schedule_name(schedule)
    return getattr(ops, f"{schedule}_attention").default


def check_schedule_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")


def schedule_groups(group, schedule: str) -> tuple[str, ...]:
    """The group names ``schedule`` runs over: the group's (a group, or its name); for the hybrid, a 2-D (ring,
    a2a) DeviceMesh's or its (flattened, ring, a2a) names."""
    if isinstance(group, tuple):
        return group if schedule == "hybrid" else group[:1]
    return (group_name_of(group),) if schedule != "hybrid" else mesh_groups(group)


def softmax_scale(q: Tensor, scale: Optional[float]) -> float:
    """``scale``, or SDPA's default ``1 / sqrt(head dim)``."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def run_schedule(schedule: str, q: Tensor, k: Tensor, v: Tensor, extra: list, call: Call, enable_gqa: bool):
    """(out, lse) of ``schedule`` for ``call`` (its groups from ``schedule_groups``), any kind: the whole op,
    differentiable."""
    res = whole_op(schedule, call.groups)(q, k, v, list(extra), *call.op_args(bool(enable_gqa)))
    return res[0], res[1]
