"""``python -m cp_compile generate-batch``: a batch of left-padded prompts generated under CP against one process.

The prompts (``--prompts``, one per row, padded on the left to the longest) are generated greedily by
``model.generate`` on one process ("sdpa", as TRL's GRPOTrainer generates) and by ``cp_compile.hf.generate`` on
C local ranks (each prompt prefilled sharded on its own, then the batch decoded from one ``ShardedCache``). Reported
per C: whether every token matches, the wall time of the whole call (prefill and decode), and the K/V bytes each
rank holds against one process's cache. Exits 1 if a token differs.
"""

from __future__ import annotations

import argparse
import time

import torch

from .generate import DTYPES, add_size_arguments, build_model, comma_ints
from .launch import RankPool


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` (1-D token ids) as one batch padded on the left with ``pad``: (input_ids, attention_mask)."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    return ids, mask


def _batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    seeded = (torch.Generator().manual_seed(length) for length in args.prompts)
    return left_padded([torch.randint(1, args.vocab, (n,), generator=g) for n, g in zip(args.prompts, seeded)])


def _timed(args, attn: str, generate) -> tuple[float, list, int]:
    """(seconds, tokens, K/V bytes of this process) of one generation of the batch, after a short one to warm up."""
    torch.set_num_threads(1)
    model = build_model(args, attn)
    ids, mask = _batch(args)
    kwargs = dict(max_new_tokens=args.new, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    with torch.no_grad():
        generate(model, ids[:, -8:], attention_mask=torch.ones_like(mask[:, -8:]), **{**kwargs, "max_new_tokens": 2})
        start = time.perf_counter()
        out = generate(model, ids, attention_mask=mask, **kwargs)
        seconds = time.perf_counter() - start
    return seconds, out.sequences.tolist(), out.cache.nbytes if attn != "sdpa" else _bytes(out.cache)


def _bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _one_process(args):
    return _timed(args, "sdpa", lambda model, ids, **kw: model.generate(ids, **kw))


def _on_ranks(args):
    import cp_compile
    import cp_compile.hf

    with cp_compile.ContextParallel():
        return _timed(args, "cp_compile", cp_compile.hf.generate)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama")
    p.add_argument("--world-sizes", "-C", type=comma_ints, default=[2], help="comma list (default 2)")
    p.add_argument("--prompts", "-P", type=comma_ints, default=[4096, 3000, 2048, 1024], help="one per row")
    p.add_argument("--new", type=int, default=16, help="tokens to generate per row (greedy)")
    add_size_arguments(p, hidden=256, layers=4, heads=8, kv_heads=4, vocab=512)
    p.add_argument("--window", type=int, default=128, help="sliding window of qwen2's and mistral's window layers")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")


def main(args: argparse.Namespace) -> int:
    (one,) = RankPool(1).run(_one_process, args, timeout=3600)
    print(
        f"{args.arch}, hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, {args.dtype}; "
        f"prompts {args.prompts} padded on the left, {args.new} new tokens each, greedy; one process = 1 thread, "
        "each CP rank 1 thread (gloo)"
    )
    print(f"{'C':>3} {'same tokens':>12} {'seconds':>9} {'one process':>12} {'K/V per rank':>14} {'one process':>12}")
    same = True
    for world_size in args.world_sizes:
        with RankPool(world_size) as pool:
            ranks = pool.run(_on_ranks, args, timeout=3600)
        seconds = max(r[0] for r in ranks)
        same = same and all(r[1] == one[1] for r in ranks)
        print(
            f"{world_size:>3} {str(all(r[1] == one[1] for r in ranks)):>12} {seconds:>9.2f} {one[0]:>12.2f} "
            f"{max(r[2] for r in ranks) / 1e6:>11.2f} MB {one[2] / 1e6:>9.2f} MB"
        )
    return 0 if same else 1
