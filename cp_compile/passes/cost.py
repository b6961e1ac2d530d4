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
    if site.kind == "flex":
        from .flex_site import choose_flex_site_schedule

        return choose_flex_site_schedule(site, options)
    causal = bool(site.args.get("is_causal"))
    if causal and options.layout == "zigzag":
        return "ring", "causal zigzag ring: equal work per rank and step, K/V transfer overlapped with compute"
    return "ring", "ring: K/V transfer overlapped with compute"
