"""A whole collated batch and this rank's share of it under a plan: what ``ContextParallelMixin`` gives the model
of a token-level trainer (``Trainer``, ``SFTTrainer``), and what ``rows.ScoredRows`` gives it for padded rows."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..errors import UnsupportedAttention
from ..plan import ContextParallel

# The batch entries the mixin shards along the sequence; others of the same shape are refused, since
# the mixin cannot know whether they are per token.
_PER_TOKEN = ("input_ids", "seq_idx", "token_type_ids")
# What the model gets whole: the documents' global boundaries (what the attention reads), the loss's count.
_WHOLE = ("cu_seq_lens_q", "cu_seq_lens_k", "num_items_in_batch", "use_cache")
# Kernel hints of the flash-attention kwargs, dropped: the CP ops do not read them, and a compiled model given
# them as Python ints would recompile for each new value.
_HINTS = ("max_length_q", "max_length_k")
IGNORE_INDEX = -100


def documents(batch: dict[str, Any]) -> Optional[Tensor]:
    """The global ``cu_seqlens`` of a one-row batch: from ``cu_seq_lens_q`` when the collator gave it, else
    where ``position_ids`` restart at 0 (packed rows), else one document; None for several rows."""
    input_ids = batch["input_ids"]
    if input_ids.shape[0] != 1:
        return None
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        return cu.to("cpu", torch.int32)
    total = input_ids.shape[1]
    positions = batch.get("position_ids")
    if positions is None:
        return torch.tensor([0, total], dtype=torch.int32)
    starts = (positions[0] == 0).nonzero().flatten().cpu()
    if starts.numel() == 0 or starts[0] != 0:
        raise UnsupportedAttention("position_ids of a packed row must start at 0 for its first document")
    return torch.cat([starts, torch.tensor([total])]).to(torch.int32)


def shift_labels(labels: Tensor) -> Tensor:
    """The label each token predicts, on the global sequence: the next token's label, -100 after the last.

    Packing collators put -100 on each document's first label, so no token predicts across a document end."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def shard_batch(plan: ContextParallel, batch: dict[str, Any]) -> dict[str, Any]:
    """This rank's share of a whole (collated) batch, as the model is to be called with it under ``plan``.

    One row is split per document (packed rows; one document when nothing says otherwise), several rows
    each as one sequence. ``labels`` become this rank's slice of the globally shifted labels (also given as
    ``shift_labels``); ``position_ids`` the global positions of this rank's slots. A packed row's model call
    (and its backward) runs inside ``with plan.packed(documents(batch)):``."""
    input_ids = batch["input_ids"]
    rows, total = input_ids.shape
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise UnsupportedAttention(
            "a batch with padding (attention_mask with zeros) under context parallelism: pack the examples "
            "(SFTConfig(packing=True) or padding_free=True, or DataCollatorWithFlattening) so that no row is padded"
        )
    for key, value in batch.items():
        if (
            key not in _PER_TOKEN + _WHOLE + _HINTS + ("labels", "shift_labels", "position_ids", "attention_mask")
            and isinstance(value, Tensor)
            and value.dim() >= 2
            and tuple(value.shape[:2]) == (rows, total)
        ):
            raise UnsupportedAttention(
                f"batch entry {key!r} looks per token, and context parallelism does not know how to shard it"
            )
    cu = documents(batch)
    if cu is not None:
        positions = plan.positions(cu_seqlens=cu, device=input_ids.device)[None]
    else:
        positions = plan.positions(total, device=input_ids.device)[None].expand(rows, -1)
    local = {key: value for key, value in batch.items() if key in _WHOLE}
    local.update({key: plan.shard(batch[key], 1, cu_seqlens=cu) for key in _PER_TOKEN if key in batch})
    local["position_ids"] = positions
    targets = _targets(batch)
    if targets is not None:
        # padding slots of a shard are 0: offset the labels so that those slots come out as -100
        local["labels"] = local["shift_labels"] = plan.shard(targets - IGNORE_INDEX, 1, cu_seqlens=cu) + IGNORE_INDEX
    # the slot count and the document count change with almost every packed batch: dynamic from the first
    # compile on, for every tensor that carries them (a view or a new tensor does not inherit the mark)
    for value in local.values():
        if isinstance(value, Tensor) and value.dim():
            torch._dynamo.maybe_mark_dynamic(value, value.dim() - 1)
    return local


def _targets(batch: dict[str, Any]) -> Optional[Tensor]:
    """What each token of a whole batch predicts: the collator's ``shift_labels``, else its labels shifted."""
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    return shift_labels(batch["labels"]) if batch.get("labels") is not None else None


def count_targets(batch: dict[str, Any]) -> Tensor:
    """How many tokens of a whole batch have a label (the global ``num_items_in_batch`` of one batch)."""
    return (_targets(batch) != IGNORE_INDEX).sum()


__all__ = ["IGNORE_INDEX", "count_targets", "documents", "shard_batch", "shift_labels"]
