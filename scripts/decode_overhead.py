"""What generation under a plan of one rank costs beyond one process's, where there is nothing to communicate.

One process, one thread: the same Llama weights on ``attn_implementation="sdpa"`` (plain transformers) and on
``"cp_compile"`` under ``ContextParallel`` of one gloo rank (``cp_compile.hf.generate``), run in turn. Prints the
prefill (the fastest ``max_new_tokens=1`` generation) and the median decode step (time between consecutive calls
of a stopping criterion), and checks that the tokens are the same.

    python scripts/decode_overhead.py [--prompt 512] [--new 48] [--reps 5]
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
from transformers import StoppingCriteria

import cp_compile
import cp_compile.hf


class Clock(StoppingCriteria):
    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=args.prompt + args.new + 8,
    )
    models = {}
    for name, attn in (("plain", "sdpa"), ("plan", "cp_compile")):
        torch.manual_seed(0)  # the same weights; a config of its own each (the model keeps the one it is given)
        models[name] = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=attn)
    ids = torch.randint(0, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    plan = cp_compile.ContextParallel()

    def generate(name: str, new: int, clock: Clock):
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, stopping_criteria=[clock])
        if name == "plain":
            return models[name].generate(ids, **kwargs)
        with plan:
            return cp_compile.hf.generate(models[name], ids, **kwargs)

    prefill: dict = {name: [] for name in models}
    steps: dict = {name: [] for name in models}
    for _ in range(args.reps):
        for name in models:
            start = time.perf_counter()
            generate(name, 1, Clock())
            prefill[name].append(time.perf_counter() - start)
            clock = Clock()
            generate(name, args.new + 1, clock)
            steps[name].extend(b - a for a, b in zip(clock.times[1:], clock.times[2:]))
    assert torch.equal(generate("plain", 8, Clock()), generate("plan", 8, Clock())), "the tokens differ"
    first = {name: min(t) * 1e3 for name, t in prefill.items()}
    step = {name: statistics.median(t) * 1e3 for name, t in steps.items()}
    print(f"prompt {args.prompt}, {args.new} new tokens, {args.reps} runs each, in turn; tokens the same")
    for what, times in (("prefill ms", first), ("decode ms/token", step)):
        ratio = times["plan"] / times["plain"]
        print(f"{what:<17} plain {times['plain']:7.3f}  plan (C=1) {times['plan']:7.3f}  {ratio:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
