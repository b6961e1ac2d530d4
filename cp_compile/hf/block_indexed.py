"""Qwen4-exp's attention and its n-gram embedding layers (PLE) on this rank's shard.

**Attention** (``Qwen4ExpTextAttention``). A block indexer picks the tokens each query reads: the tokens it may see,
cut into blocks of ``r`` from the start of its document (or of the sequence), each complete block's index key the
mean of its tokens', normed and rotated at the block's first token; the query's index heads score every block
(ReLU, summed), and it reads the tokens of its top ``budget / r`` blocks and of its last, incomplete one. Under a plan
(``GatheredModule.sharded``, a call given no cache):

- the blocks are ``mixers.windows``' windows, counted from each document's start where one process's mask keeps the
  documents apart: each rank pools the blocks that close in its slots and the ranks all-gather the pooled keys (T/r
  rows of one head), under ``no_grad`` (one process's picks carry no gradient either);
- each rank scores its own queries against every block, takes their top blocks over the whole sequence, and adds
  their incomplete blocks' tokens (global positions);
- the attention reads those tokens of every rank's keys and values, gathered (``mixers.indexed.indexed_attention``,
  DSA's), then the module's gate and output projection.

**PLE** (``Qwen4ExpTextPLELayer``). Each token's n-gram ids hash it with the ``n - 1`` tokens before it in its EOS
segment, and a dilated depthwise convolution reads ``(k - 1) * dilation`` earlier tokens: the earlier ids and the
convolution's input come by the halo, and the module's own code runs over each chunk with its halo in front (EOS
before position 0, as one process's history holds).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import UnsupportedAttention
from ..guard import mixers_over_the_whole_sequence
from ..mixers import Sharding
from ..mixers.conv import with_halo, without_halo
from ..mixers.indexed import indexed_attention, sees, sequence_slots
from ..mixers.windows import gather_windows, windows_ending_here
from .mask_rows import documents_apart
from .own_forwards import modeling_of


def _block_keys(indexer, raw: Tensor, cos: Tensor, sin: Tensor, restart: bool, sharding: Sharding):
    """Every block's index key ``[B, N, D]`` and the place of its last token ``[N]`` (-1: no block), in order."""
    rate, dim = indexer.compress_ratio, raw.shape[-1]
    closing = windows_ending_here(torch.cat([raw, cos, sin], -1), rate, rate, sharding, restart)
    tokens, first_cos, first_sin = closing.spans.split([dim, cos.shape[-1], sin.shape[-1]], -1)
    pooled = indexer.k_layernorm(tokens.float().mean(dim=2).to(raw.dtype))
    rotate = modeling_of(indexer).apply_rotary_pos_emb
    keys = rotate(pooled.unsqueeze(2), cos=first_cos[:, :, 0], sin=first_sin[:, :, 0], unsqueeze_dim=2).squeeze(2)
    local_len = raw.shape[1]
    keys = gather_windows(keys, local_len, rate, sharding, restart)
    ends = gather_windows((closing.places + 1)[None], local_len, rate, sharding, restart)[0] - 1
    return keys, ends


def _top_blocks(scores: Tensor, readable: Tensor, count: int) -> Tensor:
    """``[B, L, count]``: each query's top blocks by ``scores [B, L, N]`` among those it may read (``readable [L, N]``,
    a run of blocks for each query), -1 where it may read fewer: the top k of each query's own run, a row as long as
    one process's, so that ties (ReLU leaves many scores at 0) break as one process breaks them. ``torch.topk``
    breaks ties by the row's length, so a masked row of every block picks otherwise (2 queries of 64 in the sweep's
    tiny model); the runs' lengths are data, so compiled, it is refused."""
    if torch.compiler.is_compiling():
        raise UnsupportedAttention(
            "Qwen4ExpTextAttention under context parallelism, compiled: its indexer takes each query's top blocks "
            "from a row as long as that query's run of blocks (so that ties break as one process breaks them), "
            "which a compiled graph cannot shape; run it eagerly"
        )
    runs = readable.sum(-1)
    starts = readable.int().argmax(-1)
    top = torch.full((*scores.shape[:2], count), -1, dtype=torch.int64, device=scores.device)
    for start, run in sorted(set(zip(starts.tolist(), runs.tolist()))):
        if run:
            rows = ((starts == start) & (runs == run)).nonzero().flatten()
            picked = scores[:, rows, start : start + run].topk(min(count, run), dim=-1).indices + start
            top[:, rows, : picked.shape[-1]] = picked
    return top


def _picks(indexer, hidden: Tensor, cos: Tensor, sin: Tensor, places: Tensor, documents, sharding: Sharding):
    """``[B, L, k * r + r - 1]``: the global tokens each of this rank's queries reads, -1 in the slots left over
    (``Qwen4ExpTextQSAIndexer.forward`` for this rank's queries)."""
    rate, dim = indexer.compress_ratio, indexer.index_head_dim
    batch, length, _ = hidden.shape
    with torch.no_grad():
        q, raw = indexer.index_qk_proj(hidden).split([indexer.index_n_heads * dim, indexer.index_kv_heads * dim], -1)
        q = indexer.q_layernorm(q.reshape(batch, length, -1, dim))
        q = modeling_of(indexer).apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)
        keys, ends = _block_keys(indexer, raw, cos, sin, documents is not None, sharding)
        scores = torch.relu(torch.einsum("blhd,bnd->blnh", q.float(), keys.float())).sum(-1) / math.sqrt(dim)
        readable = sees(places[:, None], ends[None, :], documents) & (ends >= 0)[None, :]  # [L, N] complete blocks
        top = _top_blocks(scores, readable, indexer.block_topk)
        first = ends.index_select(0, top.clamp(min=0).flatten()).view_as(top) - (rate - 1)
        blocks = first[..., None] + torch.arange(rate, device=hidden.device)
        blocks = torch.where((top >= 0)[..., None], blocks, -1).flatten(2)
        # the tokens after the query's last complete block: its document's (or the sequence's) start on
        start = 0
        if documents is not None:
            cu = documents.to(places)
            start = cu[torch.searchsorted(cu, places.clamp(min=0), right=True) - 1]
        back = torch.arange(rate - 1, device=hidden.device)
        after = (back < ((places - start + 1) % rate)[:, None]) & (places >= 0)[:, None]
        tail = torch.where(after, places[:, None] - back, -1)
        return torch.cat([blocks, tail[None].expand(batch, -1, -1)], -1)


def qwen4_exp_attention(
    module, sharding: Sharding, hidden_states: Tensor, position_embeddings, attention_mask, cache=None, **kwargs
):
    """``Qwen4ExpTextAttention.forward`` for this rank's shard under a plan, with no cache (module docstring)."""
    if module.training and module.attention_dropout > 0:
        raise UnsupportedAttention(
            "Qwen4ExpTextAttention under context parallelism: attention dropout in training is not supported (its "
            "sparse attention reads each query's picked tokens alone); set attention_dropout=0"
        )
    if module.indexer.index_kv_heads != 1:
        raise UnsupportedAttention("Qwen4ExpTextAttention under context parallelism: an indexer of one key head only")
    batch, length, _ = hidden_states.shape
    cos, sin = position_embeddings
    places = sequence_slots(hidden_states, *sharding.op_args)
    documents = sharding.cu_seqlens if documents_apart(attention_mask, sharding, hidden_states.device) else None
    picks = _picks(module.indexer, hidden_states, cos, sin, places, documents, sharding)
    query, gate = torch.chunk(module.q_proj(hidden_states).view(batch, length, -1, module.head_dim * 2), 2, dim=-1)
    shape = (batch, length, -1, module.head_dim)
    query = module.q_norm(query.reshape(shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(shape)).transpose(1, 2)
    value = module.v_proj(hidden_states).view(shape).transpose(1, 2)
    query, key = modeling_of(module).apply_rotary_pos_emb(query, key, cos, sin)
    out, _ = indexed_attention(query, key, value, picks, sharding, module.scaling, documents)
    out = out.transpose(1, 2).reshape(batch, length, -1) * torch.sigmoid(gate.reshape(batch, length, -1))
    return module.o_proj(out), None


def qwen4_exp_ple(module, sharding: Sharding, hidden_states: Tensor, input_ids: Tensor, cache=None, conv_mask=None):
    """``Qwen4ExpTextPLELayer.forward`` for this rank's shard under a plan, with no cache: the class's forward over each
    chunk with the tokens before it in front, as many as its n-grams and its convolution read together, ids and
    hidden states alike; where no token is (before position 0), EOS ids and a padding mask that zeroes the
    convolution's input, as one process's history and padding hold. Its own padding mask, all ones under a plan
    (the gathered route's checks refuse any other), unread."""
    width = module.short_conv_state_len + module.ple_embedding.context_len + 1
    places = sequence_slots(hidden_states, *sharding.op_args)
    held = with_halo((places + 1)[None], 1, width, sharding) > 0  # [1, S]: a token in the row
    ids = torch.where(held, with_halo(input_ids.long(), 1, width, sharding), module.ple_embedding.eos_token_id)
    extended = with_halo(hidden_states, 1, width, sharding)
    with mixers_over_the_whole_sequence():  # its convolution over the extended shard, on purpose
        out = type(module).forward(module, extended, ids, None, conv_mask=held.expand(extended.shape[0], -1))
    return without_halo(out, 1, width, sharding, hidden_states.shape[1])


__all__ = ["qwen4_exp_attention", "qwen4_exp_ple"]
