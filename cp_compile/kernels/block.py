"""Block attention: one (query block, key/value block) tile under one of a few masks.

``cp::block_attn(q, k, v, mask, scale) -> (out, lse)`` is the unit every CP
schedule is built from. ``out`` is normalised over this block's keys only and
``lse`` (fp32, fp64 for fp64 input) is its log-sum-exp, so partial results
from several blocks merge exactly (see ``merge.py``).

Masks, for a query block of length Lq against a key block of length Lk:

``none``                 every query sees every key
``causal``               query i sees keys j <= i (top-left aligned)
``causal_bottom_right``  query i sees keys j <= i + (Lk - Lq): the query block
                         ends where the key block ends
``empty``                nothing is visible: out = 0, lse = -inf, zero grads

The backward takes the *final* out and lse of the whole attention, not this
block's, so each tile's gradients are exactly its share of the true gradient.
It also takes an optional gradient for lse (used when a caller returns lse).

Tensors are ``[B, H, L, D]``. GQA (fewer key/value heads than query heads,
``Hq % Hkv == 0``) is passed straight to kernels that accept it (CPU flash,
CUDA flash), so repeated K/V is materialised only for CUDA's memory-efficient
kernel (fp32, head dims flash does not take).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .merge import acc_dtype, merge_partial

MASKS = ("none", "causal", "causal_bottom_right", "empty")

aten = torch.ops.aten


def dense_like(t: Tensor) -> Tensor:
    """An uninitialised contiguous tensor like ``t``: every CP op returns contiguous
    tensors, whatever the strides of its inputs, and its fake says so."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def result_like(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Uninitialised (out, lse) of attention of ``q`` over values like ``v``: what fakes return."""
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


# ----------------------------------------------------------------------------
# Kernels: one dense tile, causal (top-left) or not.
# ----------------------------------------------------------------------------


def _use_math(q: Tensor) -> bool:
    return q.device.type not in ("cpu", "cuda")


def _cuda_use_flash(q: Tensor) -> bool:
    """Flash attention takes fp16/bf16 and head dims up to 256 in multiples of 8; it groups the query heads over
    fewer key/value heads itself (forward and backward), so GQA never repeats K/V on that path."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def _rows_by_heads(t: Tensor) -> Tensor:
    """``t`` [B, H, L, D] stored as [B, L, H, D]: the layout the efficient kernel writes its output in, and the one
    its backward assumes when it reads ``out`` (it is given out's batch and head strides, and takes the row
    stride to be H * D). A [B, H, L, D]-contiguous out read that way gives a wrong delta = rowsum(dout * out),
    hence wrong dq and dk, wherever the kernel computes delta itself (fp16/bf16, H > 1)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def repeat_kv(q: Tensor, t: Tensor) -> Tensor:
    groups = q.shape[1] // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def sum_kv_groups(grad: Tensor, kv_heads: int) -> Tensor:
    b, hq, length, d = grad.shape
    if hq == kv_heads:
        return grad
    return grad.view(b, kv_heads, hq // kv_heads, length, d).sum(2)


def _math_scores(q: Tensor, k: Tensor, visible: Optional[Tensor], scale: float, softcap: float = 0.0) -> Tensor:
    """Scores in the accumulator dtype, [B, Hkv, G, Lq, Lk], without repeating K; -inf where not ``visible``.

    With ``softcap > 0`` the scores are ``softcap * tanh(scale * q.k / softcap)`` (Gemma 2's logit
    soft-capping): a per-score map, so partial results still merge exactly."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    dt = acc_dtype(q.dtype)
    qg = q.to(dt).view(b, hkv, hq // hkv, lq, d)
    s = soft_cap(torch.matmul(qg, k.to(dt).unsqueeze(2).transpose(-1, -2)) * scale, softcap)
    return s if visible is None else s.masked_fill(~visible, float("-inf"))


def soft_cap(scores: Tensor, softcap: float) -> Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's logit soft-capping); ``softcap = 0``: the scores."""
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def _causal(q: Tensor, k: Tensor, causal: bool) -> Optional[Tensor]:
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril() if causal else None


def math_attn_impl(
    q: Tensor, k: Tensor, v: Tensor, visible: Optional[Tensor], scale: float, softcap: float = 0.0
) -> tuple[Tensor, Tensor]:
    """A tile no fused kernel expresses (a window edge, soft-capped scores): the math path, memory Lq x Lk.
    Every row must see some key."""
    b, hq, lq, _ = q.shape
    s = _math_scores(q, k, visible, scale, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, v.to(s.dtype).unsqueeze(2))
    return out.reshape(b, hq, lq, v.shape[-1]).to(q.dtype), lse.reshape(b, hq, lq)


def _math_probs(q, k, lse, visible, scale, softcap: float = 0.0):
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    s = _math_scores(q, k, visible, scale, softcap)
    return torch.exp(s - lse.to(s.dtype).view(b, hkv, hq // hkv, lq, 1)), s


def math_attn_backward_impl(dout, q, k, v, out, lse, visible, scale, dlse=None, softcap: float = 0.0):
    """(dq, dk, dv) of a math tile, in the accumulator dtype."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    dt = acc_dtype(q.dtype)
    g = hq // hkv
    p, s = _math_probs(q, k, lse, visible, scale, softcap)
    do = dout.to(dt).view(b, hkv, g, lq, -1)
    dp = torch.matmul(do, v.to(dt).unsqueeze(2).transpose(-1, -2))
    delta = (do * out.to(dt).view(b, hkv, g, lq, -1)).sum(-1, keepdim=True)
    if dlse is not None:  # d lse_i / d s_ij = p_ij
        delta = delta - dlse.to(dt).view(b, hkv, g, lq, 1)
    ds = p * (dp - delta) * scale
    if softcap:  # d(c tanh(x / c))/dx = 1 - tanh^2; masked scores are -inf, their p is 0
        ds = ds * (1 - (s.masked_fill(p == 0, 0) / softcap) ** 2)
    dq = torch.matmul(ds, k.to(dt).unsqueeze(2)).reshape(b, hq, lq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.to(dt).view(b, hkv, g, lq, d)).sum(2)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    return dq, dk, dv  # in the accumulator dtype: every caller accumulates or casts once


def _pad_dim(t: Tensor, dim: int) -> Tensor:
    return t if t.shape[-1] == dim else torch.nn.functional.pad(t, (0, dim - t.shape[-1]))


def tile_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, lse in the accumulator dtype) of one dense tile, causal (top-left) or not: one fused
    kernel call where the device has one."""
    if q.shape[-1] != v.shape[-1] and not _use_math(q):
        # the fused kernels take one head dim: zero columns change neither the scores (q, k) nor the
        # kept columns of the output (v); multi-head latent attention has q/k wider than v
        dim = max(q.shape[-1], v.shape[-1])
        out, lse = tile_fwd(_pad_dim(q, dim), _pad_dim(k, dim), _pad_dim(v, dim), causal, scale)
        return out[..., : v.shape[-1]], lse
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(acc_dtype(q.dtype))
    if q.device.type == "cuda":
        if _cuda_use_flash(q):
            res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1]
        kr, vr = repeat_kv(q, k), repeat_kv(q, v)
        res = aten._scaled_dot_product_efficient_attention(q, kr, vr, None, True, 0.0, causal, scale=scale)
        return res[0], res[1][..., : q.shape[2]].to(acc_dtype(q.dtype))
    return math_attn_impl(q, k, v, _causal(q, k, causal), scale)


def _tile_bwd(dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) of one dense tile, in the inputs' dtype or, where the kernel gives it, the accumulator's."""
    if q.shape[-1] != v.shape[-1] and not _use_math(q):  # see tile_fwd
        dim = max(q.shape[-1], v.shape[-1])
        dq, dk, dv = _tile_bwd(*(_pad_dim(t, dim) for t in (dout, q, k, v, out)), lse, causal, scale)
        return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]
    if q.device.type == "cpu":
        if q.dtype in (torch.bfloat16, torch.float16):
            # the CPU kernel computes in fp32 either way; given fp32 inputs it also sums the query heads of a
            # key/value group in fp32 before its one rounding (in bf16 its dK/dV error doubles at 3 groups)
            # (the gradients stay fp32 for the caller's accumulators)
            return _tile_bwd(*(t.float() for t in (dout, q, k, v, out)), lse, causal, scale)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if q.device.type == "cuda":
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # read only with dropout
        if _cuda_use_flash(q):
            # cumulative lengths: undefined (None), as the dense forward returns them; a defined
            # tensor would mean packed sequences to the kernel
            return aten._scaled_dot_product_flash_attention_backward(
                dout.contiguous(),
                q,
                k,
                v,
                out,
                lse.float(),
                None,
                None,
                q.shape[2],
                k.shape[2],
                0.0,
                causal,
                seed,
                seed,
                scale=scale,
            )
        kr, vr = repeat_kv(q, k), repeat_kv(q, v)
        # the layout the efficient forward returns (and its backward reads): rows padded to 32
        lse32 = torch.nn.functional.pad(lse.float(), (0, -lse.shape[-1] % 32)).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(),
            q,
            kr,
            vr,
            None,
            _rows_by_heads(out),
            lse32,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, sum_kv_groups(dk, k.shape[1]), sum_kv_groups(dv, v.shape[1])
    return math_attn_backward_impl(dout, q, k, v, out, lse, _causal(q, k, causal), scale)


def _lse_grad(dlse, q, k, lse, causal, scale):
    """Gradients of lse alone: d lse_i / d s_ij = p_ij. Dense, so only used when
    a caller really differentiates lse."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    dt = acc_dtype(q.dtype)
    p, _ = _math_probs(q, k, lse, _causal(q, k, causal), scale)
    ds = p * dlse.to(dt).view(b, hkv, hq // hkv, lq, 1) * scale
    dq = torch.matmul(ds, k.to(dt).unsqueeze(2)).reshape(b, hq, lq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.to(dt).view(b, hkv, hq // hkv, lq, d)).sum(2)
    return dq, dk


# ----------------------------------------------------------------------------
# Masks as compositions of dense tiles.
# ----------------------------------------------------------------------------


def _pieces(lq: int, lk: int, mask: str):
    """Split a block into dense tiles: (q rows, k cols, causal) triples.

    Bottom-right causal is a fully visible key prefix plus a top-left causal
    square, so the fused kernels (which only know top-left) serve it exactly.
    """
    if mask == "empty" or lq == 0 or lk == 0:
        return []
    if mask == "none":
        return [(slice(0, lq), slice(0, lk), False)]
    if mask == "causal":
        return [(slice(0, lq), slice(0, lk), True)]
    # causal_bottom_right
    if lq <= lk:
        off = lk - lq
        tiles = [(slice(0, lq), slice(off, lk), True)]
        if off:
            tiles.insert(0, (slice(0, lq), slice(0, off), False))
        return tiles
    # more queries than keys: the first lq - lk rows see nothing
    return [(slice(lq - lk, lq), slice(0, lk), True)]


def _merge_into(out, lse, part_out, part_lse, rows):
    new_out, new_lse = merge_partial(out[:, :, rows].to(lse.dtype), lse[:, :, rows], part_out, part_lse)
    out[:, :, rows] = new_out.to(out.dtype)
    lse[:, :, rows] = new_lse


def block_attn_impl(q: Tensor, k: Tensor, v: Tensor, mask: str, scale: float) -> tuple[Tensor, Tensor]:
    tiles = _pieces(q.shape[2], k.shape[2], mask)
    if len(tiles) == 1 and tiles[0][0] == slice(0, q.shape[2]):
        _, cols, causal = tiles[0]
        return tile_fwd(q, k[:, :, cols], v[:, :, cols], causal, scale)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for rows, cols, causal in tiles:
        part_out, part_lse = tile_fwd(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, scale)
        _merge_into(out, lse, part_out, part_lse, rows)
    return out, lse


def block_attn_backward_parts(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: str,
    scale: float,
    dlse: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the block, unrounded: as the tile kernel returns them (fp32 from the CPU kernel for
    low-precision input), accumulated over the block's tiles in the accumulator dtype. For callers that
    accumulate further before one cast (packed tiles)."""
    pieces = _pieces(q.shape[2], k.shape[2], mask)
    whole = (slice(0, q.shape[2]), slice(0, k.shape[2]))
    dq = dk = dv = None
    for rows, cols, causal in pieces:
        args = (q[:, :, rows], k[:, :, cols], v[:, :, cols])
        tq, tk, tv = _tile_bwd(dout[:, :, rows], *args, out[:, :, rows], lse[:, :, rows].contiguous(), causal, scale)
        if dlse is not None:
            eq, ek = _lse_grad(dlse[:, :, rows], args[0], args[1], lse[:, :, rows], causal, scale)
            tq, tk = tq + eq, tk + ek
        if len(pieces) == 1 and (rows, cols) == whole:  # the tile is the block: no accumulators
            return tq, tk, tv
        if dq is None:
            dt = acc_dtype(q.dtype)
            dq, dk, dv = (torch.zeros(t.shape, dtype=dt, device=t.device) for t in (q, k, v))
        dq[:, :, rows] += tq
        dk[:, :, cols] += tk
        dv[:, :, cols] += tv
    if dq is None:  # nothing visible
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return dq, dk, dv


def block_attn_backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: str,
    scale: float,
    dlse: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtypes (``block_attn_backward_parts``, cast once)."""
    dq, dk, dv = block_attn_backward_parts(dout, q, k, v, out, lse, mask, scale, dlse)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def band_visible(lq: int, lk: int, offset: int, left: int, right: int, device=None) -> Tensor:
    """[Lq, Lk] bool of a sliding-window band: query a is ``offset + a - b`` positions after key b
    and sees it when that distance is at most ``left`` back and ``right`` ahead (-1: unbounded)."""
    behind = offset + torch.arange(lq, device=device)[:, None] - torch.arange(lk, device=device)[None, :]
    visible = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= behind <= left
    if right >= 0:
        visible &= -behind <= right
    return visible


def tile_visible(mask: str, lq: int, lk: int, offset: int, window: tuple[int, int], device=None) -> Optional[Tensor]:
    """[Lq, Lk] bool of a tile of ``mask`` ``"none"`` (None: everything), ``"causal"`` (top-left) or
    ``"band"`` (``band_visible``)."""
    if mask == "none":
        return None
    if mask == "causal":
        return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    return band_visible(lq, lk, offset, *window, device)


def check_block_args(q: Tensor, k: Tensor, v: Tensor, mask: str) -> None:
    if mask not in MASKS:
        raise ValueError(f"unknown mask {mask!r}; expected one of {MASKS}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, L, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"incompatible q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


# ----------------------------------------------------------------------------
# The custom ops.
# ----------------------------------------------------------------------------


@torch.library.custom_op("cp::block_attn", mutates_args=())
def block_attn(q: Tensor, k: Tensor, v: Tensor, mask: str, scale: float) -> tuple[Tensor, Tensor]:
    check_block_args(q, k, v, mask)
    out, lse = block_attn_impl(q, k, v, mask, scale)
    # Custom ops may not return views of inputs or of each other.
    return out.contiguous(), lse.contiguous()


@block_attn.register_fake
def _(q, k, v, mask, scale):
    check_block_args(q, k, v, mask)
    return result_like(q, v)


@torch.library.custom_op("cp::block_attn_backward", mutates_args=())
def block_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: str,
    scale: float,
    dlse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = block_attn_backward_impl(dout, q, k, v, out, lse, mask, scale, dlse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, mask, scale, dlse=None):
    return dense_like(q), dense_like(k), dense_like(v)


def _block_setup(ctx, inputs, output):
    q, k, v, mask, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mask, ctx.scale = mask, scale
    # an unused lse must arrive as None, not zeros: its gradient path is dense
    ctx.set_materialize_grads(False)


def _block_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = block_attn_backward(dout, q, k, v, out, lse, ctx.mask, ctx.scale, dlse)
    return dq, dk, dv, None, None


block_attn.register_autograd(_block_backward, setup_context=_block_setup)
