"""Fine-tune a Hugging Face Llama with TRL's SFTTrainer on packed examples under context parallelism, and the
same script on one process: the logged losses must match step for step, also across a resume.

    python examples/sft_trl.py                           # C=2 against one process, then a resume at C=1
    python examples/sft_trl.py --steps 8 --compile aot_eager --plot sft.png
    python examples/sft_trl.py --launcher accelerate --cp 2 --dp 2      # 4 processes: 2 replicas of C=2

What changes for CP in the training script itself (``train`` below) is the trainer class,
``class CPSFTTrainer(cp_compile.hf.ContextParallelMixin, SFTTrainer)``, and the plan passed to it; the
model, ``SFTConfig(packing=True, ...)`` and the dataset are the one-process script's. The dataset is built
here in the plain-text format of language-modeling datasets (a ``text`` column), tokenized by a word-level
tokenizer built here too: nothing is downloaded.

Without ``--worker`` the script is the driver: it runs the one-process reference, the CP run (launched with
``torchrun --nproc-per-node C*DP`` or ``accelerate launch --num_processes C*DP``), and, with ``--resume-at k``
(default: half way), the CP run's checkpoint of step k resumed at C = ``--resume-cp`` (the file a job stopped after
step k leaves; ``--stop-cp 1``: the one-process run's).
It prints the largest relative difference of the logged losses against one process, the steps per second
of each run, plots the curves, and exits 1 when a difference exceeds --tol (fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

WORDS = [f"w{i}" for i in range(48)]


def build_tokenizer():
    """A word-level tokenizer over this script's vocabulary (tokenizers' own classes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_dataset(n: int, seed: int):
    """``n`` texts of 3 to 60 words: a random motif repeated (copying needs the right document in attention)."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        motif = rng.choices(WORDS, k=rng.randint(1, 6))
        length = rng.randint(3, 60)
        texts.append(" ".join((motif * (length // len(motif) + 1))[:length]))
    return Dataset.from_dict({"text": texts})


def build_model(vocab_size: int, family: str = "llama"):
    """A small model of ``family``: Llama, Qwen3, a hybrid whose layers mix tokens outside attention (Qwen3.5's Gated
    DeltaNet, LFM2's short convolutions) beside full attention, or one whose attention is code of its own (BLOOM's
    ALiBi, Doge's dynamic mask)."""
    import torch
    import transformers

    shared = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    shared.update(num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if family == "llama":
        config, cls = transformers.LlamaConfig(num_hidden_layers=2, **shared), transformers.LlamaForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(num_hidden_layers=2, head_dim=16, **shared)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(
            layer_types=["linear_attention", "full_attention"],
            num_hidden_layers=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            **shared,
        )
        cls = transformers.Qwen3_5ForCausalLM
    elif family == "bloom":  # ALiBi, in attention code of its own
        config = transformers.BloomConfig(vocab_size=vocab_size, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0)
        config.bos_token_id = config.eos_token_id = 1
        cls = transformers.BloomForCausalLM
    elif family == "doge":  # a dynamic mask of its own: a bias per key from the values, cut to each query's top keys
        # its MLP is dense (no router): no auxiliary loss, for which TRL would ask its router logits
        config = transformers.DogeConfig(num_hidden_layers=2, keep_window_size=32, router_aux_loss_coef=0.0, **shared)
        cls = transformers.DogeForCausalLM
    else:
        config = transformers.Lfm2Config(layer_types=["conv", "full_attention"], num_hidden_layers=2, **shared)
        cls = transformers.Lfm2ForCausalLM
    torch.manual_seed(0)  # the same weights in every process
    return cls._from_config(config, attn_implementation="cp_compile")


def run_arguments(opts) -> dict:
    """The ``TrainingArguments`` of a run of this script's or ``dpo_trl.py``'s: steps, batch, learning rate, a log
    line and (with ``--save-steps``) a checkpoint, evaluation, on the CPU, with the same seed in every run."""
    return dict(
        output_dir=opts.output_dir,
        max_steps=opts.steps,
        per_device_train_batch_size=opts.batch,
        gradient_accumulation_steps=opts.accum,
        learning_rate=opts.lr,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=opts.save_steps,
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        eval_strategy="steps" if opts.eval_steps else "no",
        eval_steps=opts.eval_steps or None,
        per_device_eval_batch_size=opts.batch,
    )


def train(opts) -> None:
    """One run of the training script: under CP when launched on several processes."""
    import torch
    import torch.distributed as dist
    from trl import SFTConfig, SFTTrainer

    import cp_compile
    import cp_compile.hf

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    config = SFTConfig(
        **run_arguments(opts),
        optim=opts.optim,
        packing=True,
        bf16=opts.bf16,
        max_length=opts.max_length,
        torch_compile=opts.compile is not None,
        torch_compile_backend=opts.compile,
    )
    train_data, eval_data = build_dataset(400, seed=1), build_dataset(24, seed=2) if opts.eval_steps else None
    model = build_model(len(tokenizer), opts.model)
    kwargs = dict(model=model, args=config, processing_class=tokenizer)
    base = SFTTrainer
    if opts.trainer == "trainer":  # transformers' own Trainer on examples it packs itself into one row
        from transformers import DataCollatorWithFlattening, Trainer

        def tokenize(dataset):
            return dataset.map(lambda row: tokenizer(row["text"] + tokenizer.eos_token), remove_columns=["text"])

        base, train_data = Trainer, tokenize(train_data)
        eval_data = tokenize(eval_data) if eval_data is not None else None
        kwargs["data_collator"] = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    kwargs.update(train_dataset=train_data, eval_dataset=eval_data)
    kernels = contextlib.nullcontext()
    if opts.cp == 1:
        trainer = base(**kwargs)  # the script without CP, unchanged (one process, or data parallel)
        if opts.model != "llama" and not torch.cuda.is_available():
            # a hybrid restarts its convolutions and scans at each packed document with the fused kernels (CUDA)
            # alone; on CPU, stand-ins that run each document alone (under CP, the plan restarts them itself)
            from cp_compile.tools.restarting import restarting_kernels

            kernels = restarting_kernels(sys.modules[type(model).__module__])
    else:
        from torch.distributed.device_mesh import init_device_mesh

        class CPTrainer(cp_compile.hf.ContextParallelMixin, base):
            pass

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // opts.cp, opts.cp), mesh_dim_names=("dp", "cp"))
        trainer = CPTrainer(**kwargs, plan=cp_compile.ContextParallel(mesh["cp"]))
    with kernels:
        trainer.train(resume_from_checkpoint=opts.resume_from)
    if trainer.is_world_process_zero():
        from torch._dynamo.utils import counters

        backend = getattr(trainer, "cp_backend", None)
        Path(opts.out).write_text(
            json.dumps(
                {
                    "history": trainer.state.log_history,
                    "graph_breaks": sum(counters["graph_break"].values()),
                    "cp_graphs": len(backend.records) if backend is not None else None,
                }
            )
        )
    # The trainer goes first, while the process groups are registered: its DDP wrapper's reducer, if it dropped a
    # group's last reference, would join gloo's threads holding the GIL, which one of them may still need to free
    # a finished collective's tensors (a hang). Destroyed from Python, a group lets go of the GIL while it joins
    # them (docs/guides/errors.md, "A rank aborts or hangs as it exits").
    del trainer
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(opts, *, processes: int, cp: int, out: Path, output_dir: Path, extra=()) -> list[dict]:
    """One training run in processes of its own; returns its log history."""
    worker = [
        str(Path(__file__).resolve()),
        "--worker",
        "--cp",
        str(cp),
        "--out",
        str(out),
        "--output-dir",
        str(output_dir),
        "--steps",
        str(opts.steps),
        "--batch",
        str(opts.batch),
        "--accum",
        str(opts.accum),
        "--lr",
        str(opts.lr),
        "--optim",
        opts.optim,
        "--max-length",
        str(opts.max_length),
        "--save-steps",
        str(opts.save_steps),
        "--eval-steps",
        str(opts.eval_steps),
        "--trainer",
        opts.trainer,
        "--model",
        opts.model,
        *extra,
    ]
    if opts.bf16:
        worker.append("--bf16")
    if opts.compile:
        worker += ["--compile", opts.compile]
    run_script(worker, processes, opts.launcher)
    result = json.loads(out.read_text())
    if opts.compile:
        cp_graphs = "" if result["cp_graphs"] is None else f", the CP backend {result['cp_graphs']} graphs"
        print(f"{out.stem}: {result['graph_breaks']} graph breaks{cp_graphs}")
    return result["history"]


def run_script(worker: list[str], processes: int, launcher: str) -> None:
    """Run ``worker`` (a script and its arguments) on ``processes`` processes: itself for one, else under
    ``torchrun`` or ``accelerate launch``; exits with the run's output when it fails."""
    if processes == 1:
        command = [sys.executable, *worker]
    elif launcher == "torchrun":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(processes),
            "--master-port",
            str(_free_port()),
            *worker,
        ]
    else:  # --multi_gpu is accelerate's launcher of local processes (torch's elastic agent); on CPU too
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(_free_port()),
            *worker,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stdout.write(run.stdout[-4000:] + run.stderr[-8000:])
        raise SystemExit(f"run failed: {' '.join(command)}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(history: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def eval_losses(history: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["eval_loss"] for entry in history if "eval_loss" in entry}


def tokens(history: list[dict]) -> dict[int, float]:
    """TRL's ``num_tokens`` at each logged step: the tokens trained on so far, a throughput users read."""
    return {entry["step"]: entry["num_tokens"] for entry in history if "num_tokens" in entry}


def steps_per_second(history: list[dict]) -> float:
    return next(entry["train_steps_per_second"] for entry in history if "train_steps_per_second" in entry)


def largest_difference(run: dict[int, float], reference: dict[int, float], floor: Optional[dict] = None) -> float:
    """The largest difference of ``run`` from ``reference`` over the reference's steps, relative to the reference's
    value (or to ``floor[step]`` where that is larger: the size of the numbers a logged difference is taken from);
    a reference of 0 is measured against 1e-12."""
    floor = floor or {}
    return max(
        0.0 if run[s] == reference[s] else abs(run[s] - reference[s]) / max(abs(reference[s]), floor.get(s, 0.0), 1e-12)
        for s in reference
    )


def compare(name: str, run: dict[int, float], reference: dict[int, float], floor: Optional[dict] = None) -> float:
    """The largest difference of ``run`` from ``reference`` over the logged steps, relative to the reference's value
    (or to ``floor[step]`` where that is larger: the size of the numbers a logged difference is taken from)."""
    if sorted(run) != sorted(reference):
        raise SystemExit(f"{name}: logged steps {sorted(run)} differ from one process's {sorted(reference)}")
    worst = largest_difference(run, reference, floor)
    print(f"{name}: {len(run)} steps, largest relative difference against one process {worst:.2e}")
    return worst


def plot(path: str, curves: dict[str, dict[int, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(2, 1))
    reference = curves["one process"]
    for (name, curve), style in zip(curves.items(), ("-", "--", ":", "-.")):
        steps = sorted(curve)
        top.plot(steps, [curve[s] for s in steps], style, label=name, linewidth=1.5)
        if name != "one process":
            bottom.semilogy(
                steps, [max(abs(curve[s] - reference[s]) / abs(reference[s]), 1e-12) for s in steps], style, label=name
            )
    top.set_ylabel("training loss (logged by the Trainer)")
    top.set_title(title)
    top.legend()
    bottom.set_ylabel("relative difference")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options this script and ``dpo_trl.py`` share: the plot, the kept files, and those of one run (what the
    driver launches)."""
    p.add_argument("--plot", default=None, help="PNG of the loss curves")
    p.add_argument("--keep", default=None, help="keep the runs' files in this folder")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--output-dir", help=argparse.SUPPRESS)
    p.add_argument("--save-steps", type=int, default=10_000, help=argparse.SUPPRESS)
    p.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas beside CP (processes: cp * dp)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=2, help="packed rows per step and replica (flattened into one)")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optim", default="adamw_torch", help="adamw_torch or sgd")
    p.add_argument("--max-length", type=int, default=128, help="tokens per packed row")
    p.add_argument(
        "--compile",
        choices=("inductor", "aot_eager"),
        default=None,
        help="torch_compile=True with this torch_compile_backend (behind the plan's backend)",
    )
    p.add_argument(
        "--trainer",
        choices=("sft", "trainer"),
        default="sft",
        help="TRL's SFTTrainer (packing=True), or transformers' Trainer with DataCollatorWithFlattening",
    )
    p.add_argument(
        "--model",
        choices=("llama", "qwen3_5", "lfm2", "bloom", "doge"),
        default="llama",
        help="Llama; a hybrid: Qwen3.5 (Gated DeltaNet) or LFM2 (short convolutions) beside full attention; or "
        "attention of a model's own code: BLOOM (ALiBi) or Doge (a dynamic mask)",
    )
    p.add_argument("--bf16", action="store_true", help="SFTConfig's default bf16 autocast (else fp32)")
    p.add_argument("--launcher", choices=("torchrun", "accelerate"), default="torchrun")
    p.add_argument(
        "--resume-at",
        type=int,
        default=None,
        help="resume the CP run's checkpoint of this step (default: half way; 0: no resume)",
    )
    p.add_argument("--stop-cp", type=int, default=None, help="whose checkpoint is resumed: 1 (one process) or --cp")
    p.add_argument("--resume-cp", type=int, default=1, help="CP degree of the resumed run")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every this many steps (0: never)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative loss difference per step")
    add_run_options(p)
    opts = p.parse_args()
    if opts.worker:
        train(opts)
        return 0

    resume_at = opts.steps // 2 if opts.resume_at is None else opts.resume_at
    work = Path(opts.keep or tempfile.mkdtemp(prefix="sft_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    processes, stop_cp = opts.cp * opts.dp, opts.stop_cp or opts.cp
    if stop_cp not in (1, opts.cp):
        p.error(f"--stop-cp {stop_cp}: the checkpoint resumed is the one-process run's (1) or the CP run's (--cp)")
    # both runs save a checkpoint at step k (the file a job stopped there leaves), and run alike in all else
    saving = ("--save-steps", str(resume_at)) if resume_at else ()
    reference = launch(
        opts,
        processes=opts.dp,
        cp=1,
        out=work / "reference.json",
        output_dir=work / "reference",
        extra=saving,
    )
    cp = launch(
        opts,
        processes=processes,
        cp=opts.cp,
        out=work / "cp.json",
        output_dir=work / "cp",
        extra=saving,
    )
    where = f"C={opts.cp}" + (f" x {opts.dp} replicas" if opts.dp > 1 else "")
    name = "SFTTrainer" if opts.trainer == "sft" else "Trainer"
    worst = compare(f"{name} under CP ({where}, {opts.launcher})", losses(cp), losses(reference))
    if opts.eval_steps:
        worst = max(worst, compare("evaluation loss", eval_losses(cp), eval_losses(reference)))
    if tokens(cp) != tokens(reference):
        print(f"FAIL: num_tokens under CP {tokens(cp)} differs from one process's {tokens(reference)}")
        worst = float("inf")
    elif tokens(cp):
        print(f"num_tokens: as one process's at every logged step ({max(tokens(cp).items())[1]:.0f} at the last)")
    print(f"steps per second: one process {steps_per_second(reference):.2f}, CP {steps_per_second(cp):.2f}")
    curves = {"one process": losses(reference), f"CP {where}": losses(cp)}
    if resume_at:
        stopped = work / ("cp" if stop_cp == opts.cp else "reference")
        resume_processes = opts.resume_cp * opts.dp
        resumed = launch(
            opts,
            processes=resume_processes,
            cp=opts.resume_cp,
            out=work / "resumed.json",
            output_dir=stopped,
            extra=("--resume-from", str(stopped / f"checkpoint-{resume_at}")),
        )
        after = {s: v for s, v in losses(resumed).items() if s > resume_at}
        ref_after = {s: v for s, v in losses(reference).items() if s > resume_at}
        change = f"C={stop_cp} checkpoint of step {resume_at} resumed at C={opts.resume_cp}"
        worst = max(worst, compare(change, after, ref_after))
        curves[change] = {**{s: v for s, v in losses(resumed).items() if s <= resume_at}, **after}
    if opts.plot:
        title = "TRL SFTTrainer, packed" if opts.trainer == "sft" else "Trainer, DataCollatorWithFlattening"
        plot(opts.plot, curves, f"{title}, {where}: logged loss against one process")
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    if worst > opts.tol:
        print(f"FAIL: a logged loss is {worst:.2e} (relative) from one process's, above --tol {opts.tol}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
