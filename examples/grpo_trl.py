"""RL-train a Hugging Face model with TRL's GRPOTrainer under context parallelism; with ``--compare``, the same
script on one process too: the same completions token for token, and every logged metric step for step, also across
a resume.

    python examples/grpo_trl.py --compare                      # C=2 against one process
    python examples/grpo_trl.py --compare --cp 3 --model qwen3_5 --beta 0.04
    python examples/grpo_trl.py --compare --cp 2 --dp 2        # 4 processes: 2 replicas of C=2, against DDP on 2
    python examples/grpo_trl.py --compare --stop-cp 1 --resume-at 2   # one process stopped at step 2, resumed at C=2

What changes for CP in the training script itself (``train`` below) is the trainer class,
``class CPGRPOTrainer(cp_compile.hf.ContextParallelMixin, GRPOTrainer)``, and the plan passed to it; the model,
``GRPOConfig``, the reward function and the dataset (prompts repeating a motif, in TRL's standard prompt-only
format) are the one-process script's. The reward is programmatic: how many of a completion's words are its prompt's
(or of the prompts' half of the vocabulary). It also records every completion it scores, which the driver compares
with one process's.

The driver launches each run in processes of its own (``torchrun --nproc-per-node C*DP`` or ``accelerate launch``).
With ``--compare`` it runs the one-process reference first (DDP on DP processes for ``--dp``), checks that each
replica sampled the reference process's completions, prints the largest relative difference of every logged metric
and exits 1 above --tol.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
from pathlib import Path

from dpo_trl import add_compared_run_options, metrics, resumed_degrees
from sft_trl import WORDS, build_model, build_tokenizer, compare, plot, run_arguments, run_script

# Counted from the start of the process, not kept in a checkpoint: the Trainer's mean loss over the steps it ran.
_PER_PROCESS = ("train_loss",)
# Every completion the reward function scored in this process: (step, prompt's token count, completion's ids).
_SCORED: list[tuple[int, int, list[int]]] = []
_FIRST_HALF = set(WORDS[: len(WORDS) // 2])


def build_dataset(n: int, seed: int):
    """``n`` prompts of 2 to 24 words repeating a motif of 1 to 4 words from the first half of the vocabulary (prompts
    of many lengths, left-padded)."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        motif = rng.choices(WORDS[: len(WORDS) // 2], k=rng.randint(1, 4))
        length = rng.randint(2, 24)
        prompts.append(" ".join((motif * (length // len(motif) + 1))[:length]))
    return Dataset.from_dict({"prompt": prompts})


def words_of_the_prompt(prompts, completions, completion_ids, trainer_state, **kwargs) -> list[float]:
    """Per word of a completion, 1 for a word of its prompt and 0.5 for another of the first half of the vocabulary
    (the prompts' words); the mean over the completion's words, 0 for an empty completion."""
    rewards = []
    for prompt, completion, ids in zip(prompts, completions, completion_ids):
        _SCORED.append((trainer_state.global_step, len(prompt.split()), list(ids)))
        words, seen = completion.split(), set(prompt.split())
        scores = [1.0 if word in seen else 0.5 if word in _FIRST_HALF else 0.0 for word in words]
        rewards.append(sum(scores) / len(scores) if scores else 0.0)
    return rewards


def train(opts) -> None:
    """One run of the training script: under CP when launched with --cp above 1."""
    import torch
    import torch.distributed as dist
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import cp_compile
    import cp_compile.hf

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    config = GRPOConfig(
        **run_arguments(opts),
        num_generations=opts.generations,
        max_completion_length=opts.completion,
        beta=opts.beta,
        loss_type=opts.loss_type,
        scale_rewards=opts.scale_rewards,
        top_entropy_quantile=opts.entropy_quantile,
        num_iterations=opts.iterations,
        steps_per_generation=opts.steps_per_generation,
        log_completions=opts.log_completions,
        num_completions_to_print=1,
        bf16=False,
        # how GRPOTrainer loads the reference model (beta above 0): from the policy's files
        model_init_kwargs={"attn_implementation": "cp_compile", "dtype": torch.float32},
    )
    model = AutoModelForCausalLM.from_pretrained(Path(opts.data) / opts.model, attn_implementation="cp_compile")
    kwargs = dict(
        model=model,
        reward_funcs=words_of_the_prompt,
        args=config,
        processing_class=tokenizer,
        train_dataset=load_from_disk(str(Path(opts.data) / "train")),
        eval_dataset=load_from_disk(str(Path(opts.data) / "eval")) if opts.eval_steps else None,
    )
    if opts.cp == 1:
        trainer = GRPOTrainer(**kwargs)  # the script without CP, unchanged (one process, or data parallel)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        class CPGRPOTrainer(cp_compile.hf.ContextParallelMixin, GRPOTrainer):
            pass

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // opts.cp, opts.cp), mesh_dim_names=("dp", "cp"))
        trainer = CPGRPOTrainer(**kwargs, plan=cp_compile.ContextParallel(mesh["cp"]))
    trainer.train(resume_from_checkpoint=opts.resume_from)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank % opts.cp == 0:  # the completions of each replica (of each process without CP)
        Path(f"{opts.out}.completions{rank // opts.cp}").write_text(json.dumps(_SCORED))
    if trainer.is_world_process_zero():
        # how the completions were generated: sharded (cp_compile.hf.generate), or why every rank ran them whole
        route = getattr(trainer, "generated_whole", "one process") or "sharded"
        # the completions table GRPOTrainer keeps for log_completions (its last generation batch)
        table = {key: list(trainer._logs[key]) for key in ("prompt", "completion", "advantages")}
        table["rewards"] = {name: list(values) for name, values in trainer._logs["rewards"].items()}
        out = {"history": trainer.state.log_history, "generation": route, "table": table}
        Path(opts.out).write_text(json.dumps(out))
    del trainer  # before the process groups (examples/sft_trl.py says why)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(opts, *, processes: int, cp: int, out: Path, output_dir: Path, extra=()) -> tuple[list[dict], list]:
    """One training run in processes of its own; returns its log history and each replica's completions."""
    worker = [str(Path(__file__).resolve()), "--worker", "--cp", str(cp), "--out", str(out), "--data", opts.data]
    worker += ["--output-dir", str(output_dir), "--steps", str(opts.steps), "--batch", str(opts.batch)]
    worker += ["--accum", str(opts.accum), "--lr", str(opts.lr), "--loss-type", opts.loss_type]
    worker += ["--model", opts.model, "--eval-steps", str(opts.eval_steps), "--save-steps", str(opts.save_steps)]
    worker += ["--generations", str(opts.generations), "--completion", str(opts.completion)]
    worker += ["--beta", str(opts.beta), "--scale-rewards", opts.scale_rewards]
    worker += ["--entropy-quantile", str(opts.entropy_quantile), "--iterations", str(opts.iterations)]
    if opts.steps_per_generation:
        worker += ["--steps-per-generation", str(opts.steps_per_generation)]
    if opts.log_completions:
        worker += ["--log-completions"]
    run_script(worker + list(extra), processes, opts.launcher)
    replicas = processes // cp
    scored = [json.loads(Path(f"{out}.completions{r}").read_text()) for r in range(replicas)]
    return json.loads(out.read_text())["history"], scored


# KL(policy || reference) per token is exp(x) - x - 1 of a log-ratio x, computed in fp32 (TRL's fused head scores in
# fp32): the difference of numbers near 1, resolved to fp32's spacing there, 1.2e-7. With kl near 1e-3 and below
# that spacing alone is 1e-4 of it, with or without CP; it is measured against KL_FLOOR where it is smaller, and the
# loss, whose policy term cancels within each group, against beta x KL_FLOOR.
KL_FLOOR = 1e-3


def floors(name: str, beta: float, steps) -> dict[int, float]:
    base = name.removeprefix("eval_")
    floor = KL_FLOOR if base == "kl" else beta * KL_FLOOR if base == "loss" else 0.0
    return dict.fromkeys(steps, floor)


def label(name: str, beta: float) -> str:
    floor = floors(name, beta, [0])[0]
    return f"  {name}" + (f" (against {floor:.0e} where smaller)" if floor else "")


def same_completions(run: list, reference: list, after: int = -1) -> bool:
    """Each replica's completions against the reference process's, token for token (those of steps after ``after``);
    prints the first difference."""
    for replica, (mine, theirs) in enumerate(zip(run, reference)):
        mine, theirs = [c for c in mine if c[0] > after], [c for c in theirs if c[0] > after]
        if mine != theirs:
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            print(f"  replica {replica}: completion {first} differs: {mine[first:][:1]} against {theirs[first:][:1]}")
            return False
        print(f"  replica {replica}: {len(mine)} completions, the same token for token")
    return True


def same_table(mine: Path, reference: Path) -> bool:
    """Whether the completions table (``log_completions``) of a run under CP holds one process's rows: the same
    prompts and completions in the same order, rewards and advantages equal (they are fp32 numbers of the same
    completions)."""
    ours, theirs = (json.loads(path.read_text())["table"] for path in (mine, reference))
    same = ours == theirs
    rows = len(theirs["completion"])
    verdict = "the same as" if same else "NOT the same as"
    print(f"completions table (log_completions): {rows} rows, {verdict} one process's")
    return same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_compared_run_options(p)
    p.add_argument("--batch", type=int, default=4, help="completions per step and replica")
    p.add_argument("--generations", type=int, default=2, help="GRPOConfig.num_generations (completions per prompt)")
    p.add_argument("--completion", type=int, default=12, help="GRPOConfig.max_completion_length")
    p.add_argument("--beta", type=float, default=0.0, help="GRPOConfig.beta (the KL term; above 0: a reference model)")
    p.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type")
    p.add_argument(
        "--iterations",
        type=int,
        default=1,
        help="GRPOConfig.num_iterations (above 1: each batch trained on again, scored by the old policy, clipped)",
    )
    p.add_argument(
        "--steps-per-generation",
        type=int,
        default=None,
        help="GRPOConfig.steps_per_generation (default: --accum; above it, a generation shuffled and split over steps)",
    )
    p.add_argument("--scale-rewards", default="group", help="GRPOConfig.scale_rewards: group, batch or none")
    p.add_argument("--entropy-quantile", type=float, default=1.0, help="GRPOConfig.top_entropy_quantile")
    p.add_argument("--model", choices=("llama", "qwen3", "qwen3_5"), default="qwen3", help="Qwen3.5 is a hybrid")
    p.add_argument(
        "--log-completions",
        action="store_true",
        help="GRPOConfig.log_completions; with --compare, the completions table against one process's",
    )
    opts = p.parse_args()
    if opts.worker:
        train(opts)
        return 0

    stop_cp, resume_cp = resumed_degrees(p, opts)
    work = Path(opts.keep or tempfile.mkdtemp(prefix="grpo_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    import datasets

    datasets.disable_progress_bars()
    opts.data = str(work / "data")
    build_dataset(64, seed=1).save_to_disk(f"{opts.data}/train")
    build_dataset(8, seed=2).save_to_disk(f"{opts.data}/eval")
    import cp_compile.hf  # noqa: F401  (attn_implementation="cp_compile")

    build_model(len(build_tokenizer()), opts.model).save_pretrained(f"{opts.data}/{opts.model}")
    where = f"C={opts.cp}" + (f" x {opts.dp} replicas" if opts.dp > 1 else "")
    history, scored = launch(
        opts, processes=opts.cp * opts.dp, cp=opts.cp, out=work / "cp.json", output_dir=work / "cp"
    )
    cp = metrics(history)
    last = max(cp["loss"])
    print(f"GRPOTrainer under CP ({where}, {opts.launcher}), {opts.model}, loss {opts.loss_type}: step {last}")
    route = json.loads((work / "cp.json").read_text())["generation"]
    print(f"  completions generated {'sharded' if route == 'sharded' else f'whole on every rank: {route}'}")
    for name, values in sorted(cp.items()):
        print(f"  {name:36s} {values[max(values)]: .6g}")
    worst, same = 0.0, True
    if opts.compare:
        reference_history, reference_scored = launch(
            opts, processes=opts.dp, cp=1, out=work / "reference.json", output_dir=work / "reference"
        )
        reference = metrics(reference_history)
        if sorted(cp) != sorted(reference):
            raise SystemExit(f"logged metrics {sorted(cp)} differ from one process's {sorted(reference)}")
        print(f"completions against one process{f' (DDP on {opts.dp})' if opts.dp > 1 else ''}:")
        same = same_completions(scored, reference_scored)
        print("every logged metric:")
        worst = max(
            compare(label(name, opts.beta), cp[name], reference[name], floors(name, opts.beta, reference[name]))
            for name in sorted(cp)
        )
        if opts.log_completions:
            same = same_table(work / "cp.json", work / "reference.json") and same
        curves = {"one process": reference["loss"], f"CP {where}": cp["loss"]}
        if opts.resume_at:
            stopped = work / ("cp" if stop_cp == opts.cp else "reference")
            resumed_history, resumed_scored = launch(
                opts,
                processes=resume_cp * opts.dp,
                cp=resume_cp,
                out=work / "resumed.json",
                output_dir=stopped,
                extra=("--resume-from", str(stopped / f"checkpoint-{opts.resume_at}")),
            )
            resumed = metrics(resumed_history)
            change = f"C={stop_cp} checkpoint of step {opts.resume_at} resumed at C={resume_cp}"
            print(f"{change}: completions after it")
            same = same_completions(resumed_scored, reference_scored, after=opts.resume_at - 1) and same
            print("every logged metric after it:")
            for name in sorted(n for n in resumed if n.removeprefix("eval_") not in _PER_PROCESS):
                after = {s: v for s, v in resumed[name].items() if s > opts.resume_at}
                before = {s: reference[name][s] for s in after}
                worst = max(worst, compare(label(name, opts.beta), after, before, floors(name, opts.beta, after)))
            curves[change] = resumed["loss"]
        if opts.plot:
            plot(opts.plot, curves, f"TRL GRPOTrainer, {where}: logged loss against one process")
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    if opts.compare:
        print(f"largest relative difference of a logged metric from one process's: {worst:.2e}")
    if not same:
        print("FAIL: a replica sampled other completions than one process")
        return 1
    if worst > opts.tol:
        print(f"FAIL: a logged metric is {worst:.2e} (relative) from one process's, above --tol {opts.tol}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
