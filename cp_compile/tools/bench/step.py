"""``python -m cp_compile step``: a Hugging Face training step under CP against one process, by sequence length.

A Llama (random weights, the same in every process) takes compiled training
steps (forward, loss, backward) on one sequence of each length: on one process
("sdpa", one thread, compiled with the same inner backend) and on C local gloo
ranks ("cp_compile", ``plan.backend()``, one thread each), where the step
also sums the gradients over the ranks in one all-reduce (as DDP's buckets do).
Reported per length: ms per step on each side, their ratio, the relative
difference of the losses (exit 1 above ``--tol``), and the CP step
taken apart from a profile (``cp_compile.tools.breakdown``: compute, collectives with
their count, the rest) next to one process's. The floor is what CP cannot
avoid: one process's step on 1/C of the tokens plus the CP step's own
collectives (recorded from a profile, then replayed back to back with the same
shapes on the ranks); it is left out where a collective cannot be replayed
from its name and shapes (the ring's sends). ``--plot`` draws step time
against length and marks where CP starts to pay. The sequence dimension is
dynamic on both sides, so each side compiles once or twice for every length.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ...torch_compat import all_gather_single, reduce_scatter_single
from ..breakdown import collectives_issued, wall_time
from ..generate import add_size_arguments, comma_ints, config_sizes, mark_crossover, pyplot, report
from ..launch import RankPool


def _model(args, attn: str):
    import transformers

    config = transformers.LlamaConfig(**config_sizes(args, max(args.lengths)))
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn)


def _batch(args, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(length))
    return ids, torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)  # labels: shifted on the whole sequence


def _steps_for(args, length: int) -> int:
    """Timed steps at ``length``: fewer where one step takes seconds."""
    return max(2, min(args.steps, args.steps * 2048 // length))


def _median_ms(args, step, length: int, barrier=None) -> float:
    """Median ms per step of ``step`` after ``args.warmup`` steps (compilation among them)."""
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(_steps_for(args, length)):
        if barrier is not None:  # the ranks start each timed step together
            barrier()
        times.append(wall_time(step))
    return 1e3 * statistics.median(times)


def _timed(args, step, length: int, barrier=None) -> tuple[float, dict]:
    """(median ms per step, breakdown) of ``step`` (``_median_ms``, then a profile of as many steps)."""
    from ..breakdown import breakdown

    ms, steps = _median_ms(args, step, length, barrier), _steps_for(args, length)

    def prepare():
        if barrier is not None:
            barrier()
        return lambda: [step() for _ in range(steps)]

    return ms, breakdown(prepare, steps)


def one_process(args) -> dict:
    torch.set_num_threads(1)
    model = _model(args, "sdpa")
    compiled = torch.compile(model, backend=args.inner, fullgraph=True)

    def step_on(ids, labels):
        def step():
            loss = compiled(ids, use_cache=False, labels=labels, shift_labels=labels).loss
            loss.backward()
            model.zero_grad()
            return loss.detach()

        return step

    runs = {}
    for length in args.lengths:
        ids, labels = _batch(args, length)
        for t in (ids, labels):
            torch._dynamo.mark_dynamic(t, 1)
        step = step_on(ids, labels)
        ms, costs = _timed(args, step, length)
        share = length // args.world_size  # the floor's compute: this process's step on one rank's share
        runs[length] = dict(
            ms=ms,
            costs=costs,
            share_ms=_median_ms(args, step_on(ids[:, :share], labels[:, :share]), length),
            loss=step().item(),
        )
    return runs


def _replay(issued: list[tuple[str, list]], grads_numel: int) -> Callable[[], None] | None:
    """The collectives one CP step issued (``breakdown.collectives_issued``) on tensors of their shapes, as one
    function; None where one cannot be rebuilt from its name and shapes."""
    import torch.distributed as dist

    world_size, calls = dist.get_world_size(), []
    for name, shapes in issued:
        if name == "_c10d_functional::all_gather_into_tensor":  # (input, group size, group name)
            x = torch.zeros(shapes[0])
            calls.append(partial(all_gather_single, x.new_empty((world_size * x.shape[0], *x.shape[1:])), x))
        elif name == "_c10d_functional::reduce_scatter_tensor":  # (input, op, group size, group name)
            x = torch.zeros(shapes[0])
            calls.append(partial(reduce_scatter_single, x.new_empty((x.shape[0] // world_size, *x.shape[1:])), x))
        elif name == "c10d::_allgather_base_":  # the agreement: (output, input, ...)
            calls.append(partial(all_gather_single, torch.zeros(shapes[0]), torch.zeros(shapes[1])))
        elif name == "c10d::allreduce_":  # the step's gradient all-reduce; the profile records no shapes for it
            calls.append(partial(dist.all_reduce, torch.zeros(grads_numel)))
        else:
            return None
    return lambda: [call() for call in calls]


def cp_ranks(args, schedule: str) -> dict:
    import torch.distributed as dist

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers attn_implementation="cp_compile")

    torch.set_num_threads(1)
    plan = cp_compile.ContextParallel(schedule=schedule, calibrate=args.calibrate)
    model = _model(args, "cp_compile")
    backend = plan.backend(args.inner)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    runs = {}
    for length in args.lengths:
        ids, labels = _batch(args, length)
        local_ids, local_labels, positions = plan.shard(ids, 1), plan.shard(labels, 1), plan.positions(length)[None]
        items = (labels != -100).sum()

        def step():
            with plan:
                loss = compiled(
                    local_ids,
                    position_ids=positions,
                    use_cache=False,
                    labels=local_labels,
                    shift_labels=local_labels,
                    num_items_in_batch=items,
                ).loss
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)  # each rank's gradient is its share of the one-process gradient
            for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(summed.view_as(g))
            model.zero_grad()
            return loss.detach()

        total = step()
        dist.all_reduce(total)  # the shares summed: the one-process loss (no optimizer step changes the weights)
        ms, costs = _timed(args, step, length, dist.barrier)
        replay = _replay(collectives_issued(step), sum(p.numel() for p in model.parameters()))
        runs[length] = dict(
            ms=ms,
            costs=costs,
            loss=total.item(),
            collectives_ms=None if replay is None else _median_ms(args, replay, length, dist.barrier),
        )
    # what each attention site runs and why (auto: the cost model's pick), over every graph compiled
    runs["sites"] = sorted({f"{site.schedule}: {site.why}" for site in backend.explain().sites})
    return runs


def _rows(args, one: dict, per_schedule: dict) -> list[dict]:
    rows = []
    for length in args.lengths:
        ref = one[length]
        for schedule, per_rank in per_schedule.items():
            cp = max((runs[length] for runs in per_rank), key=lambda run: run["ms"])  # the slowest rank
            replayed = [runs[length]["collectives_ms"] for runs in per_rank]
            floor = None if None in replayed else ref["share_ms"] + max(replayed)
            rows.append(
                dict(
                    C=args.world_size,
                    schedule=schedule,
                    length=length,
                    cp_ms=cp["ms"],
                    one_ms=ref["ms"],
                    ratio=cp["ms"] / ref["ms"],
                    floor_ms=floor,
                    share_ms=ref["share_ms"],
                    collectives_ms=None if floor is None else max(replayed),
                    loss_rel_err=abs(cp["loss"] - ref["loss"]) / abs(ref["loss"]),
                    costs=cp["costs"],
                    one_costs=ref["costs"],
                    sites=per_rank[0]["sites"],
                )
            )
    return rows


def _table(rows: list[dict]) -> str:
    from ..breakdown import format_breakdown

    def fmt(x, spec):
        return format(x, spec) if x is not None else format("-", ">" + spec.split(".")[0])

    lines = [
        f"{'C':>2} {'schedule':>10} {'tokens':>7} {'CP ms':>9} {'one ms':>9} {'CP/one':>7} {'floor ms':>9} "
        f"{'CP/floor':>8} {'floor/one':>9} {'loss diff':>9}"
    ]
    for r in rows:
        floor = r["floor_ms"]
        lines.append(
            f"{r['C']:>2} {r['schedule']:>10} {r['length']:>7} {r['cp_ms']:>9.1f} {r['one_ms']:>9.1f} "
            f"{r['ratio']:>7.2f} {fmt(floor, '9.1f')} {fmt(floor and r['cp_ms'] / floor, '8.2f')} "
            f"{fmt(floor and floor / r['one_ms'], '9.2f')} {r['loss_rel_err']:>9.1e}"
        )
    for schedule, sites in dict.fromkeys((r["schedule"], tuple(r["sites"])) for r in rows):
        lines += [f"{schedule}: {site}" for site in sites]
    lines += [
        "floor = one process on 1/C of the tokens + the CP step's collectives back to back:",
        *(
            f"  {r['schedule']} {r['length']}: {r['share_ms']:.2f} + {r['collectives_ms']:.2f} ms"
            for r in rows
            if r["floor_ms"] is not None
        ),
        "per step, from a profile (CP: the slowest rank):",
        *(
            f"  {r['schedule']} {r['length']}: CP {format_breakdown(r['costs'])}; one process "
            f"{format_breakdown(r['one_costs'])}"
            for r in rows
        ),
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    lengths = sorted({r["length"] for r in rows})
    first = [next(r for r in rows if r["length"] == n) for n in lengths]
    ax.plot(lengths, [r["one_ms"] for r in first], "k--o", label="one process")
    for schedule in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == schedule]
        xs, cp_ms = [r["length"] for r in mine], [r["cp_ms"] for r in mine]
        (line,) = ax.plot(xs, cp_ms, "-o", label=f"CP, C={mine[0]['C']} ({schedule})")
        mark_crossover(ax, xs, cp_ms, [r["one_ms"] for r in mine], line.get_color(), 0.55)
    ax.set(xscale="log", yscale="log", xlabel="sequence tokens", ylabel="ms per training step", title=title)
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", "-C", type=int, default=2)
    p.add_argument("--lengths", "-L", type=comma_ints, default=[256, 2048], help="sequence lengths, comma list")
    p.add_argument(
        "--schedules",
        type=lambda s: s.split(","),
        default=["auto"],
        help="the plan's schedule, comma list (auto, ring, allgather, ...)",
    )
    p.add_argument("--calibrate", action="store_true", help="the plan measures the machine (calibrate=True)")
    add_size_arguments(p, hidden=128, layers=2, heads=4, kv_heads=2, vocab=256)
    p.add_argument("--inner", choices=["inductor", "aot_eager"], default="inductor")
    p.add_argument("--steps", type=int, default=10, help="timed steps at 2048 tokens and below (fewer above)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative loss difference (exit 1 above it)")
    p.add_argument("--out", type=Path, default=None, help="JSON of the rows")
    p.add_argument("--plot", type=Path, default=None, help="PNG: ms per step against sequence length")


def main(args: argparse.Namespace) -> int:
    with RankPool(1, pin=True) as pool:
        one = pool.run(one_process, args, timeout=3600)[0]
    with RankPool(args.world_size, pin=True) as pool:
        per_schedule = {schedule: pool.run(cp_ranks, args, schedule, timeout=3600) for schedule in args.schedules}
    rows = _rows(args, one, per_schedule)
    report(
        rows,
        f"llama, hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, fp32, "
        f"compiled ({args.inner}); forward + loss + backward (+ one gradient all-reduce under CP); one "
        "process = 1 thread, each CP rank 1 thread (gloo)",
        _table(rows),
        args.out,
        args.plot
        and (
            lambda: plot(
                rows,
                args.plot,
                f"training step under CP (llama, hidden {args.hidden}, {args.layers} layers, {args.inner})",
            )
        ),
    )
    return 0 if all(r["loss_rel_err"] < args.tol for r in rows) else 1
