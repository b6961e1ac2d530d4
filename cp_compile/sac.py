"""Selective activation checkpointing (SAC) that never re-runs a CP ring.

``sac_policy()`` is a policy for
``torch.utils.checkpoint.create_selective_checkpoint_contexts``: CP ops
(namespace ``cp``) are always saved, so the recompute in backward never issues
the forward ring's transfers again; matmuls and other attention kernels are
saved; everything else (norms, activations, RoPE, reshapes) is recomputed.
Pass ``base=`` to keep your own decisions for non-CP ops.

``sac_context()`` is ready for ``checkpoint(..., context_fn=...)``, eagerly and
under ``torch.compile``.

Plain ``torch.utils.checkpoint`` without a policy re-runs the whole forward of
the region in backward, the ring included: C-1 more K/V transfers per
attention in eager mode. Under ``torch.compile`` the CP backend marks CP
outputs MUST_SAVE in the joint graph, so even plain checkpointing keeps the
ring out of the backward graph (``activation_memory_budget < 1`` does not yet:
see ``compiler/partition.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

#: Ops saved by the default policy besides CP ops: the expensive ones.
SAVED_BY_DEFAULT = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }
)

Policy = Callable[..., CheckpointPolicy]


def _is_cp_op(op) -> bool:
    return getattr(op, "namespace", None) == "cp"


def _cp_then(base: Optional[Policy], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if _is_cp_op(op):
        return CheckpointPolicy.MUST_SAVE
    if base is not None:
        return base(ctx, op, *args, **kwargs)
    return CheckpointPolicy.PREFER_SAVE if op in SAVED_BY_DEFAULT else CheckpointPolicy.PREFER_RECOMPUTE


def default_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """CP ops and matmuls saved, the rest recomputed."""
    return _cp_then(None, ctx, op, *args, **kwargs)


def sac_policy(base: Optional[Policy] = None) -> Policy:
    """A SAC policy that saves CP ops and defers to ``base`` (or the default) for the rest."""
    return default_policy if base is None else functools.partial(_cp_then, base)


def sac_context(base: Optional[Policy] = None):
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` with ``sac_policy(base)``."""
    return functools.partial(create_selective_checkpoint_contexts, sac_policy(base))
