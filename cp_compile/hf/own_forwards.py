"""Attention modules of their own code under a plan (``Family.own_attention``): each family's forward runs the module's
own projections and output layers on this rank's shard around ``attend``, which ``hf.own_attention`` supplies
(positions, cache, the attention function): BLOOM and MPT (ALiBi), XGLM (queries scaled before their product),
GPT-NeoX-Japanese (partial RoPE), MiniMax's lightning attention around a decayed linear attention by state
passing (``mixers.lightning``), and Doge's attention under its dynamic mask (over every rank's keys, for this rank's
queries).

ALiBi adds ``slope_h * (j - anchor)`` to every score of key ``j``: a bias of the key alone, the same for every query
of a call (BLOOM anchors at position 0, MPT at the call's last key). A bias of the key alone is one more term of the
dot product: each query gets columns of ones, each key the columns ``bias / scale``, each value zero columns, and
``scale * (q'. k') = scale * q.k + bias``. The schedules, the kinds, the cache and the compiled graph then see
plain attention of a head dim a column or three wider, and the ring moves ``1/D`` more bytes.

The bias is computed as both families compute theirs, in fp32 from integer positions (the same bits in fp64), and
carried in the input's dtype; fp16 and bf16 carry it as three limbs (hi, mid, lo: fp32's 24 bits), which the
kernels' fp32 accumulation adds back together.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UnsupportedAttention
from ..kernels.merge import pivot


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


def modeling_of(module):
    """The modeling module (``transformers.models.<name>.modeling_<name>``) that defines ``module``'s class."""
    return sys.modules[type(module).__module__]


def bloom_slopes(module) -> Tensor:
    """BLOOM's per-head slopes, from its own builder (its bias of position 1)."""
    ones = torch.ones(1, 2, dtype=torch.long)
    return modeling_of(module).build_alibi_tensor(ones, module.num_heads, torch.float32)[:, 0, 1]


def mpt_slopes(module) -> Tensor:
    """MPT's per-head slopes, from its own builder (the bias of the key before the last, negated), with the bias
    maximum its model builds with (the builder's default)."""
    return -modeling_of(module).build_mpt_alibi_tensor(module.n_heads, 2)[:, 0, 0].float()


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
    return modeling_of(module).dropout_add(out, residual, module.hidden_dropout, module.training), None


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


def minimax_lightning(
    module, mix: Attend, hidden_states: Tensor, position_embeddings=None, attention_mask=None, cache=None, **_
):
    """``MiniMaxLightningAttention.forward`` under a plan: its projections, norm, gate and output on the shard around
    ``mix`` (the decayed linear attention of every rank's tokens, ``[B, L, H, D]``)."""
    batch, length, _ = hidden_states.shape
    qkv = module.act_fn(module.qkv_proj(hidden_states))
    qkv = modeling_of(module).apply_mask_to_padding_states(qkv, attention_mask)
    qkv = qkv.reshape(batch, length, module.num_attention_heads, 3 * module.head_dim)
    query, key, value = torch.split(qkv, module.head_dim, dim=3)
    mixed = mix(module, query, key, value, cache).reshape(batch, length, -1)
    gated = torch.sigmoid(module.output_gate(hidden_states)) * module.norm(mixed)
    return module.out_proj(gated), None


def xglm_attention(
    module, attend: Attend, hidden_states: Tensor, key_value_states=None, cache=None, attention_mask=None, **_
):
    """``XGLMAttention.forward`` under a plan: its queries scaled before their product with the keys."""
    if key_value_states is not None:
        raise UnsupportedAttention(
            "XGLMAttention under context parallelism: cross-attention (add_cross_attention) is not supported"
        )
    batch, length, _ = hidden_states.shape

    def heads(t: Tensor) -> Tensor:
        return t.view(batch, length, -1, module.head_dim).transpose(1, 2)

    query = heads(module.q_proj(hidden_states) * module.scaling)
    key, value = heads(module.k_proj(hidden_states)), heads(module.v_proj(hidden_states))
    dropout = module.dropout if module.training else 0.0
    context = attend(module, query, key, value, attention_mask, cache, 1.0, dropout)
    return module.out_proj(context.reshape(batch, length, module.embed_dim)), None


def openai_attention(module, attend: Attend, x: Tensor, attention_mask=None, output_attentions=False):
    """OpenAI GPT's ``Attention.forward`` under a plan: causal attention of its own (masked scores at -1e4, which the
    softmax takes to zero as it does -inf), its padding mask refused."""
    if attention_mask is not None or output_attentions:
        raise UnsupportedAttention(
            "OpenAI GPT's attention under context parallelism given a padding mask or asked for its attention "
            "weights: shard unpadded sequences, without output_attentions"
        )
    batch, length, _ = x.shape
    query, key, value = (
        t.view(batch, length, module.n_head, -1).transpose(1, 2) for t in module.c_attn(x).split(module.split_size, 2)
    )
    scale = value.shape[-1] ** -0.5 if module.scale else 1.0
    dropout = module.attn_dropout.p if module.training else 0.0
    context = attend(module, query, key, value, None, None, scale, dropout)
    return [module.resid_dropout(module.c_proj(context.reshape(batch, length, -1)))]


def gpt_neox_japanese_attention(
    module,
    attend: Attend,
    hidden_states: Tensor,
    attention_mask=None,
    position_ids=None,
    layer_past=None,
    use_cache: bool = False,
    output_attentions: bool = False,
    position_embeddings=None,
    **_,
):
    """``GPTNeoXJapaneseAttention.forward`` under a plan: RoPE on the first ``rotary_ndims`` of each head (cos and sin
    of the global positions its model was given)."""
    if output_attentions:
        raise UnsupportedAttention(
            "GPTNeoXJapaneseAttention under context parallelism: output_attentions is not supported"
        )
    batch, length, _ = hidden_states.shape
    heads, size, rotary = module.num_attention_heads, module.head_size, module.rotary_ndims
    qkv = module.query_key_value(hidden_states).view(batch, length, heads, 3 * size).permute(0, 2, 1, 3)
    query, key, value = qkv[..., :size], qkv[..., size : 2 * size], qkv[..., 2 * size :]
    cos, sin = position_embeddings
    query_rot, key_rot = modeling_of(module).apply_rotary_pos_emb(query[..., :rotary], key[..., :rotary], cos, sin)
    query = torch.cat([query_rot, query[..., rotary:]], -1)
    key = torch.cat([key_rot, key[..., rotary:]], -1)
    dropout = module.attention_dropout.p if module.training else 0.0
    context = attend(module, query, key, value, attention_mask, layer_past, 1.0 / module.norm_factor, dropout)
    return module.dense(context.reshape(batch, length, heads * size)), None, module.dense_bias


def doge_attention(
    module, keys_and_rows, hidden_states: Tensor, position_embeddings, attention_mask=None, cache=None, **_
):
    """``DogeAttention.forward`` under a plan: its projections, norms and RoPE on the shard; its dynamic mask (a bias
    per key from the values, cut to each query's top keys) built by the module for this rank's queries over every
    key they may see, from the rows of one process's mask that ``keys_and_rows`` hands back with those keys and
    values; its attention as the model's eager code computes it."""
    modeling = modeling_of(module)
    shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_norm(module.q_proj(hidden_states).view(shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(shape)).transpose(1, 2)
    value = module.v_proj(hidden_states).view(shape).transpose(1, 2)
    query, key = modeling.apply_rotary_pos_emb(query, key, *position_embeddings)
    seen = keys_and_rows(module, query, key, value, attention_mask, cache, hidden_states)
    dt = module.dt_proj(seen.value.transpose(1, 2).reshape(seen.value.shape[0], seen.value.shape[-2], -1))
    dt = torch.exp(module.A * F.softplus(dt)).transpose(-1, -2)
    keep = module.keep_window_size
    if seen.share is None:
        mask = module.prepare_dynamic_mask(hidden_states, dt, keep, seen.rows)
    elif seen.share.most_seen() <= keep:  # no top-k bites: each key's bias its own (as many slots as kept, none cut)
        mask = module.prepare_dynamic_mask(hidden_states, dt, dt.shape[-1], seen.rows)
    else:  # the top keys of every rank's, as one process picks them from the same row, at this rank's keys
        whole = module.prepare_dynamic_mask(
            hidden_states, seen.share.whole(dt, seen.key_places, 0.0), keep, seen.share.whole_rows()
        )
        mask = seen.share.own_columns(whole, seen.key_places, torch.finfo(whole.dtype).min)
    mask = modeling.repeat_kv(mask, module.num_key_value_groups)
    out = eager_attention(module, query, seen, mask)
    return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), None


def eager_attention(module, query: Tensor, seen, added: Tensor, sinks=None) -> Tensor:
    """``[B, L, H, D]``: the models' eager attention over ``seen``'s keys (``KeysAndRows``) with ``added`` to the scores
    (and ``sinks [B, H, L, 1]``, a logit per query with a zero value), its softmax in fp32 or the input's dtype when
    wider (one process's SDPA in fp64). Over this rank's share of a cache (``seen.share``), the ranks' partial
    attentions merge by log-sum-exp, the sinks counted once."""
    repeat = modeling_of(module).repeat_kv
    key, value = (repeat(t, module.num_key_value_groups) for t in (seen.key, seen.value))
    scores = torch.matmul(query, key.transpose(2, 3)) * module.scaling + added
    wide = torch.promote_types(query.dtype, torch.float32)
    if seen.share is not None:
        scores = scores.to(wide)
        lse = torch.logsumexp(scores, -1)
        weights = torch.exp(scores - pivot(lse)[..., None]).to(query.dtype)
        weights = F.dropout(weights, p=module.attention_dropout, training=module.training)
        out, lse = seen.share.merge(query, torch.matmul(weights, value), lse)
        if sinks is not None:
            out = out * torch.exp(lse - torch.logaddexp(lse, sinks[..., 0].to(lse.dtype)))[..., None].to(out.dtype)
        return out.transpose(1, 2)
    if sinks is not None:
        weights = F.softmax(torch.cat([scores, sinks], -1), dim=-1, dtype=wide)[..., :-1].to(query.dtype)
    else:
        weights = F.softmax(scores, dim=-1, dtype=wide).to(query.dtype)
    weights = F.dropout(weights, p=module.attention_dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2)


def masked(bias: Tensor, rows: Tensor) -> Tensor:
    """``bias`` where one process's mask rows (additive, or True where masked) let a key through."""
    return bias.masked_fill(rows, torch.finfo(bias.dtype).min) if rows.dtype == torch.bool else bias + rows


def inkling_attention(
    module, keys_and_rows, hidden_states: Tensor, attention_mask=None, conv_mask=None, cache=None, **_
):
    """``InklingAttention.forward`` under a plan: its projections, short convolutions (by the halo) and norms on the
    shard; its relative bias (each query's bank of biases by distance, zero beyond ``rel_extent``) and log scaling
    from the queries' global positions, over every key ``keys_and_rows`` hands back, with one process's mask rows."""
    shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_norm(module.q_proj(hidden_states).view(shape)).transpose(1, 2)
    key = module.k_sconv(module.k_proj(hidden_states), cache=cache, conv_mask=conv_mask)
    value = module.v_sconv(module.v_proj(hidden_states), cache=cache, conv_mask=conv_mask)
    key, value = module.k_norm(key.view(shape)).transpose(1, 2), value.view(shape).transpose(1, 2)
    seen = keys_and_rows(module, query, key, value, attention_mask, cache, hidden_states)
    relative = module.r_proj(hidden_states).view(*hidden_states.shape[:-1], module.num_heads, -1)
    bias = module.rel_logits_proj(relative, seen.query_places, seen.key_places)
    floor = module.config.log_scaling_n_floor
    if not module.is_sliding and floor is not None:  # in fp32, as the model scales
        tau = 1.0 + module.config.log_scaling_alpha * torch.log(
            ((seen.query_places + 1).float() / floor).clamp(min=1.0)
        )
        tau = tau.view(1, 1, -1, 1)
        query, bias = (query.float() * tau).to(query.dtype), (bias.float() * tau).to(bias.dtype)
    out = eager_attention(module, query, seen, masked(bias, seen.rows))
    return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), None


def inkling2_attention(
    module,
    keys_and_rows,
    hidden_states: Tensor,
    key_hidden_states=None,
    value_hidden_states=None,
    attention_mask=None,
    relative_distance=None,
    conv_mask=None,
    cache=None,
    cache_offset: int = 0,
    **kwargs,
):
    """``Inkling2SlidingAttention.forward`` and ``Inkling2FullAttention.forward`` (and the loop model's) under a plan:
    the query, key and value projections (their convolutions by the halo, the queries' log scaling from the plan's
    positions) on the shard; the relative bias by each query's global distance to every key ``keys_and_rows`` hands
    back (the model's own ``relative_distance`` is its call's), with one process's mask rows and the sinks."""
    positions = kwargs["position_ids"]
    query = module.q_proj(hidden_states, positions)
    projected = []
    for projection, given in ((module.k_proj, key_hidden_states), (module.v_proj, value_hidden_states)):
        source = hidden_states if given is None else given
        projected.append(projection(source, cache=cache, conv_mask=conv_mask, cache_offset=cache_offset, **kwargs))
    layer = module.layer_idx + cache_offset
    seen = keys_and_rows(module, query, *projected, attention_mask, cache, hidden_states, layer)
    distance = seen.query_places[:, None] - seen.key_places[None, :]
    bias = module.relative_position_bias(hidden_states, distance, positions)
    sinks = module.sink_proj(hidden_states).transpose(1, 2).unsqueeze(-1)
    out = eager_attention(module, query, seen, masked(bias, seen.rows), sinks)
    return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous(), hidden_states), None


__all__ = [
    "bias_columns",
    "bloom_attention",
    "bloom_slopes",
    "doge_attention",
    "eager_attention",
    "gpt_neox_japanese_attention",
    "inkling2_attention",
    "inkling_attention",
    "limbs_for",
    "masked",
    "modeling_of",
    "minimax_lightning",
    "mpt_attention",
    "mpt_slopes",
    "openai_attention",
    "with_bias",
    "xglm_attention",
]
