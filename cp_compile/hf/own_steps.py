"""Steps of recurrent modules put on their instances (``Family.own_steps``), run under a plan on this rank's shard and
as the model's own everywhere else (outside every plan, decoding):

- RecurrentGemma's recurrent block keeps its own forward; its convolution runs by the halo and its RG-LRU's scan by
  state passing (``mixers.diagonal``);
- RWKV's time mixing and channel mixing get forwards of the module's own layers around its token shift by a one-token
  halo and its WKV by state passing (``mixers.wkv``), the model's own WKV run over each chunk from the state that
  enters it. A state list given (``use_cache``), they leave it the whole sequence's, as one process does;
- xLSTM's mLSTM backend runs by state passing (``mixers.mlstm``), its own kernels over each chunk from the state
  that enters it;
- Inkling 2's dynamic short convolution (per-token taps, in code of its own) runs over each chunk with its halo.

Each is a partial of a module-level function, not a closure: a deep copy of the model (a reference model) gets steps
of its own.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UnsupportedAttention
from ..guard import mixers_over_the_whole_sequence
from ..mixers import Sharding
from ..mixers.conv import causal_conv1d, with_halo, without_halo
from ..mixers.diagonal import diagonal_scan_states
from ..mixers.halo import sequence_tail
from ..mixers.indexed import sequence_slots
from ..mixers.mlstm import mlstm_states
from ..mixers.wkv import token_shift, wkv_states


def _rg_convolution(block, sharded: Callable, count: Callable, x: Tensor) -> Tensor:
    """``block.conv_1d``'s forward: the halo convolution of a plan's shard, which also leaves the block the whole
    sequence's last inputs as its convolution state; elsewhere ``nn.Conv1d``'s own."""
    conv = block.conv_1d
    sharding = sharded(conv)
    with mixers_over_the_whole_sequence():  # the shard with its halo, or tokens every rank holds whole
        if sharding is None:
            return type(conv).forward(conv, x)
        count(convs=1)
        out = causal_conv1d(x, conv.weight[:, 0], conv.bias, None, sharding)
    width = conv.kernel_size[0]
    if block.conv1d_state is not None:  # a prefill that keeps the states
        block.conv1d_state = sequence_tail(x, 2, width - 1, sharding)
    return F.pad(out, (0, width - 1))  # the block keeps the first ``L`` outputs of its padded convolution


def _rg_recurrence(
    lru, sharded: Callable, count: Callable, hidden_states, recurrent_gate, reset, recurrent_states=None
):
    """``lru._rnn_scan``: the RG-LRU's recurrence of a plan's shard by state passing, returning the state after the
    sequence's last token; elsewhere the model's own scan."""
    scan = type(lru)._rnn_scan
    sharding = sharded(lru)
    if sharding is None:
        return scan(lru, hidden_states, recurrent_gate, reset, recurrent_states)
    if hidden_states.shape[1] == 1:
        raise UnsupportedAttention(
            "RecurrentGemma's recurrent block under context parallelism on a shard of one token (which it takes "
            "for a decoding step): shard a longer sequence, or with load_balance='zigzag'"
        )
    if torch.compiler.is_compiling() and sharding.cu_seqlens is not None:
        raise UnsupportedAttention(
            "RecurrentGemma's RG-LRU under context parallelism, compiled, on packed documents: state passing "
            "reads the documents' chunks on the host; run it eagerly"
        )
    count(scans=1)

    def from_zero(x: Tensor, a: Tensor):
        return scan(lru, x, a, torch.zeros(*x.shape[:2], 1, dtype=torch.bool, device=x.device), None)

    return diagonal_scan_states(from_zero, hidden_states, recurrent_gate * ~reset, sharding, recurrent_states)


def recurrent_gemma_steps(block, sharded: Callable, count: Callable) -> None:
    """Puts on a ``RecurrentGemmaRecurrentBlock``'s instance its two steps that mix tokens, run under a plan's shard
    (``sharded(module)``: its ``Sharding``, None elsewhere) while the block's own forward runs unchanged around
    them: its convolution (``conv_1d``) by the halo and its RG-LRU's scan (``rg_lru._rnn_scan``) by state passing."""
    block.conv_1d.forward = functools.partial(_rg_convolution, block, sharded, count)
    block.rg_lru._rnn_scan = functools.partial(_rg_recurrence, block.rg_lru, sharded, count)


def _shifted(hidden: Tensor, sharding: Sharding, previous: Optional[Tensor]) -> Tensor:
    """RWKV's token shift of the shard ``hidden [B, L, W]``; ``previous [B, W]``: the token before the sequence's first
    (a state list's), which the sequence's first token reads."""
    shifted = token_shift(hidden, sharding)
    if previous is None:
        return shifted
    first = sequence_slots(hidden, *sharding.op_args) == 0
    return torch.where(first[None, :, None], previous[:, None].to(shifted.dtype), shifted)


def _rwkv_time_mixing(module, sharded: Callable, count: Callable, hidden: Tensor, state=None, use_cache=False):
    """``RwkvSelfAttention.forward`` on a plan's shard: its token shift by the halo, its WKV by state passing."""
    sharding = sharded(module)
    if sharding is None:
        return type(module).forward(module, hidden, state=state, use_cache=use_cache)
    count(convs=1, scans=1)
    layer = module.layer_id
    with mixers_over_the_whole_sequence():
        shifted = _shifted(hidden, sharding, None if state is None else state[1][:, :, layer])
        key, value, receptance = (
            hidden * mix + shifted * (1 - mix)
            for mix in (module.time_mix_key, module.time_mix_value, module.time_mix_receptance)
        )
        key, value = module.key(key), module.value(value)
        receptance = torch.sigmoid(module.receptance(receptance))
        start = None if state is None else torch.stack([s[:, :, layer] for s in state[2:]], -1)
        wkv = sys.modules[type(module).__module__].rwkv_linear_attention
        # the model's WKV reads its keys rounded to fp32 whatever their dtype: so do the summaries (the gradient
        # passes as it is)
        keys = key + (key.float().to(key.dtype) - key).detach()
        mixed, last = wkv_states(wkv, module.time_decay, module.time_first, keys, value, sharding, start)
        if state is not None:
            state[1][:, :, layer] = sequence_tail(hidden, 1, 1, sharding)[:, 0]
            for index, part in enumerate(last.detach().unbind(-1)):
                state[2 + index][:, :, layer] = part
    return module.output(receptance * mixed), state


def _rwkv_channel_mixing(module, sharded: Callable, count: Callable, hidden: Tensor, state=None):
    """``RwkvFeedForward.forward`` on a plan's shard: its token shift by the halo."""
    sharding = sharded(module)
    if sharding is None:
        return type(module).forward(module, hidden, state=state)
    count(convs=1)
    layer = module.layer_id
    with mixers_over_the_whole_sequence():
        shifted = _shifted(hidden, sharding, None if state is None else state[0][:, :, layer])
        if state is not None:
            state[0][:, :, layer] = sequence_tail(hidden, 1, 1, sharding)[:, 0]
    key = hidden * module.time_mix_key + shifted * (1 - module.time_mix_key)
    receptance = hidden * module.time_mix_receptance + shifted * (1 - module.time_mix_receptance)
    value = module.value(torch.square(torch.relu(module.key(key))))
    return torch.sigmoid(module.receptance(receptance)) * value, state


def _xlstm_backend(backend, sharded: Callable, count: Callable, query, key, value, igate, fgate, *args, **kwargs):
    """``xLSTMBackend.forward`` on a plan's shard: the mLSTM by state passing (``mixers.mlstm``), the model's own
    kernels run over each chunk from the state that enters it."""
    forward = type(backend).forward
    sharding = sharded(backend)
    if sharding is None:
        return forward(backend, query, key, value, igate, fgate, *args, **kwargs)
    given = dict(zip(("c_initial", "n_initial", "m_initial"), args), **kwargs)
    if any(given.get(name) is not None for name in ("c_initial", "n_initial", "m_initial")):
        raise UnsupportedAttention(
            "xLSTM under context parallelism given a state to start from (its model's own chunks of a long sequence "
            "in eval mode, over max_inference_chunksize tokens, or a cache): run it in training mode, or raise "
            "config.max_inference_chunksize above the sequence's length"
        )
    count(scans=1)
    mode = given.get("mode")

    def from_state(q, k, v, i, f, c, n, m):
        return forward(backend, q, k, v, i, f, c, n, m, return_last_states=True, mode=mode)

    with mixers_over_the_whole_sequence():
        return mlstm_states(from_state, query, key, value, igate, fgate, sharding)


def _inkling2_dynamic_convolution(
    module, sharded: Callable, count: Callable, hidden_states, dynamic_input, cache=None, conv_mask=None, **kwargs
):
    """``Inkling2DynamicShortConvolution.forward`` on a plan's shard: the module's own forward over each chunk with the
    tokens before it (``mixers.conv.with_halo``: its input and the input of its per-token taps), their outputs
    dropped; a cache given (the sharded prefill), it keeps the whole sequence's last tokens, as one process's."""
    forward = type(module).forward
    sharding = sharded(module)
    if sharding is None:
        return forward(module, hidden_states, dynamic_input, cache=cache, conv_mask=conv_mask, **kwargs)
    if conv_mask is not None:
        raise UnsupportedAttention(
            "Inkling 2's dynamic short convolution under context parallelism given a padding mask (conv_mask): "
            "shard unpadded sequences, or pack them"
        )
    count(convs=1)
    width, reset = module.conv_kernel_size, kwargs.pop("seq_idx", None) is not None
    if cache is not None:  # what its own forward stores: in a sharded prefill, the sequence's last tokens
        layer = module.layer_idx + kwargs.get("cache_offset", 0)
        context = hidden_states.float().transpose(1, 2)
        cache.update_conv_state(context, layer, state_idx=module.conv_idx, conv_kernel_size=width)
    with mixers_over_the_whole_sequence():
        extended = [with_halo(t, 1, width, sharding, reset) for t in (hidden_states, dynamic_input)]
        out = forward(module, *extended, **kwargs)
    return without_halo(out, 1, width, sharding, hidden_states.shape[1])


def _put_forward(forward: Callable, module, sharded: Callable, count: Callable) -> None:
    module.forward = functools.partial(forward, module, sharded, count)


def _on_shards(forward: Callable) -> Callable:
    """A ``Family.own_steps`` entry that puts ``forward(module, sharded, count, *args, **kwargs)`` on the module's
    instance as its forward."""
    return functools.partial(_put_forward, forward)


rwkv_time_mixing_on_shards = _on_shards(_rwkv_time_mixing)
rwkv_channel_mixing_on_shards = _on_shards(_rwkv_channel_mixing)
xlstm_backend_on_shards = _on_shards(_xlstm_backend)
inkling2_dynamic_convolution_on_shards = _on_shards(_inkling2_dynamic_convolution)


__all__ = [
    "inkling2_dynamic_convolution_on_shards",
    "recurrent_gemma_steps",
    "rwkv_channel_mixing_on_shards",
    "rwkv_time_mixing_on_shards",
    "xlstm_backend_on_shards",
]
