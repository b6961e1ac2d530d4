"""``python -m cp_compile indexed``: one indexed sparse-attention layer (DSA) under CP against one process.

For each sequence length and C, on C local gloo ranks, fp32, one layer's worth of each half:

- ``indexer``: the index keys gathered from every rank, each query's scores against all of them (the heads'
  ReLU'd dot products weighted per query, as DeepSeek-V3.2's indexer scores), masked causally, and the top k;
  queries in blocks of rows (one process alike), so that no ``[L, heads, T]`` score is held whole;
- ``attention``: keys and values gathered from every rank, each query over the k it picked
  (``kernels.sparse.picked_attention``), forward and backward (the gradients reduce-scattered back).

Each row: milliseconds per rank (the median of ``--repeats`` runs, the slowest rank), the same call on one
process over the whole sequence (on one thread, as each rank has), and the bytes one rank receives (forward and
backward).
"""

from __future__ import annotations

import argparse
import json

from . import grid

DEFAULTS = dict(lengths="8192,32768", world_sizes="2,4", repeats=1)
# a small DeepSeek-V3.2 layer: indexer 4 heads of 64 (the model: 64 of 128), top 2048 (the model's); attention
# 2 heads, query/key 48 + 16 (RoPE), value 32 (the model: 128 heads of 128 + 64, value 128)
INDEXER = dict(heads=4, dim=64, top_k=2048)
ATTENTION = dict(heads=2, qk=64, v=32)
ROWS = 512  # query rows scored at a time by the indexer


def _inputs(total: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    i, a = INDEXER, ATTENTION
    return {
        "index_q": torch.randn(1, total, i["heads"], i["dim"], generator=g),
        "index_w": torch.randn(1, total, i["heads"], generator=g),
        "index_k": torch.randn(1, total, i["dim"], generator=g),
        "q": torch.randn(1, a["heads"], total, a["qk"], generator=g),
        "k": torch.randn(1, a["heads"], total, a["qk"], generator=g),
        "v": torch.randn(1, a["heads"], total, a["v"], generator=g),
    }


def top_k(index_q, index_w, keys, mask_rows) -> torch.Tensor:  # noqa: F821
    """``[1, L, k]``: each query's top k keys by the indexer's score; ``mask_rows(rows)`` -> ``[1, r, T]`` bool."""
    import torch

    picks = []
    for start in range(0, index_q.shape[1], ROWS):
        rows = slice(start, start + ROWS)
        scores = torch.relu(torch.einsum("bshd,btd->bsht", index_q[:, rows], keys))
        scores = torch.einsum("bsh,bsht->bst", index_w[:, rows], scores).masked_fill(~mask_rows(rows), float("-inf"))
        picks.append(scores.topk(min(INDEXER["top_k"], scores.shape[-1]), dim=-1).indices)
    return torch.cat(picks, dim=1)


def _attention_step(q, k, v, picks, usable, gather=None):
    from ...kernels.sparse import picked_attention

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    keys, values = (k, v) if gather is None else (gather(k), gather(v))
    out, _ = picked_attention(q, keys, values, picks, usable, q.shape[-1] ** -0.5)
    out.sum().backward()


def rank_times(total: int, repeats: int) -> dict[str, float]:
    """On every rank: seconds of the indexer and of the attention's forward and backward on this rank's shard."""
    import torch

    import cp_compile
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.gathered import gather_sequence
    from cp_compile.mixers.indexed import gather_index_keys, sees, sequence_slots

    plan = cp_compile.ContextParallel()
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance)
    local = {n: plan.shard(t, 2 if n in ("q", "k", "v") else 1) for n, t in _inputs(total).items()}
    places = sequence_slots(local["index_q"], *sharding.op_args)
    keys = torch.arange(total)

    def indexer():
        return top_k(
            local["index_q"],
            local["index_w"],
            gather_index_keys(local["index_k"], sharding),
            lambda r: sees(places[r, None], keys[None], None)[None],
        )

    picks = indexer()
    usable = sees(places[:, None], picks, None)

    def attention():
        _attention_step(local["q"], local["k"], local["v"], picks, usable, lambda t: gather_sequence(t, 2, sharding))

    return {"indexer": grid.median_seconds(indexer, repeats), "attention": grid.median_seconds(attention, repeats)}


def one_process_times(total: int, repeats: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    whole = _inputs(total)
    places = torch.arange(total)

    def indexer():
        return top_k(whole["index_q"], whole["index_w"], whole["index_k"], lambda r: places[None, :] <= places[r, None])

    picks = indexer()
    usable = picks <= places[None, :, None]
    return {
        "indexer": grid.median_seconds(indexer, repeats),
        "attention": grid.median_seconds(
            lambda: _attention_step(whole["q"], whole["k"], whole["v"], picks, usable), repeats
        ),
    }


def received_bytes(total: int, world_size: int) -> dict[str, int]:
    """What one rank receives per layer: the other ranks' index keys (indexer); their keys and values, and the
    gradients of its own from every other rank (attention)."""
    others = total * (world_size - 1) // world_size
    a = ATTENTION
    return {"indexer": others * INDEXER["dim"] * 4, "attention": 2 * others * a["heads"] * (a["qk"] + a["v"]) * 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    grid.add_arguments(p, DEFAULTS)


def main(args: argparse.Namespace) -> int:
    from ...cost.model import fmt_bytes

    lengths, sizes = grid.lengths_and_sizes(args)
    one = {n: one_process_times(n, args.repeats) for n in lengths}
    rows = []
    for c, n, per_rank in grid.on_rank_pools(sizes, lengths, rank_times, args.repeats, timeout=1800):
        for part, moved in received_bytes(n, c).items():
            rows.append(
                {
                    "part": part,
                    "C": c,
                    "length": n,
                    "ms": 1e3 * max(r[part] for r in per_rank),
                    "one_process_ms": 1e3 * one[n][part],
                    "bytes": moved,
                }
            )
    print(f"{'part':<10} {'C':>2} {'length':>7} {'ms/rank':>9} {'one proc':>9} {'receives/rank':>14}")
    for r in rows:
        print(
            f"{r['part']:<10} {r['C']:>2} {r['length']:>7} {r['ms']:>9.1f} {r['one_process_ms']:>9.1f} "
            f"{fmt_bytes(r['bytes']):>14}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


__all__ = ["add_arguments", "main"]
