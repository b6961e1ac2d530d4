"""Configurations, the variant registry and the measurement: what runs on each rank,
how the ranks are driven and how their numbers are combined.

What is measured, per configuration and variant
-----------------------------------------------
time          fwd+bwd wall time per step. Each repeat runs every variant once, in
              an order that rotates from repeat to repeat, so slow drift of a
              shared machine hits all variants alike. One sample is the mean of
              ``n`` back-to-back steps, ``n`` chosen per variant after warm-up so
              that a sample lasts at least ``--min-sample-ms`` (short steps are
              otherwise dominated by scheduling noise and barrier skew; every
              rank uses the same ``n``). A variant's time in one repeat is the
              slowest rank's sample (ranks start together after a barrier); the
              reported time is the median over repeats.
host/step     host time per ring step: the same fwd+bwd step, timed the same way,
              with the attention kernels replaced by zero-cost stand-ins (zeros of
              the right shapes; transfers, merges and dispatch stay real), divided
              by the 2C ring steps of a fwd+bwd (C forward, C backward). On a GPU
              this is what the host needs to issue one step; once it exceeds the
              device time of a step, CP runs at Python speed. On CPU with gloo it
              also contains the (blocking) transfers of the step's K/V.
efficiency    single-device time / (C x variant time).
time ratio    variant time / torch ring time (< 1: faster than torch), per rotate method.
peak memory   growth of the peak RSS (``PeakMemory``) during one fwd+bwd after
              warm-up, above the memory held before it (inputs included there),
              max over ranks, in units of one local q tensor (B*H*S/C*D elements).
bytes/rank    payload bytes that arrive at one rank from other ranks during one
              fwd+bwd. Ours: ``cp_compile.count_traffic()`` (bytes each
              ``cp::ring_shift`` sends; on a ring what a rank sends equals what
              it receives). Torch: its K/V and dK/dV buffers are counted as they
              are handed to ``funcol.permute_tensor`` (all-to-all with one peer:
              the buffer's bytes) or ``funcol.all_gather_single`` (C-1 times the
              buffer's bytes arrive), with the wrappers installed around one step.
              The small shape agreement ours does first (an int64 all-gather of
              18 values per rank) is not counted.
comm hidden   fraction of communication time hidden behind compute. An instrumented
              re-run records, with ``time.perf_counter`` in a ``TorchDispatchMode``
              (``OpTracer``), every op the schedule issues: comm issues
              (``cp::ring_shift``, ``_c10d_functional.*``), waits
              (``_c10d_functional.wait_tensor``), attention kernels and merges.
              exposed    = time this rank spends inside comm issues and waits;
              standalone = the same sum in a re-run with identical communication
                           but the attention kernels replaced by zero-cost
                           stand-ins (zeros of the right shapes), i.e. the
                           communication's own cost;
              hidden     = 1 - exposed / standalone, the mean over ranks, where
                           exposed and standalone are each the median over
                           ``--trace-repeats`` alternating (real, comm-only) pairs.
              Waits also absorb skew between ranks, so on a loaded machine the
              value can be negative (more blocked time than the transfers cost).
              The instrumented re-run calls the schedule's Python functions
              directly (``ring_forward`` / ``ring_backward``): a dispatch mode
              cannot see inside a custom op.
GFLOP/s/rank  model FLOPs of full attention fwd+bwd, 12*B*H*S^2*D (fwd 4*B*H*S^2*D,
              bwd twice that; recompute not counted), halved when causal,
              divided by C and by the time.

The JSON also keeps one per-rank timeline (the largest causal configuration,
ours) and the PNG draws it next to time and memory against C.

Under ``torchrun`` the same driver runs on the launched ranks: with CUDA and
NCCL on GPUs (not yet run there), with gloo on CPU (tested). C is then the
launched world size only, torch's ring variants are skipped (they are wired to
the CPU kernel), timings synchronise CUDA, peak memory comes from the CUDA
allocator and the comm-hidden measurement is skipped (host timestamps of
asynchronous kernels mean nothing). GFLOP/s per rank is reported next to
single-GPU SDPA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ..memory import PeakMemory, release_heap
from .trace import OpTracer
from .variants import (
    CONFIG_HOOKS,
    OURS,
    SINGLE,
    TORCH_A2A,
    TORCH_AG,
    TORCH_RINGS,
    VARIANTS,
    Problem,
    Variant,
    make_inputs,
)

# ----------------------------------------------------------------------------
# The per-rank task: validate, time, measure memory / traffic / overlap.
# ----------------------------------------------------------------------------


def _tolerance(dtype: str) -> float:
    return {"float64": 1e-9, "float32": 1e-4}.get(dtype, 5e-2)


def _rel_err(got: Tensor, want: Tensor) -> float:
    return (got.double() - want.double()).abs().max().item() / max(want.abs().max().item(), 1e-6)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_summary(tracers: list[OpTracer]) -> dict:
    """Per-field median over repeated traced runs."""
    rows = [t.summary() for t in tracers]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _timed_sample(step: Callable, n: int, device: torch.device) -> float:
    """Mean wall time of ``n`` back-to-back steps."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / n


def _steps_per_sample(
    variants: list[Variant], steps: dict, mine, device: torch.device, min_sample_s: float, most: int = 64
) -> dict[str, int]:
    """Steps per timing sample for each variant, the same on every rank.

    Each variant is timed once more here (after its warm-up); the slowest rank's
    time decides, so the ranks run the same number of steps (and collectives).
    """
    import torch.distributed as dist

    once = torch.zeros(len(variants), dtype=torch.float64)
    for i, v in enumerate(variants):
        dist.barrier()
        if mine(v):
            once[i] = _timed_sample(steps[v.name], 1, device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    return {v.name: max(1, min(most, math.ceil(min_sample_s / max(t, 1e-6)))) for v, t in zip(variants, once.tolist())}


def _interleaved_samples(
    variants: list[Variant], steps: dict, mine, device: torch.device, repeats: int, per_sample: dict[str, int]
) -> dict[str, list[float]]:
    """One sample of every variant per repeat, in an order that rotates from repeat to repeat
    (slow drift of a shared machine hits all alike); ranks start each sample together."""
    import torch.distributed as dist

    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(repeats if variants else 0):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            dist.barrier()
            if mine(v):
                samples[v.name].append(_timed_sample(steps[v.name], per_sample[v.name], device))
    return samples


def bench_rank(
    p: Problem,
    variants: list[Variant],
    repeats: int,
    device_type: str = "cpu",
    trace: bool = True,
    keep_timeline: tuple[str, ...] = (),
    trace_repeats: int = 1,
    min_sample_s: float = 0.0,
) -> dict:
    """Runs on every rank of a C-rank group; returns this rank's measurements."""
    import torch.distributed as dist

    from ...layout import Zigzag

    rank, world = dist.get_rank(), dist.get_world_size()
    release_heap()
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    x = make_inputs(p, rank, world, device)
    mine = lambda v: rank == 0 or not v.single_rank  # noqa: E731
    steps = {v.name: v.setup(p, x) for v in variants if mine(v)}
    result: dict[str, Any] = {"rank": rank, "variants": {v.name: {} for v in variants}}

    # -- warm-up, then check every variant against the single-device result
    reference = None
    for v in variants:
        if v.single_rank and mine(v):
            for _ in range(v.warmup):
                reference = steps[v.name]()
            _sync(device)
    if reference is None:  # rank 0 holds it; the others receive it
        reference = [torch.empty_like(t) for t in (x.q_full, x.k_full, x.v_full, x.do_full)]
    reference = [t.detach().contiguous() for t in reference]
    for t in reference:
        dist.broadcast(t, src=0)
    local_ref = [Zigzag().shard(t, 2, rank, world) for t in reference]
    errs = torch.zeros(len(variants), dtype=torch.float64, device=device)
    for i, v in enumerate(variants):
        if v.single_rank:
            continue
        with (v.meter or contextlib.nullcontext)() as box:
            got = steps[v.name]()  # first warm-up step: traffic of one fwd+bwd
        for _ in range(v.warmup - 1):
            got = steps[v.name]()
        _sync(device)
        errs[i] = max(_rel_err(a, b) for a, b in zip(got, local_ref))
        if box is not None:
            result["variants"][v.name]["bytes_per_rank"] = box.bytes
        del got
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)  # every rank reaches the same verdict
    for i, v in enumerate(variants):
        result["variants"][v.name].update(max_rel_err=float(errs[i]), valid=bool(errs[i] <= _tolerance(p.dtype)))
    valid = [v for v in variants if result["variants"][v.name]["valid"]]
    del reference, local_ref

    # -- timing: every repeat runs every valid variant once, rotating the order
    per_sample = _steps_per_sample(valid, steps, mine, device, min_sample_s)
    times = _interleaved_samples(valid, steps, mine, device, repeats, per_sample)
    for v in valid:
        result["variants"][v.name]["steps_per_sample"] = per_sample[v.name]
    # -- host time per ring step: the same steps with zero-cost attention kernels
    stubbed = [v for v in valid if v.stub is not None and not v.single_rank]
    if stubbed:
        with contextlib.ExitStack() as stack:
            for v in stubbed:
                stack.enter_context(v.stub())
            host_n = _steps_per_sample(stubbed, steps, mine, device, min_sample_s)
            host = _interleaved_samples(stubbed, steps, mine, device, repeats, host_n)
        for v in stubbed:
            result["variants"][v.name]["host_s_per_step"] = statistics.median(host[v.name]) / (2 * world)
    # -- peak memory of one step, after warm-up
    for v in valid:
        dist.barrier()
        if not mine(v):
            continue
        release_heap()
        with PeakMemory(device) as mem:
            out = steps[v.name]()
            _sync(device)
        del out
        q = x.q_full if v.single_rank else x.q
        result["variants"][v.name].update(
            times_s=times[v.name], peak_bytes=mem.peak_bytes, q_bytes=q.numel() * q.element_size()
        )
    # -- instrumented re-runs: exposed vs standalone communication
    if trace and device.type == "cpu":
        for v in [v for v in valid if v.traced_setup is not None and not v.single_rank]:
            runs: dict[bool, list[OpTracer]] = {False: [], True: []}
            steps_traced = {stub: v.traced_setup(p, x, stub) for stub in (False, True)}
            for _ in range(max(1, trace_repeats)):
                for stub in (False, True):  # alternate, so drift hits both alike
                    dist.barrier()
                    with OpTracer() as tracer:
                        steps_traced[stub]()
                    runs[stub].append(tracer)
            entry = result["variants"][v.name]
            entry["trace"] = {"run": _median_summary(runs[False]), "comm_only": _median_summary(runs[True])}
            if v.name in keep_timeline:
                # absolute perf_counter times: one clock for every process of this machine
                entry["timeline"] = runs[False][0].timeline(origin=0.0)
    dist.barrier()
    return result


# ----------------------------------------------------------------------------
# Driving the ranks and summarising.
# ----------------------------------------------------------------------------

# runner(world_size, fn, *args, timeout=...) -> per-rank results (the tests'
# ``ranks`` fixture has this signature; LocalPools is the CLI's).
Runner = Callable[..., list]


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarise(p: Problem, variants: list[Variant], rows: list[dict]) -> dict:
    """Combine per-rank measurements into one entry per variant, plus derived ratios."""
    out: dict[str, Any] = {}
    for v in variants:
        per_rank = [row["variants"][v.name] for row in rows]
        first = per_rank[0]
        entry: dict[str, Any] = {
            "valid": first["valid"],
            "max_rel_err": first["max_rel_err"],
            "description": v.description,
        }
        ranks_with_times = [r for r in per_rank if r.get("times_s")]
        if first["valid"] and ranks_with_times:
            # the slowest rank in each repeat (as many repeats as every rank has)
            per_repeat = [max(repeat) for repeat in zip(*(r["times_s"] for r in ranks_with_times))]
            entry.update(
                time_s=_median(per_repeat),
                times_s=per_repeat,
                per_rank_time_s=[_median(r["times_s"]) for r in ranks_with_times],
                peak_bytes=max(r["peak_bytes"] for r in ranks_with_times),
                q_bytes=ranks_with_times[0]["q_bytes"],
            )
            entry["peak_q_units"] = entry["peak_bytes"] / entry["q_bytes"]
            entry["gflops_per_rank"] = p.flops / (1 if v.single_rank else p.world_size) / entry["time_s"] / 1e9
        for key in ("bytes_per_rank", "host_s_per_step"):
            if key in first:
                entry[key] = max(r[key] for r in per_rank)
        if "steps_per_sample" in first:
            entry["steps_per_sample"] = first["steps_per_sample"]
        traces = [r["trace"] for r in per_rank if "trace" in r]
        if traces:
            exposed = [t["run"]["exposed_comm_s"] for t in traces]
            standalone = [t["comm_only"]["exposed_comm_s"] for t in traces]
            # C = 1: nothing crosses ranks (torch still all-to-alls dK/dV to itself)
            hidden = [1.0 - e / s if s > 0 and p.world_size > 1 else None for e, s in zip(exposed, standalone)]
            known = [h for h in hidden if h is not None]
            entry.update(
                comm_exposed_s=statistics.mean(exposed),
                comm_standalone_s=statistics.mean(standalone),
                comm_hidden_fraction=statistics.mean(known) if known else None,
                comm_hidden_per_rank=hidden,
                traced_compute_s=statistics.mean(t["run"]["compute_s"] for t in traces),
            )
        timelines = [r.get("timeline") for r in per_rank]
        if any(t is not None for t in timelines):
            entry["timeline"] = timelines
        out[v.name] = entry

    single = out.get(SINGLE, {}).get("time_s")
    for v in variants:
        entry = out[v.name]
        if v.single_rank or entry.get("time_s") is None:
            continue
        if single:
            entry["parallel_efficiency"] = single / (p.world_size * entry["time_s"])
        for base in TORCH_RINGS:
            base_time = out.get(base, {}).get("time_s")
            if base_time and v.name != base:
                entry[f"time_ratio_vs {base}"] = entry["time_s"] / base_time
    return out


def _progress_line(index: int, total: int, p: Problem, res: dict, elapsed: float) -> str:
    short = {OURS: "ours", TORCH_A2A: "torch a2a", TORCH_AG: "torch ag", SINGLE: "single"}
    parts = []
    for name, entry in res.items():
        label = short.get(name, name)
        if not entry["valid"]:
            parts.append(f"{label} INVALID (err {entry['max_rel_err']:.1e})")
        elif entry.get("time_s") is not None:
            parts.append(f"{label} {entry['time_s']:.3f}s")
    ours = res.get(OURS, {})
    extra = "".join(
        f" | {label} {ours[key]:.2f}"
        for key, label in (
            ("parallel_efficiency", "eff"),
            (f"time_ratio_vs {TORCH_A2A}", "ours/torch-a2a"),
            ("comm_hidden_fraction", "hidden"),
        )
        if ours.get(key) is not None
    )
    hosts = [(short.get(n, n), e["host_s_per_step"]) for n, e in res.items() if e.get("host_s_per_step") is not None]
    if hosts:
        extra += " | host/step " + ", ".join(f"{label} {t * 1e3:.2f} ms" for label, t in hosts)
    return f"[{index}/{total}] {p.label():<22} " + " | ".join(parts) + extra + f"  ({elapsed:.0f}s)"


@dataclass
class BenchOptions:
    world_sizes: tuple[int, ...] = (1, 2, 4)
    seq_lens: tuple[int, ...] = (2048, 4096, 8192)
    causal: tuple[bool, ...] = (True, False)
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    repeats: int = 5
    trace: bool = True
    trace_repeats: int = 3  # instrumented (real, comm-only) pairs per variant; medians reported
    min_sample_ms: float = 50.0  # a timing sample averages back-to-back steps until it lasts this long
    variants: Optional[tuple[str, ...]] = None  # None: every registered variant
    device: str = "cpu"
    threads_per_rank: int = 1


TINY = dict(world_sizes=(1, 2), seq_lens=(256,), heads=2, head_dim=32, repeats=2, trace_repeats=1, min_sample_ms=0.0)


def run_benchmark(opts: BenchOptions, runner: Runner, log: Callable[[str], None] = print) -> dict:
    """Run every configuration; returns the results dict written to JSON."""
    names = list(opts.variants) if opts.variants else list(VARIANTS)
    if SINGLE not in names:
        names.append(SINGLE)  # the reference: validation and efficiency need it
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; registered: {list(VARIANTS)}")
    skipped = {n: f"not available on {opts.device}" for n in names if opts.device not in VARIANTS[n].devices}
    variants = [VARIANTS[n] for n in names if n not in skipped]
    problems = [
        Problem(opts.batch, opts.heads, opts.head_dim, s, c, causal, opts.dtype)
        for causal in opts.causal
        for c in opts.world_sizes
        for s in opts.seq_lens
    ]
    for p in problems:
        if p.seq_len % (2 * p.world_size):
            raise ValueError(f"S={p.seq_len} does not split into 2C={2 * p.world_size} zigzag chunks")
    timeline_problem = max([p for p in problems if p.causal] or problems, key=lambda p: (p.world_size, p.seq_len))
    log(
        f"benchmarking {len(problems)} configurations x {len(variants)} variants "
        f"({', '.join(v.name for v in variants)}); B={opts.batch} H={opts.heads} D={opts.head_dim} "
        f"{opts.dtype}, {opts.repeats} repeats, device {opts.device}"
    )
    configs = []
    start = time.perf_counter()
    for i, p in enumerate(problems, 1):
        rows = runner(
            p.world_size,
            bench_rank,
            p,
            variants,
            opts.repeats,
            opts.device,
            opts.trace,
            (OURS,) if p == timeline_problem else (),  # the variant whose timeline is kept
            opts.trace_repeats,
            opts.min_sample_ms / 1e3,
        )
        res = summarise(p, variants, rows)
        extras = {name: hook(p, res, runner) for name, hook in CONFIG_HOOKS.items()}
        configs.append({"config": dataclasses.asdict(p), "flops": p.flops, "variants": res, "extras": extras})
        log(_progress_line(i, len(problems), p, res, time.perf_counter() - start))
        for name, extra in extras.items():
            if extra and extra.get("line"):
                log(f"    {name}: {extra['line']}")
    return {
        "meta": {
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "device": opts.device,
            "threads_per_rank": opts.threads_per_rank,
            "options": dataclasses.asdict(opts),
            "skipped_variants": skipped,
            "timeline_config": dataclasses.asdict(timeline_problem),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_s": time.perf_counter() - start,
            "definitions": _DEFINITIONS,
        },
        "variants": {v.name: v.description for v in variants},
        "configs": configs,
    }


_DEFINITIONS = {
    "time_s": "median over repeats of the slowest rank's fwd+bwd wall time per step (a sample averages "
    "steps_per_sample back-to-back steps); variants interleaved per repeat",
    "host_s_per_step": "fwd+bwd time with zero-cost attention kernels / 2C ring steps, slowest rank",
    "parallel_efficiency": "single-device time / (C * time)",
    "time_ratio_vs": "time / that torch ring variant's time (< 1: faster)",
    "peak_q_units": "peak RSS (or CUDA allocator) growth during one fwd+bwd, max over ranks, / bytes of one local q",
    "bytes_per_rank": "payload bytes arriving at one rank from others in one fwd+bwd",
    "comm_hidden_fraction": "1 - (time in comm issue+wait calls) / (same, compute replaced by stand-ins); "
    "mean over ranks",
    "gflops_per_rank": "12*B*H*S^2*D (x0.5 causal) / C / time",
}
