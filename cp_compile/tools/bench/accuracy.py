"""``python -m cp_compile accuracy``: each schedule's error against fp64, as C grows.

The same seeded global q, k, v and output gradient on every rank. The
reference is single-device SDPA in fp64; the yardstick is single-device SDPA
in the low precision (``--dtype``). For each schedule and C, the CP output
and input gradients are computed in that precision from this rank's shards
and gathered, and the report gives

    ratio = max |CP - fp64| / max |single device - fp64|

over out, dq, dk and dv (the project's gate: at most 2), and the fp64 CP
error itself (the gate: about 1e-10). ``--plot`` draws both against C.

``--variant`` measures the attention of other model families instead of plain
(causal) attention: a sliding window, chunked attention (Llama 4), soft-capped
scores (Gemma 2), attention sinks (GPT-OSS) or value heads narrower than
query/key heads (multi-head latent attention). One device then runs SDPA with
the variant's mask, or, for caps and sinks, which no fused kernel takes,
transformers' eager attention (scores in the input dtype, softmax in fp32).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..generate import add_size_arguments, pyplot
from ..launch import RankPool

SCHEDULES = ("ring", "allgather", "ulysses")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the attention of the model families users bring: each a variant of the causal (or not) baseline
VARIANTS = ("plain", "window", "chunk", "softcap", "sinks", "mla")


def _inputs(args, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    dv = args.head_dim // 2 if args.variant == "mla" else args.head_dim  # latent attention: value narrower
    shapes = [
        (1, args.heads, args.seq, args.head_dim),
        (1, args.kv_heads, args.seq, args.head_dim),
        (1, args.kv_heads, args.seq, dv),
        (1, args.heads, args.seq, dv),
    ]
    tensors = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    return tensors, torch.randn(args.heads, generator=g, dtype=torch.float64).to(dtype)  # and the sinks


def _visible(args) -> torch.Tensor:
    i = torch.arange(args.seq)
    visible = i[:, None] >= i[None, :] if args.causal else torch.ones(args.seq, args.seq, dtype=torch.bool)
    if args.variant == "window":
        visible &= i[:, None] - i[None, :] < args.window
    if args.variant == "chunk":
        visible &= i[:, None] // args.chunk == i[None, :] // args.chunk
    return visible


def _single(args, q, k, v, do, sinks) -> list[torch.Tensor]:
    """One device: SDPA (with the variant's mask), or for caps and sinks the eager attention of
    transformers' models (scores in the input dtype, softmax in fp32)."""
    q, k, v, sinks = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    groups = q.shape[1] // k.shape[1]
    if args.variant in ("softcap", "sinks"):
        kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        s = (q @ kr.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if args.variant == "softcap":
            s = torch.tanh(s / args.softcap) * args.softcap
        s = s.masked_fill(~_visible(args), float("-inf"))
        if args.variant == "sinks":
            s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        p = torch.softmax(s if s.dtype == torch.float64 else s.float(), dim=-1).to(q.dtype)
        out = p[..., : args.seq] @ vr
    elif args.variant in ("window", "chunk"):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_visible(args), enable_gqa=True)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=True)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def _cp(plan, args, q, k, v, do, sinks) -> list[torch.Tensor]:
    import cp_compile
    from cp_compile.kernels.merge import fold_sinks

    local = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    if args.variant in ("plain", "mla"):
        out = plan.attention(*local, is_causal=args.causal, enable_gqa=q.shape[1] != k.shape[1])
    else:  # one row as one document of the packed kind, which takes windows, chunks and caps
        rows = [t[0].transpose(0, 1) for t in local]
        out, lse = cp_compile.varlen_attention(
            *rows,
            torch.tensor([0, args.seq], dtype=torch.int32),
            window_size=(args.window - 1 if args.variant == "window" else -1, 0 if args.causal else -1),
            enable_gqa=True,
            schedule=plan.schedule,
            chunk=args.chunk if args.variant == "chunk" else 0,
            softcap=args.softcap if args.variant == "softcap" else 0.0,
            return_lse=True,
        )
        if args.variant == "sinks":
            out = fold_sinks(out, lse, sinks, 1)
        out = out.transpose(0, 1)[None]
    out.backward(plan.shard(do, 2))
    return [plan.unshard(t.detach(), 2) for t in [out] + [x.grad for x in local]]


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want))


def errors_rank(args) -> dict:
    """Runs on every rank of a C-rank group: every schedule's errors in fp64 and in ``args.dtype``."""
    import cp_compile

    exact, low = _inputs(args, torch.float64), _inputs(args, DTYPES[args.dtype])
    reference = _single(args, *exact[0], exact[1])
    single = _worst(_single(args, *low[0], low[1]), reference)
    row = {"single": single}
    for schedule in args.schedules:
        plan = cp_compile.ContextParallel(schedule=schedule)
        row[schedule] = {
            "fp64": _worst(_cp(plan, args, *exact[0], exact[1]), reference),
            "ratio": _worst(_cp(plan, args, *low[0], low[1]), reference) / single,
        }
    return row


def plot(rows: list[dict], args, path: Path) -> None:
    plt = pyplot()

    fig, (ax_ratio, ax_fp64) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    sizes = [r["C"] for r in rows]
    for schedule in args.schedules:
        ax_ratio.plot(sizes, [r[schedule]["ratio"] for r in rows], marker="o", label=schedule)
        ax_fp64.plot(sizes, [max(r[schedule]["fp64"], 1e-18) for r in rows], marker="o", label=schedule)
    ax_ratio.axhline(2.0, color="0.5", linestyle="--", label="gate: 2x one device")
    ax_ratio.set(
        title=f"{args.dtype}: CP error / one-device error (against fp64)",
        xlabel="C (ranks)",
        ylabel="ratio (max over out, dq, dk, dv)",
        ylim=(0, 2.5),
        xticks=sizes,
    )
    ax_fp64.axhline(1e-10, color="0.5", linestyle="--", label="gate: 1e-10")
    ax_fp64.set(
        title="fp64: CP against one device (0 drawn at 1e-18)",
        xlabel="C (ranks)",
        ylabel="max abs error",
        yscale="log",
        xticks=sizes,
    )
    for ax in (ax_ratio, ax_fp64):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{args.variant}, {'causal' if args.causal else 'non-causal'}, S={args.seq}, "
        f"heads {args.heads}/{args.kv_heads}, D={args.head_dim}, fwd+bwd"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-sizes", "-C", default="1,2,3,4", help="comma list (default 1,2,3,4)")
    p.add_argument("--seq", "-S", type=int, default=1536, help="global tokens; must split into 2C chunks for each C")
    p.add_argument("--heads", type=int, default=12, help="query heads (Ulysses needs them to divide by C)")
    add_size_arguments(p, kv_heads=4, head_dim=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument(
        "--variant",
        choices=VARIANTS,
        default="plain",
        help="the attention measured: plain, a sliding window (--window), chunks (--chunk), capped scores "
        "(--softcap), a sink per head, or value heads half as wide as query/key (mla)",
    )
    p.add_argument("--window", type=int, default=256, help="window of --variant window (transformers' sliding_window)")
    p.add_argument("--chunk", type=int, default=256, help="chunk size of --variant chunk")
    p.add_argument("--softcap", type=float, default=20.0, help="logit cap of --variant softcap")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma list of ring, allgather, ulysses")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write the PNG")


def main(args: argparse.Namespace) -> int:
    args.schedules = [s for s in args.schedules.split(",") if s]
    rows = []
    print(f"{'C':>2} {'one device':>11} " + " ".join(f"{s + ' ratio':>15} {s + ' fp64':>15}" for s in args.schedules))
    for size in (int(c) for c in args.world_sizes.split(",") if c):
        with RankPool(size) as pool:
            row = {**pool.run(errors_rank, args, timeout=3600)[0], "C": size}
        rows.append(row)
        print(
            f"{size:>2} {row['single']:>11.2e} "
            + " ".join(f"{row[s]['ratio']:>15.2f} {row[s]['fp64']:>15.1e}" for s in args.schedules),
            flush=True,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args, args.plot)
    worst = max(row[s]["ratio"] for row in rows for s in args.schedules)
    exact = max(row[s]["fp64"] for row in rows for s in args.schedules)
    print(f"worst ratio {worst:.2f} (gate 2), worst fp64 error {exact:.1e} (gate 1e-10)")
    return 0 if worst <= 2.0 and exact <= 1e-10 else 1
