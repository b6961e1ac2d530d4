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

The attention on the head-sharded tensors is pluggable (``INNER``): a name
maps to an ``Inner``, the kernels of one kind of attention over all of the
group's tokens for this rank's heads, plus its checks and (for the hybrid
schedule, ``ops.hybrid``) its ring across all-to-all groups. ``"sdpa"`` is
the dense kernel (causal or not, tokens in sequence order). Mask kinds that
need more than ``is_causal`` register their own entry (``ops.ulysses_masks``:
``"flex"``, ``"packed"``): the ops take their tensors as ``extra`` (mask and
score buffers, ``cu_seqlens``) and their other settings as one ``options``
string that the entry parses, so one schedule and one pair of ops serve them
all, eager and compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .block import acc_dtype, block_attn_backward_impl, block_attn_impl, dense_like, result_like
from .comm import resolve_group
from .heads import check_heads, heads_to_seq, replicate_kv_heads, seq_to_heads
from .registry import Traceable, register_schedule
from .ring import check_ring_args, group_name_of, ring_backward, ring_forward


@dataclass(frozen=True)
class HeadsCall:
    """The non-tensor arguments an inner attention sees; the same on every rank."""

    group_name: str  # every rank of the schedule (hybrid: the flattened mesh)
    a2a_group: str  # the all-to-all group (Ulysses: group_name)
    ring_group: str  # hybrid: the ring across all-to-all groups; Ulysses: ""
    is_causal: bool
    layout: str  # the plan's layout of the sequence shards
    scale: float
    options: str  # the inner's own settings, "key=value key=value"

    def option(self, key: str) -> str:
        items = dict(item.split("=", 1) for item in self.options.split())
        if key not in items:
            raise ValueError(f"inner attention options {self.options!r} lack {key}=")
        return items[key]


def _dense_start(q, k, v, extra, call: HeadsCall, world_size: int, enable_gqa: bool, what: str) -> None:
    if world_size > 1:
        torch.ops.cp.agree(q, k, v, call.group_name, what)
    check_ring_args(q, k, v, world_size, call.is_causal, call.layout, enable_gqa)


@dataclass(frozen=True)
class Inner:
    """One kind of attention over head-sharded tensors ([B, H/C, S, D]: all of the group's tokens).

    ``forward(q, k, v, extra, call) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, dlse,
    extra, call) -> (dq, dk, dv)`` are kernels: they run inside ``cp::heads_attn`` (+ ``_backward``),
    read the rank at run time if they need it, and may return gradients in the accumulation dtype.
    ``start(q, k, v, extra, call, world_size, enable_gqa, what)`` runs first on the sequence shards:
    it checks the inputs and makes every rank agree on ``what`` plus the inner's own settings (the
    same collectives on every rank). ``ring_forward(q, k, v, extra, call) -> (out, lse)`` and
    ``ring_backward(dout, q, k, v, out, lse, dlse, extra, call) -> (dq, dk, dv)`` are the hybrid's
    K/V ring over ``call.ring_group`` (traced schedule code, not kernels). ``rank_order``: the
    exchange leaves every rank's shard in rank order instead of sequence order (a mask evaluated
    at known slots does not need the sequence order).
    """

    forward: Callable
    backward: Callable
    start: Callable = _dense_start
    ring_forward: Optional[Callable] = None
    ring_backward: Optional[Callable] = None
    rank_order: bool = False

    def exchange_layout(self, layout: str) -> str:
        return "contiguous" if self.rank_order else layout


def _sdpa_mask(call: HeadsCall) -> str:
    return "causal" if call.is_causal else "none"


def _sdpa_ring_forward(q, k, v, extra, call: HeadsCall):
    return ring_forward(q, k, v, group_name=call.ring_group, world_size=resolve_group(call.ring_group).size(),
                        is_causal=call.is_causal, layout=call.layout, scale=call.scale,
                        enable_gqa=q.shape[1] != k.shape[1])


def _sdpa_ring_backward(dout, q, k, v, out, lse, dlse, extra, call: HeadsCall):
    return ring_backward(dout, q, k, v, out, lse, dlse, group_name=call.ring_group,
                         world_size=resolve_group(call.ring_group).size(), is_causal=call.is_causal,
                         layout=call.layout, scale=call.scale)


INNER: dict[str, Inner] = {
    "sdpa": Inner(
        forward=lambda q, k, v, extra, call: block_attn_impl(q, k, v, _sdpa_mask(call), call.scale),
        backward=lambda do, q, k, v, out, lse, dlse, extra, call: block_attn_backward_impl(
            do, q, k, v, out, lse, _sdpa_mask(call), call.scale, dlse),
        ring_forward=_sdpa_ring_forward,
        ring_backward=_sdpa_ring_backward,
    ),
}


def inner_entry(inner: str) -> Inner:
    if inner not in INNER:
        raise ValueError(f"unknown inner attention {inner!r}; expected one of {sorted(INNER)}")
    return INNER[inner]


def _heads_call(group_name: str, is_causal: bool, layout: str, scale: float, options: str) -> HeadsCall:
    return HeadsCall(group_name, group_name, "", is_causal, layout, scale, options)


@torch.library.custom_op("cp::heads_attn", mutates_args=())
def heads_attn(
    q: Tensor, k: Tensor, v: Tensor, extra: list[Tensor], inner: str, group_name: str, is_causal: bool,
    layout: str, scale: float, options: str,
) -> tuple[Tensor, Tensor]:
    """Attention over the full sequence for this rank's heads: (out, lse)."""
    call = _heads_call(group_name, is_causal, layout, scale, options)
    out, lse = inner_entry(inner).forward(q, k, v, list(extra), call)
    return out.contiguous(), lse.contiguous()


@heads_attn.register_fake
def _(q, k, v, extra, inner, group_name, is_causal, layout, scale, options):
    inner_entry(inner)
    return result_like(q, v)


@torch.library.custom_op("cp::heads_attn_backward", mutates_args=())
def heads_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    extra: list[Tensor], inner: str, group_name: str, is_causal: bool, layout: str, scale: float, options: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtype (the exchange back moves no more bytes than the forward's)."""
    call = _heads_call(group_name, is_causal, layout, scale, options)
    grads = inner_entry(inner).backward(dout, q, k, v, out, lse, dlse, list(extra), call)
    return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v)))


@heads_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, extra, inner, group_name, is_causal, layout, scale, options):
    inner_entry(inner)
    return dense_like(q), dense_like(k), dense_like(v)


# ----------------------------------------------------------------------------
# The schedule (one definition, eager and compiled).
# ----------------------------------------------------------------------------


def _options(is_causal: bool, layout: str, scale: float, enable_gqa: bool) -> str:
    return f"ulysses causal={is_causal} layout={layout} scale={scale!r} gqa={enable_gqa}"


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
    """The mirror: dout (and dlse) to head sharding, ``attend_backward(dout_h, dlse_h)``, gradients back.

    The gradients travel in the dtype ``attend_backward`` returns them in; replicated K/V heads'
    gradients are summed in the accumulation dtype."""
    dout_h = seq_to_heads(dout, group_name, world_size, layout)
    dlse_h = None if dlse is None else seq_to_heads(dlse, group_name, world_size, layout)
    grads = attend_backward(dout_h, dlse_h)
    dq, dk, dv = (heads_to_seq(t, group_name, world_size, layout) for t in grads)
    copies = dk.shape[1] // kv_heads
    if copies > 1:  # the replicated heads' gradients, summed back onto each original head
        b, _, s, _ = dk.shape
        acc = acc_dtype(dk.dtype)
        dk = dk.view(b, kv_heads, copies, s, dk.shape[-1]).sum(2, dtype=acc).to(dk.dtype)
        dv = dv.view(b, kv_heads, copies, s, dv.shape[-1]).sum(2, dtype=acc).to(dv.dtype)
    return dq, dk, dv


def ulysses_forward(
    q: Tensor, k: Tensor, v: Tensor, extra: list[Tensor], *, group_name: str, world_size: int, is_causal: bool,
    layout: str, scale: float, enable_gqa: bool, inner: str, options: str,
) -> tuple[Tensor, ...]:
    """(out, lse) sequence-sharded, then the head-sharded (q, k, v, out, lse) the backward needs."""
    entry = inner_entry(inner)
    call = _heads_call(group_name, is_causal, layout, scale, options)
    entry.start(q, k, v, extra, call, world_size, enable_gqa, f"{_options(is_causal, layout, scale, enable_gqa)} "
                f"inner={inner}")
    check_heads(q.shape[1], world_size, "the query")

    def attend(qh, kh, vh):
        return torch.ops.cp.heads_attn(qh, kh, vh, extra, inner, group_name, is_causal, layout, scale, options)

    return exchange_forward(q, k, v, group_name, world_size, entry.exchange_layout(layout), attend)


def ulysses_backward(
    dout: Tensor, dlse: Optional[Tensor], qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor,
    extra: list[Tensor], *, group_name: str, world_size: int, is_causal: bool, layout: str, scale: float,
    kv_heads: int, inner: str, options: str,
) -> tuple[Tensor, Tensor, Tensor]:
    def attend_backward(dout_h, dlse_h):
        return torch.ops.cp.heads_attn_backward(dout_h, qh, kh, vh, out_h, lse_h, dlse_h, extra, inner, group_name,
                                                is_causal, layout, scale, options)

    return exchange_backward(dout, dlse, group_name, world_size, inner_entry(inner).exchange_layout(layout),
                             kv_heads, attend_backward)


# ----------------------------------------------------------------------------
# Ulysses as one differentiable op.
# ----------------------------------------------------------------------------


@torch.library.custom_op("cp::ulysses_attention", mutates_args=())
def ulysses_attention_op(
    q: Tensor, k: Tensor, v: Tensor, extra: list[Tensor], group_name: str, is_causal: bool, layout: str,
    scale: float, enable_gqa: bool, inner: str, options: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse) of this rank's queries, plus head-sharded q, k, v, out, lse kept for backward."""
    world_size = resolve_group(group_name).size()
    res = ulysses_forward(q, k, v, list(extra), group_name=group_name, world_size=world_size, is_causal=is_causal,
                          layout=layout, scale=scale, enable_gqa=enable_gqa, inner=inner, options=options)
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


def head_sharded_results(q: Tensor, k: Tensor, v: Tensor, world_size: int) -> tuple[Tensor, ...]:
    """Fake outputs of a head-sharding forward op over ``world_size`` ranks: (out, lse, qh, kh, vh, out_h, lse_h)."""
    out, lse = result_like(q, v)
    kv_heads = k.shape[1] * kv_copies(q.shape[1], k.shape[1], world_size)
    return (out, lse, _head_sharded_like(q, world_size), _head_sharded_like(k, world_size, kv_heads),
            _head_sharded_like(v, world_size, kv_heads), _head_sharded_like(out, world_size),
            _head_sharded_like(lse, world_size))


def sequence_sharded_grads(dout: Tensor, qh: Tensor, kh: Tensor, vh: Tensor, world_size: int,
                           kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Fake outputs of a head-sharding backward op: (dq, dk, dv) in dout's dtype."""
    b, s = dout.shape[0], dout.shape[2]
    return (dout.new_empty(b, qh.shape[1] * world_size, s, qh.shape[-1]),
            dout.new_empty(b, kv_heads, s, kh.shape[-1]), dout.new_empty(b, kv_heads, s, vh.shape[-1]))


@ulysses_attention_op.register_fake
def _(q, k, v, extra, group_name, is_causal, layout, scale, enable_gqa, inner, options):
    inner_entry(inner)
    return head_sharded_results(q, k, v, resolve_group(group_name).size())


@torch.library.custom_op("cp::ulysses_attention_backward", mutates_args=())
def ulysses_attention_backward_op(
    dout: Tensor, dlse: Optional[Tensor], qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor,
    extra: list[Tensor], group_name: str, is_causal: bool, layout: str, scale: float, kv_heads: int,
    inner: str, options: str,
) -> tuple[Tensor, Tensor, Tensor]:
    world_size = resolve_group(group_name).size()
    res = ulysses_backward(dout, dlse, qh, kh, vh, out_h, lse_h, list(extra), group_name=group_name,
                           world_size=world_size, is_causal=is_causal, layout=layout, scale=scale,
                           kv_heads=kv_heads, inner=inner, options=options)
    return _distinct(res, (dout, dlse, qh, kh, vh, out_h, lse_h))


@ulysses_attention_backward_op.register_fake
def _(dout, dlse, qh, kh, vh, out_h, lse_h, extra, group_name, is_causal, layout, scale, kv_heads, inner,
      options):
    return sequence_sharded_grads(dout, qh, kh, vh, resolve_group(group_name).size(), kv_heads)


def register_head_sharded_autograd(forward_op, backward_op, backward_options: Callable) -> None:
    """Autograd for a whole head-sharding op ``(q, k, v, extra, *options) -> (out, lse, qh, kh, vh, out_h, lse_h)``.

    It keeps the head-sharded outputs and ``extra``; its backward op takes
    ``(dout, dlse, qh, kh, vh, out_h, lse_h, extra, *args)`` where
    ``backward_options(k_heads, *options)`` returns (the all-to-all group, ``args``).
    """

    def setup(ctx, inputs, output):
        q, k, v, extra, *options = inputs
        ctx.save_for_backward(*output[2:], *extra)
        ctx.n_extra, ctx.n_options = len(extra), len(options)
        ctx.a2a_group, ctx.args = backward_options(k.shape[1], *options)
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, dlse, *_unused):
        qh, kh, vh, out_h, lse_h, *extra = ctx.saved_tensors
        if dout is None:  # only lse is used: zeros of the sequence-sharded output's shape
            c = resolve_group(ctx.a2a_group).size()
            dout = out_h.new_zeros(out_h.shape[0], out_h.shape[1] * c, out_h.shape[2] // c, out_h.shape[3])
        dq, dk, dv = backward_op(dout, dlse, qh, kh, vh, out_h, lse_h, extra, *ctx.args)
        return (dq, dk, dv, [None] * ctx.n_extra) + (None,) * ctx.n_options

    forward_op.register_autograd(backward, setup_context=setup)


def _ulysses_backward_options(kv_heads, group_name, is_causal, layout, scale, enable_gqa, inner, options):
    return group_name, (group_name, is_causal, layout, scale, kv_heads, inner, options)


register_head_sharded_autograd(ulysses_attention_op, torch.ops.cp.ulysses_attention_backward,
                               _ulysses_backward_options)


def _expand_forward(args) -> Traceable:
    q, k, v, extra, group_name, is_causal, layout, scale, enable_gqa, inner, options = args
    world_size = resolve_group(group_name).size()

    def fn(q, k, v, *extra):
        return ulysses_forward(q, k, v, list(extra), group_name=group_name, world_size=world_size,
                               is_causal=is_causal, layout=layout, scale=scale, enable_gqa=enable_gqa, inner=inner,
                               options=options)

    return Traceable("forward", world_size, fn, [q, k, v, *extra])


def split_backward_tensors(tensors: tuple, n_extra: int) -> tuple:
    """``(dout, qh, kh, vh, out_h, lse_h, *extra[, dlse])`` -> (dout, dlse, qh, kh, vh, out_h, lse_h, extra):
    a traced backward's fixed arity (dlse is there or not)."""
    dout, qh, kh, vh, out_h, lse_h = tensors[:6]
    extra = list(tensors[6:6 + n_extra])
    dlse = tensors[6 + n_extra] if len(tensors) > 6 + n_extra else None
    return dout, dlse, qh, kh, vh, out_h, lse_h, extra


def backward_tensors(dout, dlse, qh, kh, vh, out_h, lse_h, extra) -> list:
    return [dout, qh, kh, vh, out_h, lse_h, *extra] + ([dlse] if dlse is not None else [])


def _expand_backward(args) -> Traceable:
    dout, dlse, qh, kh, vh, out_h, lse_h, extra, group_name, is_causal, layout, scale, kv_heads, inner, options = args
    world_size = resolve_group(group_name).size()
    n_extra = len(extra)

    def fn(*tensors):
        dout, dlse, qh, kh, vh, out_h, lse_h, extra = split_backward_tensors(tensors, n_extra)
        return ulysses_backward(dout, dlse, qh, kh, vh, out_h, lse_h, extra, group_name=group_name,
                                world_size=world_size, is_causal=is_causal, layout=layout, scale=scale,
                                kv_heads=kv_heads, inner=inner, options=options)

    return Traceable("backward", world_size, fn, backward_tensors(dout, dlse, qh, kh, vh, out_h, lse_h, extra))


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
    return ulysses_attention_op(q, k, v, [], group_name_of(group), bool(is_causal), layout, scale,
                                bool(enable_gqa), "sdpa", "")[0]
