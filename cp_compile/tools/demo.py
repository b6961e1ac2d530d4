"""``python -m cp_compile demo``: context-parallel training checked against one device.

``--mode train`` (default): a small Llama-style model (RoPE from positions,
RMSNorm, SwiGLU, GQA, causal SDPA), written for one device, trains for a few
steps on C ranks, compiled with the CP backend; each step's loss is checked
against the same model trained in one process.

``--mode attention``: eager ring attention forward and backward on a realistic
shape, checked against single-device attention.

By default it starts C local ranks with gloo on CPU. Under ``torchrun`` it
joins the launched group instead (NCCL when CUDA is available).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from .generate import add_size_arguments
from .launch import RankPool, launched_by_torchrun, torchrun_group, torchrun_runner
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
    return {
        "rank": plan.rank,
        "step_s": statistics.median(times),
        "max_err": max((a.double() - plan.shard(b.detach(), 2)).abs().max().item() for a, b in pairs),
        "peak_bytes": mem.peak_bytes,
        "q_local_bytes": leaves[0].numel() * leaves[0].element_size(),
    }


def _attention_table(rows: list[dict], args) -> str:
    tokens = args.batch * args.seq_len
    lines = [
        f"ring attention, C={len(rows)}, B={args.batch} H={args.heads}/{args.kv_heads} S={args.seq_len} "
        f"D={args.head_dim} {args.dtype} {'causal' if args.causal else 'full'}; fwd+bwd, median of {args.steps}",
        f"{'rank':>4} {'step (s)':>9} {'tokens/s':>10} {'max err vs fp64':>16} {'peak MiB':>9} {'peak / local q':>15}",
    ]
    lines += [
        f"{r['rank']:>4} {r['step_s']:>9.3f} {tokens / r['step_s']:>10.0f} {r['max_err']:>16.2e} "
        f"{r['peak_bytes'] / MiB:>9.1f} {r['peak_bytes'] / r['q_local_bytes']:>15.1f}"
        for r in rows
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Training: a single-device model, compiled with the CP backend.
# ----------------------------------------------------------------------------


def _model_and_data(args):
    from .llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab=args.vocab,
        dim=args.model_dim,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        hidden=2 * args.model_dim,
    )
    model = Llama(cfg).to(getattr(torch, args.dtype))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (args.batch, args.seq_len + 1), generator=gen) for _ in range(args.steps)]
    return model, [(b[:, :-1], b[:, 1:]) for b in batches]


def train_rank(args):
    """Runs on every rank: compiled CP training; returns per-step losses and timings."""
    import torch.distributed as dist

    import cp_compile

    from .llama import token_loss_sum

    plan = cp_compile.ContextParallel()
    model, batches = _model_and_data(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    compiled = torch.compile(model, backend=plan.backend(args.inner), fullgraph=True)
    positions = plan.positions(args.seq_len)
    n_tokens = args.batch * args.seq_len
    losses, times, peak = [], [], 0
    for step, (tokens, labels) in enumerate(batches):
        start = time.perf_counter()
        with PeakMemory() as mem:
            loss = token_loss_sum(compiled(plan.shard(tokens, 1), positions), plan.shard(labels, 1)) / n_tokens
            loss.backward()
            for p in model.parameters():  # CP ranks hold the same weights: sum their gradient shares
                dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        if step:
            peak = max(peak, mem.peak_bytes)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        if plan.rank == 0:
            note = " (includes compilation)" if step == 0 else ""
            print(f"  step {step}: loss {total.item():.6f}, {times[-1]:.2f} s{note}", flush=True)
    return {"rank": plan.rank, "losses": losses, "times": times, "peak_bytes": peak}


def train_reference(args):
    """The same model and data on one process, eager: the losses CP must reproduce."""
    from .llama import token_loss_sum

    torch.set_num_threads(args.threads_per_rank)
    model, batches = _model_and_data(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    positions = torch.arange(args.seq_len)
    losses, times = [], []
    for tokens, labels in batches:
        start = time.perf_counter()
        loss = token_loss_sum(model(tokens, positions), labels) / tokens.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def _train_table(rows, ref_losses, ref_times, args) -> str:
    tokens = args.batch * args.seq_len
    steady = lambda ts: statistics.median(ts[1:]) if len(ts) > 1 else ts[0]  # noqa: E731
    worst = max(abs(a - b) for a, b in zip(rows[0]["losses"], ref_losses))
    lines = [
        f"Llama-style model ({args.layers} layers, dim {args.model_dim}, heads {args.heads}/{args.kv_heads}), "
        f"B={args.batch} S={args.seq_len} {args.dtype}, {args.steps} SGD steps, C={len(rows)}, inner={args.inner}",
        f"{'step':>4} {'loss (CP)':>12} {'loss (1 proc)':>14} {'|diff|':>10}",
    ]
    lines += [
        f"{i:>4} {a:>12.6f} {b:>14.6f} {abs(a - b):>10.2e}"
        for i, (a, b) in enumerate(zip(rows[0]["losses"], ref_losses))
    ]
    lines.append(f"{'rank':>4} {'step (s)':>9} {'tokens/s':>10} {'peak MiB':>9}   (steady state, after compilation)")
    for r in rows:
        t = steady(r["times"])
        lines.append(f"{r['rank']:>4} {t:>9.3f} {tokens / t:>10.0f} {r['peak_bytes'] / MiB:>9.1f}")
    t = steady(ref_times)
    lines += [
        f"{'1 proc':>6} {t:>7.3f} {tokens / t:>10.0f}   (eager, {args.threads_per_rank} thread)",
        f"max loss difference {worst:.2e}",
    ]
    return "\n".join(lines), worst


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["train", "attention"], default="train")
    p.add_argument("--world-size", "-C", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    add_size_arguments(p, batch=1, heads=8)
    p.add_argument("--kv-heads", type=int, default=None, help="fewer for GQA (default: heads/2 in train, heads)")
    p.add_argument("--seq-len", type=int, default=None, help="global sequence length (default 1024 train, 4096)")
    p.add_argument("--head-dim", type=int, default=64, help="attention mode")
    p.add_argument("--model-dim", type=int, default=256, help="train mode")
    p.add_argument("--layers", type=int, default=2, help="train mode")
    p.add_argument("--vocab", type=int, default=1024, help="train mode")
    p.add_argument("--lr", type=float, default=0.1, help="train mode (SGD)")
    p.add_argument("--inner", choices=["inductor", "aot_eager"], default="inductor", help="train mode")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--no-causal", dest="causal", action="store_false", help="attention mode")
    p.add_argument("--steps", type=int, default=None, help="default 5 train, 3 attention")
    p.add_argument("--threads-per-rank", type=int, default=1)


def _run_on_ranks(args, fn, *fn_args):
    """Every rank runs fn: under torchrun in this process, else on a local gloo pool."""
    if launched_by_torchrun():
        import torch.distributed as dist

        with torchrun_group():
            rows = torchrun_runner(dist.get_world_size(), fn, *fn_args)
            rank = dist.get_rank()
        return rows if rank == 0 else None
    print(f"starting {args.world_size} local ranks (gloo, CPU, {args.threads_per_rank} thread each)...", flush=True)
    with RankPool(args.world_size, threads_per_rank=args.threads_per_rank) as pool:
        return pool.run(fn, *fn_args, timeout=3600)


def main(args: argparse.Namespace) -> int:
    train = args.mode == "train"
    args.kv_heads = args.kv_heads or (args.heads // 2 if train else args.heads)
    args.seq_len = args.seq_len or (1024 if train else 4096)
    args.steps = args.steps or (5 if train else 3)
    if train:
        print(f"training {args.steps} steps with CP (compiled, inner={args.inner})...", flush=True)
        rows = _run_on_ranks(args, train_rank, args)
        if rows is None:
            return 0
        print("training the same model in one process...", flush=True)
        ref_losses, ref_times = train_reference(args)
        table, worst = _train_table(rows, ref_losses, ref_times, args)
    else:
        rows = _run_on_ranks(
            args,
            demo_rank,
            args.batch,
            args.heads,
            args.kv_heads,
            args.seq_len,
            args.head_dim,
            args.dtype,
            args.causal,
            args.steps,
            "cuda" if launched_by_torchrun() and torch.cuda.is_available() else "cpu",
        )
        if rows is None:
            return 0
        table, worst = _attention_table(rows, args), max(r["max_err"] for r in rows)
    print(table)
    tolerance = 1e-9 if args.dtype == "float64" else (1e-4 if args.dtype == "float32" else 5e-2)
    ok = worst <= tolerance
    print(f"{'OK' if ok else 'MISMATCH'}: max difference {worst:.2e} (tolerance {tolerance:g})")
    return 0 if ok else 1
