"""Where the time of a step goes, from a profile: compute, collectives, and everything else.

The generate command (``python -m cp_compile generate``) and ``examples/train_packed.py`` report it.

``breakdown(prepare, steps)`` times the steps ``prepare()`` returns once plainly and once under
``torch.profiler``; per step it reports

- ``wall_ms``: the plain run's time; ``profiled_ms`` the profiled run's;
- ``compute_ms``: the self time of the ATen operators the profile saw (kernels on CPU; the host side of
  launches on a GPU) on the threads that run the step, the collectives' own excluded;
- ``collective_ms`` and ``collectives``: the time inside the collectives (issue and wait; waiting on a peer
  counts here) and how many were issued per step;
- ``other_ms``: the rest of the profiled run's time (``profiled_ms``): Python, tensor bookkeeping, guards and
  checks, and the profiler's own overhead, which ``wall_ms - profiled_ms`` bounds.

Under the profiler one rank runs slower, so its peers wait longer inside the collectives: read the
collectives' time as an upper bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# The threads that run a step: the caller (marked by this event around the steps) and the autograd engine's
# (which runs a GPU's backward on a thread of its own). Others are a backend's: gloo copies a collective's
# buffers on a worker thread while the caller waits inside the collective's event, which counts that time.
_STEPS = "cp_compile.breakdown.steps"
_AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"
# What the collectives of cp_compile (functional collectives) and of torch.distributed record on the calling thread
_COLLECTIVE_PREFIXES = ("_c10d_functional::", "c10d::")
_ISSUE = (
    "all_gather",
    "allgather",
    "all_to_all",
    "alltoall",
    "reduce_scatter",
    "all_reduce",
    "allreduce",
    "broadcast",
    "send",
    "recv",
)


def _is_collective(name: str) -> bool:
    return name.startswith(_COLLECTIVE_PREFIXES)


def _inside_collective(event) -> bool:
    """Whether a collective's event encloses ``event`` (it then counts as that collective's, not on its own)."""
    parent = event.cpu_parent
    while parent is not None and not _is_collective(parent.name):
        parent = parent.cpu_parent
    return parent is not None


def _issues(name: str) -> bool:
    """Whether an outermost collective event issues a collective (a wait is not one of its own)."""
    return any(k in name for k in _ISSUE)


def wall_time(run: Callable[[], object]) -> float:
    """Seconds of one ``run()``, by the wall clock."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def breakdown(prepare: Callable[[], Callable[[], None]], steps: int) -> dict[str, float]:
    """Per-step costs of ``prepare()()``, which makes ``steps`` steps; ``prepare()`` (untimed, unprofiled) sets up
    what the steps start from (a prefilled cache) and returns them. See the module docstring."""
    from torch.profiler import ProfilerActivity, profile, record_function

    wall = wall_time(prepare())
    run = prepare()
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function(_STEPS):
        profiled = wall_time(run)
    events = prof.events()
    step_threads = {e.thread for e in events if e.name == _STEPS or e.name.startswith(_AUTOGRAD_PREFIX)}
    collective_us, compute_us, issued = 0.0, 0.0, 0
    for event in [e for e in events if e.thread in step_threads]:
        name = event.name
        if _is_collective(name) and not _inside_collective(event):
            collective_us += event.cpu_time_total  # the outermost event holds the backend's own
            issued += _issues(name)
        elif name.startswith("aten::") and not _inside_collective(event):
            compute_us += event.self_cpu_time_total
    profiled_ms = 1e3 * profiled / steps
    compute_ms, collective_ms = 1e-3 * compute_us / steps, 1e-3 * collective_us / steps
    return dict(
        wall_ms=1e3 * wall / steps,
        profiled_ms=profiled_ms,
        compute_ms=compute_ms,
        collective_ms=collective_ms,
        collectives=issued / steps,
        other_ms=max(0.0, profiled_ms - compute_ms - collective_ms),
    )


def collectives_issued(step: Callable[[], None]) -> list[tuple[str, list]]:
    """The collectives one ``step()`` issues on the calling thread, in order: (operator name, input shapes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return [
        (e.name, e.input_shapes)
        for e in prof.events()
        if _is_collective(e.name) and not _inside_collective(e) and _issues(e.name)
    ]


def format_breakdown(costs: dict[str, float]) -> str:
    return (
        f"{costs['wall_ms']:.2f} ms (profiled {costs['profiled_ms']:.2f} = compute {costs['compute_ms']:.2f} + "
        f"{costs['collectives']:.1f} collectives {costs['collective_ms']:.2f} + other {costs['other_ms']:.2f})"
    )
