"""transformers modules that mix tokens in code of their own, run under a plan over the gathered sequence.

Some families mix tokens in a module's own forward, with no module-level function to wrap (MiniMax's
lightning attention: a loop over blocks of the sequence inside ``MiniMaxLightningAttention.forward``; RWKV's
time mixing; OpenAI GPT's attention, by matmuls of its own). Under a
plan, each such module (its family's ``Family.gathered``, by class) runs over the whole sequence: a forward
pre-hook gathers its sequence-shaped arguments from every rank (``mixers.gathered.gather_sequence``), the
module runs unchanged, as one process runs it, and a forward hook keeps this rank's rows of its output
(``rank_rows``). Exact for any code, at C times the module's compute; the gradient of the gathered input is
reduce-scattered back to the ranks that hold its rows.

The hooks are torch's per-module hooks, put on a model's modules of those classes before its first call followed
under a plan (``hf.checks.prepare``); outside every plan, and in the decoding steps of ``cp_compile.hf.generate`` (the
same tokens on every rank), they return at once. In generation's sharded prefill the module sees the whole
prompt, so the state it leaves in the cache is the whole sequence's on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from ..active import active_plan
from ..comm.agree import refuse_together
from ..errors import LocalAttentionError, UnsupportedAttention
from ..guard import mixers_over_the_whole_sequence, set_aside
from ..layout import layout_named
from ..layout.packed import packed_slots
from ..mixers import Sharding
from ..mixers.gathered import gather_sequence, rank_rows
from .cache import ReplicatedLinearLayer, ShardedCache
from .families import GatheredModule, family_of, gathered_call
from .family_caches import WholeKVCache
from .forward import (
    count_call,
    documents_of_the_call,
    in_gathered_module,
    over_the_gathered_sequence,
    plan_of_shards,
    sharding_of,
)
from .mask_rows import mask_tensor, whole_sequence_mask
from .masks import MaskSpec

# padding masks a gathered module may be given: all ones under a plan (the gathered sequence has no padding)
_PADDING_MASKS = ("attention_mask", "conv_mask")
_PER_TOKEN_KWARGS = ("seq_idx",)


class _Calls:
    """One hooked module's calls in flight, innermost last (what its forward hook needs of its pre-hook), kept on its
    hooks with how it is called (``spec``: its ``GatheredModule``, or the ``ShardedInside`` of a module inside one):
    each (this rank's rows, or None for a decoding step; the rows before them; the sharding; the context entered
    for the call). ``ran_under_plan``: whether its latest forward (not a recompute) ran under a plan."""

    def __init__(self, spec, model=None):
        self.spec = spec
        self.model = None if model is None else weakref.ref(model)
        self.in_flight: list[tuple] = []
        self.ran_under_plan = False


def _by_name(module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments, each by its name (a ``**kwargs`` parameter's spread out)."""
    if not args:
        return dict(kwargs)
    signature = inspect.signature(functools.partial(type(module).forward, module))  # its own forward's, never ours
    named = dict(signature.bind(*args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    return named


def _check_recompute(module, calls: _Calls, plan) -> None:
    """A checkpointed layer recomputes its forward during backward: outside the plan that ran the forward, the
    module would run on this rank's shard alone (eagerly; a compiled graph recomputes what it traced)."""
    if torch.compiler.is_compiling():
        return
    if torch._C._current_autograd_node() is None:
        calls.ran_under_plan = plan is not None
    elif plan is None and calls.ran_under_plan:
        raise LocalAttentionError(
            f"{type(module).__name__} recomputes its forward during backward (activation checkpointing) outside "
            "`with plan:`, while its forward ran inside the plan: the recompute would mix this rank's shard of the "
            "sequence alone. Call loss.backward() inside `with plan:` as well."
        )


def _before(calls: _Calls, module, args: tuple, kwargs: dict):
    plan = plan_of_shards()
    _check_recompute(module, calls, plan)
    model = calls.model()
    if plan is None:
        step = _mask_of_the_step(calls.spec, model, module, args, kwargs)
        if step is not None:  # decoding: the attention it calls runs as on one process, over its whole K/V
            guard = contextlib.ExitStack()
            guard.enter_context(over_the_gathered_sequence())
            calls.in_flight.append((None, 0, None, guard))
        return step
    kwargs = _by_name(module, args, kwargs)
    call = calls.spec
    sharding = sharding_of(plan, kwargs.get("cu_seq_lens_q"))
    prefix = getattr(model.config, call.prefix) if call.prefix is not None else 0
    local_len = _first_given(call, kwargs).shape[call.dim] - prefix
    _refuse_what_a_plan_cannot_give(module, call, kwargs, plan, lambda: _real_slots(plan, sharding, local_len))
    if call.sharded is not None and _cache_given(kwargs) is None:  # its forward on the shard (``_sharded``)
        return None
    # compiled, packed documents' padding slots stay after the tokens: the gathered length would be data in the graph
    padding_last = torch.compiler.is_compiling() and sharding.cu_seqlens is not None
    if padding_last and not call.causal:
        raise UnsupportedAttention(
            f"{type(module).__name__} under context parallelism, compiled, on packed documents: its rows see later "
            "ones, which the padding slots kept after the tokens while compiled would be; run it eagerly"
        )
    mask_spec = kwargs.get(call.mask) if call.mask is not None else None
    count_call(convs=1, scans=1)  # the module stands for the layer's convolution and scan both
    # the module's own convolutions run on the whole sequence, on purpose: the guard would take them for a shard's
    guard = contextlib.ExitStack()
    guard.enter_context(mixers_over_the_whole_sequence())
    if not torch.compiler.is_compiling():
        guard.enter_context(set_aside())
    guard.enter_context(over_the_gathered_sequence())  # the mixers and attention it calls: as on one process
    calls.in_flight.append((local_len, prefix, sharding, guard))
    gather = functools.partial(_gathered, sharding=sharding, dim=call.dim, padding_last=padding_last)
    # the sequence arguments given (an optional one the call leaves out stays None)
    kwargs.update(
        {
            name: _after_the_prefix(kwargs[name], call.dim, prefix, gather)
            for name in call.sequence
            if kwargs.get(name) is not None
        }
    )
    # documents' marks a padding-free collator passes on, per token, for the module's own kernels to restart at
    for name in _PER_TOKEN_KWARGS:
        if kwargs.get(name) is not None and name not in call.sequence:
            kwargs[name] = _gathered(kwargs[name], sharding, padding_last=padding_last)
    for name in (*call.unread, *call.hiding_nothing, *(m for m in _PADDING_MASKS if m in kwargs)):
        kwargs[name] = None
    whole = _first_given(call, kwargs)
    if call.mask is not None:
        kwargs[call.mask] = whole_sequence_mask(mask_spec, whole, sharding)
    kwargs.update({name: build(module, model, whole, whole.shape[call.dim]) for name, build in call.rebuilt})
    _whole_states_from(module, kwargs.get("cache"), guard)
    return (), kwargs


def _cache_given(kwargs: dict):
    return next((value for value in kwargs.values() if isinstance(value, Cache)), None)


def _sharded(sharded: Callable, module, *args, **kwargs):
    """The forward of a module with one on the shard (``GatheredModule.sharded``): there under a plan, for a call given
    no cache; the class's own elsewhere (outside every plan, decoding, over the gathered sequence the hooks give)."""
    plan = plan_of_shards()
    named = _by_name(module, args, kwargs)
    if plan is None or _cache_given(named) is not None:
        return type(module).forward(module, *args, **kwargs)
    count_call(convs=1, scans=1)  # the module stands for the layer's convolution and scan both
    return sharded(module, sharding_of(plan, named.get("cu_seq_lens_q")), **named)


def _first_given(call: GatheredModule, kwargs: dict) -> Tensor:
    """The first of the call's sequence arguments that it was given (BLT's model: its ids or its embeddings)."""
    return next(kwargs[name] for name in call.sequence if kwargs.get(name) is not None)


def _real_slots(plan, sharding, local_len: int) -> Tensor:
    """``[local_len]``: which of this rank's slots hold a token (the others are the layout's padding)."""
    if sharding.cu_seqlens is None:
        return torch.ones(local_len, dtype=torch.bool)
    return packed_slots(sharding.cu_seqlens.cpu(), plan.rank, plan.world_size)["real"]


def _hides_tokens(mask: Tensor, real: Tensor) -> bool:
    """Whether a padding mask (0 or False where hidden) hides tokens, not only the layout's padding slots, which the
    gathered sequence leaves out. ``[B, L]``: by slot. ``[B, P + Q, P + K]`` (after P rows of the model's own): by
    count, as CPM-Ant builds it, hiding as many of the first keys as its tokens hold zeros (the layout pads with
    zeros)."""
    if mask.dim() == 2:
        return bool((~mask.bool() & real.to(mask.device)).any())
    hidden = (~mask.bool().any(-2)).sum(-1)
    return bool((hidden > int((~real).sum())).any())


def _refuse_what_a_plan_cannot_give(module, call: GatheredModule, kwargs: dict, plan, real: Callable) -> None:
    """Arguments the gathered module cannot be given for the whole sequence, refused by name on every rank: those
    that depend on the shard's values (padding) together, at the others' first agreement. ``real()``: which of this
    rank's slots hold a token (asked only of a padding mask)."""
    where = f"{type(module).__name__} under context parallelism"
    for name, what in call.refused:
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"{where}: {what}, which its model builds for this rank's shard alone")
    if torch.compiler.is_compiling():
        _refuse_masks_while_tracing(where, call, kwargs)
        return
    shard = _first_given(call, kwargs)
    for name in _PADDING_MASKS:
        mask = kwargs.get(name)
        if isinstance(mask, Tensor) and _hides_tokens(mask, real()):
            # this rank's shard alone may hold the padding: the refusal meets the others' first agreement
            error = UnsupportedAttention(
                f"{where}: a padding mask ({name}) with padding in it (the gathered sequence is the plan's tokens, "
                "without padding)"
            )
            refuse_together(error, shard, shard, shard, plan.group_name)
    for name in call.hiding_nothing:
        mask = kwargs.get(name)
        if isinstance(mask, Tensor) and bool(mask.any()):
            error = UnsupportedAttention(
                f"{where}: its mask {name} hides keys (padding, a causal or a permutation order), which its model "
                "builds for this rank's shard alone; under a plan it attends to every token of the sequence"
            )
            refuse_together(error, shard, shard, shard, plan.group_name)


def _refuse_masks_while_tracing(where: str, call: GatheredModule, kwargs: dict) -> None:
    """While Dynamo traces, a mask's values cannot be read: a 2-D padding mask goes unread, as the attention
    function leaves it (documented), and a mask the model builds per pair of the shard's tokens is refused by name
    (CPM-Ant's, from its token ids; XLNet's)."""
    masks = [n for n in _PADDING_MASKS if isinstance(kwargs.get(n), Tensor) and kwargs[n].dim() > 2]
    masks += [n for n in call.hiding_nothing if isinstance(kwargs.get(n), Tensor)]
    if masks:
        raise UnsupportedAttention(
            f"{where}, compiled: its model builds {', '.join(masks)} per pair of the shard's tokens, from their "
            "values, which cp_compile cannot read while Dynamo traces; run it eagerly"
        )


def _after_the_prefix(value: Tensor, dim: int, prefix: int, change) -> Tensor:
    """``change`` applied to ``value``'s rows after its first ``prefix`` (along ``dim``), which stay as they are."""
    if not prefix:
        return change(value)
    return torch.cat([value.narrow(dim, 0, prefix), change(value.narrow(dim, prefix, value.shape[dim] - prefix))], dim)


def _gathered(value, sharding, dim: int = 1, padding_last: bool = False):
    """The whole sequence of a shard's tensor (tokens along ``dim``), or of each tensor of a tuple (RoPE's cos and
    sin) or a dict of those (DeepSeek V4's position embeddings per rotary kind)."""
    if isinstance(value, dict):
        return {key: _gathered(item, sharding, dim, padding_last) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_gathered(item, sharding, dim, padding_last) for item in value)
    return gather_sequence(value, dim, sharding, padding_last)


def _mask_of_the_step(call: GatheredModule, model, module, args: tuple, kwargs: dict):
    """Decoding (the same tokens on every rank, under a plan), a module that reads its mask tensor runs as on one
    process over its whole K/V (``WholeKVCache``): it is given the mask of the step's n tokens after the ones its
    layer holds, causal, as one process builds it, and what its model built from positions, built for those keys
    (the cache reports mask sizes as if it held nothing, which the mask function asks)."""
    if call.mask is None or active_plan() is None:
        return None
    kwargs = _by_name(module, args, kwargs)
    spec = kwargs.get(call.mask)
    if not isinstance(spec, MaskSpec):
        return None
    name, cache = next(((k, v) for k, v in kwargs.items() if isinstance(v, Cache)), (None, None))
    if isinstance(cache, WholeKVCache):
        kwargs[name] = _OneProcessSizes(cache)
    hidden = kwargs[call.sequence[0]]
    n = hidden.shape[1]
    before, keys, first_key = 0, n, 0
    if cache is not None:  # the keys the layer will hold after this step's update, as one process's mask sizes say
        layer = cache.layers[module.layer_idx]
        before = layer.get_seq_length()
        keys, first_key = layer.get_mask_sizes(n)
    places = torch.arange(before, before + n, device=hidden.device)
    kwargs[call.mask] = mask_tensor(spec, places, keys, None, hidden, first_key)
    # the model built them for the keys its mask sizes say: this step's alone
    kwargs.update({name: build(module, model, hidden, before + n) for name, build in call.rebuilt})
    return (), kwargs


class _OneProcessSizes:
    """A ``WholeKVCache`` as a module that attends in code of its own reads it while decoding: its layers' own
    lengths and offsets (the cache itself reports sizes as if it held nothing, which the model's mask functions
    ask), so that positions the module counts from them (Inkling's relative bias and log scaling) are one process's."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._cache.layers[layer_idx].get_mask_sizes(query_length)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._cache.layers[layer_idx].get_seq_length()


def _whole_states_from(module, cache, guard: contextlib.ExitStack) -> None:
    """In a sharded prefill, a cache layer given states by a gathered module takes them as they are: they are the
    whole prompt's (not a shard's tail to gather, as a wrapped convolution's are). Where the layer also has wrapped
    convolutions (Inkling's, beside its attention module), only the states given during the module's call."""
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(cache, ShardedCache) or layer_idx is None:
        return
    layer = cache.layers[layer_idx]
    if not isinstance(layer, ReplicatedLinearLayer):
        return
    if not family_of(module).wrapped:
        layer.given_whole()
        return
    layer.states_whole = True
    guard.callback(setattr, layer, "states_whole", False)


def _after(calls: _Calls, module, args: tuple, kwargs: dict, output):
    if not calls.in_flight:  # not a gathered call (outside every plan, decoding)
        return None
    local_len, prefix, sharding, guard = calls.in_flight.pop()
    guard.close()
    if output is None or local_len is None:  # the forward raised, or a decoding step's (no rows to keep)
        return None
    call = calls.spec

    def own_rows(whole: Tensor) -> Tensor:
        return _after_the_prefix(whole, call.dim, prefix, lambda rows: rank_rows(rows, call.dim, local_len, sharding))

    if isinstance(output, ModelOutput):  # its fields by place, as its tuple lists them (BLT's model)
        for i in call.outputs:
            name = list(output.keys())[i]
            output[name] = own_rows(output[name])
        return output
    if not isinstance(output, (tuple, list)):
        return own_rows(output)
    kept = [own_rows(t) if i in call.outputs else t for i, t in enumerate(output)]
    return type(output)(*kept) if hasattr(output, "_fields") else type(output)(kept)  # a named tuple (Reformer's)


def _share_before(calls: _Calls, module, args: tuple, kwargs: dict):
    """Inside a gathered module, ``module`` runs over this rank's share of its own sequence (``ShardedInside``)."""
    plan = active_plan()
    if plan is None or not in_gathered_module():  # outside every plan, decoding: as one process runs it
        return None
    kwargs = _by_name(module, args, kwargs)
    packed = plan.documents is not None or kwargs.get("cu_seq_lens_q") is not None
    if packed or documents_of_the_call() is not None:  # the same on every rank
        raise UnsupportedAttention(
            f"{type(module).__name__} under context parallelism on packed documents: one process runs it over a "
            "sequence of its own that knows no documents; pass one sequence per row"
        )
    share = calls.spec
    whole = kwargs[share.sequence[0]]
    total, world, layout = whole.shape[1], plan.world_size, layout_named(plan.load_balance)
    local_len = -(-total // layout.num_chunks(world)) * layout.chunks_per_rank(world)  # whole chunks, padded at the end
    sharding = Sharding(plan.group_name, world, plan.load_balance, None)
    for name in share.sequence:
        kwargs[name] = rank_rows(kwargs[name], 1, local_len, sharding)
    places = torch.arange(total, device=whole.device).expand(whole.shape[0], -1)
    kwargs[share.positions] = rank_rows(places, 1, local_len, sharding)
    kwargs[share.mask] = MaskSpec(True, model=type(module).__name__)
    context = contextlib.ExitStack()
    context.enter_context(over_the_gathered_sequence(gathered=False))
    calls.in_flight.append((total, sharding, context))
    return (), kwargs


def _share_after(calls: _Calls, module, args: tuple, kwargs: dict, output):
    if not calls.in_flight:  # not run over a share
        return None
    total, sharding, context = calls.in_flight.pop()
    context.close()
    if output is None:  # the forward raised
        return None
    return gather_sequence(output, 1, sharding).narrow(1, 0, total)


def hook_gathered_modules(model) -> None:
    """Puts the gathered route's two hooks on every module of ``model`` whose class mixes tokens in code of its own
    (``Family.gathered``), and the share's two on the modules inside them that run over this rank's share of a
    sequence of their own (``ShardedInside``)."""
    for module in model.modules():
        call = gathered_call(module)
        if call is None:
            continue
        calls = _Calls(call, model)
        if call.sharded is not None and "forward" not in module.__dict__:
            # a partial of a module-level function, not a closure: a deep copy of the model gets its own
            module.forward = functools.partial(_sharded, call.sharded, module)
        module.register_forward_pre_hook(functools.partial(_before, calls), with_kwargs=True)
        module.register_forward_hook(functools.partial(_after, calls), with_kwargs=True, always_call=True)
        shares = dict(call.sharded_inside)
        for inner in module.modules():
            share = shares.get(type(inner).__name__)
            if share is not None:
                calls = _Calls(share)
                inner.register_forward_pre_hook(functools.partial(_share_before, calls), with_kwargs=True)
                inner.register_forward_hook(functools.partial(_share_after, calls), with_kwargs=True, always_call=True)


__all__ = ["hook_gathered_modules", "whole_sequence_mask"]
