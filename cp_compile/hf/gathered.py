"""transformers modules that mix tokens in code of their own, run under a plan over the gathered sequence.

Some families mix tokens in a module's own forward, with no module-level function to wrap (MiniMax's
lightning attention: a loop over blocks of the sequence inside ``MiniMaxLightningAttention.forward``; RWKV's
time mixing; OpenAI GPT's attention, by matmuls of its own). Under a
plan, each such module (``hf.mixers.GATHERED_MIXERS``, by class) runs over the whole sequence: a forward
pre-hook gathers its sequence-shaped arguments from every rank (``mixers.gathered.gather_sequence``), the
module runs unchanged, as one process runs it, and a forward hook keeps this rank's rows of its output
(``rank_rows``). Exact for any code, at C times the module's compute; the gradient of the gathered input is
reduce-scattered back to the ranks that hold its rows.

The hooks are torch's per-module hooks, put on a model's modules of those classes before its first call followed
under a plan (``hf.forward``); outside every plan, and in the decoding steps of ``cp_compile.hf.generate`` (the
same tokens on every rank), they return at once. In generation's sharded prefill the module sees the whole
prompt, so the state it leaves in the cache is the whole sequence's on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicIndexedLayer, DynamicLayer
from transformers.utils import ModelOutput

from ..active import active_plan
from ..comm.agree import every_rank, refuse_together
from ..comm.groups import resolve_group
from ..errors import LocalAttentionError, UnsupportedAttention
from ..guard import mixers_over_the_whole_sequence, set_aside
from ..inference.hf_cache import (
    HybridLayer,
    ReplicatedLinearLayer,
    ShardedCache,
    ShardedHybridLayer,
    ShardedIndexedLayer,
    ShardedLayer,
)
from ..layout import layout_named
from ..layout.packed import packed_slots
from ..mixers import Sharding
from ..mixers.gathered import gather_sequence, rank_rows
from ..mixers.indexed import visible_keys
from .forward import count_call, prepare_models_with
from .masks import MaskSpec
from .mixers import (
    GATHERED_MODULES,
    WRAPPED_FAMILIES,
    GatheredModule,
    ShardedInside,
    _plan_of_shards,
    _sharding,
    in_gathered_module,
    over_the_gathered_sequence,
)

# padding masks a gathered module may be given: all ones under a plan (the gathered sequence has no padding)
_PADDING_MASKS = ("attention_mask", "conv_mask")
_PER_TOKEN_KWARGS = ("seq_idx",)

_HOOKED: weakref.WeakSet = weakref.WeakSet()  # the models whose gathered modules have their hooks
_UNDER_PLAN: weakref.WeakSet = weakref.WeakSet()  # the gathered modules whose latest forward ran under a plan
# id(module) -> (local length, rows before it, sharding, the guard set aside) of its calls running
_IN_FLIGHT: dict[int, list[tuple[Optional[int], int, object, contextlib.ExitStack]]] = {}
# id(module) -> (the length of its own sequence, its sharding, the share's context) of a ``ShardedInside``'s calls
_SHARES: dict[int, list[tuple[int, Sharding, contextlib.ExitStack]]] = {}


def _by_name(module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments, each by its name (a ``**kwargs`` parameter's spread out)."""
    if not args:
        return dict(kwargs)
    signature = inspect.signature(module.forward)
    named = dict(signature.bind(*args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    return named


def _check_recompute(module, plan) -> None:
    """A checkpointed layer recomputes its forward during backward: outside the plan that ran the forward, the
    module would run on this rank's shard alone (eagerly; a compiled graph recomputes what it traced)."""
    if torch.compiler.is_compiling():
        return
    if torch._C._current_autograd_node() is None:
        (_UNDER_PLAN.add if plan is not None else _UNDER_PLAN.discard)(module)
    elif plan is None and module in _UNDER_PLAN:
        raise LocalAttentionError(
            f"{type(module).__name__} recomputes its forward during backward (activation checkpointing) outside "
            "`with plan:`, while its forward ran inside the plan: the recompute would mix this rank's shard of the "
            "sequence alone. Call loss.backward() inside `with plan:` as well."
        )


def _before(model_ref: weakref.ref, module, args: tuple, kwargs: dict):
    plan = _plan_of_shards()
    _check_recompute(module, plan)
    model = model_ref()
    if plan is None:
        step = _mask_of_the_step(model, module, args, kwargs)
        if step is not None:  # decoding: the attention it calls runs as on one process, over its whole K/V
            guard = contextlib.ExitStack()
            guard.enter_context(over_the_gathered_sequence())
            _IN_FLIGHT.setdefault(id(module), []).append((None, 0, None, guard))
        return step
    kwargs = _by_name(module, args, kwargs)
    call = _call_of(module)
    sharding = _sharding(plan, kwargs.get("cu_seq_lens_q"))
    prefix = getattr(model.config, call.prefix) if call.prefix is not None else 0
    local_len = _first_given(call, kwargs).shape[call.dim] - prefix
    _refuse_what_a_plan_cannot_give(module, call, kwargs, plan, lambda: _real_slots(plan, sharding, local_len))
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
    _IN_FLIGHT.setdefault(id(module), []).append((local_len, prefix, sharding, guard))
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


def _mask_tensor(spec, places: Tensor, total: int, cu_seqlens, like: Tensor, first_key: int = 0) -> Tensor:
    """``[B, 1, n, total]``: the mask one process builds for queries at ``places [n]`` against the ``total`` tokens
    from ``first_key`` on (a sliding layer's cache holds its last ones alone), as the layer's ``MaskSpec`` says
    (causal, a window; within the documents of ``cu_seqlens`` when given): additive in ``like``'s dtype (0 where a
    key is visible, the dtype's minimum elsewhere), or, turned to booleans by the model (``spec.as_bool``), True where
    a key is masked. ``like [B, ...]``: the batch, dtype and device."""
    if not isinstance(spec, MaskSpec) or spec.chunk or not spec.causal:
        raise UnsupportedAttention(
            f"a module reading its attention mask as a tensor, over the gathered sequence: its mask ({spec!r}) is "
            "not a causal one, with or without a window, as cp_compile's mask function describes it"
        )
    keys = torch.arange(first_key, first_key + total, device=places.device)
    visible = keys[None, :] <= places[:, None] if first_key else visible_keys(places, total, cu_seqlens)
    if spec.window is not None:
        visible &= keys[None, :] > places[:, None] - spec.window
    if spec.as_bool:
        mask = ~visible
    else:
        mask = torch.zeros(visible.shape, dtype=like.dtype, device=like.device)
        mask = mask.masked_fill(~visible, torch.finfo(like.dtype).min)
    return mask.expand(like.shape[0], 1, *visible.shape)


def whole_sequence_mask(spec, whole: Tensor, sharding) -> Tensor:
    """``[B, 1, T, T]``: the mask one process builds for ``whole``, the gathered sequence (``[B, T, ...]``); within
    the documents of ``sharding`` where the mask function keeps documents apart, as it does when the model passes it
    the positions."""
    total = whole.shape[1]
    documents = sharding.cu_seqlens if _documents_apart(spec, sharding, whole.device) else None
    return _mask_tensor(spec, torch.arange(total, device=whole.device), total, documents, whole)


def _documents_apart(spec, sharding, device) -> bool:
    """Whether the mask one process builds keeps the packed documents apart: where any rank's mask function saw them
    in its positions. A rank whose positions run on without a break (C = 2, documents of 4 and 12 tokens: rank 1
    holds positions 1 to 8) sees none whatever the model passes, so the ranks agree (one small all-gather); compiled,
    the spec's own answer stands (transformers keeps them apart wherever the model passes positions while tracing)."""
    seen = getattr(spec, "documents", False)
    if sharding.cu_seqlens is None or sharding.cu_seqlens.shape[0] <= 2:
        return False
    if seen is None:
        raise UnsupportedAttention(
            f"{spec.model}: compiled, a module that reads the mask tensor of a window or chunk layer, given packed "
            "documents: cp_compile cannot tell while Dynamo traces whether the model's mask keeps them apart; run it "
            "eagerly"
        )
    if sharding.world_size == 1 or torch.compiler.is_compiling():
        return seen
    return any(row[0] for row in every_rank([int(seen)], resolve_group(sharding.group_name), device))


def _mask_of_the_step(model, module, args: tuple, kwargs: dict):
    """Decoding (the same tokens on every rank, under a plan), a module that reads its mask tensor runs as on one
    process over its whole K/V (``WholeKVCache``): it is given the mask of the step's n tokens after the ones its
    layer holds, causal, as one process builds it, and what its model built from positions, built for those keys
    (the cache reports mask sizes as if it held nothing, which the mask function asks)."""
    call = GATHERED_MODULES.get(type(module).__module__, {}).get(type(module).__name__)
    if call is None or call.mask is None or active_plan() is None:
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
    kwargs[call.mask] = _mask_tensor(spec, places, keys, None, hidden, first_key)
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


def _call_of(module) -> GatheredModule:
    return GATHERED_MODULES[type(module).__module__][type(module).__name__]


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
    if type(module).__module__ not in WRAPPED_FAMILIES:
        layer.pending_conv = None
        return
    layer.states_whole = True
    guard.callback(setattr, layer, "states_whole", False)


def _after(module, args: tuple, kwargs: dict, output):
    calls = _IN_FLIGHT.get(id(module))
    if not calls:  # not a gathered call (outside every plan, decoding)
        return None
    local_len, prefix, sharding, guard = calls.pop()
    guard.close()
    if not calls:
        del _IN_FLIGHT[id(module)]
    if output is None or local_len is None:  # the forward raised, or a decoding step's (no rows to keep)
        return None
    call = _call_of(module)

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


def _share_before(share: ShardedInside, module, args: tuple, kwargs: dict):
    """Inside a gathered module, ``module`` runs over this rank's share of its own sequence (``ShardedInside``)."""
    plan = active_plan()
    if plan is None or not in_gathered_module():  # outside every plan, decoding: as one process runs it
        return None
    kwargs = _by_name(module, args, kwargs)
    if plan.documents is not None or kwargs.get("cu_seq_lens_q") is not None:  # the same on every rank
        raise UnsupportedAttention(
            f"{type(module).__name__} under context parallelism on packed documents: one process runs it over a "
            "sequence of its own that knows no documents; pass one sequence per row"
        )
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
    _SHARES.setdefault(id(module), []).append((total, sharding, context))
    return (), kwargs


def _share_after(module, args: tuple, kwargs: dict, output):
    calls = _SHARES.get(id(module))
    if not calls:  # not run over a share
        return None
    total, sharding, context = calls.pop()
    context.close()
    if not calls:
        del _SHARES[id(module)]
    if output is None:  # the forward raised
        return None
    return gather_sequence(output, 1, sharding).narrow(1, 0, total)


def hook_gathered_modules(model) -> None:
    """Puts the gathered route's two hooks on every module of ``model`` whose class mixes tokens in code of its own
    (``GATHERED_MODULES``), and the share's two on the modules inside them that run over this rank's share of a
    sequence of their own (``ShardedInside``), once per model."""
    if model in _HOOKED or torch.compiler.is_compiling():
        return
    for module in model.modules():
        call = GATHERED_MODULES.get(type(module).__module__, {}).get(type(module).__name__)
        if call is None:
            continue
        module.register_forward_pre_hook(functools.partial(_before, weakref.ref(model)), with_kwargs=True)
        module.register_forward_hook(_after, with_kwargs=True, always_call=True)
        shares = dict(call.sharded_inside)
        for inner in module.modules():
            share = shares.get(type(inner).__name__)
            if share is not None:
                inner.register_forward_pre_hook(functools.partial(_share_before, share), with_kwargs=True)
                inner.register_forward_hook(_share_after, with_kwargs=True, always_call=True)
    _HOOKED.add(model)


prepare_models_with(hook_gathered_modules)


def _minimax_cache_class():
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class ShardedMiniMaxCache(ShardedCache, MiniMaxCache):
        """MiniMax's model takes a cache of its own class alone, and its lightning attention keeps its state through
        ``get_linear_cache`` / ``set_linear_cache``: here the state of each linear layer, whole on every rank.

        Its "full_attention" layers attend within ``config.sliding_window`` when one is set: they are kept as
        windows, and the cache is not compileable, as MiniMax's own is not, so that ``generate()`` lets the model
        build its (windowed) masks instead of building them from the layer types."""

        is_compileable = False

        def __init__(self, config, max_cache_len: int, plan=None):
            if getattr(config, "sliding_window", None) is not None:
                config = copy.copy(config)
                config.layer_types = ["sliding_attention" if t == "full_attention" else t for t in config.layer_types]
            super().__init__(config, max_cache_len, plan)

        def get_linear_cache(self, layer_idx: int):
            layer = self.layers[layer_idx]
            return layer.recurrent_states[0] if layer.has_previous_state.get(0) else None

        def set_linear_cache(self, layer_idx: int, linear_cache: Tensor) -> None:
            layer = self.layers[layer_idx]
            layer.update_recurrent_state(linear_cache, 0)
            layer.has_previous_state[0] = True

        def __len__(self) -> int:
            return len(self.layers)

    return ShardedMiniMaxCache


class ShardedCacheOfModuleStates(ShardedCache):
    """For a family whose recurrent layers keep their state on their own modules (RecurrentGemma's recurrent
    blocks): the cache's linear layers hold nothing. The sharded prefill runs those modules over the whole prompt
    (the gathered route), so each rank's modules keep the whole prompt's state; the model-call check counts them."""

    @contextlib.contextmanager
    def sharded_prefill(self, positions: Tensor, tokens: int):
        with super().sharded_prefill(positions, tokens):
            for layer in self.layers:
                if isinstance(layer, ReplicatedLinearLayer):
                    layer.pending_conv = None
            yield self


class WholeKVLayer(DynamicLayer):
    """The whole sequence's K/V, the same on every rank: what a module that attends in code of its own reads."""

    is_compileable = False


class WholeKVIndexedLayer(DynamicIndexedLayer):
    """An indexed attention layer's whole K/V and its indexer's keys (Qwen4-exp's, whose attention module runs over
    the gathered sequence), the same on every rank. The model keeps the positions of every token it has seen on the
    layer (``indexer_position_ids``, the history its rotary embedding covers); given a shard's in a sharded prefill,
    the layer keeps the whole prompt's, gathered from every rank."""

    is_compileable = False

    def __init__(self, plan):
        self.plan, self.prompt_tokens, self._positions = plan, None, None
        super().__init__()

    @property
    def indexer_position_ids(self) -> Optional[Tensor]:
        return self._positions

    @indexer_position_ids.setter
    def indexer_position_ids(self, positions: Optional[Tensor]) -> None:
        if positions is not None and self.prompt_tokens is not None:
            prompt = torch.tensor([0, self.prompt_tokens], device=positions.device)
            sharding = Sharding(self.plan.group_name, self.plan.world_size, self.plan.load_balance, prompt)
            positions = gather_sequence(positions, positions.dim() - 1, sharding)
        self._positions = positions


class WholeKVHybridLayer(HybridLayer, WholeKVLayer):
    """A hybrid layer's whole K/V (``WholeKVLayer``) beside its convolution and recurrent states, whole on every rank
    (Inkling's attention with short convolutions)."""

    is_compileable = False
    kv_layer = WholeKVLayer

    def __init__(self, plan, number_of_states: int):
        WholeKVLayer.__init__(self)
        ReplicatedLinearLayer.__init__(self, plan, number_of_states)


class WholeKVCache(ShardedCache):
    """For families whose attention is code of their own that reads its K/V and its mask as tensors (XGLM, BLOOM,
    GPT-NeoX-Japanese): every rank keeps the whole sequence's K/V, as one process does, C times the memory of a
    sharded cache. The sharded prefill runs those modules over the gathered prompt, so each stores the whole
    prompt's K/V; decoding runs them as one process does, on every rank, with no collective (the ranks' tokens are
    compared once, at the end)."""

    is_compileable = False
    keeps_whole_layers = True  # a layer type of the model's own: its own cache class, whole on every rank

    def __init__(self, config, max_cache_len: int, plan=None):
        super().__init__(config, max_cache_len, plan)
        self.layers = [self._whole(layer, self.plan) for layer in self.layers]

    @contextlib.contextmanager
    def sharded_prefill(self, positions: Tensor, tokens: int):
        indexed = [layer for layer in self.layers if isinstance(layer, WholeKVIndexedLayer)]
        for layer in indexed:
            layer.prompt_tokens = tokens
        try:
            with super().sharded_prefill(positions, tokens):
                yield self
        finally:
            for layer in indexed:
                layer.prompt_tokens = None

    @staticmethod
    def _whole(layer, plan):
        if isinstance(layer, ShardedHybridLayer):
            return WholeKVHybridLayer(plan, layer.number_of_states)
        if isinstance(layer, ShardedIndexedLayer):
            return WholeKVIndexedLayer(plan)
        return WholeKVLayer() if isinstance(layer, ShardedLayer) else layer


_CACHE_CLASSES = {
    "transformers.models.minimax.modeling_minimax": _minimax_cache_class,
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma": lambda: ShardedCacheOfModuleStates,
}


def _fresh_module_states(model) -> None:
    """RecurrentGemma's model zeroes its blocks' states only when it is given no cache: a new cache starts them anew
    here, as its own call would (else a one-token prefill decodes from an earlier call's state)."""
    embeddings = model.get_input_embeddings().weight
    model.base_model._setup_cache(model.config, 1, embeddings.device, embeddings.dtype)


_FRESH_STATES = {"transformers.models.recurrent_gemma.modeling_recurrent_gemma": _fresh_module_states}


def sharded_cache(model, max_cache_len: int, plan) -> ShardedCache:
    """A new ``ShardedCache`` for ``model`` (one prompt), of the cache class its family requires where it requires
    one; a family that keeps states on its modules starts them anew."""
    family = type(model).__module__
    if family in _FRESH_STATES:
        _FRESH_STATES[family](model)
    if any(call.mask is not None or call.whole_kv for call in GATHERED_MODULES.get(family, {}).values()):
        return WholeKVCache(model.config, max_cache_len, plan)
    make = _CACHE_CLASSES.get(family)
    return (make() if make is not None else ShardedCache)(model.config, max_cache_len, plan)


__all__ = ["hook_gathered_modules", "sharded_cache"]
