"""Padded rows under context parallelism, for the trainers that score completions (TRL's ``DPOTrainer``).

Such a trainer calls its policy and its reference model on a batch of padded rows (DPO: chosen and rejected
completions after their prompts) with ``fused_lm_head=True``, and reduces the per-token log-probabilities it
gets back itself: per row sums, log-ratios, the loss, and metrics gathered from every process. Under
``ScoredRows`` each such call runs as one packed row of the batch's real tokens, every row a document of its
own (``plan.shard`` per document, global positions), and its per-token outputs come back whole and in the
rows' padded shape, on every rank of the plan. The trainer's own code then runs unchanged, on the same numbers
on every rank of a replica, as on one process.

Only per-token scalars cross ranks (T values per output, never the hidden states or the logits). The gather
of a field that carries a gradient is differentiated by a reduce-scatter: every rank of the plan computes the
same loss from the gathered values, and the data-parallel gradient all-reduce, which averages over every
process, then gives each replica's gradient once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import Tensor

from ..comm.gather import gather_dim0, reduce_scatter_dim0
from ..errors import UnsupportedAttention
from ..layout.packed import sequence_permutation
from ..plan import ContextParallel
from .batch import IGNORE_INDEX, shard_batch, shift_labels

# What the fused LM head (TRL's ``add_fused_lm_head``) returns per token; all of them come back whole.
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
# Kwargs of a scoring call that pass through to the model unchanged (the rest of a call is its rows).
_PASSED = ("use_cache", "fused_lm_head", "return_dict")


class PackedRows:
    """Where the real tokens of a batch of padded rows sit once packed into one row, each row a document.

    A row's real tokens (``attention_mask`` 1) must be one run: left padding, right padding, or both (a
    left-padded prompt followed by a right-padded completion)."""

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Optional[Tensor]) -> PackedRows:
        """The rows of a batch or a model call (no ``attention_mask``: no padding)."""
        return cls(torch.ones_like(input_ids) if attention_mask is None else attention_mask)

    def __init__(self, attention_mask: Tensor):
        real = attention_mask.bool()
        columns = torch.arange(real.shape[1], device=real.device)
        lengths = real.sum(1)
        first = torch.where(real.any(1), real.int().argmax(1), 0)
        run = (columns >= first[:, None]) & (columns < (first + lengths)[:, None])
        if not bool((run == real).all()):
            rows = (run != real).any(1).nonzero().flatten().tolist()
            raise UnsupportedAttention(
                f"rows {rows} of the batch have padding between their tokens (attention_mask); under context "
                "parallelism a row's tokens are packed as one document, so they must be one run (left or right "
                "padding)"
            )
        self.real, self.first = real, first
        self.positions = (real.cumsum(1) - 1).clamp(min=0)
        kept = lengths[lengths > 0].cpu()
        self.cu_seqlens = torch.cat([kept.new_zeros(1), kept.cumsum(0)]).to(torch.int32)

    @property
    def total(self) -> int:
        return int(self.cu_seqlens[-1])

    def pack(self, x: Tensor) -> Tensor:
        """``[N, L, ...]`` -> ``[1, total, ...]``: the real tokens, row after row."""
        return x[self.real][None]

    def next_targets(self, labels: Tensor) -> Tensor:
        """What each real token predicts, packed: the next token's label in its row, -100 at a row's end.

        Raises:
            UnsupportedAttention: a row's first token has a label after left padding (one process would score it
                from the padding slot before it; nothing in the row precedes it).
        """
        padded_first = labels.gather(1, self.first[:, None])[:, 0].ne(IGNORE_INDEX) & (self.first > 0)
        if bool(padded_first.any()):
            raise UnsupportedAttention(
                f"rows {padded_first.nonzero().flatten().tolist()} are padded on the left and their first token has a "
                "label: on one process a padding slot predicts it, and under context parallelism nothing does. Mask "
                "the first token of a row out of the labels (-100), as a prompt is"
            )
        following_real = torch.cat([self.real[:, 1:], self.real.new_zeros(self.real.shape[0], 1)], 1)
        return self.pack(torch.where(following_real, shift_labels(labels), IGNORE_INDEX))

    def gathered_order(self, world_size: int) -> Tensor:
        """Rows of every rank's slots gathered in rank order that hold the real tokens, in packed order."""
        return sequence_permutation(self.cu_seqlens, world_size)[: self.total]

    def unpack(self, packed: Tensor) -> Tensor:
        """``[total]`` -> ``[N, L]``, zero at padding (differentiable in ``packed``)."""
        return packed.new_zeros(self.real.shape).masked_scatter(self.real, packed)


class _GatheredSlots(torch.autograd.Function):
    """Every rank's slots, in rank order; the gradient of a value every rank used alike sums over the ranks."""

    @staticmethod
    def forward(ctx, local: Tensor, group_name: str, world_size: int) -> Tensor:
        ctx.group = (group_name, world_size)
        return gather_dim0(local, group_name, world_size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_dim0(grad, *ctx.group), None, None


def gather_rows(plan: ContextParallel, rows: PackedRows, order: Tensor, local: Tensor, width: int) -> Tensor:
    """A per-token output of this rank's slots (``[1, slots]``) -> the batch's ``[N, width]`` on every rank
    (``order``: ``rows.gathered_order(plan.world_size)``)."""
    dtype = local.dtype
    flat = local[0].to(torch.uint8) if dtype == torch.bool else local[0]
    if flat.requires_grad:
        every = _GatheredSlots.apply(flat, plan.group_name, plan.world_size)
    else:
        every = gather_dim0(flat, plan.group_name, plan.world_size)
    return rows.unpack(every.index_select(0, order.to(every.device))).to(dtype)[:, :width]


class ScoredRows:
    """``with ScoredRows(plan, models):`` each call of one of ``models`` with ``fused_lm_head=True`` on padded
    rows runs packed and sharded over ``plan``, and returns its per-token outputs whole (module docstring).

    The model calls must be made inside ``with plan:``; each runs inside ``with plan.packed(cu):`` of its rows, and
    a backward that recomputes it (activation checkpointing) must run inside ``with plan.packed(cu):`` too
    (``PackedRows.of(input_ids, attention_mask).cu_seqlens``)."""

    def __init__(self, plan: ContextParallel, models: list[torch.nn.Module]):
        self.plan, self.models = plan, models
        self._calls: list[tuple[PackedRows, int, Optional[Tensor], contextlib.ExitStack]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ScoredRows:
        # eager around a compiled model (``Module.compile`` compiles its hooks with it): packing reads the rows'
        # lengths, and the sharded call in between is what the plan's backend compiles
        shard, gather = torch.compiler.disable(self._shard), torch.compiler.disable(self._gather)
        for model in self.models:
            self._handles.append(model.register_forward_pre_hook(shard, with_kwargs=True))
            self._handles.append(model.register_forward_hook(gather, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for *_, in_force in reversed(self._calls):  # calls that raised before their forward hook
            in_force.close()
        self._calls.clear()

    def _shard(self, model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        where = f"{type(model).__name__} called on padded rows under context parallelism"
        if args or not kwargs.get("fused_lm_head"):
            raise UnsupportedAttention(
                f"{where}: only fused_lm_head=True calls with keyword arguments are supported (TRL's scoring "
                "calls); a call for the logits would need every rank's vocabulary-wide rows"
            )
        if kwargs.get("output_router_logits"):
            raise UnsupportedAttention(
                f"{where}: output_router_logits=True (a MoE load-balancing loss) is not supported: that loss is not "
                "a sum over tokens, so a shard's share of it is not its share of the batch's"
            )
        input_ids = kwargs["input_ids"]
        rows = PackedRows.of(input_ids, kwargs.get("attention_mask"))
        unknown = [
            key
            for key, value in kwargs.items()
            if key not in (*_PASSED, "input_ids", "attention_mask", "labels", "shift_labels", "num_items_in_batch")
            and value is not None
        ]
        if unknown:
            raise UnsupportedAttention(f"{where}: the arguments {unknown} are not supported there")
        if kwargs.get("shift_labels") is not None:
            targets, width = rows.pack(kwargs["shift_labels"]), input_ids.shape[1]
        else:
            targets, width = rows.next_targets(kwargs["labels"]), input_ids.shape[1] - 1
        # what a padding-free collator gives a packed row: the convolutions and scans of a hybrid restart at the
        # documents where they are told them, as the fused kernels do on one process
        lengths, cu = rows.cu_seqlens.diff().long(), rows.cu_seqlens.to(input_ids.device)
        documents = torch.arange(len(lengths), dtype=torch.int32)
        packed = {
            "input_ids": rows.pack(input_ids),
            "position_ids": rows.pack(rows.positions),
            "shift_labels": targets,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "seq_idx": documents.repeat_interleave(lengths)[None].to(input_ids.device),
        }
        local = shard_batch(self.plan, packed)
        local["num_items_in_batch"] = (targets != IGNORE_INDEX).sum()
        # a hybrid's convolutions and scans read the documents from the plan
        in_force = contextlib.ExitStack()
        in_force.enter_context(self.plan.packed(rows.cu_seqlens))
        self._calls.append((rows, width, kwargs.get("num_items_in_batch"), in_force))
        return (), {**{key: kwargs[key] for key in _PASSED if key in kwargs}, **local}

    def _gather(self, model, args: tuple, kwargs: dict, output):
        rows, width, num_items_in_batch, in_force = self._calls.pop()
        in_force.close()
        order = rows.gathered_order(self.plan.world_size)
        fields = {
            name: gather_rows(self.plan, rows, order, value, width)
            for name in PER_TOKEN_FIELDS
            if (value := getattr(output, name, None)) is not None
        }
        log_probs = fields["log_probs"]
        count = fields["label_mask"].sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return type(output)(loss=-log_probs.sum() / count, **fields)


__all__ = ["PER_TOKEN_FIELDS", "PackedRows", "ScoredRows", "gather_rows"]
