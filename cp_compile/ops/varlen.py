"""Packed documents (THD, ``cu_seqlens``) under CP: all-gather and ring schedules.

Tensors are packed ``[T_local, H, D]``: this rank's slots under the
per-document zigzag (``layout.packed_slots``): every document split into 2C
chunks on its own, rank r holding chunks r and 2C-1-r of each, padding at a
document's tail. ``cu_seqlens`` is the *global* int32 tensor of real document
lengths, the same on every rank, exactly what the model passes to
``varlen_attn`` on one device.

Which query may see which key is decided from global facts only: the
document, the position inside it and whether the slot is a real token, all
computed exactly from ``cu_seqlens`` (never by dividing lengths by 2C). A key
is visible to a query when both are real, in the same document and inside
the window ``(left, right)`` (-1: unbounded; ``right = 0`` is causal), as in
``varlen_attn``. Padding rows get out = 0, lse = -inf and zero gradients, and
are never visible as keys.

The per-rank compute (``cp::varlen_block_attn``) reads the rank at run time,
turns this rank's slots and the step's K/V into runs of real tokens
(``layout.packed_segments``) and attends per document tile over strided
views (``ops.tiles``): fused kernels for full and causal tiles, the math path
only for window edges, so memory is per tile. A ring step whose K/V block is
outside every query's window has no tile and computes nothing.

Schedules (``ulysses`` and ``hybrid`` shard heads instead: they run as the
``"packed"`` inner attention of ``cp::ulysses_attention`` /
``cp::hybrid_attention``, ``ops.ulysses_masks``):

- ``allgather``: gather K/V once and put it in global packed order
  (``cp::packed_sequence_order``), so each local query chunk attends to one
  contiguous visible range of its document: a bottom-right causal prefix, or
  a window; backward gathers again, returns dK/dV to rank order and
  reduce-scatters it.
- ``ring``: the K/V ring of ``ops.ring`` with per-step visibility; partial
  results merge into an fp32 accumulator; dK/dV ride along in backward.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..layout import check_cu_seqlens, packed_local_len, packed_segments, sequence_permutation, sequence_segments
from .allgather import gather_dim0, reduce_scatter_dim0
from .block import acc_dtype, dense_like
from .comm import resolve_group
from .registry import Traceable, register_schedule
from .ring import group_name_of, is_2d_mesh, ring_pass_backward, ring_pass_forward
from .tiles import plan_tiles, tiles_attn, tiles_attn_backward

# ulysses and hybrid run as cp::ulysses_attention / cp::hybrid_attention (inner "packed", ops.ulysses_masks)
PACKED_SCHEDULES = ("allgather", "ring", "ulysses", "hybrid")
GATHERED = -1  # the ``step`` of a call whose K/V hold every rank's slots, in global packed order


# ----------------------------------------------------------------------------
# Which tiles each call computes, from cu_seqlens and the rank read at run time.
# ----------------------------------------------------------------------------


def step_tiles(q: Tensor, k: Tensor, cu_seqlens: Tensor, step: int, group_name: str, left: int, right: int):
    """The tiles of this rank's Q against the K/V a ring step holds (``GATHERED``: all, in sequence order)."""
    group = resolve_group(group_name)
    rank, size = group.rank(), group.size()
    cu = check_cu_seqlens(cu_seqlens)
    expected = packed_local_len(cu, size)
    if q.shape[0] != expected:
        raise ValueError(
            f"q has {q.shape[0]} local tokens but cu_seqlens={cu} gives {expected} slots per rank over C={size}; "
            "shard packed inputs with ContextParallel.shard(x, 0, cu_seqlens=...)"
        )
    if k.shape[0] != expected * (size if step == GATHERED else 1):
        raise ValueError(f"k/v have {k.shape[0]} tokens; expected {expected * (size if step == GATHERED else 1)} "
                         f"for step {step}")
    k_runs = sequence_segments(cu) if step == GATHERED else packed_segments(cu, [(rank - step) % size], size)
    return plan_tiles(packed_segments(cu, [rank], size), k_runs, left, right)


@functools.lru_cache(maxsize=64)
def _permutation(cu: tuple[int, ...], world_size: int, inverse: bool) -> Tensor:
    perm = sequence_permutation(list(cu), world_size)
    return perm.argsort() if inverse else perm


@torch.library.custom_op("cp::packed_sequence_order", mutates_args=())
def packed_sequence_order(x: Tensor, cu_seqlens: Tensor, world_size: int, inverse: bool) -> Tensor:
    """Every rank's slots (rank order) -> real tokens in global packed order, then padding; ``inverse`` undoes it."""
    perm = _permutation(tuple(check_cu_seqlens(cu_seqlens)), world_size, inverse)
    return x.index_select(0, perm.to(x.device))


@packed_sequence_order.register_fake
def _(x, cu_seqlens, world_size, inverse):
    return dense_like(x)


# ----------------------------------------------------------------------------
# Per-step compute ops (rank read at run time).
# ----------------------------------------------------------------------------


@torch.library.custom_op("cp::varlen_block_attn", mutates_args=())
def varlen_block_attn(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, step: int, group_name: str,
    window_left: int, window_right: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """This rank's packed Q against one step's K/V (``step=-1``: every rank's, gathered)."""
    tiles = step_tiles(q, k, cu_seqlens, step, group_name, window_left, window_right)
    return tiles_attn(q, k, v, tiles, scale)


def packed_result_like(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Uninitialised packed (out [T, Hq, Dv], lse [T, Hq]): what the fakes return."""
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype))


@varlen_block_attn.register_fake
def _(q, k, v, cu_seqlens, step, group_name, window_left, window_right, scale):
    return packed_result_like(q, v)


@torch.library.custom_op("cp::varlen_block_attn_backward", mutates_args=())
def varlen_block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    cu_seqlens: Tensor, step: int, group_name: str, window_left: int, window_right: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    tiles = step_tiles(q, k, cu_seqlens, step, group_name, window_left, window_right)
    return tiles_attn_backward(dout, q, k, v, out, lse, dlse, tiles, scale)


@varlen_block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, step, group_name, window_left, window_right, scale):
    dt = acc_dtype(q.dtype)
    return tuple(t.new_empty(t.shape, dtype=dt) for t in (q, k, v))


# ----------------------------------------------------------------------------
# The schedules (one definition each, eager and compiled).
# ----------------------------------------------------------------------------


def check_packed_args(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"packed q, k, v must be [tokens, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible packed q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads but k/v have {k.shape[1]}; pass enable_gqa=True")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


@torch.library.custom_op("cp::agree_cu_seqlens", mutates_args=())
def agree_cu_seqlens(cu_seqlens: Tensor, group_name: str) -> None:
    """All-gather a digest of cu_seqlens; raise on every rank if the ranks passed different ones.

    Validation comes after the exchange: a rank that raised first would leave
    the others waiting in the collective.
    """
    group = resolve_group(group_name)
    cu = [int(x) for x in cu_seqlens.tolist()]
    device = cu_seqlens.device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    mine = torch.tensor([zlib.crc32(str(cu).encode()), len(cu), cu[-1] if cu else -1], dtype=torch.int64, device=device)
    everyone = torch.empty(3 * group.size(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.view(group.size(), 3).tolist()
    if any(row != rows[0] for row in rows):
        detail = "; ".join(f"rank {r}: {n - 1} documents, {total} tokens" for r, (_, n, total) in enumerate(rows))
        raise ValueError(f"cu_seqlens differs across ranks ({detail}); pass the same global cu_seqlens on every rank")
    check_cu_seqlens(cu)


@agree_cu_seqlens.register_fake
def _(cu_seqlens, group_name):
    return None


torch.fx.node.has_side_effect(torch.ops.cp.agree_cu_seqlens.default)


def _start(q, k, v, cu_seqlens, group_name, world_size, schedule, left, right, scale, enable_gqa):
    if world_size > 1:
        torch.ops.cp.agree(q, k, v, group_name, f"packed {schedule} window=({left},{right}) scale={scale!r} "
                           f"gqa={enable_gqa}")
        torch.ops.cp.agree_cu_seqlens(cu_seqlens, group_name)
    check_packed_args(q, k, v, enable_gqa)


def _gather_in_sequence_order(k, v, cu_seqlens, group_name, world_size):
    return tuple(torch.ops.cp.packed_sequence_order(gather_dim0(t, group_name, world_size), cu_seqlens, world_size,
                                                    False) for t in (k, v))


def packed_allgather_forward(q, k, v, cu_seqlens, *, group_name, world_size, window, scale, enable_gqa):
    _start(q, k, v, cu_seqlens, group_name, world_size, "allgather", *window, scale, enable_gqa)
    k_all, v_all = _gather_in_sequence_order(k, v, cu_seqlens, group_name, world_size)
    return torch.ops.cp.varlen_block_attn(q, k_all, v_all, cu_seqlens, GATHERED, group_name, *window, scale)


def packed_allgather_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, *, group_name, world_size, window, scale):
    k_all, v_all = _gather_in_sequence_order(k, v, cu_seqlens, group_name, world_size)
    dq, dk_all, dv_all = torch.ops.cp.varlen_block_attn_backward(
        dout, q, k_all, v_all, out, lse, dlse, cu_seqlens, GATHERED, group_name, *window, scale
    )
    del k_all, v_all
    dk, dv = (reduce_scatter_dim0(torch.ops.cp.packed_sequence_order(t, cu_seqlens, world_size, True), group_name,
                                  world_size) for t in (dk_all, dv_all))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def packed_ring_forward(q, k, v, cu_seqlens, *, group_name, world_size, window, scale, enable_gqa):
    _start(q, k, v, cu_seqlens, group_name, world_size, "ring", *window, scale, enable_gqa)

    def attend(step, k_block, v_block):
        out, lse = torch.ops.cp.varlen_block_attn(q, k_block, v_block, cu_seqlens, step, group_name, *window, scale)
        return out.unsqueeze(0), lse.unsqueeze(0)  # [T, H, D] as a batch of one for the merge

    out, lse = ring_pass_forward(q, k, v, attend, group_name=group_name, world_size=world_size)
    return out.squeeze(0).to(q.dtype), lse.squeeze(0)


def packed_ring_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, *, group_name, world_size, window, scale):
    """As ``ring_backward``: K/V travel again, each block's dK/dV so far riding along."""
    def attend_backward(step, k_block, v_block, dout, q, out, lse, dlse):
        return torch.ops.cp.varlen_block_attn_backward(
            dout, q, k_block, v_block, out, lse, dlse, cu_seqlens, step, group_name, *window, scale
        )

    # the tiles depend on tokens only, so a step splits into head halves as the SDPA ring's does
    dq, dk, dv = ring_pass_backward(q, k, v, attend_backward, group_name=group_name, world_size=world_size,
                                    q_side=(dout, q, out, lse, dlse), split_heads=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_FORWARD = {"allgather": packed_allgather_forward, "ring": packed_ring_forward}
_BACKWARD = {"allgather": packed_allgather_backward, "ring": packed_ring_backward}


def _check_schedule(schedule: str) -> None:
    if schedule not in PACKED_SCHEDULES:
        raise ValueError(f"unknown packed schedule {schedule!r}; expected one of {PACKED_SCHEDULES}")
    if schedule not in _FORWARD:
        raise ValueError(f"schedule={schedule!r} shards heads: it runs as cp::{schedule}_attention with "
                         f"inner='packed' (ops.ulysses_masks.packed_heads_attention), not as cp::varlen_attention")


# ----------------------------------------------------------------------------
# One differentiable op for both schedules.
# ----------------------------------------------------------------------------


@torch.library.custom_op("cp::varlen_attention", mutates_args=())
def varlen_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, group_name: str, schedule: str,
    window_left: int, window_right: int, scale: float, enable_gqa: bool,
) -> tuple[Tensor, Tensor]:
    """Packed attention of this rank's slots over every document's whole length: (out, lse [T, H])."""
    _check_schedule(schedule)
    out, lse = _FORWARD[schedule](
        q, k, v, cu_seqlens, group_name=group_name, world_size=resolve_group(group_name).size(),
        window=(window_left, window_right), scale=scale, enable_gqa=enable_gqa,
    )
    return out.contiguous(), lse.contiguous()


@varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens, group_name, schedule, window_left, window_right, scale, enable_gqa):
    return packed_result_like(q, v)


@torch.library.custom_op("cp::varlen_attention_backward", mutates_args=())
def varlen_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    cu_seqlens: Tensor, group_name: str, schedule: str, window_left: int, window_right: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_schedule(schedule)
    dq, dk, dv = _BACKWARD[schedule](
        dout, q, k, v, out, lse, dlse, cu_seqlens, group_name=group_name,
        world_size=resolve_group(group_name).size(), window=(window_left, window_right), scale=scale,
    )
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@varlen_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, group_name, schedule, window_left, window_right, scale):
    return dense_like(q), dense_like(k), dense_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, group_name, schedule, left, right, scale, _ = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.options = (group_name, schedule, left, right, scale)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.cp.varlen_attention_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None


varlen_attention_op.register_autograd(_backward, setup_context=_setup)


def _expand_forward(args) -> Traceable:
    q, k, v, cu_seqlens, group_name, schedule, left, right, scale, enable_gqa = args
    world_size = resolve_group(group_name).size()

    def fn(q, k, v, cu_seqlens):
        return _FORWARD[schedule](q, k, v, cu_seqlens, group_name=group_name, world_size=world_size,
                                  window=(left, right), scale=scale, enable_gqa=enable_gqa)

    return Traceable("forward", world_size, fn, [q, k, v, cu_seqlens])


def _expand_backward(args) -> Traceable:
    dout, q, k, v, out, lse, dlse, cu_seqlens, group_name, schedule, left, right, scale = args
    world_size = resolve_group(group_name).size()

    def fn(*tensors):  # a fixed arity for tracing: dlse is there or not
        dout, q, k, v, out, lse, cu = tensors[:7]
        dlse = tensors[7] if len(tensors) > 7 else None
        return _BACKWARD[schedule](dout, q, k, v, out, lse, dlse, cu, group_name=group_name,
                                   world_size=world_size, window=(left, right), scale=scale)

    tensors = [dout, q, k, v, out, lse, cu_seqlens] + ([dlse] if dlse is not None else [])
    return Traceable("backward", world_size, fn, tensors)


# listing names starting with "attend" carry the step number, the first int argument
register_schedule(
    torch.ops.cp.varlen_attention.default, _expand_forward,
    torch.ops.cp.varlen_attention_backward.default, _expand_backward,
    {torch.ops.cp.varlen_block_attn.default: "packed attend",
     torch.ops.cp.varlen_block_attn_backward.default: "packed attend_backward"},
)


# ----------------------------------------------------------------------------
# Eager API.
# ----------------------------------------------------------------------------


def window_of(window_size, is_causal: bool) -> tuple[int, int]:
    """(left, right) as ``varlen_attn`` takes it; ``is_causal`` means right = 0."""
    if len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right); got {window_size}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {window_size}")
    if is_causal:
        if right > 0:
            raise ValueError(f"is_causal=True with window_size={tuple(window_size)}: a causal window has right = 0")
        right = 0
    return left, right


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, group=None, *, is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), scale: Optional[float] = None, enable_gqa: bool = False,
    schedule: str = "auto", machine=None,
) -> Tensor:
    """CP attention over packed documents. Differentiable.

    ``q, k, v`` are this rank's ``[T_local, H, D]`` slots (``ContextParallel.shard(x, 0,
    cu_seqlens=cu)``); ``cu_seqlens`` is the global int32 tensor of document
    boundaries, as on one device. ``window_size=(left, right)`` as in torch's
    ``varlen_attn`` (-1 unbounded; ``(-1, 0)`` or ``is_causal=True``: causal).
    ``schedule`` is ``"allgather"``, ``"ring"``, ``"ulysses"`` (query heads
    must divide by C), ``"hybrid"`` (``group`` a 2-D (ring, a2a) DeviceMesh;
    query heads must divide by its a2a size) or ``"auto"``: the cost model's
    choice (``passes.masked.choose_packed``) from the documents, the window and
    ``machine`` (a ``cp_compile.Machine``; default: the device type's profile),
    the same choice a compiled ``varlen_attn`` site makes.
    """
    left, right = window_of(window_size, is_causal)
    if schedule == "auto":
        from ..passes.masked import choose_packed

        schedule = "hybrid" if is_2d_mesh(group) else choose_packed(
            q, k, v, cu_seqlens, resolve_group(group_name_of(group)).size(), (left, right), machine)[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if schedule in ("ulysses", "hybrid"):
        from .ulysses_masks import packed_heads_attention

        return packed_heads_attention(q, k, v, cu_seqlens, group, schedule, left, right, scale, bool(enable_gqa))[0]
    group_name = group_name_of(group)
    _check_schedule(schedule)
    out, _ = varlen_attention_op(q, k, v, cu_seqlens, group_name, schedule, left, right, scale, bool(enable_gqa))
    return out
