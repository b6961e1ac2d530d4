"""Benchmark variants for the other schedules, and the cost model's choice against the measurements.

Imported by ``cp_compile.tools.bench`` when present. Adds, next to "ours eager" (the
ring):

- "ours ulysses": ``cp_compile.ulysses_attention``, eager, zigzag;
- "ours hybrid": ``cp_compile.hybrid_attention`` on a ``(C/2, 2)`` mesh (ring
  over C/2, all-to-all over pairs of ranks; a plain ring at odd C);

and a per-configuration line "auto": which schedule ``schedule="auto"``
picks for the configuration (machine profile calibrated on the same ranks),
and its measured time against the best measured schedule.
"""

from __future__ import annotations

import functools

import torch

from .variants import CONFIG_HOOKS, OURS, Inputs, Problem, Variant, fwd_bwd_step, register_variant

OURS_ULYSSES = "ours ulysses"
OURS_HYBRID = "ours hybrid"
MEASURED = {"ring": OURS, "ulysses": OURS_ULYSSES, "hybrid": OURS_HYBRID}


def hybrid_mesh_shape(world_size: int) -> tuple[int, int]:
    a2a = 2 if world_size % 2 == 0 else 1
    return world_size // a2a, a2a


def _ulysses_setup(p: Problem, x: Inputs):
    import cp_compile

    return fwd_bwd_step(functools.partial(cp_compile.ulysses_attention, is_causal=p.causal), (x.q, x.k, x.v), x.do)


@functools.cache
def _mesh(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", hybrid_mesh_shape(world_size), mesh_dim_names=("ring", "a2a"))


def _hybrid_setup(p: Problem, x: Inputs):
    import cp_compile

    from ...comm.groups import mesh_groups

    groups = mesh_groups(_mesh(p.world_size))
    return fwd_bwd_step(
        lambda q, k, v: cp_compile.hybrid_attention(q, k, v, groups, is_causal=p.causal), (x.q, x.k, x.v), x.do
    )


register_variant(Variant(OURS_ULYSSES, _ulysses_setup, "cp_compile.ulysses_attention, eager, zigzag", devices=("cpu",)))
register_variant(
    Variant(
        OURS_HYBRID,
        _hybrid_setup,
        "cp_compile.hybrid_attention, eager, mesh (C/2 ring, 2 all-to-all)",
        devices=("cpu",),
    )
)


def _calibrated():
    import cp_compile

    return cp_compile.calibrate(cp_compile.ContextParallel())


def auto_choice(p: Problem, res: dict, runner) -> dict:
    """The cost model's pick for ``p`` and how its measured time compares with the best measured schedule."""
    from ...cost.model import Workload, default_machine, estimate_all, pick

    machine = _machines.get(p.world_size)
    if machine is None and p.world_size > 1:
        machine = _machines[p.world_size] = runner(p.world_size, _calibrated)[0]
    if machine is None:
        machine = default_machine("cpu")
    w = Workload(
        p.batch,
        p.heads,
        p.heads,
        p.local_len,
        p.head_dim,
        p.head_dim,
        getattr(torch, p.dtype),
        p.world_size,
        (p.seq_len + 1) / (2 * p.seq_len) if p.causal else 1.0,
        p.causal,
        True,
        hybrid_mesh_shape(p.world_size),
    )
    measured = {s: res[v]["time_s"] for s, v in MEASURED.items() if res.get(v, {}).get("time_s") is not None}
    if not measured:  # --variants left out every schedule: nothing to compare the pick with
        return {"line": "no schedule variant measured"}
    estimates = estimate_all(w, machine, available=set(measured))
    chosen = pick(estimates).schedule
    best = min(measured, key=measured.get)
    ratio = measured[chosen] / measured[best] if chosen in measured else None
    estimated = {e.schedule: e.time_s for e in estimates if e.feasible}
    return {
        "chosen": chosen,
        "best_measured": best,
        "time_ratio": ratio,
        "estimated_s": estimated,
        "measured_s": measured,
        "machine": str(machine),
        "line": f"auto picks {chosen}; best measured {best}"
        + (f"; auto's time / best = {ratio:.2f}" if ratio is not None else "")
        + "; estimated "
        + ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in estimated.items())
        + "; measured "
        + ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in measured.items()),
    }


_machines: dict = {}
CONFIG_HOOKS["auto"] = auto_choice
