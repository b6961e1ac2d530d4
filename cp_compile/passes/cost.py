"""Which CP schedule each attention site gets, and why.

Every input to the choice (shapes, dtype, mask, C, the plan's options) is the
same on every rank, so every rank picks the same schedule and builds the same
graph.
"""

from __future__ import annotations

SCHEDULES = ("ring", "allgather")


def check_schedule(schedule: str) -> None:
    if schedule != "auto" and schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected 'auto' or one of {SCHEDULES}")


def choose_schedule(site, options) -> tuple[str, str]:
    """(schedule, reason) for ``site`` under the plan's ``options``."""
    check_schedule(options.schedule)
    if options.schedule != "auto":
        return options.schedule, "chosen by the plan (schedule=...)"
    if site.kind == "varlen":
        from ..ops.comm import resolve_group

        q_shape, k_shape = site.shape("query"), site.shape("key")
        window = (site.args["window_left"], site.args["window_right"])  # parsed by the varlen site kind
        return choose_packed_schedule(q_shape[1], k_shape[1], q_shape[0], window,
                                      resolve_group(options.group_name).size())
    if site.kind == "flex":
        from .flex_site import choose_flex_site_schedule

        return choose_flex_site_schedule(site, options)
    causal = bool(site.args.get("is_causal"))
    if causal and options.layout == "zigzag":
        return "ring", "causal zigzag ring: equal work per rank and step, K/V transfer overlapped with compute"
    return "ring", "ring: K/V transfer overlapped with compute"


def choose_packed_schedule(q_heads: int, kv_heads: int, local_len: int, window: tuple[int, int],
                           world_size: int) -> tuple[str, str]:
    """Ring or all-gather for packed documents (every argument is the same on every rank)."""
    left, right = window
    if world_size > 1 and left >= 0 and right >= 0 and left + right < local_len:
        return "allgather", (
            f"window ({left}, {right}) is shorter than a rank's {local_len} slots: each query sees only neighbouring "
            "chunks, so most ring steps would be empty; one K/V gather replaces C-1 latency-bound ring steps"
        )
    if kv_heads * 4 <= q_heads:
        return "allgather", (
            f"few K/V heads ({kv_heads} for {q_heads} query heads): the gathered K/V is small, and one gather "
            "replaces C-1 ring steps"
        )
    return "ring", "packed ring: K/V transfer overlapped with compute, memory flat in C"
