"""``explain``: what the CP backend does to a model, as data and as text.

For a full dump of every graph (Dynamo, joint, forward, backward, post-grad,
generated code), wrap the call in depyf::

    import depyf
    with depyf.prepare_debug("depyf_out"):
        compiled(*args)            # depyf_out/ then holds the graphs; the post-grad
                                   # forward/backward show the expanded ring

or set ``TORCH_LOGS=graph_code,aot_graphs,post_grad_graphs,output_code``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cost.model import fmt_bytes as _fmt_bytes
from ..kernels.merge import acc_dtype
from .site import Decision


@dataclass
class SiteReport:
    """One attention site and the schedule it got."""

    source: str  # the user's file/line and code
    location: str  # top-level graph or inside which HOP body
    schedule: str
    why: str
    is_causal: bool
    q_shape: tuple
    kv_shape: tuple
    dtype: str
    world_size: int
    forward_bytes_per_step: int  # K and V of one rank, sent by every rank
    backward_bytes_per_step: int  # K/V again plus the fp32 dK/dV accumulator
    forward_memory_q_units: float  # what the forward schedule holds, in local-q units
    backward_memory_q_units: float
    candidates: list = field(default_factory=list)  # cost.model.Estimate per schedule considered
    machine: Any = None  # the cost.model.Machine the estimates assume

    def __str__(self) -> str:
        if self.schedule == "ring":
            text = self._ring_text()
        elif self.schedule == "allgather":
            text = self._allgather_text()
        else:
            text = self._header()
        if self.candidates:
            text += f"\n    candidates ({self.machine}):" + "".join(
                f"\n      {'*' if e.schedule == self.schedule else ' '} {e.row()}" for e in self.candidates
            )
        return text

    def _header(self) -> str:
        return (
            f"{self.source}\n    {self.location}; q {self.q_shape} k/v {self.kv_shape} {self.dtype}, "
            f"{'causal' if self.is_causal else 'non-causal'}\n"
            f"    schedule: {self.schedule} over C={self.world_size} ({self.why})"
        )

    def _allgather_text(self) -> str:
        c = self.world_size
        return (
            f"{self._header()}\n"
            f"    receives per rank: forward K/V of {c - 1} ranks ({c - 1} x "
            f"{_fmt_bytes(self.forward_bytes_per_step)}) in one all-gather, backward the same again + a "
            f"reduce-scatter of fp32 dK/dV\n"
            f"    holds: forward {self.forward_memory_q_units:.1f}, backward {self.backward_memory_q_units:.1f} "
            f"local-q units at this C (grows with C: the gathered K/V)"
        )

    def _ring_text(self) -> str:
        c = self.world_size
        return (
            f"{self._header()}\n"
            f"    sends per rank: forward {c - 1} x {_fmt_bytes(self.forward_bytes_per_step)}, "
            f"backward {c - 1} x {_fmt_bytes(self.forward_bytes_per_step)} K/V + "
            f"{c if c > 1 else 0} x {_fmt_bytes(self.backward_bytes_per_step - self.forward_bytes_per_step)} dK/dV\n"
            f"    holds: forward {self.forward_memory_q_units:.1f}, backward {self.backward_memory_q_units:.1f} "
            f"local-q units, whatever C is"
        )


@dataclass
class ExplainReport:
    sites: list[SiteReport] = field(default_factory=list)
    graphs: int = 0  # graphs Dynamo captured
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)
    schedules: list[list[str]] = field(default_factory=list)  # CP ops per compiled graph, in order
    mixers: list = field(default_factory=list)  # compiler.mixer_sites.MixerReport per convolution / scan exchange

    def __str__(self) -> str:
        mixers = f"{len(self.mixers)} mixer op(s), " if self.mixers else ""
        lines = [
            f"cp_compile: {len(self.sites)} attention site(s), {mixers}{self.graphs} graph(s), "
            f"{self.graph_breaks} graph break(s)"
        ]
        lines += [f"  break: {r}" for r in self.break_reasons]
        for i, site in enumerate(self.sites):
            lines.append(f"[{i}] " + str(site))
        for i, mixer in enumerate(self.mixers):
            lines.append(f"[mixer {i}] " + str(mixer))
        for i, listing in enumerate(self.schedules):
            lines.append(f"compiled graph {i}: " + " -> ".join(_compress(listing)))
        return "\n".join(lines)


def _compress(listing: list[str]) -> list[str]:
    """['wait', 'wait'] -> ['wait x2'] for readability."""
    out: list[str] = []
    for item in listing:
        if out and out[-1].split(" x")[0] == item and item in ("wait",):
            base, _, n = out[-1].partition(" x")
            out[-1] = f"{base} x{int(n or 1) + 1}"
        else:
            out.append(item)
    return out


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


def site_report(site, world_size: int) -> SiteReport:
    q_shape, k_shape, v_shape = site.shape("query"), site.shape("key"), site.shape("value")
    dtype = site.dtype()
    acc = acc_dtype(dtype)
    q_bytes = _nbytes(q_shape, dtype)
    kv_bytes = _nbytes(k_shape, dtype) + _nbytes(v_shape, dtype)
    dkv_bytes = _nbytes(k_shape, acc) + _nbytes(v_shape, acc)
    out_acc, lse = _nbytes(q_shape[:-1] + v_shape[-1:], acc), _nbytes(q_shape[:-1], acc)
    partial = _nbytes(q_shape[:-1] + v_shape[-1:], dtype) + lse
    # forward: current + incoming K/V, the fp32 accumulator, one step's partial result
    forward = (2 * kv_bytes if world_size > 1 else kv_bytes) + out_acc + lse + partial
    # backward: current + incoming K/V, travelling dK/dV (mine + incoming), dQ accumulator, one step's grads
    backward = 2 * kv_bytes + 2 * dkv_bytes + _nbytes(q_shape, acc) + q_bytes + kv_bytes
    decision = site.decision or Decision("?", "", bool(site.args["is_causal"]))
    if decision.schedule == "allgather":
        # gathered K/V, out and lse; backward: gathered K/V, full-length fp32 dK/dV, dQ
        forward = world_size * kv_bytes + out_acc + lse
        backward = world_size * (kv_bytes + dkv_bytes) + _nbytes(q_shape, acc)
    return SiteReport(
        source=site.source,
        location=site.location,
        schedule=decision.schedule,
        why=decision.why,
        is_causal=decision.is_causal,
        q_shape=q_shape,
        kv_shape=k_shape,
        dtype=str(dtype).replace("torch.", ""),
        world_size=world_size,
        forward_bytes_per_step=kv_bytes,
        backward_bytes_per_step=kv_bytes + dkv_bytes,
        forward_memory_q_units=forward / q_bytes,
        backward_memory_q_units=backward / q_bytes,
        candidates=list(decision.estimates),
        machine=decision.machine,
    )


def explain(fn_or_module, *args, plan, inner: str = "aot_eager", backward: bool = False, **kwargs) -> ExplainReport:
    """Compile ``fn_or_module`` with ``plan``'s backend, run it once, and report.

    Runs one forward (and, with ``backward=True``, a backward of the sum of the
    first output, which accumulates into ``.grad``). Call it on every rank, as
    any CP code: it communicates. ``inner`` defaults to ``"aot_eager"``, which
    expands the same schedules without generating code.
    """
    from torch._dynamo.utils import counters

    backend = plan.backend(inner)
    breaks_before = dict(counters["graph_break"])
    compiled = torch.compile(fn_or_module, backend=backend)
    out = compiled(*args, **kwargs)
    if backward:
        first = out if isinstance(out, torch.Tensor) else next(t for t in _tensors(out))
        first.sum().backward()
    new_breaks = {k: v - breaks_before.get(k, 0) for k, v in counters["graph_break"].items()}
    new_breaks = {k: v for k, v in new_breaks.items() if v > 0}
    report = ExplainReport(
        graphs=len(backend.records),
        graph_breaks=sum(new_breaks.values()),
        break_reasons=sorted(new_breaks),
    )
    for record in backend.records:
        report.sites += [site_report(site, plan.world_size) for site in record.sites]
        report.schedules += record.schedules
        report.mixers += record.mixers
    return report


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
