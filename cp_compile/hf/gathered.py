"""transformers modules that mix tokens in code of their own, run under a plan over the gathered sequence.

Some families mix tokens in a module's own forward, with no module-level function to wrap (MiniMax's
lightning attention: a loop over blocks of the sequence inside ``MiniMaxLightningAttention.forward``). Under a
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

import copy
import weakref

import torch
from torch import Tensor

from ..errors import UnsupportedAttention
from ..inference.hf_cache import ShardedCache
from ..mixers.gathered import gather_sequence, rank_rows
from .forward import CONV, SCAN, count_call, prepare_models_with
from .mixers import GATHERED_MODULES, _plan_of_shards, _sharding

_PADDING_MASK = "attention_mask"

_HOOKED: weakref.WeakSet = weakref.WeakSet()  # the models whose gathered modules have their hooks
_IN_FLIGHT: dict[int, list[tuple[int, object]]] = {}  # id(module) -> (local length, sharding) of calls running


def _before(module, args: tuple, kwargs: dict):
    plan = _plan_of_shards()
    if plan is None:
        return None
    if args:
        raise UnsupportedAttention(
            f"{type(module).__name__} under context parallelism takes its arguments by name (the gathered route "
            f"knows them by name); it was given {len(args)} by position"
        )
    mask = kwargs.get(_PADDING_MASK)
    if isinstance(mask, Tensor) and not bool(mask.all()):
        raise UnsupportedAttention(
            f"{type(module).__name__} under context parallelism: a padding mask with padding in it (the gathered "
            "sequence is the plan's tokens, without padding)"
        )
    hidden = kwargs["hidden_states"]
    sharding = _sharding(plan, kwargs.get("cu_seq_lens_q"))
    count_call(CONV)  # the module stands for the layer's convolution and scan both
    count_call(SCAN)
    _IN_FLIGHT.setdefault(id(module), []).append((hidden.shape[1], sharding))
    gathered, unread = _arguments(module)
    kwargs = dict(kwargs)
    for name in gathered:
        kwargs[name] = gather_sequence(kwargs[name], 1, sharding)
    for name in (*unread, _PADDING_MASK):
        kwargs[name] = None
    return args, kwargs


def _arguments(module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return GATHERED_MODULES[type(module).__module__][type(module).__name__]


def _after(module, args: tuple, kwargs: dict, output):
    calls = _IN_FLIGHT.get(id(module))
    if not calls:  # not a gathered call (outside every plan, decoding)
        return None
    local_len, sharding = calls.pop()
    if not calls:
        del _IN_FLIGHT[id(module)]
    if output is None:  # the forward raised
        return None
    first, *rest = output if isinstance(output, tuple) else (output,)
    mine = rank_rows(first, 1, local_len, sharding)
    return (mine, *rest) if isinstance(output, tuple) else mine


def hook_gathered_modules(model) -> None:
    """Puts the gathered route's two hooks on every module of ``model`` whose class mixes tokens in code of its own
    (``GATHERED_MODULES``), once per model."""
    if model in _HOOKED or torch.compiler.is_compiling():
        return
    for module in model.modules():
        if type(module).__name__ in GATHERED_MODULES.get(type(module).__module__, {}):
            module.register_forward_pre_hook(_before, with_kwargs=True)
            module.register_forward_hook(_after, with_kwargs=True, always_call=True)
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
            layer.pending_conv = None  # a sharded prefill reached it: the module ran over the whole prompt

        def __len__(self) -> int:
            return len(self.layers)

    return ShardedMiniMaxCache


_CACHE_CLASSES = {"transformers.models.minimax.modeling_minimax": _minimax_cache_class}


def sharded_cache(model, max_cache_len: int, plan) -> ShardedCache:
    """A ``ShardedCache`` for ``model``, of the cache class its family requires where it requires one."""
    make = _CACHE_CLASSES.get(type(model).__module__)
    return (make() if make is not None else ShardedCache)(model.config, max_cache_len, plan)


__all__ = ["hook_gathered_modules", "sharded_cache"]
