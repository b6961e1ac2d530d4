"""``transformers.Trainer`` and TRL's ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer`` under context parallelism, by
subclassing.

``ContextParallelMixin`` goes first in the bases of a trainer class::

    class CPSFTTrainer(cp_compile.hf.ContextParallelMixin, SFTTrainer):
        pass

    trainer = CPSFTTrainer(model, args=SFTConfig(packing=True, ...), train_dataset=ds, plan=plan)

Overriding the methods that ``Trainer`` documents as its extension points ("subclass and override") is
the one way in that sees each batch whole before the model does, decides what the loss is normalised by,
and keeps what a checkpoint holds unchanged; a callback sees no batch, a collator runs before the batch
is split between the data-parallel replicas, and accelerate's own context parallelism is torch's (SDPA
only, no packed documents). What the mixin changes:

- **data**: the ranks of one CP group are one data-parallel replica. Every one of them reads the same
  batches (the replica's), and replicas read different ones, as the processes of a run without CP would;
- **inputs**: each rank gets its shard of every batch, packed rows (TRL's ``position_ids`` /
  ``cu_seq_lens_q``, ``DataCollatorWithFlattening``) split per document, with global positions, labels
  shifted on the global sequence (``shift_labels``), and the model runs inside ``with plan:`` (and
  ``with plan.packed(cu):`` for a packed row);
- **loss**: ``Trainer`` counts the labels of the whole batch (``num_items_in_batch``); ``get_cp_size``
  tells it that C ranks counted the same batch. Each rank's loss is then its share of the global token
  mean, and the gradient all-reduce that ``Trainer`` already makes over every process sums the shares;
- **evaluation**: each rank's share of the replica's loss, summed over the CP group;
- **compilation**: ``torch_compile=True`` compiles the model in place (``Module.compile``) with the plan's
  backend, ``torch_compile_backend`` naming the backend behind it (``"inductor"`` or ``"aot_eager"``), so
  that saved and loaded state dicts keep their names.

A trainer that scores padded rows itself (TRL's ``DPOTrainer``: a batch without labels, with a
``completion_mask``) keeps its own loss and metrics: its model calls run sharded, each row a packed document, and
give their per-token outputs back whole on every rank of the replica (``rows.ScoredRows``).

A trainer that samples completions and scores them itself (TRL's ``GRPOTrainer``) generates them sharded
(``cp_compile.hf.generate`` of the replica's left-padded prompts, every rank sampling with the replica's random
state: the same tokens on each, one process's), scores them sharded as above, and computes its advantages, loss
and metrics seeing the replica as one process (``replicas.ReplicaAccelerator``): its gathers and reductions then
count each completion once.

Checkpoints hold nothing that depends on C: a run saved at one CP degree resumes at another (the random state of a
replica saved under the name of the process it stands for).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import shutil
import tempfile
import warnings
import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm.agree import every_rank
from ..errors import UnsupportedAttention
from ..plan import ContextParallel
from .batch import count_targets, documents, shard_batch, shift_labels
from .checks import prepare
from .generate import generate, why_not_batched
from .replicas import ReplicaAccelerator, completions_logged_once, data_parallel_group, one_copy_per_replica
from .rows import PackedRows, ScoredRows


class ContextParallelMixin:
    """Put first in the bases of a ``transformers.Trainer`` subclass (``Trainer``, TRL's ``SFTTrainer``, ...) to
    train under context parallelism; the rest of the trainer is unchanged. See the module docstring.

    Args:
        plan: the ``ContextParallel`` plan (its group is one data-parallel replica; build it on the CP dim of a
            2-D ``DeviceMesh`` ``(dp, cp)`` for data parallelism beside CP). Default: one plan over every
            process, on a group of its own. The trainer's own arguments go through unchanged.

    Raises:
        ValueError: a plan whose group is not a block of consecutive ranks (as ``init_device_mesh(..., (dp, cp))``
            makes), ``torch_compile_mode`` set (the plan's backend takes no mode), or, for a trainer that generates
            (GRPOTrainer), a replica's generation batch without whole groups of ``num_generations``.
        UnsupportedAttention: at a step, a batch CP cannot run exactly (padded rows, an unknown per-token entry); for
            a trainer that generates, at construction, what every rank of a replica would run once per completion
            (vLLM, tools, rollout functions) and ``torch_compile``, and at a step, reward functions that give a
            replica's ranks different rewards.
        TypeError: a trainer that generates without the methods the mixin overrides there (another TRL version).
    """

    def __init__(self, *args, plan: Optional[ContextParallel] = None, **kwargs):
        trainer_args = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if trainer_args is None:
            raise TypeError("ContextParallelMixin needs the trainer's args= (TrainingArguments or SFTConfig)")
        if not dist.is_initialized():
            raise RuntimeError(
                "ContextParallelMixin needs torch.distributed initialised: launch with torchrun or "
                "accelerate launch (TrainingArguments initialises the process group)"
            )
        self.plan = plan if plan is not None else ContextParallel(dist.new_group(list(range(dist.get_world_size()))))
        self._replica, self._replicas = _replica_of(self.plan)
        # a trainer that samples completions and scores them itself (TRL's GRPOTrainer)
        self._samples_completions = hasattr(type(self), "_generate_and_score_completions")
        self._rolled_out: Optional[dict[str, Any]] = None  # the step's inputs, generated before the plan is entered
        # why a trainer that generates (GRPOTrainer) runs its generation whole on every rank; None: it is sharded
        self.generated_whole: Optional[str] = None
        if self._samples_completions:
            # GRPOTrainer documents no extension point for its sampling and its reductions: the methods the mixin
            # overrides there must be the trainer's
            trainer = super()  # the next class's methods (a comprehension has no super() of its own)
            missing = [name for name in _SAMPLER_METHODS if not hasattr(trainer, name)]
            if missing:
                raise TypeError(
                    f"{type(self).__name__} generates completions (it has _generate_and_score_completions) but not "
                    f"{missing}: a TRL version ContextParallelMixin does not know (it is tried with TRL 1.16)"
                )
            trainer_args = _sampling_per_replica(trainer_args, self._replicas, self.plan.world_size, kwargs)
            args = _with_trainer_args(args, kwargs, trainer_args)
        self._compile_backend = None
        if trainer_args.torch_compile:
            if trainer_args.torch_compile_mode is not None:
                raise ValueError(
                    "torch_compile_mode is not supported under context parallelism: the model is "
                    "compiled with the plan's backend, which takes no mode"
                )
            self._compile_backend = trainer_args.torch_compile_backend or "inductor"
            # the trainer's accelerator would compile the wrapped model with a backend of its own
            trainer_args = copy.copy(trainer_args)
            trainer_args.torch_compile, trainer_args.torch_compile_backend = False, None
            args = _with_trainer_args(args, kwargs, trainer_args)
        super().__init__(*args, **kwargs)
        if self.accelerator.num_processes != dist.get_world_size():
            raise RuntimeError(
                f"accelerate runs {self.accelerator.num_processes} process(es) but torch.distributed has "
                f"{dist.get_world_size()}: the trainer would not see the ranks it shares batches with. On CPU pass "
                "use_cpu=True in the TrainingArguments (accelerate otherwise sets up no process group without "
                "GPUs), or launch with torchrun / accelerate launch so that accelerate sees every process"
            )
        self.cp_backend = None  # the plan's backend the model is compiled with (its records: the graphs)
        if self._compile_backend is not None:
            # compiled in place, its first call is traced whole, hooks and all: what a plan's first call puts on the
            # model's modules (forwards of their own, hooks) is put there before
            prepare(self.accelerator.unwrap_model(self.model))
            self.cp_backend = self.plan.backend(self._compile_backend)
            self.model.compile(backend=self.cp_backend)
        self._data_parallel = None
        if self._samples_completions:
            from accelerate.utils import set_seed

            self._data_parallel = data_parallel_group(self.plan, self._replicas)
            # GRPOTrainer seeds each process apart (its own completions); the ranks of a replica sample as one process
            set_seed(trainer_args.seed + self._replica)
            self.generated_whole = why_not_batched(self.accelerator.unwrap_model(self.model), self.plan)
            if self.generated_whole is not None:
                warnings.warn(
                    f"{type(self).__name__}: every rank of a replica generates its completions whole (C times the "
                    f"compute, one process's cache), since cp_compile.hf.generate cannot take a batch here: "
                    f"{self.generated_whole}",
                    stacklevel=2,
                )

    # -- data: one replica per CP group ---------------------------------------------------------------
    def get_cp_size(self) -> int:
        """C ranks read the same batches: ``Trainer`` divides the label count gathered from every process by it,
        and counts data-parallel replicas as processes / C."""
        return self.plan.world_size

    def get_train_dataloader(self):
        return self._per_replica(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._per_replica(super().get_eval_dataloader(eval_dataset))

    def _per_replica(self, loader):
        """Deals the batches to replicas instead of processes (accelerate's batch sampler reads both numbers
        at each iteration)."""
        if dist.get_world_size() == 1:
            return loader
        from accelerate.data_loader import BatchSamplerShard

        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, BatchSamplerShard):
            raise UnsupportedAttention(
                f"context parallelism needs a map-style dataset with a batch sampler accelerate shards; got "
                f"{type(loader).__name__} with {type(sampler).__name__} (iterable datasets and dispatched batches "
                "are not supported)"
            )
        sampler.num_processes, sampler.process_index = self._replicas, self._replica
        return loader

    # -- the step --------------------------------------------------------------------------------------
    def _under_plan(self, inputs: dict[str, Any]) -> contextlib.ExitStack:
        """``with plan:``, and ``with plan.packed(cu):`` for a packed row or for padded rows packed as one (its
        convolutions and scans read the documents there, also when a backward recomputes them)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.plan)
        if _scores_rows(inputs):
            cu = PackedRows.of(inputs["input_ids"], inputs.get("attention_mask")).cu_seqlens
        else:
            cu = documents(inputs)
        if cu is not None:
            stack.enter_context(self.plan.packed(cu))
        return stack

    def training_step(self, model, inputs, *args, **kwargs):
        if self._samples_completions:
            return self._training_step_on_completions(model, inputs, *args, **kwargs)
        # backward inside the plan too: activation checkpointing (SFTConfig's default) recomputes attention there
        with self._under_plan(inputs):
            return super().training_step(model, inputs, *args, **kwargs)

    def _training_step_on_completions(self, model, inputs, *args, **kwargs):
        """GRPOTrainer's step: completions sampled (``_generate_single_turn``) before the plan is entered for the
        step, then the step inside it, and the backward in its rows' documents."""
        model.train()  # as the step begins: GRPOTrainer reads the mode when it generates
        self._rolled_out = self._prepare_inputs(inputs)
        rows = torch.cat([self._rolled_out["prompt_mask"], self._rolled_out["completion_mask"]], 1)
        try:
            with self.plan, self.plan.packed(PackedRows(rows).cu_seqlens):
                return super().training_step(model, self._rolled_out, *args, **kwargs)
        finally:
            self._rolled_out = None

    def _generate_single_turn(self, *args, **kwargs):
        """GRPOTrainer's generation: the policy's ``generate``, which TRL calls on the replica's left-padded prompts,
        is ``cp_compile.hf.generate`` under the plan for the call (each rank prefills 1/C of every prompt and keeps
        1/C of its cache; every rank samples the batch as one process does)."""
        if self.generated_whole is not None:
            return super()._generate_single_turn(*args, **kwargs)
        policy = self.accelerator.unwrap_model(self.model)
        policy.generate = functools.partial(_generate_under, self.plan, policy)  # this instance, for this call
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            del policy.generate

    def _prepare_inputs(self, inputs):
        if not self._samples_completions:
            return super()._prepare_inputs(inputs)
        if inputs is self._rolled_out:  # the step's, prepared before the plan was entered
            return inputs
        with self._seen_per_replica(), completions_logged_once(self, self.plan.world_size):
            return super()._prepare_inputs(inputs)

    @contextlib.contextmanager
    def _seen_per_replica(self):
        """The trainer's accelerator as the process a replica stands for sees it (``replicas.ReplicaAccelerator``)."""
        accelerator = self.accelerator
        self.accelerator = ReplicaAccelerator(accelerator, self._replica, self._replicas, self._data_parallel)
        try:
            yield
        finally:
            self.accelerator = accelerator

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """GRPOTrainer's rewards of every process's completions: one copy per replica, as R processes gather them.

        Raises:
            UnsupportedAttention: the ranks of the replica sampled different completions (a generation that is not
                deterministic on this device); they would score different rows as one batch.
        """
        digest = zlib.crc32(repr(completion_ids_list).encode())
        if len({rank[0] for rank in every_rank([digest], self.plan.group, self.accelerator.device)}) > 1:
            raise UnsupportedAttention(
                "the ranks of a context-parallel replica sampled different completions from the same prompts and "
                "random state: generation is not deterministic on this device (make it so, e.g. "
                "torch.use_deterministic_algorithms(True))"
            )
        every = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return one_copy_per_replica(every, self.plan.world_size, self._replicas)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """GRPOTrainer's scoring calls (policy, old policy, reference model): sharded, their outputs whole."""
        with self.plan, ScoredRows(self.plan, [self.accelerator.unwrap_model(model)]):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._samples_completions:  # its model calls are sharded by _get_per_token_logps_and_entropies
            with self._seen_per_replica():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if _scores_rows(inputs):
            return self._compute_loss_on_rows(model, inputs, return_outputs, num_items_in_batch)
        if num_items_in_batch is None:
            raise UnsupportedAttention(
                "the trainer did not count the batch's labels (num_items_in_batch), so each rank's loss would be a "
                "mean over its own tokens: under context parallelism the model must accept loss kwargs "
                "(transformers' causal LMs do) or the trainer be given a compute_loss_func"
            )
        local = shard_batch(self.plan, inputs)
        # also in the model's own arguments: trainers that compute the loss from the model's outputs (TRL's
        # fused LM head) do not pass it on, and a shard's labels without it are refused (cp_compile.hf.checks)
        local["num_items_in_batch"] = num_items_in_batch
        counted = getattr(self, "_total_train_tokens", None) if model.training else None
        with self._under_plan(inputs):
            result = super().compute_loss(
                model, local, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if counted is not None:
            self._count_tokens_as_without_cp(counted, inputs)
        return result

    def _compute_loss_on_rows(self, model, inputs, return_outputs, num_items_in_batch):
        """A trainer that scores padded rows itself (TRL's DPOTrainer): its model calls run sharded and give their
        per-token outputs back whole (``rows.ScoredRows``), so that its own loss and metrics run unchanged, the
        same on every rank of a replica."""
        models = [self.accelerator.unwrap_model(model)]
        if getattr(self, "ref_model", None) is not None:
            models.append(self.accelerator.unwrap_model(self.ref_model))
        # TRL divides the token count it gathers from every process by ``_tp_size``, the ranks given the same
        # batch: here the C ranks of a replica are given the same rows too
        tp = getattr(self, "_tp_size", 1)
        self._tp_size = tp * self.plan.world_size
        try:
            with self._under_plan(inputs), ScoredRows(self.plan, models):
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
        finally:
            self._tp_size = tp

    def _count_tokens_as_without_cp(self, counted: int, inputs: dict[str, Any]) -> None:
        """TRL's SFTTrainer logs ``num_tokens``, the tokens trained on so far, from the inputs its compute_loss
        sees: under CP each rank's shard, whose padding slots it would count too. Counted again here as TRL
        counts the whole batch without CP (real tokens summed over data-parallel replicas)."""
        mine = (
            inputs["attention_mask"].sum()
            if "attention_mask" in inputs
            else torch.tensor(inputs["position_ids"].size(1))
        )
        tokens = mine.to(device=self.accelerator.device, dtype=torch.int64)
        dist.all_reduce(tokens)  # every rank of a replica holds the same batch
        self._total_train_tokens = counted + int(tokens) // self.plan.world_size // getattr(self, "_tp_size", 1)
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: the replica's loss on every rank of it (the mean over the whole batch's tokens)."""
        scores_itself = self._samples_completions or _scores_rows(inputs)
        if scores_itself:  # the trainer's own step, its model calls sharded by compute_loss
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if not prediction_loss_only:
            raise UnsupportedAttention(
                "under context parallelism evaluation computes the loss only: each rank "
                "holds a shard of the logits (no compute_metrics)"
            )
        inputs = self._prepare_inputs(inputs)
        local = shard_batch(self.plan, inputs)
        local["num_items_in_batch"] = count_targets(inputs)
        with torch.no_grad(), self.compute_loss_context_manager(), self._under_plan(inputs):
            # the model's own loss: compute_loss would scale it for the gradient all-reduce
            share = model(**local).loss.detach()
        dist.all_reduce(share, group=self.plan.group)
        return share, None, None

    # -- checkpoints: the random state of each replica, as a run of R processes keeps it ----------------------
    def _rng_file(self) -> str:
        return _rng_file_of(self._replica, self._replicas)

    def _save_rng_state(self, output_dir: str) -> None:
        """The ranks of a replica draw alike (GRPOTrainer samples completions with it): its first rank saves the
        replica's state under the name the process it stands for would use, so a run resumes at any C."""
        with tempfile.TemporaryDirectory() as scratch:
            super()._save_rng_state(scratch)
            if self.plan.rank == 0:
                (saved,) = os.listdir(scratch)
                os.makedirs(output_dir, exist_ok=True)
                shutil.move(os.path.join(scratch, saved), os.path.join(output_dir, self._rng_file()))

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, self._rng_file())):
            return super()._load_rng_state(checkpoint)
        with tempfile.TemporaryDirectory() as scratch:  # named as the trainer reads it for this process
            mine = _rng_file_of(dist.get_rank(), dist.get_world_size())
            shutil.copy(os.path.join(checkpoint, self._rng_file()), os.path.join(scratch, mine))
            super()._load_rng_state(scratch)

    # evaluation gathers each rank's loss from every process; a replica's ranks hold the same value
    def _gather_replicas(self, tensor):
        per_rank = self.accelerator.gather(tensor).reshape(dist.get_world_size(), -1)
        first = per_rank[:: self.plan.world_size].reshape(-1, *tensor.shape[1:])
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            first = first[: state.remainder]
        return first

    def evaluation_loop(self, *args, **kwargs):
        gather, self.gather_function = self.gather_function, self._gather_replicas
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = gather


def _generate_under(plan: ContextParallel, model, input_ids, **generate_kwargs):
    """``model.generate`` as the mixin sets it on the policy for TRL's call: ``cp_compile.hf.generate``, which calls
    the model's own ``generate`` (the instance's is set aside for the call)."""
    sharded = model.__dict__.pop("generate")
    try:
        with plan:
            return generate(model, input_ids, **generate_kwargs)
    finally:
        model.generate = sharded


def _rng_file_of(process: int, processes: int) -> str:
    """The file ``Trainer`` keeps the random state of process ``process`` of ``processes`` in."""
    return "rng_state.pth" if processes == 1 else f"rng_state_{process}.pth"


def _with_trainer_args(args: tuple, kwargs: dict, trainer_args) -> tuple:
    """The trainer's positional arguments with ``trainer_args`` in place of its ``args`` (put in ``kwargs`` when
    given there)."""
    if "args" in kwargs:
        kwargs["args"] = trainer_args
        return args
    return (args[0], trainer_args, *args[2:])


# GRPOTrainer's methods that the mixin overrides: its batch preparation (where it samples), its rewards gathered from
# every process, and its scoring calls.
_SAMPLER_METHODS = (
    "_prepare_inputs",
    "_generate_single_turn",
    "_calculate_rewards",
    "_get_per_token_logps_and_entropies",
)


def _sampling_per_replica(trainer_args, replicas: int, size: int, kwargs: dict):
    """GRPOConfig with the generation batch of R processes (TRL sizes it for every process; here a replica reads
    the batches of one), or an error for what its ranks cannot share."""
    refused = {
        "use_vllm": "vLLM generation",
        "use_transformers_continuous_batching": "continuous-batching generation",
        "torch_compile": "torch_compile (GRPO's generation and scoring are not compiled under CP yet)",
    }
    unsupported = [what for name, what in refused.items() if getattr(trainer_args, name, False)]
    unsupported += [f"{name}=" for name in ("tools", "environment_factory", "rollout_func") if kwargs.get(name)]
    if unsupported:
        raise UnsupportedAttention(
            f"not supported for a trainer that generates under context parallelism: {', '.join(unsupported)}. Each "
            "rank of a replica generates the replica's completions itself, so what runs once per completion "
            "(a tool call, a request to a server) would run C times"
        )
    generation_batch = trainer_args.generation_batch_size // size
    batches = [(generation_batch, trainer_args.num_generations, "generation batch")]
    if trainer_args.do_eval and trainer_args.eval_strategy != "no":
        groups = trainer_args.num_generations_eval or trainer_args.num_generations
        batches.append((trainer_args.per_device_eval_batch_size * replicas, groups, "evaluation batch"))
    for batch, groups, what in batches:
        if batch % groups:
            raise ValueError(
                f"under context parallelism the {what} of the {replicas} replica(s) ({batch} completions) must hold "
                f"whole groups of {groups} generations: a replica reads the batches of one process"
            )
    sampling = copy.copy(trainer_args)
    sampling.generation_batch_size = generation_batch
    return sampling


def _scores_rows(inputs: dict[str, Any]) -> bool:
    """A batch of padded rows without labels, which the trainer scores itself (TRL's DPOTrainer: chosen and rejected
    completions, its targets made from ``completion_mask``)."""
    return inputs.get("labels") is None and inputs.get("shift_labels") is None and "completion_mask" in inputs


def _replica_of(plan: ContextParallel) -> tuple[int, int]:
    """(this process's replica, the number of replicas): a plan's group must be a block of consecutive ranks."""
    world, size = dist.get_world_size(), plan.world_size
    ranks = dist.get_process_group_ranks(plan.group)
    first = ranks[0]
    if world % size or ranks != list(range(first, first + size)) or first % size:
        raise ValueError(
            f"the plan's group {ranks} is not a block of {size} consecutive ranks: build data parallelism beside CP "
            "as init_device_mesh(device, (world // C, C), mesh_dim_names=('dp', 'cp')) and pass "
            "ContextParallel(mesh['cp'])"
        )
    return first // size, world // size


__all__ = ["ContextParallelMixin", "count_targets", "documents", "shard_batch", "shift_labels"]
