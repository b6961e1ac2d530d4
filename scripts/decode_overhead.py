"""What a plan of one rank costs beyond one process, where there is nothing to communicate.

One process, one thread: the same Llama weights on ``attn_implementation="sdpa"`` (plain transformers) and on
``"cp_compile"`` under ``ContextParallel`` of one gloo rank, run in turn, for each of

- the prefill: the fastest ``max_new_tokens=1`` generation (``model.generate`` against ``cp_compile.hf.generate``);
- the eager decode step: the median time between consecutive calls of a stopping criterion;
- the compiled decode step (``--compile``): the same with transformers' ``CompileConfig`` (Inductor, a static cache
  on the plain side, as compiled decoding needs);
- the eager training step (``--train``): forward and backward of ``--train-tokens`` tokens with a loss over every
  token, the plan's side given its shard (at one rank, the tokens themselves) and global positions.

The tokens generated (and the losses) are checked to be the same on both sides.

    python scripts/decode_overhead.py [--prompt 512] [--new 48] [--reps 5] [--compile] [--train]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import transformers
from transformers import CompileConfig, StaticCache, StoppingCriteria

import cp_compile
import cp_compile.hf


class Clock(StoppingCriteria):
    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, mode=None)
    config._compile_all_devices = True  # transformers compiles decoding by itself on GPUs only
    return config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also time compiled decoding (Inductor)")
    p.add_argument("--train", action="store_true", help="also time an eager training step")
    p.add_argument("--train-tokens", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    longest = max(args.prompt + args.new + 8, args.train_tokens)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=longest,
    )
    models = {}
    for name, attn in (("plain", "sdpa"), ("plan", "cp_compile")):
        torch.manual_seed(0)  # the same weights; a config of its own each (the model keeps the one it is given)
        models[name] = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=attn)
    ids = torch.randint(0, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    plan = cp_compile.ContextParallel()
    compiled = {name: _compile_config() for name in models}  # one config each: one compiled step each

    def generate(name: str, new: int, clock: Clock, compile_decode: bool = False):
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, stopping_criteria=[clock])
        if compile_decode:  # a static cache of the same size on both sides
            kwargs.update(compile_config=compiled[name], max_cache_len=args.prompt + args.new + 8)
        if name == "plain":
            if compile_decode:
                kwargs["cache"] = StaticCache(config=models[name].config, max_cache_len=kwargs.pop("max_cache_len"))
            return models[name].generate(ids, **kwargs)
        with plan:
            return cp_compile.hf.generate(models[name], ids, **kwargs)

    def decode_steps(compile_decode: bool) -> tuple[dict, str]:
        steps: dict = {name: [] for name in models}
        tokens = {}
        for rep in range(args.reps + compile_decode):  # a compiled run first compiles, untimed
            for name in models:
                clock = Clock()
                tokens[name] = generate(name, args.new + 1, clock, compile_decode)
                if rep or not compile_decode:
                    steps[name].extend(b - a for a, b in zip(clock.times[1:], clock.times[2:]))
        medians = {name: statistics.median(t) * 1e3 for name, t in steps.items()}
        return medians, "tokens the same" if torch.equal(*tokens.values()) else "TOKENS DIFFER"

    rows = []
    prefill: dict = {name: [] for name in models}
    for _ in range(args.reps):
        for name in models:
            start = time.perf_counter()
            generate(name, 1, Clock())
            prefill[name].append(time.perf_counter() - start)
    rows.append(("prefill ms", {name: min(t) * 1e3 for name, t in prefill.items()}, ""))
    rows.append(("decode ms/token", *decode_steps(False)))
    if args.compile:
        rows.append(("compiled decode ms/token", *decode_steps(True)))
    if args.train:
        rows.append(("train step ms", *_train_steps(models, plan, args)))
    print(f"prompt {args.prompt}, {args.new} new tokens, {args.reps} runs each, in turn")
    for what, times, check in rows:
        ratio = times["plan"] / times["plain"]
        print(f"{what:<25} plain {times['plain']:7.3f}  plan (C=1) {times['plan']:7.3f}  {ratio:.2f}x  {check}")
    dist.destroy_process_group()


def _train_steps(models: dict, plan, args) -> tuple[dict, str]:
    """The median eager forward and backward of ``args.train_tokens`` tokens on each side, and whether the losses
    are the same (to fp32 rounding)."""
    n = args.train_tokens
    ids = torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(3))
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)  # labels shifted once, over the whole sequence
    times: dict = {name: [] for name in models}
    losses = {}
    for _ in range(args.reps + 1):  # the first step warms up, untimed
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            if name == "plain":
                out = model(input_ids=ids, labels=ids, shift_labels=shift, use_cache=False)
                out.loss.backward()
            else:
                with plan:
                    out = model(
                        input_ids=plan.shard(ids, 1),
                        position_ids=plan.positions(n)[None],
                        labels=plan.shard(ids, 1),
                        shift_labels=plan.shard(shift, 1),
                        num_items_in_batch=torch.tensor(n - 1),
                        use_cache=False,
                    )
                    out.loss.backward()
            times[name].append(time.perf_counter() - start)
            losses[name] = out.loss.item()
    same = abs(losses["plain"] - losses["plan"]) <= 1e-5 * abs(losses["plain"])
    medians = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
    return medians, "loss the same" if same else "LOSS DIFFERS"


if __name__ == "__main__":
    main()
