"""``transformers.Trainer`` and TRL's ``SFTTrainer`` and ``DPOTrainer`` under context parallelism, by subclassing.

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

Checkpoints hold nothing that depends on C: a run saved at one CP degree resumes at another.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import UnsupportedAttention
from ..plan import ContextParallel
from .batch import count_targets, documents, shard_batch, shift_labels
from .families import family_of
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
            makes), or ``torch_compile_mode`` set (the plan's backend takes no mode).
        UnsupportedAttention: at a step, a batch CP cannot run exactly (padded rows, an unknown per-token entry).
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
        self._compile_backend = None
        if trainer_args.torch_compile:
            if trainer_args.torch_compile_mode is not None:
                raise ValueError(
                    "torch_compile_mode is not supported under context parallelism: the model is "
                    "compiled with the plan's backend, which takes no mode"
                )
            self._compile_backend = trainer_args.torch_compile_backend or "inductor"
            model = kwargs.get("model", args[0] if args else None)
            if trainer_args.gradient_checkpointing and model is not None and family_of(model).mixes_outside_attention:
                # each mixer checks that every rank passed alike shapes (an op with a side effect), which torch's
                # activation checkpointing refuses inside a compiled checkpointed layer
                raise ValueError(
                    f"{type(model).__name__} mixes tokens outside attention (convolutions, scans): compiled with "
                    "gradient checkpointing under context parallelism it is not supported yet; set "
                    "gradient_checkpointing=False (TRL's SFTConfig turns it on by default) or torch_compile=False"
                )
            # the trainer's accelerator would compile the wrapped model with a backend of its own
            trainer_args = copy.copy(trainer_args)
            trainer_args.torch_compile, trainer_args.torch_compile_backend = False, None
            if "args" in kwargs:
                kwargs["args"] = trainer_args
            else:
                args = (args[0], trainer_args, *args[2:])
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
            self.cp_backend = self.plan.backend(self._compile_backend)
            self.model.compile(backend=self.cp_backend)

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
        # backward inside the plan too: activation checkpointing (SFTConfig's default) recomputes attention there
        with self._under_plan(inputs):
            return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
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
        if _scores_rows(inputs):  # the trainer's own step, its model calls sharded by compute_loss
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
