"""``python -m cp_compile bench --device cuda``: the ring's decomposition on one device.

CP can be no faster than the attention kernels one rank runs. This benchmark
takes the ring apart on a single device: for each of C *virtual* ranks it runs
exactly the step kernels that rank runs in a zigzag ring (each step's section of
the tile, the fp32 merge in forward, the dQ and travelling dK/dV accumulation in
backward, the backward's head halves) on that rank's shards, with no transfers,
and compares the slowest rank with single-device SDPA on the whole sequence
divided by C:

efficiency      (single-device time / C) / slowest virtual rank's time. 1.0 means
                splitting attention into ring steps costs nothing; ring-flash-
                attention's published zigzag reaches 0.85 (fwd) / 0.90 (fwd+bwd)
                of C x one GPU including communication.
TFLOP/s/rank    model FLOPs of the whole attention (fwd 4*B*H*S^2*D, bwd twice
                that, halved when causal) / C / the slowest rank's time.
peak            allocator peak of one virtual rank's fwd+bwd above what it held
                before (its shards and every rank's K/V), GiB and local-q units.
device ms/step  slowest rank's fwd+bwd time / 2C ring steps.
host ms/step    the same rank's fwd+bwd issued with zero-cost attention kernels
                (zeros of the right shapes), host wall time / 2C: what the host
                needs to issue one step. While it stays below the device time of
                a step, the host runs ahead of the device.

Device time is taken with CUDA events on a GPU, wall time on CPU (where the
benchmark runs as a smoke test at small sizes). The real ring with overlap on
several GPUs is ``torchrun --nproc-per-node N -m cp_compile bench`` (NCCL), the
multi-rank driver in ``cp_compile.tools.bench``; it runs these same step kernels.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...comm.ring import TAG_KV
from ...kinds.sdpa import ring_section, section_attn, section_attn_backward
from ...layout import Zigzag
from ...schedules.ring import ring_pass_backward, ring_pass_forward
from ..breakdown import wall_time
from ..memory import PeakMemory
from .builtin import _stub_our_kernels
from .core import _sync
from .variants import DTYPES, Problem

CUDA_DEFAULTS = dict(
    world_sizes=(2, 4, 8), seq_lens=(8192, 32768, 131072), batch=1, heads=32, head_dim=128, dtype="bfloat16"
)


@contextlib.contextmanager
def _clock(device: torch.device, box: list):
    """Elapsed seconds of a region, appended to ``box``: CUDA events on a GPU, wall time elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        end.synchronize()
        box.append(start.elapsed_time(end) / 1e3)
    else:
        t0 = time.perf_counter()
        yield
        box.append(time.perf_counter() - t0)


def _sections(world: int, rank: int, causal: bool) -> list[str]:
    return [ring_section(causal, "zigzag", rank, (rank - step) % world) for step in range(world)]


class _VirtualHops:
    """A virtual rank's ring without transfers: the K/V of the next step come from every rank's
    blocks; the travelling dK/dV stay where they are (the same additions, no hop)."""

    def __init__(self, kv: list[tuple[Tensor, Tensor]], rank: int):
        self.kv, self.rank, self.step = kv, rank, 0

    def first(self, tensors):
        return list(tensors)

    def shift(self, tensors, tag):
        if tag != TAG_KV:
            return tensors
        self.step += 1
        return list(self.kv[(self.rank - self.step) % len(self.kv)])

    def wait(self, received, sent):
        return received


def rank_forward(
    q: Tensor, kv: list[tuple[Tensor, Tensor]], rank: int, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Virtual rank ``rank``'s ring forward (``schedules.ring.ring_pass_forward``): each step's
    section against the K/V that arrives at that step, merged into the fp32 accumulator."""
    sections = _sections(len(kv), rank, causal)
    out, lse = ring_pass_forward(
        q,
        *kv[rank],
        lambda step, k, v: section_attn(q, k, v, sections[step], scale),
        world_size=len(kv),
        hops=_VirtualHops(kv, rank),
    )
    return out.to(q.dtype), lse


def rank_backward(
    do: Tensor,
    q: Tensor,
    kv: list[tuple[Tensor, Tensor]],
    out: Tensor,
    lse: Tensor,
    rank: int,
    causal: bool,
    scale: float,
) -> tuple[Tensor, list[Tensor]]:
    """Virtual rank ``rank``'s ring backward (``schedules.ring.ring_pass_backward``): steps after
    the first in head halves, dQ and the travelling dK/dV accumulated in fp32. Returns dq and the
    last dK/dV accumulator (which, on a real ring, holds other ranks' contributions too)."""
    sections = _sections(len(kv), rank, causal)
    dq, dk, dv = ring_pass_backward(
        q,
        *kv[rank],
        lambda step, k, v, do, q, out, lse, dlse: section_attn_backward(
            do, q, k, v, out, lse, dlse, sections[step], scale
        ),
        world_size=len(kv),
        hops=_VirtualHops(kv, rank),
        q_side=(do, q, out, lse, None),
        split_heads=True,
    )
    return dq, [dk, dv]


def rank_step(
    q: Tensor, kv: list[tuple[Tensor, Tensor]], do: Tensor, rank: int, causal: bool, scale: float
) -> Callable[[], None]:
    """Virtual rank ``rank``'s ring fwd+bwd compute, in the order the ring runs it, without transfers."""

    def step():
        out, lse = rank_forward(q, kv, rank, causal, scale)
        rank_backward(do, q, kv, out, lse, rank, causal, scale)

    return step


def single_step(q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool) -> Callable[[], None]:
    """Single-device SDPA fwd+bwd on the whole sequence (the flash kernel where the device has it)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def step():
        backends = [torch.nn.attention.SDPBackend.FLASH_ATTENTION]
        if q.device.type != "cuda":
            backends.append(torch.nn.attention.SDPBackend.MATH)
        with torch.nn.attention.sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        out.backward(do)
        for t in leaves:
            t.grad = None

    return step


def _median_time(step: Callable[[], None], device: torch.device, repeats: int, warmup: int) -> float:
    """Median device time of ``step`` after ``warmup`` untimed runs."""
    for _ in range(warmup):
        step()
    times: list[float] = []
    for _ in range(repeats):
        with _clock(device, times):
            step()
    return statistics.median(times)


def _host_time(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Host wall time to issue ``step`` (the device is drained first, not after)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        times.append(wall_time(step))
    _sync(device)
    return statistics.median(times)


def measure(
    p: Problem, device: torch.device, repeats: int = 5, warmup: int = 2, single_s: Optional[float] = None
) -> dict:
    """One configuration's row; ``single_s``: the single-device time of this sequence and mask, when another C
    already measured it (it does not depend on C)."""
    g = torch.Generator().manual_seed(0)
    shape = (p.batch, p.heads, p.seq_len, p.head_dim)
    q, k, v, do = (torch.randn(shape, generator=g).to(device, DTYPES[p.dtype]) for _ in range(4))
    scale = 1.0 / math.sqrt(p.head_dim)
    if single_s is None:
        single_s = _median_time(single_step(q, k, v, do, p.causal), device, repeats, warmup)

    shard = lambda t, r: Zigzag().shard(t, 2, r, p.world_size)  # noqa: E731
    kv = [(shard(k, r), shard(v, r)) for r in range(p.world_size)]
    del k, v
    per_rank = []
    for r in range(p.world_size):
        step = rank_step(shard(q, r), kv, shard(do, r), r, p.causal, scale)
        seconds = _median_time(step, device, repeats, warmup)
        with PeakMemory(device) as mem:
            step()
        with _stub_our_kernels():
            step()
            host_s = _host_time(step, device, repeats)
        per_rank.append({"rank": r, "time_s": seconds, "peak_bytes": mem.peak_bytes, "host_s": host_s})
    slowest = max(per_rank, key=lambda e: e["time_s"])
    q_local_bytes = q.numel() // p.world_size * q.element_size()
    steps = 2 * p.world_size
    return {
        "config": asdict(p),
        "single_s": single_s,
        "rank_time_s": slowest["time_s"],
        "per_rank": per_rank,
        "efficiency": single_s / p.world_size / slowest["time_s"],
        "tflops_per_rank": p.flops / p.world_size / slowest["time_s"] / 1e12,
        "single_tflops": p.flops / single_s / 1e12,
        "peak_gib": max(e["peak_bytes"] for e in per_rank) / 2**30,
        "peak_q_units": max(e["peak_bytes"] for e in per_rank) / q_local_bytes,
        "device_ms_per_step": slowest["time_s"] / steps * 1e3,
        "host_ms_per_step": max(e["host_s"] for e in per_rank) / steps * 1e3,
    }


def table(rows: list[dict]) -> str:
    head = (
        f"{'config':<24} {'single/C ms':>11} {'rank ms':>9} {'eff':>5} {'TF/s/rank':>9} {'single TF/s':>11} "
        f"{'peak GiB':>8} {'peak q':>6} {'dev ms/step':>11} {'host ms/step':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        p = Problem(**r["config"])
        if "skipped" in r:
            lines.append(f"{p.label():<24} {r['skipped']}")
            continue
        lines.append(
            f"{p.label():<24} {r['single_s'] / p.world_size * 1e3:11.2f} {r['rank_time_s'] * 1e3:9.2f} "
            f"{r['efficiency']:5.2f} {r['tflops_per_rank']:9.1f} {r['single_tflops']:11.1f} {r['peak_gib']:8.2f} "
            f"{r['peak_q_units']:6.1f} {r['device_ms_per_step']:11.2f} {r['host_ms_per_step']:12.3f}"
        )
    return "\n".join(lines)


def run(
    device: torch.device,
    world_sizes,
    seq_lens,
    causal,
    batch: int,
    heads: int,
    head_dim: int,
    dtype: str,
    repeats: int,
    out: Optional[Path],
    log: Callable[[str], None] = print,
    warmup: int = 2,
    deadline: Optional[float] = None,
) -> list[dict]:
    """A row per configuration, shortest sequences first; with a ``deadline`` (``time.monotonic()``), a
    configuration its predecessors say would end after it is left out (rows with ``skipped``: the reason)."""
    rows = []
    problems = [Problem(batch, heads, head_dim, s, c, m, dtype) for m in causal for s in seq_lens for c in world_sizes]
    bad = [p.label() for p in problems if p.seq_len % (2 * p.world_size)]
    if bad:
        raise ValueError(f"S must split into 2C zigzag chunks: {bad}")
    log(
        f"ring decomposition on one {device.type} device: {len(problems)} configurations, B={batch} H={heads} "
        f"D={head_dim} {dtype}, {repeats} repeats (median)"
    )
    single_times: dict[tuple, float] = {}
    took: dict[int, float] = {}  # sequence length -> seconds of its latest configuration
    for i, p in enumerate(problems, 1):
        if deadline is not None:
            left, expected = deadline - time.monotonic(), _expected_seconds(p.seq_len, took)
            if expected > left:
                reason = f"not run: about {expected:.0f} s expected, {max(left, 0):.0f} s left"
                rows.append({"config": asdict(p), "skipped": reason})
                log(f"[{i}/{len(problems)}] {p.label():<22} {reason}")
                continue
        start = time.monotonic()
        single_key = (p.seq_len, p.causal)
        row = measure(p, device, repeats, warmup, single_times.get(single_key))
        single_times[single_key] = row["single_s"]
        took[p.seq_len] = time.monotonic() - start
        rows.append(row)
        log(
            f"[{i}/{len(problems)}] {p.label():<22} efficiency {row['efficiency']:.2f}, "
            f"{row['tflops_per_rank']:.1f} TFLOP/s per rank, host {row['host_ms_per_step']:.3f} ms/step "
            f"vs device {row['device_ms_per_step']:.2f} ms/step"
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if out is not None:
        meta = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "configs": rows}, indent=1))
    return rows


def _expected_seconds(seq_len: int, took: dict[int, float]) -> float:
    """A configuration's time from the latest one measured at this length or, for a longer sequence, from the
    longest shorter one, scaled by the square of the lengths (attention's work); 0 before any."""
    if seq_len in took:
        return took[seq_len]
    shorter = [s for s in took if s < seq_len]
    return took[max(shorter)] * (seq_len / max(shorter)) ** 2 if shorter else 0.0
