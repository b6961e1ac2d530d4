"""Preference-tune a Hugging Face model with TRL's DPOTrainer under context parallelism; with ``--compare``, the
same script on one process too: every logged metric must match step for step, also across a resume.

    python examples/dpo_trl.py --compare                      # C=2 against one process
    python examples/dpo_trl.py --compare --cp 3 --loss-type sigmoid,ipo
    python examples/dpo_trl.py --compare --cp 2 --dp 2        # 4 processes: 2 replicas of C=2, against DDP on 2
    python examples/dpo_trl.py --compare --stop-cp 1 --resume-at 2   # one process stopped at step 2, resumed at C=2

What changes for CP in the training script itself (``train`` below) is the trainer class,
``class CPDPOTrainer(cp_compile.hf.ContextParallelMixin, DPOTrainer)``, and the plan passed to it; the model,
the reference model, ``DPOConfig`` (its defaults: padded rows, activation checkpointing) and the dataset are the
one-process script's. The dataset is built here in TRL's standard preference format (``prompt``, ``chosen``,
``rejected`` texts): the chosen completion continues the prompt's repeated motif, the rejected one does not.

The driver launches each run in processes of its own (``torchrun --nproc-per-node C*DP`` or ``accelerate launch``)
and prints the metrics DPOTrainer logs. With ``--compare`` it runs the one-process reference first (DDP on DP
processes for ``--dp``), prints the largest relative difference of every logged metric and exits 1 above --tol.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
from pathlib import Path

from sft_trl import (
    WORDS,
    add_run_options,
    build_model,
    build_tokenizer,
    compare,
    largest_difference,
    plot,
    run_arguments,
    run_script,
)

BETA = 0.1  # DPOConfig.beta
# What the trainer logs that depends on the wall clock, or counts steps, not on the training.
_TIMED = ("_runtime", "_per_second", "total_flos", "epoch", "step_time")


# Counted from the start of the process, not kept in a checkpoint: the Trainer's mean loss over the steps this process
# ran, and DPOTrainer's count of the tokens trained on (also logged with the evaluation).
_PER_PROCESS = ("train_loss", "num_tokens")


def build_dataset(n: int, seed: int):
    """``n`` preference pairs: a prompt of 2 to 40 words repeating a motif; the chosen completion continues the
    motif, the rejected one is random words; completions of 1 to 24 words (rows of many lengths, padded)."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        motif = rng.choices(WORDS, k=rng.randint(1, 5))
        prompt, completion = rng.randint(2, 40), rng.randint(1, 24)
        words = (motif * ((prompt + completion) // len(motif) + 1))[: prompt + completion]
        rows["prompt"].append(" ".join(words[:prompt]))
        rows["chosen"].append(" " + " ".join(words[prompt:]))
        rows["rejected"].append(" " + " ".join(rng.choices(WORDS, k=rng.randint(1, 24))))
    return Dataset.from_dict(rows)


def train(opts) -> None:
    """One run of the training script: under CP when launched with --cp above 1."""
    import torch
    import torch.distributed as dist
    from datasets import load_from_disk
    from trl import DPOConfig, DPOTrainer

    import cp_compile
    import cp_compile.hf

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    config = DPOConfig(
        **run_arguments(opts),
        loss_type=opts.loss_type.split(","),
        beta=BETA,
        precompute_ref_log_probs=opts.precompute,
        bf16=opts.bf16,
        max_length=128,
        torch_compile=opts.compile is not None,
        torch_compile_backend=opts.compile,
    )
    dtype = getattr(torch, opts.dtype)
    model = build_model(len(tokenizer), opts.model).to(dtype)
    kwargs = dict(
        model=model,
        ref_model=None if opts.precompute else build_model(len(tokenizer), opts.model).to(dtype),
        args=config,
        processing_class=tokenizer,
        train_dataset=load_from_disk(str(Path(opts.data) / "train")),
        eval_dataset=load_from_disk(str(Path(opts.data) / "eval")) if opts.eval_steps else None,
    )
    if opts.cp == 1:
        trainer = DPOTrainer(**kwargs)  # the script without CP, unchanged (one process, or data parallel)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        class CPDPOTrainer(cp_compile.hf.ContextParallelMixin, DPOTrainer):
            pass

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // opts.cp, opts.cp), mesh_dim_names=("dp", "cp"))
        trainer = CPDPOTrainer(**kwargs, plan=cp_compile.ContextParallel(mesh["cp"]))
    trainer.train(resume_from_checkpoint=opts.resume_from)
    if trainer.is_world_process_zero():
        backend = getattr(trainer, "cp_backend", None)
        graphs = len(backend.records) if backend is not None else None
        Path(opts.out).write_text(json.dumps({"history": trainer.state.log_history, "cp_graphs": graphs}))
    del trainer  # before the process groups (examples/sft_trl.py says why)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(opts, *, processes: int, cp: int, out: Path, output_dir: Path, extra=()) -> list[dict]:
    """One training run in processes of its own; returns its log history."""
    worker = [str(Path(__file__).resolve()), "--worker", "--cp", str(cp), "--out", str(out), "--data", opts.data]
    worker += ["--output-dir", str(output_dir), "--steps", str(opts.steps), "--batch", str(opts.batch)]
    worker += ["--accum", str(opts.accum), "--lr", str(opts.lr), "--loss-type", opts.loss_type]
    worker += ["--model", opts.model, "--dtype", opts.dtype, "--eval-steps", str(opts.eval_steps)]
    worker += ["--save-steps", str(opts.save_steps)]
    if opts.precompute:
        worker.append("--precompute")
    if opts.bf16:
        worker.append("--bf16")
    if opts.compile:
        worker += ["--compile", opts.compile]
    run_script(worker + list(extra), processes, opts.launcher)
    result = json.loads(out.read_text())
    if result["cp_graphs"] is not None:
        print(f"{out.stem}: the plan's backend compiled {result['cp_graphs']} graphs")
    return result["history"]


def metrics(history: list[dict]) -> dict[str, dict[int, float]]:
    """Every logged number, by name and step (the wall-clock ones left out)."""
    table: dict[str, dict[int, float]] = {}
    for entry in history:
        for name, value in entry.items():
            if name != "step" and not name.endswith(_TIMED) and isinstance(value, (int, float)):
                table.setdefault(name, {})[entry["step"]] = float(value)
    return table


def floors(name: str, reference: dict[str, dict[int, float]]) -> dict[int, float]:
    """A reward is BETA times the difference of two log-probabilities of a completion (the policy's and the
    reference model's), each a sum of about 50 tokens' fp32 values: right after the first update it is a few
    thousandths, and fp32's rounding of the log-probabilities (1e-7 of them, as for any change of the order of a sum)
    is 1e-4 of it. It is measured against BETA times the larger log-probability of its step instead."""
    if not _is_reward(name):
        return {}
    prefix = "eval_" if name.startswith("eval_") else ""
    chosen, rejected = reference[f"{prefix}logps/chosen"], reference[f"{prefix}logps/rejected"]
    return {step: BETA * max(abs(chosen[step]), abs(rejected[step])) for step in chosen}


def against_fp64(opts, work: Path, cp: dict, one: dict) -> float:
    """The bf16 runs against one process in fp64 (the same script with ``--dtype float64``, no autocast): each
    metric's error under CP must be within twice one process's bf16 error (or under --tol). Returns 0 when every
    metric passes, else the worst ratio of the two errors."""
    exact_opts = argparse.Namespace(**{**vars(opts), "bf16": False, "dtype": "float64", "compile": None})
    exact = metrics(launch(exact_opts, processes=opts.dp, cp=1, out=work / "fp64.json", output_dir=work / "fp64"))
    print("bf16 against one process in fp64, every logged metric (CP's error / one process's):")
    worst = 0.0
    for name in sorted(cp):
        floor = floors(name, exact)
        errors = [largest_difference(run, exact[name], floor) for run in (cp[name], one[name])]
        ratio = 0.0 if errors[0] <= opts.tol else errors[0] / max(errors[1], 1e-12)
        print(f"  {name}: {errors[0]:.2e} / {errors[1]:.2e}{'  FAIL: above twice' if ratio > 2 else ''}")
        worst = max(worst, ratio)
    return 0.0 if worst <= 2 else worst


def _is_reward(name: str) -> bool:
    """A logged reward (not the accuracy of the rewards' order), in training or evaluation."""
    return name.removeprefix("eval_").startswith("rewards/") and not name.endswith("accuracies")


def label(name: str) -> str:
    return f"  {name}" + (" (against BETA x |logps| where larger)" if _is_reward(name) else "")


def add_compared_run_options(p: argparse.ArgumentParser) -> None:
    """The options of this script and ``grpo_trl.py``: the run, its launch, the comparison and the resume."""
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas beside CP (processes: cp * dp)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--launcher", choices=("torchrun", "accelerate"), default="torchrun")
    p.add_argument("--compare", action="store_true", help="run the same training on one process and compare")
    p.add_argument("--resume-at", type=int, default=0, help="resume the checkpoint of this step (0: no resume)")
    p.add_argument("--stop-cp", type=int, default=None, help="whose checkpoint is resumed: 1 (one process) or --cp")
    p.add_argument("--resume-cp", type=int, default=None, help="CP degree of the resumed run (default: --cp)")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every this many steps (0: never)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative difference of a logged metric")
    add_run_options(p)
    p.add_argument("--data", help=argparse.SUPPRESS)


def resumed_degrees(p: argparse.ArgumentParser, opts) -> tuple[int, int]:
    """(the CP degree of the run whose checkpoint is resumed, that of the resumed run); both runs then save the
    checkpoint of ``--resume-at``."""
    stop_cp, resume_cp = opts.stop_cp or opts.cp, opts.resume_cp or opts.cp
    if stop_cp not in (1, opts.cp):
        p.error(f"--stop-cp {stop_cp}: the checkpoint resumed is the one-process run's (1) or the CP run's (--cp)")
    if (opts.resume_at or stop_cp == 1) and not opts.compare:
        p.error("--resume-at and --stop-cp 1 compare the resumed run with one process's: add --compare")
    if opts.resume_at:
        opts.save_steps = opts.resume_at  # both runs save the file a job stopped after that step leaves
    return stop_cp, resume_cp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_compared_run_options(p)
    p.add_argument("--batch", type=int, default=2, help="preference pairs per step and replica")
    p.add_argument("--loss-type", default="sigmoid", help="DPOConfig.loss_type, comma-separated for a mix")
    p.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs=True (no reference model)")
    p.add_argument("--model", choices=("llama", "qwen3", "qwen3_5"), default="llama", help="Qwen3.5 is a hybrid")
    p.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="the models' dtype (TRL's fused head scores in fp32 either way)",
    )
    p.add_argument("--bf16", action="store_true", help="DPOConfig's default bf16 autocast (else fp32)")
    p.add_argument(
        "--compile",
        choices=("inductor", "aot_eager"),
        default=None,
        help="torch_compile=True with this torch_compile_backend (behind the plan's backend)",
    )
    opts = p.parse_args()
    if opts.worker:
        train(opts)
        return 0

    stop_cp, resume_cp = resumed_degrees(p, opts)
    work = Path(opts.keep or tempfile.mkdtemp(prefix="dpo_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    # on disk, as a dataset from the Hub is: every process of a run reads the same files, and so finds the reference
    # log-probabilities that the main process caches beside them (precompute_ref_log_probs)
    import datasets

    datasets.disable_progress_bars()
    opts.data = str(work / "data")
    build_dataset(64, seed=1).save_to_disk(f"{opts.data}/train")
    build_dataset(8, seed=2).save_to_disk(f"{opts.data}/eval")
    where = f"C={opts.cp}" + (f" x {opts.dp} replicas" if opts.dp > 1 else "")
    cp = metrics(launch(opts, processes=opts.cp * opts.dp, cp=opts.cp, out=work / "cp.json", output_dir=work / "cp"))
    last = max(cp["loss"])
    print(f"DPOTrainer under CP ({where}, {opts.launcher}), {opts.model}, loss {opts.loss_type}: step {last}")
    for name, values in sorted(cp.items()):
        print(f"  {name:28s} {values[max(values)]: .6g}")
    worst = 0.0
    if opts.compare:
        reference = launch(opts, processes=opts.dp, cp=1, out=work / "reference.json", output_dir=work / "reference")
        reference = metrics(reference)
        if sorted(cp) != sorted(reference):
            raise SystemExit(f"logged metrics {sorted(cp)} differ from one process's {sorted(reference)}")
        print(f"against one process{f' (DDP on {opts.dp})' if opts.dp > 1 else ''}, every logged metric:")
        worst = max(compare(label(name), cp[name], reference[name], floors(name, reference)) for name in sorted(cp))
        if opts.bf16:  # bf16 differs from bf16 by bf16's rounding: the test is against fp64
            worst = against_fp64(opts, work, cp, reference)
        curves = {"one process": reference["loss"], f"CP {where}": cp["loss"]}
        if opts.resume_at:
            stopped = work / ("cp" if stop_cp == opts.cp else "reference")
            resumed = launch(
                opts,
                processes=resume_cp * opts.dp,
                cp=resume_cp,
                out=work / "resumed.json",
                output_dir=stopped,
                extra=("--resume-from", str(stopped / f"checkpoint-{opts.resume_at}")),
            )
            resumed = metrics(resumed)
            change = f"C={stop_cp} checkpoint of step {opts.resume_at} resumed at C={resume_cp}"
            print(f"{change}, every logged metric after it:")
            for name in sorted(n for n in resumed if n.removeprefix("eval_") not in _PER_PROCESS):
                after = {s: v for s, v in resumed[name].items() if s > opts.resume_at}
                before = {s: reference[name][s] for s in after}
                worst = max(worst, compare(label(name), after, before, floors(name, reference)))
            curves[change] = resumed["loss"]
        if opts.plot:
            plot(opts.plot, curves, f"TRL DPOTrainer, {where}: logged loss against one process")
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    if worst > opts.tol:
        print(f"FAIL: a logged metric is {worst:.2e} (relative) from one process's, above --tol {opts.tol}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
