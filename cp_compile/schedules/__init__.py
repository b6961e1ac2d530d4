"""CP schedules: how K/V (or heads) move between ranks, each written once over the kinds.

Each module is one schedule: plain Python over ``cp::attend`` and the comm ops
that the eager whole op runs and the compiler traces, defined as a whole op
pair by ``whole.sequence_schedule`` or ``whole.heads_schedule``. A new schedule
is one module here, imported by ``cp_compile.registration``, plus its name in ``SCHEDULES`` (and the
cost model's estimate in ``cost.model``, and its group arguments in
``whole_op``).

``whole_op`` names a schedule's op and ``run_schedule`` calls it: the eager API, the plan's
``attention`` and the Hugging Face integration run schedules through them.

The decode schedule outside that family (queries every rank holds against a KV
cache sharded over the ranks) is ``cp_compile.inference.cached``.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from ..comm import group_name_of, mesh_groups
from ..kinds.base import Call

SCHEDULES = ("ring", "allgather", "ulysses", "hybrid")
HEAD_SCHEDULES = ("ulysses", "hybrid")


def whole_op(schedule: str, group_name: str, mesh_group_names: tuple = ()):
    """(whole forward op, its group arguments) of ``schedule`` over the plan's group; the op is called
    as ``op(q, k, v, extra, *groups, is_causal, layout, scale, enable_gqa, kind, options[, mods])`` and its
    outputs 0 and 1 are (out, lse)."""
    import torch

    ops = torch.ops.cp
    if schedule == "hybrid":
        if len(mesh_group_names) != 2:
            raise ValueError("schedule='hybrid' needs a 2-D DeviceMesh (ring, a2a) as the group")
        return ops.hybrid_attention.default, (group_name, *mesh_group_names)
    check_schedule_name(schedule)
    return getattr(ops, f"{schedule}_attention").default, (group_name,)


def check_schedule_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")


def _groups(group, schedule: str) -> tuple[str, tuple]:
    """(group name, mesh groups) of an eager call's ``group``: a group (name) or, for the hybrid,
    a 2-D (ring, a2a) DeviceMesh or its (flattened, ring, a2a) group names."""
    if isinstance(group, tuple):
        return group[0], tuple(group[1:]) if schedule == "hybrid" else ()
    if schedule != "hybrid":
        return group_name_of(group), ()
    names = mesh_groups(group)
    return names[0], tuple(names[1:])


def softmax_scale(q: Tensor, scale: Optional[float]) -> float:
    """``scale``, or SDPA's default ``1 / sqrt(head dim)``."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def run_schedule(
    schedule: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    extra: list,
    group,
    is_causal: bool,
    layout: str,
    scale: float,
    enable_gqa: bool,
    kind: str,
    options: str,
    mods=None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``schedule`` over ``group`` for any kind: the whole op, differentiable."""
    op, groups = whole_op(schedule, *_groups(group, schedule))
    call = Call(kind, groups, bool(is_causal), layout, scale, options, mods)
    res = op(q, k, v, list(extra), *call.op_args(bool(enable_gqa)))
    return res[0], res[1]
