"""CP schedules: how K/V (or heads) move between ranks, each written once over the kinds.

Each module is one schedule: plain Python over ``cp::attend`` and the comm ops
that the eager whole op runs and the compiler traces, defined as a whole op
pair by ``whole.sequence_schedule`` or ``whole.heads_schedule``. A new schedule
is one module here, imported by ``cp_compile.registration``, plus its name in ``SCHEDULES`` (and the
cost model's estimate in ``cost.model``, and its group arguments in
``whole_op``).

The decode schedule outside that family (queries every rank holds against a KV
cache sharded over the ranks) is ``cp_compile.inference.cached``.
"""

SCHEDULES = ("ring", "allgather", "ulysses", "hybrid")
HEAD_SCHEDULES = ("ulysses", "hybrid")


def whole_op(schedule: str, group_name: str, mesh_groups: tuple = ()):
    """(whole forward op, its group arguments) of ``schedule`` over the plan's group; the op is called
    as ``op(q, k, v, extra, *groups, is_causal, layout, scale, enable_gqa, kind, options)`` and its
    outputs 0 and 1 are (out, lse)."""
    import torch

    ops = torch.ops.cp
    if schedule == "hybrid":
        if len(mesh_groups) != 2:
            raise ValueError("schedule='hybrid' needs a 2-D DeviceMesh (ring, a2a) as the group")
        return ops.hybrid_attention.default, (group_name, *mesh_groups)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    return getattr(ops, f"{schedule}_attention").default, (group_name,)
