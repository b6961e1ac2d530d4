"""Ulysses (all-to-all) attention: trade sequence sharding for head sharding.

Forward: one all-to-all each for q, k and v turns this rank's tokens of all
heads into all tokens of H/C heads (``heads.seq_to_heads``); ordinary
attention runs on the full sequence (``cp::heads_attn``, one kernel call, any
mask the single-device op supports); one all-to-all brings the output back to
sequence sharding (and one small one the lse). Every tensor crosses the wire
once and (C-1)/C of it leaves the rank: 4/C of the activations per rank in
the forward, against C-1 full K/V blocks for the ring.

The head-sharded q, k, v, out and lse are extra outputs of the forward op and
are what the backward keeps, so the backward moves dout in and dq, dk, dv out
(and dlse if the caller differentiates lse), nothing else.

GQA: K/V heads are sharded like query heads when they divide by C. When they
do not, each K/V head is repeated ``lcm(Hkv, C) / Hkv`` times before the
exchange (``explain`` says so) and its gradients are summed back afterwards.
Query heads must divide by C (``ValueError`` otherwise; ``auto`` then picks
another schedule).

The attention on the full sequence is pluggable (``INNER``): a name maps to a
forward ``(q, k, v, is_causal, scale) -> (out, lse)`` and its backward, over
head-sharded tensors in global sequence order. ``"sdpa"`` is the dense kernel
(causal or not). Other mask kinds register their own entry.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from .block import block_attn_backward_impl, block_attn_impl, dense_like, result_like
from .comm import resolve_group
from .heads import check_heads, heads_to_seq, replicate_kv_heads, seq_to_heads
from .registry import Traceable, register_schedule
from .ring import check_ring_args, group_name_of

# name -> (forward(q, k, v, is_causal, scale) -> (out, lse),
#          backward(dout, q, k, v, out, lse, dlse, is_causal, scale) -> (dq, dk, dv))
INNER: dict[str, tuple[Callable, Callable]] = {
    "sdpa": (
        lambda q, k, v, causal, scale: block_attn_impl(q, k, v, "causal" if causal else "none", scale),
        lambda do, q, k, v, out, lse, dlse, causal, scale: block_attn_backward_impl(
            do, q, k, v, out, lse, "causal" if causal else "none", scale, dlse),
    ),
}


def _check_inner(inner: str) -> None:
    if inner not in INNER:
        raise ValueError(f"unknown inner attention {inner!r}; expected one of {sorted(INNER)}")


@torch.library.custom_op("cp::heads_attn", mutates_args=())
def heads_attn(q: Tensor, k: Tensor, v: Tensor, inner: str, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention over the full sequence for this rank's heads: (out, lse)."""
    _check_inner(inner)
    out, lse = INNER[inner][0](q, k, v, is_causal, scale)
    return out.contiguous(), lse.contiguous()


@heads_attn.register_fake
def _(q, k, v, inner, is_causal, scale):
    return result_like(q, v)


@torch.library.custom_op("cp::heads_attn_backward", mutates_args=())
def heads_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    inner: str, is_causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_inner(inner)
    dq, dk, dv = INNER[inner][1](dout, q, k, v, out, lse, dlse, is_causal, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@heads_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, inner, is_causal, scale):
    return dense_like(q), dense_like(k), dense_like(v)


# ----------------------------------------------------------------------------
# The schedule (one definition, eager and compiled).
# ----------------------------------------------------------------------------


def _options(is_causal: bool, layout: str, scale: float, enable_gqa: bool) -> str:
    return f"ulysses causal={is_causal} layout={layout} scale={scale!r} gqa={enable_gqa}"


def check_ulysses_args(q, k, v, world_size, is_causal, layout, enable_gqa) -> None:
    check_ring_args(q, k, v, world_size, is_causal, layout, enable_gqa)
    check_heads(q.shape[1], world_size, "the query")


def kv_copies(q_heads: int, kv_heads: int, world_size: int) -> int:
    """Copies of each K/V head the exchange needs (1 when K/V heads divide by C)."""
    return replicate_kv_heads(kv_heads, q_heads, world_size)


def exchange_forward(q: Tensor, k: Tensor, v: Tensor, group_name: str, world_size: int, layout: str,
                     attend: Callable) -> tuple[Tensor, ...]:
    """Head-shard q, k, v over the group, ``attend(qh, kh, vh) -> (out_h, lse_h)``, sequence-shard back.

    Returns (out, lse) sequence-sharded, then the head-sharded (q, k, v, out, lse) the backward needs.
    """
    copies = kv_copies(q.shape[1], k.shape[1], world_size)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    qh, kh, vh = (seq_to_heads(t, group_name, world_size, layout) for t in (q, k, v))
    out_h, lse_h = attend(qh, kh, vh)
    out = heads_to_seq(out_h, group_name, world_size, layout)
    lse = heads_to_seq(lse_h, group_name, world_size, layout)
    return out, lse, qh, kh, vh, out_h, lse_h


def exchange_backward(dout: Tensor, dlse: Optional[Tensor], group_name: str, world_size: int, layout: str,
                      kv_heads: int, attend_backward: Callable) -> tuple[Tensor, Tensor, Tensor]:
    """The mirror: dout (and dlse) to head sharding, ``attend_backward(dout_h, dlse_h)``, gradients back."""
    dout_h = seq_to_heads(dout, group_name, world_size, layout)
    dlse_h = None if dlse is None else seq_to_heads(dlse, group_name, world_size, layout)
    grads = attend_backward(dout_h, dlse_h)
    dq, dk, dv = (heads_to_seq(t, group_name, world_size, layout) for t in grads)
    copies = dk.shape[1] // kv_heads
    if copies > 1:  # the replicated heads' gradients, summed back onto each original head
        b, _, s, _ = dk.shape
        dk = dk.view(b, kv_heads, copies, s, dk.shape[-1]).sum(2)
        dv = dv.view(b, kv_heads, copies, s, dv.shape[-1]).sum(2)
    return dq, dk, dv


def ulysses_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group_name: str, world_size: int, is_causal: bool, layout: str,
    scale: float, enable_gqa: bool, inner: str = "sdpa",
) -> tuple[Tensor, ...]:
    """(out, lse) sequence-sharded, then the head-sharded (q, k, v, out, lse) the backward needs."""
    if world_size > 1:
        torch.ops.cp.agree(q, k, v, group_name, _options(is_causal, layout, scale, enable_gqa))
    check_ulysses_args(q, k, v, world_size, is_causal, layout, enable_gqa)
    return exchange_forward(q, k, v, group_name, world_size, layout,
                            lambda qh, kh, vh: torch.ops.cp.heads_attn(qh, kh, vh, inner, is_causal, scale))


def ulysses_backward(
    dout: Tensor, dlse: Optional[Tensor], qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor, *,
    group_name: str, world_size: int, is_causal: bool, layout: str, scale: float, kv_heads: int,
    inner: str = "sdpa",
) -> tuple[Tensor, Tensor, Tensor]:
    def attend_backward(dout_h, dlse_h):
        return torch.ops.cp.heads_attn_backward(dout_h, qh, kh, vh, out_h, lse_h, dlse_h, inner, is_causal, scale)

    return exchange_backward(dout, dlse, group_name, world_size, layout, kv_heads, attend_backward)


# ----------------------------------------------------------------------------
# Ulysses as one differentiable op.
# ----------------------------------------------------------------------------


@torch.library.custom_op("cp::ulysses_attention", mutates_args=())
def ulysses_attention_op(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, is_causal: bool, layout: str, scale: float,
    enable_gqa: bool, inner: str = "sdpa",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse) of this rank's queries, plus head-sharded q, k, v, out, lse kept for backward."""
    world_size = resolve_group(group_name).size()
    res = ulysses_forward(q, k, v, group_name=group_name, world_size=world_size, is_causal=is_causal,
                          layout=layout, scale=scale, enable_gqa=enable_gqa, inner=inner)
    return _distinct(res, (q, k, v))


def _distinct(tensors, inputs) -> tuple:
    """Custom op outputs may alias neither inputs nor each other (at C=1 the exchange is the identity)."""
    seen = {id(t) for t in inputs}
    out = []
    for t in tensors:
        out.append(t.clone(memory_format=torch.contiguous_format) if id(t) in seen else t.contiguous())
        seen.add(id(out[-1]))
    return tuple(out)


def _head_sharded_like(t: Tensor, world_size: int, heads: Optional[int] = None) -> Tensor:
    heads = t.shape[1] if heads is None else heads
    return t.new_empty(t.shape[0], heads // world_size, t.shape[2] * world_size, *t.shape[3:])


@ulysses_attention_op.register_fake
def _(q, k, v, group_name, is_causal, layout, scale, enable_gqa, inner="sdpa"):
    c = resolve_group(group_name).size()
    out, lse = result_like(q, v)
    kv_heads = k.shape[1] * kv_copies(q.shape[1], k.shape[1], c)
    return (out, lse, _head_sharded_like(q, c), _head_sharded_like(k, c, kv_heads),
            _head_sharded_like(v, c, kv_heads), _head_sharded_like(out, c), _head_sharded_like(lse, c))


@torch.library.custom_op("cp::ulysses_attention_backward", mutates_args=())
def ulysses_attention_backward_op(
    dout: Tensor, dlse: Optional[Tensor], qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor,
    group_name: str, is_causal: bool, layout: str, scale: float, kv_heads: int, inner: str = "sdpa",
) -> tuple[Tensor, Tensor, Tensor]:
    world_size = resolve_group(group_name).size()
    res = ulysses_backward(dout, dlse, qh, kh, vh, out_h, lse_h, group_name=group_name,
                           world_size=world_size, is_causal=is_causal, layout=layout, scale=scale,
                           kv_heads=kv_heads, inner=inner)
    return _distinct(res, (dout, dlse, qh, kh, vh, out_h, lse_h))


@ulysses_attention_backward_op.register_fake
def _(dout, dlse, qh, kh, vh, out_h, lse_h, group_name, is_causal, layout, scale, kv_heads, inner="sdpa"):
    c = resolve_group(group_name).size()
    b, s = dout.shape[0], dout.shape[2]
    return (dout.new_empty(b, qh.shape[1] * c, s, qh.shape[-1]),
            dout.new_empty(b, kv_heads, s, kh.shape[-1]), dout.new_empty(b, kv_heads, s, vh.shape[-1]))


def _setup(ctx, inputs, output):
    _, k, _, group_name, is_causal, layout, scale, _, inner = inputs
    ctx.save_for_backward(*output[2:])
    ctx.options = (group_name, is_causal, layout, scale, k.shape[1], inner)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, *_unused):
    qh, kh, vh, out_h, lse_h = ctx.saved_tensors
    if dout is None:
        dout = heads_to_seq_like_zeros(out_h, ctx.options[0])
    dq, dk, dv = torch.ops.cp.ulysses_attention_backward(dout, dlse, qh, kh, vh, out_h, lse_h, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None


def heads_to_seq_like_zeros(out_h: Tensor, group_name: str) -> Tensor:
    c = resolve_group(group_name).size()
    return out_h.new_zeros(out_h.shape[0], out_h.shape[1] * c, out_h.shape[2] // c, out_h.shape[3])


ulysses_attention_op.register_autograd(_backward, setup_context=_setup)


def _expand_forward(args) -> Traceable:
    q, k, v, group_name, is_causal, layout, scale, enable_gqa, *rest = args
    inner = rest[0] if rest else "sdpa"
    world_size = resolve_group(group_name).size()

    def fn(q, k, v):
        return ulysses_forward(q, k, v, group_name=group_name, world_size=world_size, is_causal=is_causal,
                               layout=layout, scale=scale, enable_gqa=enable_gqa, inner=inner)

    return Traceable("forward", world_size, fn, [q, k, v])


def _expand_backward(args) -> Traceable:
    dout, dlse, qh, kh, vh, out_h, lse_h, group_name, is_causal, layout, scale, kv_heads, *rest = args
    inner = rest[0] if rest else "sdpa"
    world_size = resolve_group(group_name).size()

    def fn(*tensors):  # fixed arity for tracing: dlse is there or not
        dout, qh, kh, vh, out_h, lse_h = tensors[:6]
        return ulysses_backward(dout, tensors[6] if len(tensors) > 6 else None, qh, kh, vh, out_h, lse_h,
                                group_name=group_name, world_size=world_size, is_causal=is_causal,
                                layout=layout, scale=scale, kv_heads=kv_heads, inner=inner)

    tensors = [dout, qh, kh, vh, out_h, lse_h] + ([dlse] if dlse is not None else [])
    return Traceable("backward", world_size, fn, tensors)


register_schedule(
    torch.ops.cp.ulysses_attention.default, _expand_forward,
    torch.ops.cp.ulysses_attention_backward.default, _expand_backward,
    {torch.ops.cp.heads_attn.default: "heads_attend", torch.ops.cp.heads_attn_backward.default: "heads_attend_backward"},
)


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, group=None, is_causal: bool = False, scale: Optional[float] = None,
    enable_gqa: bool = False, layout: str = "zigzag",
) -> Tensor:
    """All-to-all (Ulysses) attention over a sequence sharded across ``group``.

    Same contract as ``ring_attention``: this rank's ``[B, H, S_local, D]``
    shards in ``layout`` order, causal over the global sequence. Query heads
    must divide by the group size. Differentiable.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return ulysses_attention_op(q, k, v, group_name_of(group), bool(is_causal), layout, scale, bool(enable_gqa))[0]
