"""``python -m cp_compile demo``: eager ring attention checked against one device.

By default it starts C local ranks with gloo on CPU. Under ``torchrun`` it
joins the launched group instead (NCCL when CUDA is available).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from .launch import RankPool
from .memory import PeakMemory

MiB = 2**20


def demo_rank(batch, heads, kv_heads, seq_len, head_dim, dtype_name, causal, steps, device_type):
    """Runs on every rank; returns timings, errors and memory of this rank."""
    import torch.distributed as dist

    import cp_compile

    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    plan = cp_compile.ContextParallel()
    g = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (batch, heads, seq_len, head_dim), (batch, kv_heads, seq_len, head_dim)
    q, do = (torch.randn(shape_q, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=g).to(device, dtype) for _ in range(2))
    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    do_local = plan.shard(do, 2)

    def step():
        for t in leaves:
            t.grad = None
        out = cp_compile.ring_attention(*leaves, is_causal=causal, enable_gqa=heads != kv_heads)
        out.backward(do_local)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    step()  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        with PeakMemory(device) as mem:
            out = step()
        times.append(time.perf_counter() - start)

    # single-device reference in fp64, on this rank, sharded like the CP result
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=causal, enable_gqa=heads != kv_heads)
    ref.backward(do.double())
    pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
    err = max((a.double() - plan.shard(b.detach(), 2)).abs().max().item() for a, b in pairs)
    q_local_bytes = leaves[0].numel() * leaves[0].element_size()
    return {
        "rank": plan.rank, "step_s": statistics.median(times), "max_err": err,
        "peak_bytes": mem.peak_bytes, "q_local_bytes": q_local_bytes,
    }


def _table(rows: list[dict], args) -> str:
    tokens = args.batch * args.seq_len
    lines = [
        f"ring attention, C={len(rows)}, B={args.batch} H={args.heads}/{args.kv_heads} S={args.seq_len} "
        f"D={args.head_dim} {args.dtype} {'causal' if args.causal else 'full'}; fwd+bwd, median of {args.steps}",
        f"{'rank':>4} {'step (s)':>9} {'tokens/s':>10} {'max err vs fp64':>16} {'peak MiB':>9} {'peak / local q':>15}",
    ]
    for r in rows:
        lines.append(
            f"{r['rank']:>4} {r['step_s']:>9.3f} {tokens / r['step_s']:>10.0f} {r['max_err']:>16.2e} "
            f"{r['peak_bytes'] / MiB:>9.1f} {r['peak_bytes'] / r['q_local_bytes']:>15.1f}"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", "-C", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="fewer for GQA (default: --heads)")
    p.add_argument("--seq-len", type=int, default=4096, help="global sequence length")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads-per-rank", type=int, default=1)


def main(args: argparse.Namespace) -> int:
    args.kv_heads = args.kv_heads or args.heads
    config = (args.batch, args.heads, args.kv_heads, args.seq_len, args.head_dim, args.dtype, args.causal, args.steps)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun
        import torch.distributed as dist

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        row = demo_rank(*config, "cuda" if cuda else "cpu")
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            print(_table(rows, args))
        dist.destroy_process_group()
        return 0
    print(f"starting {args.world_size} local ranks (gloo, CPU, {args.threads_per_rank} thread each)...", flush=True)
    with RankPool(args.world_size, threads_per_rank=args.threads_per_rank) as pool:
        print(f"running {args.steps} timed fwd+bwd steps on every rank...", flush=True)
        rows = pool.run(demo_rank, *config, "cpu", timeout=1800)
    print(_table(rows, args))
    tolerance = 1e-9 if args.dtype == "float64" else (1e-4 if args.dtype == "float32" else 5e-2)
    worst = max(r["max_err"] for r in rows)
    print(f"{'OK' if worst <= tolerance else 'MISMATCH'}: max error {worst:.2e} (tolerance {tolerance:g})")
    return 0 if worst <= tolerance else 1
