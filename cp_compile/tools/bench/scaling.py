"""``python -m cp_compile scale``: how each family's training step scales under CP, by the route its tokens mix on.

For each family, a tiny model of the models sweep (``model_configs.tiny_config``: the family's own classes, hidden
64, one layer of each type; random weights, fp32) takes training steps (forward, loss, backward) on one sequence of
``--length`` tokens, each process on one thread:

- **one process**: plain transformers (``"sdpa"``, or ``"eager"`` where the family has no SDPA path);
- **C = 1**: ``"cp_compile"`` under a plan of one rank, on one process (what the route costs by itself);
- **C = 2, 4, ...**: ``"cp_compile"`` under a plan of C local gloo ranks, each on the plan's shard.

Reported per family and C: the median step time of the slowest rank, its ratio to the faster single process (plain,
or a plan of one rank), the activations the step saves for its backward on the rank that saves most (every tensor
the autograd graph keeps, parameters left out, each storage once) and their ratio to one process's, with the route
(``Family.route``). Ranks beyond the machine's cores share them: their times say nothing then (the table marks
them), their memory still does.

``--cache-prompt P`` adds, per family and C, greedy generation of ``--new`` tokens after a P-token prompt: the bytes
its cache holds per rank (every tensor of the cache and its layers; RecurrentGemma's states on its modules) against
one process's, and whether the tokens are one process's. ``--steps 0`` leaves the training steps out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..launch import RankPool

CONTROLS = ("llama", "lfm2")
# the families whose tokens mix outside the attention schedules, by the issues that track them
ROUTED = ("minimax", "recurrent_gemma", "rwkv", "xlstm", "bloom", "mpt", "inkling_text", "doge", "xglm")
ROUTED += ("gpt_neox_japanese", "deepseek_v32", "glm_moe_dsa", "deepseek_v4", "qwen4_exp_text")


# the config fields that bound a family's sequence length
_LENGTH_FIELDS = ("max_position_embeddings", "max_seq_len", "n_positions", "max_sequence_length")


class SavedActivations:
    """The bytes of every tensor saved for backward meanwhile, each storage once, parameters left out."""

    def __init__(self, model: torch.nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor without storage (a wrapper subclass)
            return t
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _tiny_model(family: str, tokens: int, longest: int, mode: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The family's tiny model (its config with room for ``longest`` tokens: MPT builds its ALiBi bias for
    max_seq_len) for ``mode`` ("plain": one process's, transformers' own attention; "plan": ``"cp_compile"``) and
    a random sequence of ``tokens`` ids ``[1, tokens]``."""
    from .model_configs import ID_RANGE, first_id, tiny_config
    from .model_run import _build, _reference_model

    config, cls, _ = tiny_config(family)
    for field in _LENGTH_FIELDS:
        if isinstance(getattr(config, field, None), int):
            setattr(config, field, max(getattr(config, field), longest))
    model = _build(cls, config, "cp_compile") if mode == "plan" else _reference_model(cls, config)[0]
    ids = torch.randint(first_id(config), ID_RANGE, (1, tokens), generator=torch.Generator().manual_seed(1))
    return model, ids


def run_steps(family: str, length: int, steps: int, mode: str) -> dict:
    """On each rank: ``steps`` timed training steps (after one untimed) of ``family`` on ``length`` tokens; ``mode``:
    "plain" (one process, transformers' own attention) or "plan" (``"cp_compile"`` under a plan of the pool's ranks).
    """
    import torch.distributed as dist

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")
    from cp_compile.hf.families import family_of

    from .model_run import _token_loss

    model, ids = _tiny_model(family, length, length, mode)
    model.train()
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    plan = cp_compile.ContextParallel() if mode == "plan" else None
    if plan is not None:
        ids, labels, positions = plan.shard(ids, 1), plan.shard(labels, 1), plan.positions(length)[None]
    else:
        positions = torch.arange(length)[None]

    def step() -> None:
        out = model(ids, position_ids=positions, use_cache=False)
        (_token_loss(out.logits, labels) / (length - 1)).backward()
        model.zero_grad(set_to_none=True)

    def timed() -> float:
        if plan is not None:
            dist.barrier()
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    with plan if plan is not None else contextlib.nullcontext():
        step()  # warm: first calls, allocations
        with SavedActivations(model) as saved:
            out = model(ids, position_ids=positions, use_cache=False)
            loss = _token_loss(out.logits, labels) / (length - 1)
        loss.backward()
        del out, loss
        model.zero_grad(set_to_none=True)
        seconds = [timed() for _ in range(steps)]
    return {"ms": 1e3 * statistics.median(seconds), "saved": saved.bytes, "route": family_of(model).route}


def held_bytes(roots: list) -> int:
    """Bytes of every tensor reachable from ``roots`` through lists, tuples, dicts and the attributes of caches and
    cache layers (transformers' ``Cache`` and ``CacheLayerMixin``), each storage once."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    storages: dict[int, int] = {}
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple)):
            todo += obj
        elif isinstance(obj, dict):
            todo += obj.values()
        elif isinstance(obj, (Cache, CacheLayerMixin)):
            todo += vars(obj).values()
    return sum(storages.values())


def generation_cache(family: str, prompt: int, new: int, mode: str) -> dict:
    """On each rank: greedy generation of ``new`` tokens after a ``prompt``-token prompt; the bytes the generation's
    cache holds at its end (with the states a family keeps on its modules), and the tokens. ``mode``: ``run_steps``'."""
    import cp_compile
    import cp_compile.hf
    from cp_compile.hf.families import family_of

    model, ids = _tiny_model(family, prompt, prompt + new, mode)
    model.eval()
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True, use_cache=True)
    with torch.no_grad():
        if mode == "plan":
            with cp_compile.ContextParallel():
                out = cp_compile.hf.generate(model, ids, **kwargs)
        else:
            out = model.generate(ids, **kwargs)
    roots = [out.past_key_values]
    if family_of(model).fresh_states is not None:  # states kept on the modules (RecurrentGemma's)
        roots += [vars(module) for module in model.modules()]
    return {"cache": held_bytes(roots), "tokens": out.sequences.tolist()}


def measure_cache(family: str, prompt: int, new: int, world_sizes: tuple[int, ...], timeout: float) -> list[dict]:
    """One row per C (0: one process) of the generation cache's bytes on the rank that holds most, against one
    process's; whether the tokens are one process's."""
    rows: list[dict] = []
    for c in (0, *world_sizes):
        try:
            with RankPool(max(c, 1)) as pool:
                mode = "plain" if c == 0 else "plan"
                per_rank = pool.run(generation_cache, family, prompt, new, mode, timeout=timeout)
            rows.append({"family": family, "C": c, "cache": max(r["cache"] for r in per_rank)})
            rows[-1]["tokens"] = per_rank[0]["tokens"]
        except Exception as e:  # noqa: BLE001
            rows.append({"family": family, "C": c, "error": str(e).strip().splitlines()[-1][:200]})
    one = rows[0] if "error" not in rows[0] else None
    for r in rows[1:]:
        if one is not None and "error" not in r:
            r["cache_ratio"] = r["cache"] / one["cache"] if one["cache"] else None
            r["same_tokens"] = r["tokens"] == one["tokens"]
    return rows


def cache_table(rows: list[dict]) -> str:
    lines = ["| family | C | generation cache per rank | / one process's | tokens |", "|---|---|---|---|---|"]
    for r in rows:
        c = "one process" if r["C"] == 0 else str(r["C"])
        if "error" in r:
            lines.append(f"| {r['family']} | {c} | {r['error']} | | |")
            continue
        ratio = f"{r['cache_ratio']:.2f}x" if r.get("cache_ratio") is not None else ""
        same = {True: "one process's", False: "differ", None: ""}[r.get("same_tokens")]
        lines.append(f"| {r['family']} | {c} | {r['cache'] / 2**10:.0f} KB | {ratio} | {same} |")
    return "\n".join(lines)


def measure(family: str, length: int, world_sizes: tuple[int, ...], steps: int, timeout: float) -> list[dict]:
    """One row per C (0: one process, plain transformers) for ``family``; a failed run is a row with its error."""
    rows = []
    for c in (0, 1, *world_sizes):
        try:
            with RankPool(max(c, 1)) as pool:
                per_rank = pool.run(run_steps, family, length, steps, "plain" if c == 0 else "plan", timeout=timeout)
            slowest = max(r["ms"] for r in per_rank)
            rows.append({"family": family, "C": c, "ms": slowest, "saved": max(r["saved"] for r in per_rank)})
            rows[-1]["route"] = per_rank[0]["route"]
        except Exception as e:  # noqa: BLE001  (a family that fails at one C still reports the others)
            rows.append({"family": family, "C": c, "error": str(e).strip().splitlines()[-1][:200]})
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Each row's step time against the faster single process and its activations against one process's."""
    by_c = {r["C"]: r for r in rows if "error" not in r}
    singles = [by_c[c]["ms"] for c in (0, 1) if c in by_c]
    for r in rows:
        if "error" in r:
            continue
        if singles:
            r["time_ratio"] = r["ms"] / min(singles)
        if 0 in by_c and by_c[0]["saved"]:
            r["saved_ratio"] = r["saved"] / by_c[0]["saved"]
    return rows


def table(rows: list[dict], cores: int) -> str:
    lines = ["| family | C | ms per step | / best single process | activations saved per rank | / one process's |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        c = "one process" if r["C"] == 0 else f"{r['C']}" + (" (shares cores)" if r["C"] > cores else "")
        if "error" in r:
            lines.append(f"| {r['family']} | {c} | {r['error']} | | | |")
            continue
        time_ratio = f"{r['time_ratio']:.2f}x" if "time_ratio" in r else ""
        saved_ratio = f"{r['saved_ratio']:.2f}x" if "saved_ratio" in r else ""
        lines.append(
            f"| {r['family']} | {c} | {r['ms']:.0f} | {time_ratio} | {r['saved'] / 2**20:.1f} MB | {saved_ratio} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", default=",".join(CONTROLS + ROUTED), help="comma list of model types")
    p.add_argument("--length", "-L", type=int, default=4096, help="tokens of the training sequence")
    p.add_argument("--world-sizes", "-C", default="2,4", help="CP degrees besides one rank, comma list")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (the median is reported)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument(
        "--cache-prompt",
        type=int,
        default=0,
        help="also generate after a prompt of this many tokens and report the cache per rank (0: not)",
    )
    p.add_argument("--new", type=int, default=32, help="tokens generated after --cache-prompt's prompt")
    p.add_argument("--out", type=Path, default=None, help="JSON of the rows")


def main(args: argparse.Namespace) -> int:
    world_sizes = tuple(int(c) for c in args.world_sizes.split(",") if c)
    cores = os.cpu_count() or 1
    every = []
    for family in args.families.split(","):
        rows = ratios(measure(family, args.length, world_sizes, args.steps, args.timeout)) if args.steps else []
        route = next((r["route"] for r in rows if r["C"] > 0 and "route" in r), "")
        every += rows
        print(f"\n{family}: {route}" + (f"\n{table(rows, cores)}" if rows else ""), flush=True)
        if args.cache_prompt:
            cached = measure_cache(family, args.cache_prompt, args.new, world_sizes, args.timeout)
            every += cached
            print(cache_table(cached), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(every, indent=1))
    return 0
