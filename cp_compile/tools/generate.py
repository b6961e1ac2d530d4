"""``python -m cp_compile generate``: Hugging Face generation under CP, checked and timed against one process.

A Hugging Face model (Llama, Qwen2 or Mistral; random weights, the same in
every process) generates greedily after a random prompt on one process
("sdpa") and on C local ranks (``cp_compile.hf.generate``: the prompt
prefilled sharded over the ranks, then decoding over a ``ShardedCache``).
Reported per (C, prompt length): whether every token matches, the largest
relative logit difference, prefill tokens/s, decode ms/token and the K/V
bytes each rank holds against one process. Decode is also set against its
floor, one process's step plus one all-gather per layer of what the decode
schedule gathers, measured two ways in the same run: the all-gathers timed
back to back, and one process's model run on each rank with them in place
(timed in turn with CP). Both steps are taken apart from a
profile (``cp_compile.tools.breakdown``): compute, collectives (count and time), and
everything else. Exits 1 if a token differs.

``--compile`` decodes with transformers' own compiled step (a compileable
cache and ``CompileConfig``, Inductor); ``--plot`` draws prefill tokens/s and
decode ms/token against prompt length, one line per C.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from .launch import RankPool

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def comma_ints(text: str) -> list[int]:
    """``"1,2,4"`` as ``[1, 2, 4]``: the comma lists of the command lines."""
    return [int(x) for x in text.split(",") if x]


def config_sizes(args, max_positions: int) -> dict:
    """The sizes of the command-line model (``--vocab --hidden --layers --heads --kv-heads``) as config fields."""
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max_positions,
    )


def add_size_arguments(p: argparse.ArgumentParser, **defaults: int) -> None:
    """Integer options ``--name`` with their defaults, in order: the command-line model's sizes as ``config_sizes``
    reads them (``--hidden --layers ...``), and the shapes of the attention commands."""
    for name, default in defaults.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def build_model(args, attn: str):
    import transformers

    common = config_sizes(args, max(args.prompts) + args.new)
    if args.arch == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif args.arch == "mistral":
        config, cls = transformers.MistralConfig(**common, sliding_window=args.window), transformers.MistralForCausalLM
    else:  # the first half of the layers full attention, the rest a sliding window
        config = transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=args.window, max_window_layers=args.layers // 2
        )
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=attn, dtype=DTYPES[args.dtype]).eval()


def _prompt(args, length: int) -> torch.Tensor:
    return torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(length))


def _compile_config(args):
    if not args.compile:
        return {}
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, mode=None)
    config._compile_all_devices = True  # transformers compiles decoding by itself on GPUs only
    return {"compile_config": config}


def _generate_timed(args, model, ids: torch.Tensor, prefill, cache, generate=None):
    """(result, prefill seconds, decode seconds per token): the first P - 1 tokens by ``prefill``, then
    ``generate`` (transformers' ``model.generate`` by default) continues from the cache (its first step
    runs the prompt's last token)."""
    generate = generate or model.generate
    kwargs = dict(
        max_new_tokens=args.new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **_compile_config(args),
    )
    if args.compile:  # compile the decode step outside the timing
        generate(ids, cache=cache(), **kwargs)
    store = cache()
    start = time.perf_counter()
    with torch.no_grad():
        store = prefill(ids[:, :-1], store)
    middle = time.perf_counter()
    result = generate(ids, cache=store, **kwargs)
    return result, middle - start, (time.perf_counter() - middle) / args.new


def _decode_costs(args, model, ids: torch.Tensor, prefill, cache, generate=None) -> dict:
    """The decode steps' costs from a profile (``tools.breakdown``): compute, collectives, other; per token."""
    from .breakdown import breakdown

    generate = generate or model.generate
    kwargs = dict(max_new_tokens=args.new, do_sample=False, **_compile_config(args))

    def prepare():
        with torch.no_grad():
            store = prefill(ids[:, :-1], cache())
        return lambda: generate(ids, cache=store, **kwargs)

    return breakdown(prepare, args.new)


def _one_process_side(args, model):
    """(prefill, cache maker for a prompt length) of one process's generation."""
    from transformers import DynamicCache, StaticCache

    def prefill(ids, cache):
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def cache_for(length):
        if args.compile:  # compiled decoding needs a compileable (static) cache, as ours is
            return lambda: StaticCache(config=model.config, max_cache_len=length + args.new)
        return lambda: DynamicCache(config=model.config)

    return prefill, cache_for


def reference_runs(args) -> dict:
    """One process, one thread (one device's worth of compute next to each CP rank's)."""
    torch.set_num_threads(1)
    model = build_model(args, "sdpa")
    prefill, cache_for = _one_process_side(args, model)
    runs = {}
    for length in [args.prompts[0]] + args.prompts:  # the first run warms up (allocator, lazy inits), unrecorded
        ids = _prompt(args, length)
        result, prefill_s, decode_s = _generate_timed(args, model, ids, prefill, cache_for(length))
        runs[length] = dict(
            sequences=result.sequences,
            logits=torch.stack(result.logits),
            prefill_s=prefill_s,
            decode_s=decode_s,
            cache_bytes=sum(t.nbytes for layer in result.cache.layers for t in (layer.keys, layer.values)),
            costs=_decode_costs(args, model, ids, prefill, cache_for(length)),
        )
    return runs


def _floor_model(args, plan):
    """One process's model, run whole on this rank, with one all-gather after each attention layer of what the
    decode schedule gathers per layer and token (out and lse of one query in the accumulator dtype; on the first
    layer with the two numbers of ``inference.cache.Agreement``'s tag): a decode step of it is one process's step plus
    the one collective per layer that a decode step under CP needs, where CP makes it."""
    from ..comm.gather import gather_dim0
    from ..inference.cache import TAG_NUMEL

    model = build_model(args, "sdpa")

    def gather_after(module, inputs, output, payload):
        gather_dim0(payload, plan.group_name, plan.world_size)

    for index, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(
            functools.partial(gather_after, payload=_layer_payload(args, TAG_NUMEL if index == 0 else 0))
        )
    return model


def _layer_payload(args, tag_numel: int = 0) -> torch.Tensor:
    """What the decode schedule gathers from each rank per layer and token: out and lse of one query per head,
    in the accumulator dtype (``inference/cached.py``), and ``tag_numel`` numbers of a tag."""
    from ..kernels.merge import acc_dtype

    return torch.zeros(1, args.heads * (args.hidden // args.heads + 1) + tag_numel, dtype=acc_dtype(DTYPES[args.dtype]))


def _layer_allgather_s(args, plan, repeats: int = 200) -> float:
    """Seconds of one all-gather of what the decode schedule gathers per layer and token (out and lse of one
    query), back to back: the collective a decode step cannot do without, with no work between."""
    from ..comm.gather import gather_dim0

    payload = _layer_payload(args)
    for _ in range(10):
        gather_dim0(payload, plan.group_name, plan.world_size)
    start = time.perf_counter()
    for _ in range(repeats):
        gather_dim0(payload, plan.group_name, plan.world_size)
    return (time.perf_counter() - start) / repeats


def rank_runs(args) -> dict:
    import cp_compile
    import cp_compile.hf

    torch.set_num_threads(1)
    plan = cp_compile.ContextParallel()
    model = build_model(args, "cp_compile")
    floor = _floor_model(args, plan)
    floor_prefill, floor_cache_for = _one_process_side(args, floor)

    def prefill(ids, cache):
        if ids.shape[1]:
            cp_compile.hf.sharded_prefill(model, plan, cache, ids)
        return cache

    # what a user calls; the prefill is done, so it decodes from the cache
    generate = functools.partial(cp_compile.hf.generate, model)

    runs = {}
    for length in [args.prompts[0]] + args.prompts:  # the first run warms up, unrecorded
        cache = functools.partial(cp_compile.hf.ShardedCache, model.config, length + args.new, plan)
        ids = _prompt(args, length)
        decode_s, floor_s = [], []
        for _ in range(args.repeats):  # CP and its floor in turn: both meet the machine in the same state
            with plan:
                result, prefill_s, seconds = _generate_timed(args, model, ids, prefill, cache, generate)
            decode_s.append(seconds)
            floor_s.append(_generate_timed(args, floor, ids, floor_prefill, floor_cache_for(length))[2])
        with plan:
            costs = _decode_costs(args, model, ids, prefill, cache, generate)
        runs[length] = dict(
            sequences=result.sequences,
            logits=torch.stack(result.logits),
            prefill_s=prefill_s,
            decode_s=min(decode_s),
            cache_bytes=result.cache.nbytes,
            costs=costs,
            floor_s=min(floor_s),
            allgather_s=_layer_allgather_s(args, plan),
            floor_costs=_decode_costs(args, floor, ids, floor_prefill, floor_cache_for(length)),
        )
    return runs


def _rows(args, reference: dict, per_world: dict) -> list[dict]:
    rows = []
    for world_size, per_rank in per_world.items():
        for length in args.prompts:
            ref = reference[length]
            mine = [runs[length] for runs in per_rank]
            err = max(
                (
                    (m["logits"].double() - ref["logits"].double()).abs().max() / ref["logits"].double().abs().max()
                ).item()
                for m in mine
            )
            prefill_s, allgather_s = max(m["prefill_s"] for m in mine), max(m["allgather_s"] for m in mine)
            slowest = max(mine, key=lambda m: m["costs"]["wall_ms"])
            rows.append(
                dict(
                    C=world_size,
                    prompt=length,
                    same_tokens=all(torch.equal(m["sequences"], ref["sequences"]) for m in mine),
                    logits_rel_err=err,
                    prefill_tok_s=(length - 1) / prefill_s if length > 1 else None,
                    ref_prefill_tok_s=(length - 1) / ref["prefill_s"] if length > 1 else None,
                    decode_ms=1e3 * max(m["decode_s"] for m in mine),
                    ref_decode_ms=1e3 * ref["decode_s"],
                    cache_MiB_per_rank=max(m["cache_bytes"] for m in mine) / 2**20,
                    ref_cache_MiB=ref["cache_bytes"] / 2**20,
                    # one process's step plus the one collective per layer that a decode step under CP needs: timed
                    # back to back, and in its place inside a step (in turn with the CP decode, on the same ranks)
                    decode_floor_ms=1e3 * (ref["decode_s"] + args.layers * allgather_s),
                    decode_in_step_floor_ms=1e3 * max(m["floor_s"] for m in mine),
                    allgather_ms=1e3 * allgather_s,
                    costs=slowest["costs"],
                    ref_costs=ref["costs"],
                    floor_costs=slowest["floor_costs"],
                )
            )
    return rows


def _table(rows: list[dict]) -> str:
    from .breakdown import format_breakdown

    lines = [
        f"{'C':>2} {'prompt':>7} {'tokens':>7} {'logit err':>9} {'prefill tok/s':>19} "
        f"{'decode ms/token':>59} {'K/V MiB per rank':>19}",
        f"{'':>2} {'':>7} {'':>7} {'':>9} {'CP':>9} {'one':>9} {'CP':>9} {'one':>9} {'floor':>9} "
        f"{'CP/floor':>9} {'in-step':>9} {'CP/it':>9} {'CP':>9} {'one':>9}",
    ]
    for r in rows:
        prefill = (
            f"{r['prefill_tok_s']:>9.0f} {r['ref_prefill_tok_s']:>9.0f}" if r["prefill_tok_s"] else f"{'-':>9} {'-':>9}"
        )
        lines.append(
            f"{r['C']:>2} {r['prompt']:>7} {'same' if r['same_tokens'] else 'DIFFER':>7} "
            f"{r['logits_rel_err']:>9.1e} {prefill} {r['decode_ms']:>9.1f} {r['ref_decode_ms']:>9.1f} "
            f"{r['decode_floor_ms']:>9.1f} {r['decode_ms'] / r['decode_floor_ms']:>9.2f} "
            f"{r['decode_in_step_floor_ms']:>9.1f} {r['decode_ms'] / r['decode_in_step_floor_ms']:>9.2f} "
            f"{r['cache_MiB_per_rank']:>9.2f} {r['ref_cache_MiB']:>9.2f}"
        )
    lines += [
        "floor: one process + one all-gather per layer timed back to back; in-step (it): one process's model "
        "run on each rank with that all-gather after each attention layer, timed in turn with CP",
        "decode step (per token, from a profile of the slowest rank):",
        *(
            f"  C={r['C']} prompt {r['prompt']}: CP {format_breakdown(r['costs'])}; in-step floor "
            f"{format_breakdown(r['floor_costs'])}; one process {format_breakdown(r['ref_costs'])}; "
            f"all-gather {r['allgather_ms']:.3f} ms"
            for r in rows
        ),
    ]
    return "\n".join(lines)


def crossover(lengths: list[int], cp: list[float], one: list[float]) -> float | None:
    """The length where CP's step time first drops below one process's (interpolated in log-log), or None."""
    import math

    for i in range(1, len(lengths)):
        before, after = cp[i - 1] - one[i - 1], cp[i] - one[i]
        if before > 0 >= after:
            a, b = math.log(cp[i - 1] / one[i - 1]), math.log(cp[i] / one[i])
            x0, x1 = math.log(lengths[i - 1]), math.log(lengths[i])
            return math.exp(x0 + (x1 - x0) * a / (a - b))
    return lengths[0] if cp and cp[0] <= one[0] else None


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend: the commands write PNGs, with or without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mark_crossover(ax, lengths: list[int], cp: list[float], one: list[float], color, height: float) -> None:
    """A dotted line and a label on ``ax`` where CP starts to pay (``crossover``), if it does."""
    at = crossover(lengths, cp, one)
    if at is None:
        return
    ax.axvline(at, color=color, linestyle=":", alpha=0.7)
    ax.annotate(
        f"CP pays from ~{at:,.0f}",
        (at, height),
        xycoords=("data", "axes fraction"),
        fontsize=8,
        color=color,
        rotation=90,
        ha="right",
        va="bottom",
    )


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    prompts = sorted({r["prompt"] for r in rows})
    first = [next(r for r in rows if r["prompt"] == p) for p in prompts]
    left.plot(prompts, [r["ref_prefill_tok_s"] for r in first], "k--o", label="one process")
    right.plot(prompts, [r["ref_decode_ms"] for r in first], "k--o", label="one process")
    for world_size in sorted({r["C"] for r in rows}):
        mine = [r for r in rows if r["C"] == world_size]
        lengths, cp_ms = [r["prompt"] for r in mine], [r["decode_ms"] for r in mine]
        left.plot(lengths, [r["prefill_tok_s"] for r in mine], "-o", label=f"CP, C={world_size}")
        (line,) = right.plot(lengths, cp_ms, "-o", label=f"CP, C={world_size}")
        right.plot(
            lengths,
            [r["decode_in_step_floor_ms"] for r in mine],
            ":",
            color=line.get_color(),
            label=f"its floor (one process + all-gathers), C={world_size}",
        )
        mark_crossover(right, lengths, cp_ms, [r["ref_decode_ms"] for r in mine], line.get_color(), 0.02)
    for ax, what in ((left, "prefill tokens/s"), (right, "decode ms/token")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="prompt tokens", ylabel=what)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama")
    p.add_argument("--world-sizes", "-C", type=comma_ints, default=[2], help="comma list (default 2)")
    p.add_argument("--prompts", "-P", type=comma_ints, default=[257, 1025], help="prompt lengths, comma list")
    p.add_argument("--new", type=int, default=64, help="tokens to generate (greedy)")
    add_size_arguments(p, hidden=256, layers=4, heads=8, kv_heads=2, vocab=1024)
    p.add_argument("--window", type=int, default=128, help="sliding window of qwen2's and mistral's window layers")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=3, help="CP and in-step floor decode runs, in turn (best kept)")
    p.add_argument("--compile", action="store_true", help="compiled decoding (transformers' CompileConfig, Inductor)")
    p.add_argument("--out", type=Path, default=None, help="JSON of the rows")
    p.add_argument("--plot", type=Path, default=None, help="PNG: prefill tokens/s and decode ms/token vs prompt length")


def main(args: argparse.Namespace) -> int:
    reference = reference_runs(args)
    per_world = {}
    for world_size in args.world_sizes:
        with RankPool(world_size) as pool:
            per_world[world_size] = pool.run(rank_runs, args, timeout=3600)
    rows = _rows(args, reference, per_world)
    decoding = "compiled" if args.compile else "eager"
    report(
        rows,
        f"{args.arch}, hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
        f"{args.dtype}, {args.new} new tokens, decoding {decoding}; one process = 1 thread, each CP rank "
        "1 thread (gloo)",
        _table(rows),
        args.out,
        args.plot
        and (lambda: plot(rows, args.plot, f"{args.arch} generate under CP ({args.dtype}, decoding {decoding})")),
    )
    return 0 if all(r["same_tokens"] for r in rows) else 1


def report(rows: list[dict], heading: str, table: str, out: Optional[Path], draw: Optional[Callable[[], None]]) -> None:
    """A command's heading and table printed, its rows written as JSON to ``out`` and its figure drawn, if asked."""
    print(heading)
    print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1))
    if draw:
        draw()
