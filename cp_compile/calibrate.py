"""Measure the machine the cost model assumes: attention FLOP rate, link bandwidth and latency.

``calibrate(plan)`` runs for well under a second on every rank of the plan's
group (a collective: call it on every rank). Each rank times one attention
kernel and ring transfers of a small and a large message; the times are then
all-reduced with MAX, so every rank ends up with the same ``Machine`` (the
slowest rank's), and the schedule choice stays identical on every rank.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .cost.model import Machine, default_machine


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(plan, device=None, small: int = 1 << 10, large: int = 1 << 22, repeats: int = 3) -> Machine:
    """A ``Machine`` measured on ``plan``'s group: the same on every rank."""
    from .comm.ring import wait
    from .kernels.block import block_attn_impl

    device = torch.device(
        device or ("cuda" if torch.cuda.is_available() and dist.get_backend(plan.group) == "nccl" else "cpu")
    )
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    b, h, s, d = 1, 4, 512, 64
    q = torch.randn(b, h, s, d, device=device, dtype=dtype)
    flops = 4.0 * b * h * s * s * d

    def attend():
        block_attn_impl(q, q, q, "none", d**-0.5)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def shift(nbytes):
        buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

        def run():
            wait(torch.ops.cp.ring_shift([buf], plan.group_name, 1, 7), sent=[buf])
            if device.type == "cuda":
                torch.cuda.synchronize()

        return run

    times = [_best_of(attend, repeats)]
    if plan.world_size > 1:
        times += [_best_of(shift(small), repeats), _best_of(shift(large), repeats)]
    measured = torch.tensor(
        times, dtype=torch.float64, device=device if dist.get_backend(plan.group) == "nccl" else "cpu"
    )
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=plan.group)
    t_attn, *t_shift = measured.tolist()
    base = default_machine(device.type)
    if not t_shift:
        return Machine(
            device.type,
            flops=flops / t_attn,
            bandwidth=base.bandwidth,
            latency=base.latency,
            kernel_overhead=base.kernel_overhead,
            source="calibrated (compute only: C=1)",
        )
    t_small, t_large = t_shift
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bandwidth, 1e-7) / 2  # a shift is one send and one receive
    return Machine(
        device.type,
        flops=flops / t_attn,
        bandwidth=bandwidth,
        latency=latency,
        kernel_overhead=base.kernel_overhead,
        source="calibrated",
    )
