"""DeepSeek-V4's attention on this rank's shard: a sliding window over the tokens and compressed keys over windows
of the sequence, in one softmax with a sink per head.

One process's ``DeepseekV4Attention`` attends each query to the keys of its sliding window (one shared K/V head)
and to the compressed keys of the windows before it: every window of ``rate`` tokens pooled into one key by its
compressor (heavily compressed layers: 128 tokens, every key seen; compressed sparse layers: 4 tokens with the 4
before, a lightning indexer picking each query's top k keys). Under a plan (``GatheredModule.sharded``, a call
without a cache) each rank runs it for its own queries:

- the queries, the sliding keys and the compressors' projections on the shard;
- the sliding keys of each of its chunks and the ``window - 1`` tokens before it (``halo``), each query's window
  found among them by its tokens' places;
- the compressed keys: each rank pools the windows that close in its slots, from its shard and the span before
  each chunk, and the ranks all-gather the pooled keys (``mixers.windows``: T/rate rows, never the tokens); the
  indexer's keys the same way, under ``no_grad`` (one process's picks carry no gradient either), scored for this
  rank's queries against every window by blocks of rows, its top k over the whole sequence;
- each query's window and compressed keys as its picks in one ``kernels.sparse.picked_attention`` call, the sink
  joining the softmax's denominator by the log-sum-exp;
- the module's own norms, rotary embedding, sink and output projections, in its order.

Bytes per layer and rank: the halos (``window - 1`` tokens per chunk, one head) and 1/rate of the sequence's
compressor outputs. Memory: ``window + k`` keys a query (``k``: every window before it in a heavily compressed
layer, the indexer's picks in a sparse one), where one process holds every query's scores against every token and
key. Training with attention dropout scores the rank's band and every compressed key by the module's eager
attention (the sparse kernel has no dropout). With a cache (a prefill), the module runs over the gathered sequence,
whose states its cache keeps whole.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..kernels.merge import fold_sinks
from ..kernels.sparse import counted_once, picked_attention, picks_in_slots, row_blocks
from ..mixers import Sharding
from ..mixers.gathered import gather_sequence
from ..mixers.halo import halo
from ..mixers.indexed import sees, sequence_slots
from ..mixers.windows import gather_windows, windows_ending_here
from .mask_rows import documents_apart, mask_rows_at
from .own_forwards import eager_attention, masked, modeling_of


class _Keys(NamedTuple):
    """What ``eager_attention`` reads of the keys: one head, read as keys and values both."""

    key: Tensor
    value: Tensor
    share: Optional[object] = None  # scored whole here, never a cache's share


def _pooled(compressor, hidden: Tensor, head_dim: int, sharding: Sharding) -> Tensor:
    """``[B, N, head_dim]``: the compressor's key of every window of the sequence, normed and rotated at its first
    position, as its forward computes them (its ``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``,
    ``rotary_emb``)."""
    rate = compressor.compress_rate
    overlap = compressor.kv_proj.out_features == 2 * head_dim  # windows with the ``rate`` tokens before them
    projected = torch.cat([compressor.kv_proj(hidden), compressor.gate_proj(hidden)], -1)
    closing = windows_ending_here(projected, rate, 2 * rate if overlap else rate, sharding)
    kv, gate = closing.spans.chunk(2, -1)
    if overlap:  # the earlier window's first half of each token, then its own window's second half
        bias = compressor.position_bias
        kv = torch.cat([kv[:, :, :rate, :head_dim], kv[:, :, rate:, head_dim:]], 2)
        earlier = gate[:, :, :rate, :head_dim] + bias[:, :head_dim]
        earlier = earlier.masked_fill((closing.places == rate - 1)[None, :, None, None], float("-inf"))  # window 0's
        gate = torch.cat([earlier, gate[:, :, rate:, head_dim:] + bias[:, head_dim:]], 2)
    else:
        gate = gate + compressor.position_bias
    keys = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
    keys = compressor.kv_norm(gather_windows(keys, hidden.shape[1], rate, sharding))
    positions = (torch.arange(keys.shape[1], device=keys.device) * rate).expand(keys.shape[0], -1)
    cos, sin = compressor.rotary_emb(keys, position_ids=positions, layer_type=compressor.rope_layer_type)
    return modeling_of(compressor).apply_rotary_pos_emb(keys.unsqueeze(1), cos, sin).squeeze(1)


def _visible_windows(position_ids: Tensor, windows: int, rate: int) -> Tensor:
    """``[B, L, N]`` bool: the windows a query may read (closed before it), by the positions its model was given."""
    return torch.arange(windows, device=position_ids.device)[None, None, :] < ((position_ids + 1) // rate)[..., None]


def _picks(indexer, hidden: Tensor, q_residual: Tensor, position_ids: Tensor, sharding: Sharding) -> Tensor:
    """``[B, L, k]``: each of this rank's queries' top windows by the indexer over the whole sequence's, -1 where it
    may read fewer (``DeepseekV4Indexer.forward`` for this rank's queries), scored by blocks of rows
    (``kernels.sparse.row_blocks``): the class's scorer on a block's queries, where its call on every query holds
    ``[B, L, heads, T/rate]`` scores. Its matmul takes each row alone, so a row's scores are the same bits."""
    with torch.no_grad():
        keys = _pooled(indexer, hidden, indexer.head_dim, sharding)
        cos, sin = indexer.rotary_emb(hidden, position_ids=position_ids, layer_type=indexer.rope_layer_type)
        batch, length, _ = hidden.shape
        q = indexer.q_b_proj(q_residual).view(batch, length, -1, indexer.head_dim).transpose(1, 2)
        q = modeling_of(indexer).apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
        windows, picks = keys.shape[1], []
        for rows in row_blocks(length, batch * q.shape[2] * windows):
            scores = indexer.scorer(q[:, rows], keys, hidden[:, rows])  # [B, r, N]
            visible = _visible_windows(position_ids[:, rows], windows, indexer.compress_rate)
            top = scores.masked_fill(~visible, float("-inf")).topk(min(indexer.index_topk, windows), dim=-1).indices
            picks.append(torch.where(visible.gather(-1, top), top, -1))
        return torch.cat(picks, 1)


class _Compressed(NamedTuple):
    """The compressed keys ``[B, 1, N, D]`` for this rank's queries at ``position_ids [B, L]``, pooled every ``rate``
    tokens, and in a compressed sparse layer the indexer's picks among them ``[B, L, k]`` (-1 where it may read
    fewer); without, a query reads every window closed before it."""

    keys: Tensor
    position_ids: Tensor
    rate: int
    picks: Optional[Tensor]

    def visible(self) -> Tensor:
        """``[B, L, N]`` bool: the windows each query reads."""
        windows = self.keys.shape[2]
        if self.picks is None:
            return _visible_windows(self.position_ids, windows, self.rate)
        chosen = torch.zeros((*self.picks.shape[:2], windows), dtype=torch.int32, device=self.picks.device)
        return chosen.scatter_add_(-1, self.picks.clamp(min=0), (self.picks >= 0).to(torch.int32)) > 0

    def bias(self) -> Tensor:
        """``[B, 1, L, N]``: 0 where read, -inf elsewhere."""
        visible = self.visible()
        bias = torch.zeros(visible.shape, dtype=self.keys.dtype, device=self.keys.device)
        return bias.masked_fill(~visible, float("-inf"))[:, None]

    def chosen(self) -> tuple[Tensor, Tensor]:
        """Each query's windows as picks ``[B, L, n]`` and whether it reads each: the indexer's, or every window."""
        if self.picks is not None:
            return self.picks.clamp(min=0), self.picks >= 0
        visible = self.visible()
        return torch.arange(visible.shape[-1], device=visible.device).expand(visible.shape), visible


def _compressed(module, hidden: Tensor, q_residual: Tensor, position_ids: Tensor, sharding: Sharding) -> _Compressed:
    compressor = module.compressor
    keys = _pooled(compressor, hidden, module.head_dim, sharding).unsqueeze(1)
    indexer = getattr(compressor, "indexer", None)
    picks = None
    if indexer is not None and keys.shape[2]:
        picks = _picks(indexer, hidden, q_residual, position_ids, sharding)
    return _Compressed(keys, position_ids, compressor.compress_rate, picks)


def _band(kv: Tensor, places: Tensor, spec, sharding: Sharding) -> tuple[Tensor, Tensor]:
    """The sliding keys this rank's queries may see, ``[B, 1, S, D]``, and their places ``[S]`` (-1: no token): its
    own tokens and the ``window - 1`` before each of its chunks (every token without a window)."""
    if spec.window is None:
        keys = gather_sequence(kv, 2, sharding)
        return keys, torch.arange(keys.shape[2], device=kv.device)
    before = halo(kv, 2, spec.window, *sharding.op_args, False)
    # the halo's places; a zero row (before position 0, a padding slot) comes back as -1, no token
    before_places = halo((places + 1)[None], 1, spec.window, *sharding.op_args, False)[0] - 1
    keys, key_places = torch.cat([kv, before], 2), torch.cat([places, before_places])
    # a token is a key once: one this rank holds and a halo brings again (zigzag's middle rank), or one before two of
    # its chunks (chunks shorter than the window); its copies hold the same row
    return keys, torch.where(counted_once(key_places, key_places >= 0), key_places, -1)


def _window_picks(places: Tensor, key_places: Tensor, window: int, limit: int, documents) -> tuple[Tensor, Tensor]:
    """Each query's window among the band's keys: the slots ``[1, L, window]`` of the tokens at its place and the
    ``window - 1`` before it, and whether it may see each (one process's sliding mask: not before its document)."""
    wanted = places[:, None] - torch.arange(window, device=places.device)[None, :]
    slots, usable = picks_in_slots(
        wanted.clamp(min=0)[None], places, torch.where(key_places >= 0, key_places, limit), limit
    )
    return slots, usable & (wanted >= 0)[None] & sees(places[:, None], wanted, documents)[None]


def _picked(module, q: Tensor, keys: Tensor, picks: Tensor, usable: Tensor) -> Tensor:
    """``[B, L, H, D]``: ``eager_attention`` over each query's picks of ``keys`` (read as values too) by
    ``kernels.sparse.picked_attention``, whose memory goes with the picks, not with the ``[L, keys]`` scores; the
    sink joins the softmax's denominator by the log-sum-exp (``kernels.merge.fold_sinks``)."""
    # the values as a view of the keys: Dynamo traces no autograd.Function given one tensor as two inputs
    out, lse = picked_attention(q, keys, keys[..., :], picks, usable, module.scaling)
    return fold_sinks(out, lse, module.sinks, 1).to(q.dtype).transpose(1, 2)


def deepseek_v4_attention(
    module,
    sharding: Sharding,
    hidden_states: Tensor,
    position_embeddings,
    position_ids: Tensor,
    attention_mask,
    cache=None,
    **kwargs,
):
    """``DeepseekV4Attention.forward`` for this rank's shard under a plan, with no cache (module docstring)."""
    rope = modeling_of(module).apply_rotary_pos_emb
    batch, length, _ = hidden_states.shape
    cos, sin = position_embeddings[module.rope_layer_type]
    q_residual = module.q_a_norm(module.q_a_proj(hidden_states))
    q = module.q_b_norm(module.q_b_proj(q_residual).view(batch, length, -1, module.head_dim).transpose(1, 2))
    q = rope(q, cos, sin)
    kv = module.kv_norm(module.kv_proj(hidden_states)).view(batch, length, -1, module.head_dim).transpose(1, 2)
    kv = rope(kv, cos, sin)
    places = sequence_slots(hidden_states, *sharding.op_args)
    keys, key_places = _band(kv, places, attention_mask, sharding)
    documents = sharding.cu_seqlens if documents_apart(attention_mask, sharding, kv.device) else None
    compressed = (
        None if module.compressor is None else _compressed(module, hidden_states, q_residual, position_ids, sharding)
    )
    if attention_mask.window is not None and not (module.training and module.attention_dropout):
        # each query's keys as picks: its window's, then its compressed keys' (after the band's)
        window = _window_picks(places, key_places, attention_mask.window, length * sharding.world_size, documents)
        picks, usable = (t.expand(batch, -1, -1) for t in window)
        if compressed is not None:
            chosen, reads = compressed.chosen()
            keys = torch.cat([keys, compressed.keys], 2)
            picks, usable = torch.cat([picks, chosen + key_places.numel()], -1), torch.cat([usable, reads], -1)
        out = _picked(module, q, keys, picks, usable)
    else:  # every token, or attention dropout: the module's eager attention, scored against every key
        rows = mask_rows_at(attention_mask, places, key_places, hidden_states, documents)
        rows = masked(hidden_states.new_zeros(rows.shape), rows)  # additive
        if compressed is not None:
            keys, rows = torch.cat([keys, compressed.keys], 2), torch.cat([rows, compressed.bias().to(rows.dtype)], -1)
        sinks = module.sinks.reshape(1, -1, 1, 1).expand(batch, -1, length, 1)
        out = eager_attention(module, q, _Keys(keys, keys), rows, sinks)  # [B, L, H, D]
    out = rope(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = module.o_a_proj(out.reshape(batch, length, module.config.o_groups, -1)).flatten(2)
    return module.o_b_proj(grouped), None


__all__ = ["deepseek_v4_attention"]
