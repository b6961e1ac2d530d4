"""``python -m cp_compile mixers``: one hybrid layer's token mixers under CP against one process.

For each sequence length and C, on C local gloo ranks, a forward and backward of one layer's worth of each
route, fp32, with transformers' own torch bodies of the scans (the ones a CPU runs):

- ``conv halo``: a causal convolution of width 4 over the layer's channels (Qwen3.5's ``conv1d`` width);
- ``GDN heads`` / ``GDN states``: the gated delta rule by the all-to-all to head groups and by state passing;
- ``Mamba2 heads`` / ``Mamba2 states``: Mamba2's SSD likewise;
- ``GDN gathered``: the same gated delta rule over the gathered sequence, the route of a module with mixing code
  of its own (every rank runs the whole scan and keeps its rows).

Each row: milliseconds per rank (the median of ``--repeats`` steps, the slowest rank), the same call on one
process over the whole sequence, and the bytes one rank moves (forward and backward, the cost model's count of
what the route exchanges); then the route the cost model picks on this CPU's default profile and the length per
rank from which it picks state passing, on the CPU and on the CUDA default profiles.
"""

from __future__ import annotations

import argparse
import json

from . import grid

DEFAULTS = dict(lengths="1024,4096", world_sizes="2,4", repeats=3)
# one layer, as a small Qwen3.5 / Nemotron-H layer: GDN 4 key heads, 8 value heads of 64; Mamba2 8 heads of 64,
# state 64, 2 groups; the convolution over GDN's q, k and v channels
GDN = dict(hk=4, hv=8, dk=64, dv=64)
MAMBA2 = dict(heads=8, p=64, n=64, groups=2)
CONV_WIDTH = 4


def _inputs(total: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    d = GDN
    conv_channels = 2 * d["hk"] * d["dk"] + d["hv"] * d["dv"]
    m = MAMBA2
    return {
        "conv": (rand(1, conv_channels, total), rand(conv_channels, CONV_WIDTH)),
        "gdn": (
            rand(1, total, d["hk"], d["dk"]),
            rand(1, total, d["hk"], d["dk"]),
            rand(1, total, d["hv"], d["dv"]),
            (-torch.rand(1, total, d["hv"], generator=g)).requires_grad_(),
            torch.rand(1, total, d["hv"], generator=g).requires_grad_(),
        ),
        "mamba2": (
            rand(1, total, m["heads"], m["p"]),
            rand(1, total, m["heads"]),
            (-torch.rand(m["heads"], generator=g)).requires_grad_(),
            rand(1, total, m["groups"], m["n"]),
            rand(1, total, m["groups"], m["n"]),
        ),
    }


def _calls(sharding):
    """name -> f(tensors) running one route (``sharding`` None: one process)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from ...mixers.conv import causal_conv1d, depthwise_causal_conv1d
    from ...mixers.gathered import gather_sequence, rank_rows
    from ...mixers.scan import gated_delta_rule, mamba2_scan

    gdn_kw = dict(chunk_size=64, use_qk_l2norm_in_kernel=True)
    m2_kw = dict(dt_softplus=True)
    if sharding is None:
        return {
            "conv halo": lambda t: depthwise_causal_conv1d(t[0], t[1], None, "silu"),
            "GDN": lambda t: torch_chunk_gated_delta_rule(*t, **gdn_kw)[0],
            "Mamba2": lambda t: mamba2_chunk_scan(*t[:3], t[3], t[4], 64, **m2_kw),
        }
    calls = {"conv halo": lambda t: causal_conv1d(t[0], t[1], None, "silu", sharding)}
    for route in ("heads", "states"):
        calls[f"GDN {route}"] = lambda t, r=route: gated_delta_rule(
            torch_chunk_gated_delta_rule, *t, sharding, route=r, **gdn_kw
        )[0]
        calls[f"Mamba2 {route}"] = lambda t, r=route: mamba2_scan(
            mamba2_chunk_scan, *t[:3], t[3], t[4], 64, sharding, route=r, **m2_kw
        )

    def gdn_gathered(t):
        whole = torch_chunk_gated_delta_rule(*(gather_sequence(x, 1, sharding) for x in t), **gdn_kw)[0]
        return rank_rows(whole, 1, t[0].shape[1], sharding)

    calls["GDN gathered"] = gdn_gathered
    return calls


def _step(fn, tensors):
    """One forward and backward of ``fn`` on ``tensors``."""
    return lambda: fn(tensors).float().sum().backward()


def _group(name: str) -> str:
    return {"conv": "conv", "GDN": "gdn", "Mamba2": "mamba2"}[name.split()[0]]


def rank_times(total: int, repeats: int) -> dict[str, float]:
    """On every rank: seconds per forward and backward of each route on this rank's shard."""
    import cp_compile
    from cp_compile.mixers import Sharding

    plan = cp_compile.ContextParallel()
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance)
    local = {
        key: tuple(
            (plan.shard(t.detach(), 2 if key == "conv" and i == 0 else 1) if t.dim() > 2 else t.detach())
            .clone()
            .requires_grad_()
            for i, t in enumerate(tensors)
        )
        for key, tensors in _inputs(total).items()
    }
    return {name: grid.median_seconds(_step(fn, local[_group(name)]), repeats) for name, fn in _calls(sharding).items()}


def one_process_times(total: int, repeats: int) -> dict[str, float]:
    """The same calls over the whole sequence on one process, on one thread as each rank has."""
    import torch

    torch.set_num_threads(1)
    whole = _inputs(total)
    return {name: grid.median_seconds(_step(fn, whole[_group(name)]), repeats) for name, fn in _calls(None).items()}


def bytes_and_route(total: int, world_size: int) -> dict:
    """The cost model's bytes per rank for each route, its pick on this CPU's default profile, and the length per
    rank above which it picks state passing on the CPU and on the CUDA default profiles."""
    from ...cost.mixers import ScanShape, choose_route
    from ...cost.model import default_machine

    machine, gpu = default_machine("cpu"), default_machine("cuda")
    local = total // world_size
    d, m = GDN, MAMBA2
    shapes = {
        "GDN": lambda n: ScanShape.delta_rule(1, n, world_size, 2, d["hk"], d["dk"], d["hv"], d["dv"], d["hv"], 4),
        "Mamba2": lambda n: ScanShape.mamba2(1, n, world_size, 2, m["heads"], m["p"], m["groups"], m["n"], 4),
    }
    out = {}

    def crossover(shape, profile):
        return next(
            (n for n in (2**i for i in range(4, 24)) if choose_route(shape(n), profile)[0].route == "states"), None
        )

    for name, shape in shapes.items():
        best, estimates = choose_route(shape(local), machine)
        out[name] = {
            "pick": best.route,
            "bytes": {e.route: e.bytes_moved for e in estimates},
            "crossover": {"cpu": crossover(shape, machine), "cuda": crossover(shape, gpu)},
        }
    channels = 2 * d["hk"] * d["dk"] + d["hv"] * d["dv"]
    out["conv halo"] = {"bytes": {"halo": 2 * world_size * 2 * (CONV_WIDTH - 1) * channels * 4}}
    # q, k, v, g and beta from the C-1 other ranks, and their gradients back
    out["GDN"]["bytes"]["gathered"] = 2 * (world_size - 1) * local * (channels + 2 * d["hv"]) * 4
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    grid.add_arguments(p, DEFAULTS)


def main(args: argparse.Namespace) -> int:
    import torch

    from ...cost.model import fmt_bytes

    torch.manual_seed(0)
    lengths, sizes = grid.lengths_and_sizes(args)
    rows = []
    one = {n: one_process_times(n, args.repeats) for n in lengths}
    for c, n, per_rank in grid.on_rank_pools(sizes, lengths, rank_times, args.repeats, timeout=900):
        model = bytes_and_route(n, c)
        for name in per_rank[0]:
            family, _, route = name.partition(" ")
            info = model["conv halo"] if family == "conv" else model[family]
            rows.append(
                {
                    "mixer": name,
                    "C": c,
                    "length": n,
                    "ms": 1e3 * max(r[name] for r in per_rank),
                    "one_process_ms": 1e3 * one[n]["conv halo" if family == "conv" else family],
                    "bytes": info["bytes"]["halo" if family == "conv" else route],
                    # the cost model chooses between the routes built for a scan, not the gathered one
                    "pick": None if route == "gathered" else info.get("pick"),
                    "crossover": info.get("crossover"),
                }
            )
    print(f"{'mixer':<14} {'C':>2} {'length':>7} {'ms/rank':>9} {'one proc':>9} {'moves/rank':>11}  cost model")
    for r in rows:
        pick = ""
        if r["pick"]:
            cpu, cuda = r["crossover"]["cpu"], r["crossover"]["cuda"]
            pick = f"picks {r['pick']}; states from {cpu or 'never'} tokens/rank (cpu), {cuda or 'never'} (cuda)"
        print(
            f"{r['mixer']:<14} {r['C']:>2} {r['length']:>7} {r['ms']:>9.2f} {r['one_process_ms']:>9.2f} "
            f"{fmt_bytes(r['bytes']):>11}  {pick}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


__all__ = ["add_arguments", "main"]
