"""DSA's multi-head latent attention (DeepSeek-V3.2, GLM-MoE-DSA) under a plan, in its absorbed form.

Each token's keys and values come from one latent ``c`` (``kv_lora_rank`` values, normalised) and one rotary key
``r`` (``qk_rope_head_dim``) shared by every head: head h's key is ``[W_k[h] c, r]`` and its value ``W_v[h] c``, where
``W_k`` and ``W_v`` are the two halves of ``kv_b_proj``. transformers expands them before its attention
(``expand_kv``: ``heads x (qk_head_dim + v_head_dim)`` values a token). Scores and outputs are linear in ``c``, so

    q[h] . k[h] = (q_nope[h] W_k[h]) . c + q_rope[h] . r
    sum_j p_j W_v[h] c_j = W_v[h] (sum_j p_j c_j)

and attention of the absorbed queries ``[q_nope[h] W_k[h], q_rope[h]]`` over one key head ``[c, r]`` and one value
head ``c`` (grouped-query attention with a single K/V head) gives each head's output in latent space, which
``W_v[h]`` takes back to ``v_head_dim``. Under a plan the module's forward runs so: its projections on this rank's
tokens as the class runs them, its indexer unchanged (``hf.indexed``), and the attention function registered as
``"cp_compile"`` over the absorbed queries and the latent, which a sharded call all-gathers once for keys and values
(``mixers.indexed``, ``values_in_keys``: ``kv_lora_rank + qk_rope_head_dim`` values a token, never the heads': 576
against 40,960 at DeepSeek-V3.2's sizes) and a ``ShardedCache`` keeps as the class keeps it. The same scores up
to rounding: the products are summed in another order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .own_forwards import modeling_of


def mla_absorbed_attention(
    module,
    attend,
    hidden_states: Tensor,
    position_embeddings,
    attention_mask,
    cache=None,
    position_ids=None,
    prev_topk_indices=None,
    **kwargs,
):
    """The attention module's forward under a plan (``Family.own_attention``, ``mixing="latent"``: ``attend`` is the
    attention function, handed the indexer's picks and the cache's step). GLM-MoE-DSA's "shared" layers take the
    previous layer's picks and return them, as the class does."""
    batch, length, _ = hidden_states.shape
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    query = module.q_b_proj(q_resid).view(batch, length, -1, module.qk_head_dim).transpose(1, 2)
    q_nope, q_rope = query.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    latent, k_rope = module.kv_a_proj_with_mqa(hidden_states).split(
        [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1
    )
    latent = module.kv_a_layernorm(latent).view(batch, 1, length, module.kv_lora_rank)
    k_rope = k_rope.view(batch, 1, length, module.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rope, k_rope = modeling_of(module).apply_rotary_pos_emb_interleave(q_rope, k_rope, cos, sin)
    if cache is not None:  # the latent kept, as the class keeps it
        latent, k_rope = cache.update(latent, k_rope, module.layer_idx, kwargs=kwargs)
    indexer = getattr(module, "indexer", None)
    if indexer is None:  # a "shared" layer
        picks = prev_topk_indices
    else:
        picks = indexer(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=cache)
    to_key, to_value = module.kv_b_proj.weight.view(module.num_heads, -1, module.kv_lora_rank).split(
        [module.qk_nope_head_dim, module.v_head_dim], dim=1
    )
    absorbed = torch.cat([torch.matmul(q_nope, to_key), q_rope], dim=-1)  # [B, H, L, kv_lora_rank + rope]
    key = torch.cat([latent, k_rope], dim=-1)
    dropout = module.attention_dropout if module.training else 0.0
    value = key[..., : module.kv_lora_rank]  # the latent: gathered with the keys, not apart
    kwargs.update(indices=picks, values_in_keys=True)
    out = attend(module, absorbed, key, value, attention_mask, module.scaling, dropout, kwargs)
    # [B, L, H, kv_lora_rank] to [B, L, H, v_head_dim], head by head
    out = torch.matmul(out.transpose(1, 2), to_value.transpose(1, 2)).transpose(1, 2)
    out = module.o_proj(out.reshape(batch, length, -1))
    return (out, None, picks) if hasattr(module, "skip_topk") else (out, None)


__all__ = ["mla_absorbed_attention"]
