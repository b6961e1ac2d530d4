"""ALiBi's attention modules (BLOOM, MPT) under a plan: their projections on this rank's shard, their attention through
the schedules, the bias as one more dimension of the dot product.

ALiBi adds ``slope_h * (j - anchor)`` to every score of key ``j``: a bias of the key alone, the same for every query
of a call (BLOOM anchors at position 0, MPT at the call's last key). A bias of the key alone is one more term of the
dot product: each query gets columns of ones, each key the columns ``bias / scale``, each value zero columns, and
``scale * (q'. k') = scale * q.k + bias``. The schedules, the kinds, the cache and the compiled graph then see
plain attention of a head dim a column or three wider, and the ring moves ``1/D`` more bytes.

The bias is computed as both families compute theirs, in fp32 from integer positions (the same bits in fp64), and
carried in the input's dtype; fp16 and bf16 carry it as three limbs (hi, mid, lo: fp32's 24 bits), which the
kernels' fp32 accumulation adds back together.

Each family's forward here runs the module's own projections and output layers around ``attend``, which
``hf.own_attention`` supplies (positions, columns, cache, the attention function).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import UnsupportedAttention


def limbs_for(dtype: torch.dtype) -> int:
    """Columns that carry an fp32 bias in ``dtype``: one in fp32 or fp64, three in 16-bit floats."""
    return 1 if torch.finfo(dtype).bits >= 32 else 3


def bias_columns(slopes: Tensor, positions: Tensor, anchor, scale: float, dtype: torch.dtype) -> Tensor:
    """``[H, L, n]``: the keys' extra columns, ``slope_h * (position - anchor) / scale`` split into ``limbs_for(dtype)``
    limbs of ``dtype``. ``positions [L]`` int64; ``anchor`` an int or a 0-d int64 tensor."""
    bias = slopes.float()[:, None] * (positions - anchor).float()[None]  # as BLOOM and MPT build theirs
    wide = torch.promote_types(dtype, torch.float32)
    rest = bias.to(wide) / scale
    columns = []
    for _ in range(limbs_for(dtype)):
        limb = rest.to(dtype)
        columns.append(limb)
        rest = rest - limb.to(wide)
    return torch.stack(columns, -1)


def with_bias(query: Tensor, key: Tensor, value: Tensor, columns: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``[B, H, L, D]`` q, k, v widened by the bias columns (``[H, L, n]``, ``bias_columns``)."""
    n = columns.shape[-1]
    batch = query.shape[0]
    ones = query.new_ones(*query.shape[:-1], n)
    keys = columns.to(key.dtype)[None].expand(batch, -1, -1, -1)
    return (
        torch.cat([query, ones], -1),
        torch.cat([key, keys], -1),
        torch.cat([value, value.new_zeros(*value.shape[:-1], n)], -1),
    )


def _modeling(module):
    return sys.modules[type(module).__module__]


def bloom_slopes(module) -> Tensor:
    """BLOOM's per-head slopes, from its own builder (its bias of position 1)."""
    ones = torch.ones(1, 2, dtype=torch.long)
    return _modeling(module).build_alibi_tensor(ones, module.num_heads, torch.float32)[:, 0, 1]


def mpt_slopes(module) -> Tensor:
    """MPT's per-head slopes, from its own builder (the bias of the key before the last, negated), with the bias
    maximum its model builds with (the builder's default)."""
    return -_modeling(module).build_mpt_alibi_tensor(module.n_heads, 2)[:, 0, 0].float()


Attend = Callable[..., Tensor]


def bloom_attention(
    module,
    attend: Attend,
    hidden_states: Tensor,
    residual: Tensor,
    alibi=None,
    attention_mask=None,
    layer_past=None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs,
):
    """``BloomAttention.forward`` under a plan (its ``alibi`` argument, built from this rank's shard, unread)."""
    if output_attentions:
        raise UnsupportedAttention("BloomAttention under context parallelism: output_attentions is not supported")
    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise UnsupportedAttention(
            "BloomAttention under context parallelism: slow_but_exact with pretraining_tp > 1 is not supported; set "
            "slow_but_exact=False (the same projection in one matmul)"
        )
    batch, length, _ = hidden_states.shape
    query, key, value = module._reshape(module.query_key_value(hidden_states))
    dropout = module.attention_dropout.p if module.training else 0.0
    context = attend(module, query, key, value, attention_mask, layer_past, module.inv_norm_factor, dropout)
    out = module.dense(context.reshape(batch, length, -1))
    return _modeling(module).dropout_add(out, residual, module.hidden_dropout, module.training), None


def mpt_attention(
    module, attend: Attend, hidden_states: Tensor, position_bias=None, cache=None, attention_mask=None, **_
):
    """``MptAttention.forward`` under a plan (its ``position_bias``, sliced for this rank's length, unread)."""
    batch, length, _ = hidden_states.shape
    mixed = module.Wqkv(hidden_states)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (
        t.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2) for t in mixed.chunk(3, dim=2)
    )
    dropout = module.attn_dropout_p if module.training else 0.0
    context = attend(module, query, key, value, attention_mask, cache, module.softmax_scale, dropout)
    return module.out_proj(context.reshape(batch, length, -1)), None


__all__ = ["bias_columns", "bloom_attention", "bloom_slopes", "limbs_for", "mpt_attention", "mpt_slopes", "with_bias"]
