"""The cost model's view of a compiled site: the workload and the mask facts read off the graph node, then
``cost`` chooses (the same choice eager calls make from their tensors).

``choose_schedule(site, plan, is_causal)`` is what each site pattern's rewrite asks: its ``Decision`` becomes
``site.decision``, for ``explain``.
"""

from __future__ import annotations

from ..cost.masked import choose_masked, flex_facts, packed_facts
from ..cost.model import Estimate, Machine, Workload, check_schedule, decide, machine_for
from ..layout.blockmask import mask_tiles
from .site import Decision, _example


def visible_fraction(site, seq_len: int) -> float:
    """Fraction of the S x S scores the site's mask keeps."""
    given = site.args.get("visible_fraction")
    if given is not None:
        return float(given)
    return (seq_len + 1) / (2 * seq_len) if site.args.get("is_causal") else 1.0


def _needs_backward(site) -> bool:
    return any(getattr(_example(site.args[n]), "requires_grad", False) for n in ("query", "key", "value"))


def workload(site, plan) -> Workload:
    q, k, v = site.shape("query"), site.shape("key"), site.shape("value")
    c = plan.world_size
    return (
        Workload(
            batch=q[0],
            q_heads=q[1],
            kv_heads=k[1],
            local_len=q[2],
            head_dim=q[3],
            v_dim=v[3],
            dtype=site.dtype(),
            world_size=c,
            visible=visible_fraction(site, q[2] * c),
            causal=bool(site.args.get("is_causal")),
            backward=_needs_backward(site),
            mesh=plan.mesh_sizes,
        )
        if _example(site.query) is not None
        else None
    )


def choose_site(site, plan, machine: Machine) -> tuple[str, str, list[Estimate]]:
    """A compiled varlen or flex site: the window, or the tile counts the sharded mask's table carries."""

    c = plan.world_size
    # ints even for a dynamic length (AttentionSite.shape): the call being compiled, the same on every rank
    q, k, v = site.shape("query"), site.shape("key"), site.shape("value")
    if site.pattern == "varlen":
        window = (site.args["window_left"], site.args["window_right"])  # parsed by the varlen site pattern
        facts, causal = packed_facts(None, q[0], c, window), window[1] == 0
    else:
        buffers = site.args["mask_mod_buffers"]
        tiles = mask_tiles(site.values.get(buffers[0]), q[2], c) if buffers else None
        facts = flex_facts(tiles, bool(buffers), q[2], c)
        causal = False
    return choose_masked(
        "packed" if site.pattern == "varlen" else "flex",
        q,
        k,
        v,
        site.dtype(),
        c,
        facts,
        causal=causal,
        backward=_needs_backward(site),
        machine=machine,
        mesh=plan.mesh_sizes,
        schedule=plan.schedule,
        where=site.source,
    )


def choose_schedule(site, plan, is_causal: bool) -> Decision:
    """The schedule for ``site`` under ``plan``, why, and the estimates behind the choice."""
    check_schedule(plan.schedule)
    example = _example(site.query)
    machine = machine_for(plan, example.device.type if example is not None else "cpu")
    if site.pattern in ("varlen", "flex"):
        schedule, why, estimates = choose_site(site, plan, machine)
    else:
        schedule, why, estimates = decide(workload(site, plan), machine, plan.schedule, None, site.source)
    return Decision(schedule, why, is_causal, tuple(estimates), machine)
