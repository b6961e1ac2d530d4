"""The report (table, JSON and PNG) and the command line of ``python -m cp_compile bench``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from ..generate import add_size_arguments, pyplot
from ..launch import LocalPools, launched_by_torchrun, torchrun_group, torchrun_runner
from .core import TINY, BenchOptions, run_benchmark
from .variants import DTYPES, OURS, SINGLE, TORCH_A2A, TORCH_AG, VARIANTS, Problem, load_plugins

# ----------------------------------------------------------------------------
# Report: table and figure.
# ----------------------------------------------------------------------------


def table(results: dict) -> str:
    head = (
        f"{'config':<22} {'variant':<24} {'time s':>8} {'eff':>5} {'/a2a':>5} {'/ag':>5} "
        f"{'peak q':>7} {'MiB/rank':>9} {'hidden':>7} {'GF/s/r':>7} {'host ms/step':>12}"
    )
    lines = [head, "-" * len(head)]
    fmt = lambda v, f, unit=1: "-" if v is None else format(v * unit, f)  # noqa: E731
    for cfg in results["configs"]:
        p = Problem(**cfg["config"])
        for name, e in cfg["variants"].items():
            if not e["valid"]:
                lines.append(f"{p.label():<22} {name:<24} INVALID: max rel err {e['max_rel_err']:.2e}")
                continue
            lines.append(
                f"{p.label():<22} {name:<24} {fmt(e.get('time_s'), '8.3f')} "
                f"{fmt(e.get('parallel_efficiency'), '5.2f')} {fmt(e.get(f'time_ratio_vs {TORCH_A2A}'), '5.2f')} "
                f"{fmt(e.get(f'time_ratio_vs {TORCH_AG}'), '5.2f')} {fmt(e.get('peak_q_units'), '7.1f')} "
                f"{fmt(e.get('bytes_per_rank'), '9.1f', 2**-20)} {fmt(e.get('comm_hidden_fraction'), '7.2f')} "
                f"{fmt(e.get('gflops_per_rank'), '7.1f')} "
                f"{fmt(e.get('host_s_per_step'), '12.2f', 1e3)}"
            )
        for name, extra in cfg.get("extras", {}).items():
            if extra and extra.get("line"):
                lines.append(f"{p.label():<22} {name}: {extra['line']}")
    return "\n".join(lines)


_COLORS = {
    OURS: "tab:blue",
    TORCH_A2A: "tab:orange",
    TORCH_AG: "tab:green",
    SINGLE: "black",
    "ours compiled": "tab:purple",
}
_SPAN_STYLE = {
    "compute": ("tab:blue", "attention"),
    "merge": ("tab:purple", "merge"),
    "other": ("0.7", "other ops"),
    "wait": ("tab:red", "blocked in wait/issue"),
}


def plot(results: dict, path: Path) -> None:
    plt = pyplot()

    configs = results["configs"]
    causal_values = sorted({c["config"]["causal"] for c in configs}, reverse=True)
    seq_lens = sorted({c["config"]["seq_len"] for c in configs})
    markers = "osD^v<>"
    spare = iter(["tab:cyan", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:gray"])
    colors = {name: _COLORS.get(name) or next(spare, None) for name in results["variants"]}
    timeline = _has_timeline(results)
    fig = plt.figure(figsize=(13, 11 if timeline else 7.5), constrained_layout=True)
    grid = fig.add_gridspec(3 if timeline else 2, len(causal_values))
    for col, causal in enumerate(causal_values):
        ax_t, ax_m = fig.add_subplot(grid[0, col]), fig.add_subplot(grid[1, col])
        for name in results["variants"]:
            for si, s in enumerate(seq_lens):
                pts = sorted(
                    (
                        (c["config"]["world_size"], c["variants"][name])
                        for c in configs
                        if c["config"]["causal"] == causal and c["config"]["seq_len"] == s and name in c["variants"]
                        if c["variants"][name].get("time_s") is not None
                    ),
                    key=lambda t: t[0],
                )
                if not pts:
                    continue
                style = dict(
                    color=colors[name],
                    marker=markers[si % len(markers)],
                    linestyle="--" if name == SINGLE else "-",
                    label=f"{name}, S={s}",
                )
                ax_t.plot([w for w, _ in pts], [e["time_s"] for _, e in pts], **style)
                if name != SINGLE:
                    ax_m.plot([w for w, _ in pts], [e["peak_q_units"] for _, e in pts], **style)
        mask = "causal" if causal else "non-causal"
        ax_t.set(title=f"fwd+bwd time, {mask}", xlabel="C (ranks)", ylabel="seconds (median)", yscale="log")
        ax_m.set(title=f"peak memory growth, {mask}", xlabel="C (ranks)", ylabel="local q units")
        for ax in (ax_t, ax_m):
            ax.set_xticks(sorted({c["config"]["world_size"] for c in configs}))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    if timeline:
        _plot_timeline(fig.add_subplot(grid[2, :]), results)
    fig.suptitle(
        f"cp_compile bench: B={configs[0]['config']['batch']} H={configs[0]['config']['heads']} "
        f"D={configs[0]['config']['head_dim']} {configs[0]['config']['dtype']}, "
        f"{results['meta']['device']}, {results['meta']['threads_per_rank']} thread/rank"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _has_timeline(results: dict) -> bool:
    return any("timeline" in c["variants"].get(OURS, {}) for c in results["configs"])


def _plot_timeline(ax, results: dict) -> None:
    tl_cfg = results["meta"].get("timeline_config")
    found = next(
        (
            cfg["variants"][OURS]["timeline"]
            for cfg in results["configs"]
            if cfg["config"] == tl_cfg and "timeline" in cfg["variants"].get(OURS, {})
        ),
        None,
    )
    if not found:
        ax.text(0.5, 0.5, "no timeline recorded", ha="center", va="center")
        ax.set_axis_off()
        return
    origin = min(e["t0"] for events in found if events for e in events)
    used = set()
    for rank, events in enumerate(found):
        y = len(found) - 1 - rank
        issued = {}
        for e in events:
            t0, t1 = e["t0"] - origin, e["t1"] - origin
            if e["class"] == "comm":
                issued[e["id"]] = t0
            lane = "wait" if e["class"] in ("wait", "comm") else e["class"]
            color, label = _SPAN_STYLE[lane]
            ax.broken_barh(
                [(t0, max(t1 - t0, 1e-5))], (y - 0.35, 0.5), color=color, label=None if lane in used else label
            )
            used.add(lane)
        ends: dict[int, float] = {}
        for e in events:
            if e["class"] == "wait" and e.get("id", -1) in issued:
                ends[e["id"]] = max(ends.get(e["id"], 0.0), e["t1"] - origin)
        ax.broken_barh(
            [(issued[i], end - issued[i]) for i, end in ends.items()],
            (y + 0.2, 0.15),
            color="tab:orange",
            alpha=0.6,
            label=None if "inflight" in used else "transfer in flight (issue to wait done)",
        )
        used.add("inflight")
    ax.set_yticks(range(len(found)), [f"rank {r}" for r in reversed(range(len(found)))])
    ax.set(
        xlabel="seconds (instrumented re-run; fwd then bwd)",
        title=f"ours eager, per-rank timeline: {'causal' if tl_cfg['causal'] else 'non-causal'} "
        f"C={tl_cfg['world_size']} S={tl_cfg['seq_len']}",
    )
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=4)


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------


_MASKS = {"both": (True, False), "causal": (True,), "full": (False,)}  # --mask: the causal values run


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchOptions()
    p.add_argument("--world-sizes", "-C", type=_ints, default=d.world_sizes, help="comma list (default 1,2,4)")
    p.add_argument(
        "--seq-lens", "-S", type=_ints, default=d.seq_lens, help="global tokens, comma list (default 2048,4096,8192)"
    )
    add_size_arguments(p, batch=d.batch, heads=d.heads, head_dim=d.head_dim)
    p.add_argument("--dtype", default=d.dtype, choices=list(DTYPES))
    p.add_argument("--mask", choices=list(_MASKS), default="both")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--variants", default=None, help="comma list of variant names (default: all registered)")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module that registers more variants (repeatable)",
    )
    p.add_argument("--no-trace", dest="trace", action="store_false", help="skip the comm-overlap re-runs")
    p.add_argument(
        "--trace-repeats",
        type=int,
        default=d.trace_repeats,
        help="instrumented (real, comm-only) run pairs per variant; medians are reported",
    )
    p.add_argument(
        "--min-sample-ms",
        type=float,
        default=d.min_sample_ms,
        help="a timing sample averages back-to-back steps until it lasts this long (default 50)",
    )
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke configuration")
    p.add_argument(
        "--out", type=Path, default=Path("bench_out/results.json"), help="JSON path; the PNG goes next to it"
    )
    p.add_argument("--list", action="store_true", help="list registered variants and exit")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda (without torchrun): the ring's decomposition on one GPU, C virtual ranks "
        "(cp_compile.tools.bench.virtual); under torchrun: the launched ranks' device",
    )
    p.add_argument(
        "--virtual",
        action="store_true",
        help="C virtual ranks on one device (implied by --device cuda outside torchrun)",
    )


def options_from_args(args: argparse.Namespace, device: str = "cpu") -> BenchOptions:
    opts = BenchOptions(
        world_sizes=args.world_sizes,
        seq_lens=args.seq_lens,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        repeats=args.repeats,
        trace=args.trace,
        trace_repeats=args.trace_repeats,
        min_sample_ms=args.min_sample_ms,
        causal=_MASKS[args.mask],
        variants=tuple(v.strip() for v in args.variants.split(",")) if args.variants else None,
        device=device,
    )
    return dataclasses.replace(opts, **TINY) if args.tiny else opts


def plot_timeline(results: dict, path: Path) -> None:
    """The per-rank timeline alone (one ring of "ours eager"), when one was recorded."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(12, 2.6), constrained_layout=True)
    _plot_timeline(ax, results)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out: Path) -> Path:
    """The JSON at ``out``, the figure next to it, and ``<out>_timeline.png`` when a timeline was recorded."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    png = out.with_suffix(".png")
    plot(results, png)
    if _has_timeline(results):
        plot_timeline(results, out.with_name(out.stem + "_timeline.png"))
    return png


def _main_virtual(args: argparse.Namespace) -> int:
    from . import virtual

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
        return 2
    device = torch.device(args.device)
    defaults = BenchOptions()
    given = {
        a for a in ("world_sizes", "seq_lens", "heads", "head_dim", "dtype") if getattr(args, a) != getattr(defaults, a)
    }
    cfg = {a: getattr(args, a) for a in ("world_sizes", "seq_lens", "batch", "heads", "head_dim", "dtype")}
    if device.type == "cuda" and not args.tiny:  # the GPU defaults unless set on the command line
        cfg.update({a: val for a, val in virtual.CUDA_DEFAULTS.items() if a not in given})
    if args.tiny:
        cfg.update(world_sizes=(2,), seq_lens=(256,), heads=2, head_dim=32)
    print(virtual.table(virtual.run(device, causal=_MASKS[args.mask], repeats=args.repeats, out=args.out, **cfg)))
    print(f"wrote {args.out}")
    return 0


def main(args: argparse.Namespace) -> int:
    load_plugins(args.imports)
    if args.list:
        for name, v in VARIANTS.items():
            print(f"{name:<26} {v.description}")
        return 0
    under_torchrun = launched_by_torchrun()
    if args.virtual or (args.device == "cuda" and not under_torchrun):
        return _main_virtual(args)
    if under_torchrun:  # NCCL on GPUs, gloo on CPU (see the docstring of ``core``)
        import torch.distributed as dist

        # every rank holds the results once they are gathered: the ranks leave the group together, before
        # rank 0 spends seconds on the table and the plot
        with torchrun_group() as cuda:
            import cp_compile  # noqa: F401

            opts = dataclasses.replace(
                options_from_args(args, "cuda" if cuda else "cpu"),
                world_sizes=(dist.get_world_size(),),
                trace=args.trace and not cuda,
            )
            main_rank = dist.get_rank() == 0
            results = run_benchmark(opts, torchrun_runner, log=print if main_rank else (lambda s: None))
        if main_rank:
            print(table(results))
            print(f"wrote {args.out} and {write_outputs(results, args.out)}")
        return 0
    opts = options_from_args(args)
    runner = LocalPools(threads_per_rank=1)
    try:
        results = run_benchmark(opts, runner)
    finally:
        runner.close()
    print(table(results))
    print(f"wrote {args.out} and {write_outputs(results, args.out)}")
    invalid = [(c["config"], n) for c in results["configs"] for n, e in c["variants"].items() if not e["valid"]]
    if invalid:
        print(f"INVALID results (not timed): {invalid}")
        return 1
    return 0
