"""The online-softmax merge of two partial attention results.

Each partial ``out`` is normalised over its own keys and carries its ``lse``.
Merged: ``lse = logaddexp(lse_a, lse_b)`` and
``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.
Accumulators are fp32 (fp64 for fp64 input) whatever the input dtype, so
low-precision error does not grow with the number of merged blocks.

A row where both sides are -inf (it sees no key yet) stays out = 0,
lse = -inf: the weights are computed against a finite stand-in for the
maximum, so exp never sees ``-inf - (-inf)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of lse and of every accumulator for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pivot(lse: Tensor) -> Tensor:
    """``lse`` with rows that see no key (-inf) at 0: ``exp(x - pivot(lse))`` never meets -inf - (-inf)."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _weights(acc_lse: Tensor, lse: Tensor, new_lse: Tensor) -> tuple[Tensor, Tensor]:
    finite = pivot(new_lse)
    return torch.exp(acc_lse - finite), torch.exp(lse.to(acc_lse.dtype) - finite)


def merge_partial(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    dt = acc_lse.dtype
    lse = lse.to(dt)
    new_lse = torch.logaddexp(acc_lse, lse)
    # rows that see nothing on either side: keep -inf but weigh against 0
    w_acc, w_new = _weights(acc_lse, lse, new_lse)
    new_out = acc_out.to(dt) * w_acc.unsqueeze(-1) + out.to(dt) * w_new.unsqueeze(-1)
    return new_out, new_lse


def merge_into_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """``merge_partial`` written into the accumulators, with no full-size temporary."""
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    w_acc, w_new = _weights(acc_lse, lse, new_lse)
    acc_out.mul_(w_acc.unsqueeze(-1)).addcmul_(out, w_new.unsqueeze(-1))
    acc_lse.copy_(new_lse)


@torch.library.custom_op("cp::merge", mutates_args=())
def merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge partial (out, lse) into the accumulator; returns fp32 (fp64) results."""
    return merge_partial(acc_out, acc_lse, out, lse)


@merge.register_fake
def _(acc_out, acc_lse, out, lse):
    return acc_out.new_empty(acc_out.shape, dtype=acc_lse.dtype), acc_lse.new_empty(acc_lse.shape)


def _merge_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)
    ctx.dtypes = [t.dtype for t in inputs]


def _merge_backward(ctx, d_out, d_lse):
    # d new_out / d lse_a = w_a * (out_a - new_out); d new_lse / d lse_a = w_a.
    acc_out, acc_lse, out, lse, new_out, new_lse = ctx.saved_tensors
    w_acc, w_new = _weights(acc_lse, lse, new_lse)
    d_out = torch.zeros_like(new_out) if d_out is None else d_out
    d_lse = torch.zeros_like(new_lse) if d_lse is None else d_lse
    g_acc_lse = w_acc * (d_lse + (d_out * (acc_out.to(new_out.dtype) - new_out)).sum(-1))
    g_lse = w_new * (d_lse + (d_out * (out.to(new_out.dtype) - new_out)).sum(-1))
    grads = (d_out * w_acc.unsqueeze(-1), g_acc_lse, d_out * w_new.unsqueeze(-1), g_lse)
    return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes))


merge.register_autograd(_merge_backward, setup_context=_merge_setup)


def start_accumulator(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """The first partial result as an accumulator (fp32 / fp64)."""
    dt = acc_dtype(out.dtype)
    return out.to(dt), lse.to(dt)


@torch.library.custom_op("cp::accumulate_", mutates_args=("acc",))
def accumulate_(acc: Tensor, x: Tensor, heads_from: int = 0) -> None:
    """``acc += x`` as one opaque step; ``x`` may cover only the heads (dim 1)
    ``[heads_from, heads_from + x.shape[1])`` of ``acc``.

    As a plain ``add_`` in a compiled backward, Inductor turns the chain of
    per-step dQ additions into one fused sum at the end of the ring, which
    keeps every step's partial dQ alive at once (memory growing with C). An
    opaque in-place op is done when it is reached, and the partial can go.
    """
    acc.narrow(1, heads_from, x.shape[1]).add_(x)


@accumulate_.register_fake
def _(acc, x, heads_from=0):
    return None


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor, head_dim: int) -> Tensor:
    """Attention sinks (GPT-OSS): each head's learned logit joins every row's softmax denominator.

    The merged result of the real keys (``out``, ``lse``) becomes
    ``out * exp(lse - logaddexp(lse, sink)) = out * sigmoid(lse - sink)``: folded once, after the
    schedule, in the accumulator dtype. ``head_dim`` is the dimension of ``lse`` holding the heads
    (``out`` has one more, the head dim). Differentiable in ``out``, ``lse`` and ``sinks``."""
    shape = [1] * lse.dim()
    shape[head_dim] = -1
    kept = torch.sigmoid(lse - sinks.to(lse.dtype).view(shape))
    return (out.to(lse.dtype) * kept.unsqueeze(-1)).to(out.dtype)
