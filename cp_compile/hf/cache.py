"""``ShardedCache``: a transformers ``Cache`` whose layers keep this rank's share of the K/V.

Passed the documented way (``model.generate(..., cache=ShardedCache(...))``,
or made by ``cp_compile.hf.generate``). Each attention layer is an ``inference.cache.CacheShard``.
``update`` stores the new K/V and hands the attention function (``"cp_compile"``)
what it needs through the attention kwargs that transformers passes to both:
the layer, and the positions of the tokens just stored.

- During a sharded prefill (``ShardedCache.sharded_prefill``) the K/V are this
  rank's shard of the prompt: the layer stores them and the attention runs
  the plan's CP schedule on them, as in training.
- Otherwise the tokens are the same on every rank (decoding, drafts, a
  follow-up prompt): one rank keeps each, and the attention is
  ``cp::cached_attention`` over every rank's share. A sliding-window layer
  keeps a bounded share (``inference.cache``).

Mask sizes are reported as if there were no cache: under a plan the mask
function builds no mask, and attention masks by the positions the cache holds.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from ..active import active_plan
from ..errors import LocalAttentionError, UnsupportedAttention
from ..inference.cache import Agreement, CacheShard, Step
from ..kernels.masked import EMPTY_POSITION
from ..mixers import Sharding
from ..mixers.halo import sequence_tail
from ..plan import ContextParallel
from .families import family_of
from .forward import in_flight

# Key of the attention kwargs under which ``update`` leaves (layer, its ``cache.Step``, or None in a sharded prefill).
CACHE_STEP = "cp_compile_cache_step"

# A model that calls ``cache.update(k, v, layer_idx)`` without its attention kwargs (GPT-NeoX, CTRL) hands the
# attention function the keys ``update`` returned, and nothing else of the cache's: the step rides with those keys,
# (the keys, then what ``CACHE_STEP`` would hold) for the one attention call that follows the update in that layer.
# Eagerly the keys are held weakly; a compiled step makes and takes the handoff inside its own trace.
_HANDED: list = [None]


def hand_over(keys: Tensor, step: tuple) -> None:
    _HANDED[0] = (keys if torch.compiler.is_compiling() else weakref.ref(keys), step)


def step_handed_with(key: Tensor) -> Optional[tuple]:
    """(layer, step) that ``update`` handed over with ``key`` when it had no attention kwargs to leave it in; None when
    ``key`` is not what the latest such update returned. Taken once. (A model whose attention is handed other keys, or
    attends on its own, leaves its layer unattended: ``ShardedCache.check_attended`` names it.)"""
    handed = _HANDED[0]
    if handed is None:  # read, not written: a compiled forward without a cache traces no side effect
        return None
    _HANDED[0] = None
    keys, step = handed
    if isinstance(keys, weakref.ref):
        keys = keys()
    return step if keys is key else None


def share_step(layer, keys: Tensor, step) -> None:
    """Layers that share their keys and values with later layers (Gemma 3n: a "store" layer's K/V, as its ``update``
    returned them, are what its "reuse" layers attend to, and those keep no cache): the latest step of each, kept on
    the record of the calls in flight (``forward.InFlight``) for the attention calls that are handed those keys."""
    calls = in_flight()
    if calls is None:
        return
    previous = getattr(layer, "shared_keys_id", None)
    if previous is not None:
        calls.shared_steps.pop(previous, None)
    layer.shared_keys_id = id(keys)
    calls.shared_steps[id(keys)] = (weakref.ref(keys), layer, step)


def step_of_shared_keys(key: Tensor) -> Optional[tuple]:
    """(layer, step) of the layer whose latest ``update`` returned ``key`` while decoding, when that layer shares its
    keys with later layers; else None."""
    calls = in_flight()
    shared = None if calls is None else calls.shared_steps.get(id(key))
    if shared is None or shared[0]() is not key:
        return None
    return shared[1], shared[2]


def drop_handed_step() -> None:
    """Forget a step handed over and never taken (its attention was not ``"cp_compile"``'s, or the call failed), and
    the shared steps of the forward just run (they hold their cache's layers)."""
    _HANDED[0] = None
    calls = in_flight()
    if calls is not None:
        calls.shared_steps.clear()


def _unsupported(what: str):
    def refuse(*args, **kwargs):
        raise UnsupportedAttention(f"ShardedCache: {what} is not supported (the cache is sharded over the CP ranks)")

    return refuse


class ShardedLayer(CacheLayerMixin, CacheShard):
    """One attention layer of a ``ShardedCache``; ``window``: its sliding window (None: full attention)."""

    is_compileable = True

    def __init__(self, plan: ContextParallel, max_tokens: int, window: Optional[int] = None):
        CacheLayerMixin.__init__(self)
        CacheShard.__init__(self, plan.group_name, plan.rank, plan.world_size, max_tokens, window)
        self.is_sliding = window is not None
        self.pending_prefill: Optional[tuple[Tensor, int]] = None  # (slot positions, prompt tokens)
        self.unattended = False  # eagerly: handed a step that no "cp_compile" attention has read yet
        self.shares_keys = False  # later layers attend to what this layer's update returns (Gemma 3n's "store")
        # a window that one process applies while decoding alone (``Family.window_at_decoding_only``): the layer keeps
        # every token, and the prompt's last token, which one process runs in its prefill, attends to every one
        self.decoding_window: Optional[int] = None
        self.prompt_tail = False

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self._allocate(key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs: Optional[dict] = None, **_):
        if kwargs is None:
            handed: dict = {}
            keys, values = self.update(key_states, value_states, kwargs=handed)
            hand_over(keys, handed[CACHE_STEP])
            return keys, values
        step = self.store(key_states, value_states)
        if step is None:  # a sharded prefill
            kwargs[CACHE_STEP] = (self, None)
            if not torch.compiler.is_compiling():
                self.unattended = True
            return key_states, value_states
        kwargs[CACHE_STEP] = (self, step)
        if self.shares_keys and not torch.compiler.is_compiling():
            share_step(self, step.keys, step)
        if not torch.compiler.is_compiling():
            self.unattended = True
        return step.keys, step.values

    def store(self, key_states: Tensor, value_states: Tensor) -> Optional[Step]:
        """Keeps the call's K/V: in a sharded prefill this rank's shard of the prompt (None returned), otherwise tokens
        every rank holds, of which this rank keeps its turns (the ``Step`` their attention reads). For attention that
        reads the cache itself (``update`` hands the step to the attention function)."""
        if not torch.compiler.is_compiling() and active_plan() is None:
            raise UnsupportedAttention(
                "ShardedCache is used outside `with plan:`: attention would see this rank's "
                "share of the cache alone; run the model inside the plan"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending_prefill is None:
            return self.append(key_states, value_states)
        positions, tokens = self.pending_prefill
        self.pending_prefill = None
        self.prefill(key_states, value_states, positions, tokens)
        return None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self):
        return self.seen if torch.compiler.is_compiling() else self.stored()

    def get_max_length(self) -> int:
        return self.max_tokens

    def reset(self) -> None:
        super().reset()
        self.pending_prefill = None
        self.positions.fill_(EMPTY_POSITION)
        for counter in (self.seen, self._append_start, self._append_slot):
            counter.zero_()
        self.host_seen = 0
        self.host_append = (0, 0)

    crop = _unsupported("cropping (assisted decoding, rolling back tokens)")
    reorder_cache = _unsupported("reordering (beam search)")
    batch_repeat_interleave = _unsupported("repeating the batch (num_return_sequences > 1, beam search)")
    batch_select_indices = _unsupported("selecting batch rows")


def runs_mixers_under_cp(config) -> bool:
    """Whether ``cp_compile.hf`` runs the token mixers of ``config``'s model under CP (its family's record)."""
    return family_of(config).mixes_outside_attention


def runs_indexers_under_cp(config) -> bool:
    """Whether ``config``'s model has its sparse-attention indexers run under CP by ``cp_compile.hf``."""
    return family_of(config).indexer is not None


def _pending(layer) -> bool:
    unseen = getattr(layer, "pending_conv", None) is not None and not layer.prefilled_states
    return getattr(layer, "pending_prefill", None) is not None or unseen


class ReplicatedLinearLayer(LinearAttentionLayer):
    """The convolution and recurrent states of a hybrid model's linear-attention, Mamba or convolution layer:
    whole, the same on every rank (they are as large whatever the sequence length).

    In a sharded prefill the scan wrappers of ``cp_compile.hf`` hand back the whole final state, and the
    convolution's state (the prompt's last k inputs) is gathered here from the ranks that hold them; the
    convolution itself gets its halo from the CP path, so the shard passes through unchanged. Decoding then
    runs every rank's copy of the layer on the same token."""

    def __init__(self, plan: ContextParallel, number_of_states: int = 1):
        LinearAttentionLayer.__init__(self, number_of_states)
        self.plan = plan
        self.pending_conv: Optional[int] = None  # prompt tokens of a sharded prefill
        self.prefilled_states: set[int] = set()  # the convolution states the sharded prefill has given so far
        # the states handed in now are the whole prompt's: a module over the gathered sequence computes them
        self.states_whole = False
        self.unattended = False

    def update_conv_state(self, conv_states: Tensor, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        if self.pending_conv is None or state_idx in self.prefilled_states:
            return super().update_conv_state(conv_states, state_idx, conv_kernel_size, **kwargs)
        self.prefilled_states.add(state_idx)
        if self.states_whole:
            return super().update_conv_state(conv_states, state_idx, conv_kernel_size, **kwargs)
        if not self.is_conv_states_initialized[state_idx]:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size)
        prompt = torch.tensor([0, self.pending_conv])
        sharding = Sharding(self.plan.group_name, self.plan.world_size, self.plan.load_balance, prompt)
        self.conv_states[state_idx].copy_(
            sequence_tail(conv_states, conv_states.dim() - 1, self.conv_kernel_size[state_idx], sharding)
        )
        self.has_previous_state[state_idx] = True
        return conv_states

    def given_whole(self) -> None:
        """In a sharded prefill, the layer's states were given whole, the prompt's (a module's own recurrence, over the
        gathered sequence or by state passing), and it keeps no convolution tail to gather."""
        self.pending_conv = None

    @property
    def nbytes(self) -> int:
        states = [*self.conv_states.values(), *self.recurrent_states.values()]
        return sum(t.numel() * t.element_size() for t in states if t is not None)


class HybridLayer(ReplicatedLinearLayer):
    """Linear states beside an attention layer's K/V (``kv_layer``, the next base class): the two kinds of update
    initialise and reset their own halves."""

    kv_layer: type

    def lazy_initialization(self, *args, **kwargs) -> None:
        if args:  # the attention's update(key, value)
            self.kv_layer.lazy_initialization(self, *args)
        else:  # update_conv_state / update_recurrent_state, by keyword
            ReplicatedLinearLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        ReplicatedLinearLayer.reset(self)
        self.kv_layer.reset(self)


class ShardedHybridLayer(HybridLayer, ShardedLayer):
    """A layer with attention and a linear mixer side by side (Falcon-H1, Zamba2's hybrid layers): this rank's
    share of the K/V and every rank's copy of the linear states."""

    kv_layer = ShardedLayer

    def __init__(self, plan: ContextParallel, max_tokens: int, window: Optional[int] = None, number_of_states: int = 1):
        ShardedLayer.__init__(self, plan, max_tokens, window)
        ReplicatedLinearLayer.__init__(self, plan, number_of_states)


class ShardedIndexedLayer(ShardedLayer):
    """An indexed sparse-attention layer (DSA): this rank's share of the K/V, and the indexer's keys of the whole
    sequence on every rank (one head of ``index_head_dim`` per token, a fraction of the K/V): the indexer of a
    decoded token scores every earlier token as one process does, and each rank reads its share of what it chose.
    In a sharded prefill the indexer is handed every rank's keys of the prompt (``hf.indexed``) and stores them.

    The index keys sit in a buffer of ``max_tokens`` rows allocated once, as the K/V slots are, and the indexer scores
    every row of it, those not yet written masked as later tokens (``hf.indexed``), as it scores the rows of
    transformers' ``StaticCache``: its top k then break ties as one process's with a static cache of the same length
    do (the ReLU of DSA's scores leaves exact zeros, and ``topk`` breaks ties by the row's length), eagerly and
    compiled alike.
    """

    def __init__(self, plan: ContextParallel, max_tokens: int):
        super().__init__(plan, max_tokens)
        self.index_keys: Optional[Tensor] = None  # [B, max_tokens, D]
        self.indexed_count = torch.zeros((), dtype=torch.int64)  # rows of ``index_keys`` written
        self.host_indexed: Optional[int] = 0  # the same as a Python int; None after a compiled step

    def update_indexer(self, keys: Tensor) -> Tensor:
        """Stores ``keys [B, n, D]`` after those held; returns every row of the buffer."""
        if self.index_keys is None:
            self.index_keys = keys.new_zeros(keys.shape[0], self.max_tokens, keys.shape[2])
            self.indexed_count = self.indexed_count.to(keys.device)
            if not torch.compiler.is_compiling():
                for t in (self.index_keys, self.indexed_count):
                    torch._dynamo.mark_static_address(t)
        count = keys.shape[1]
        held = None if torch.compiler.is_compiling() else self.indexed() + count  # a compiled step keeps no int
        if held is not None and held > self.max_tokens:
            raise ValueError(f"the indexer's keys of {held} tokens do not fit a cache of {self.max_tokens} tokens")
        rows = self.indexed_count + torch.arange(count, device=keys.device)
        self.index_keys.index_copy_(1, rows, keys.to(self.index_keys.dtype))
        self.indexed_count.add_(count)
        self.host_indexed = held
        return self.index_keys

    def indexed(self) -> int:
        """Tokens whose index keys the layer holds (a device read only after a compiled step)."""
        if self.host_indexed is None:
            self.host_indexed = int(self.indexed_count)
        return self.host_indexed

    @property
    def nbytes(self) -> int:
        keys = 0 if self.index_keys is None else self.index_keys.nbytes
        return super().nbytes + keys

    def reset(self) -> None:
        super().reset()
        self.indexed_count.zero_()
        self.host_indexed = 0


_LINEAR = ("linear_attention", "conv")
_HYBRID = ("hybrid", "hybrid_sliding")  # attention (full, or within a window) beside a linear mixer
_ATTENTION = ("full_attention", "sliding_attention", "chunked_attention")


class ShardedCache(Cache):
    """A KV cache for a model with ``attn_implementation="cp_compile"``, sharded over ``plan``'s ranks.

    ``max_cache_len`` is the longest sequence (prompt and generated tokens) it holds; each rank
    preallocates about ``max_cache_len / C`` slots per layer. ``plan`` defaults to the active plan.
    """

    # a subclass whose layers are every rank's whole (``hf.family_caches.WholeKVCache``) takes the model's own cache
    # class for a layer type of its own
    keeps_whole_layers = False

    def __init__(self, config, max_cache_len: int, plan: Optional[ContextParallel] = None):
        plan = plan if plan is not None else active_plan()
        if plan is None:
            raise ValueError("ShardedCache needs a plan: pass plan= or construct it inside `with plan:`")
        text = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        layers: list = []
        linear_ok = runs_mixers_under_cp(config)
        # Gemma 3n: a "reuse" layer attends to the K/V of the last "store" layer of its type and keeps none
        # (transformers makes it a dummy layer); the store layer hands its decoding steps on with the keys it returns
        sharing = getattr(config.get_text_config(decoder=True), "kv_sharing_modes", None) or [None] * len(layer_types)
        for index, (layer_type, extra) in enumerate(zip(layer_types, layer_kwargs)):
            if layer_type in (*_LINEAR, *_HYBRID) and not linear_ok:
                raise UnsupportedAttention(
                    f"ShardedCache: layer {index} is {layer_type!r}, and cp_compile.hf does not run this family's "
                    "convolutions and scans under CP"
                )
            states = extra.get("number_of_states", 1)
            if layer_type in _LINEAR:
                layers.append(ReplicatedLinearLayer(plan, states))
                continue
            if layer_type == "dummy" and (linear_ok or sharing[index] == "reuse"):
                layers.append(DummyLayer())  # a hybrid's MLP or MoE layer, a layer reusing another's K/V: nothing kept
                continue
            if layer_type == "indexed_attention" and (runs_indexers_under_cp(config) or linear_ok):
                layers.append(ShardedIndexedLayer(plan, max_cache_len))
                continue
            if layer_type not in (*_ATTENTION, *_HYBRID) and self.keeps_whole_layers:
                own = DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)
                if own is not None:  # registered by the model's own cache class (DeepSeek V4's compressed layers)
                    layers.append(own(**extra))
                    continue
            if layer_type not in (*_ATTENTION, *_HYBRID):
                raise UnsupportedAttention(
                    f"ShardedCache: layer {index} is {layer_type!r}; only full, sliding-window and chunked "
                    "attention layers, and the linear-attention, convolution, hybrid and indexed sparse-attention "
                    "layers of the families cp_compile.hf runs under CP, can be kept"
                )
            # a chunked layer keeps every token: which keys its queries see is decided at attention time
            window = extra.get("sliding_window") if layer_type in ("sliding_attention", "hybrid_sliding") else None
            decoding_window = None
            if window is not None and family_of(config).window_at_decoding_only:
                window, decoding_window = None, window
            layers.append(
                ShardedHybridLayer(plan, max_cache_len, window, states)
                if layer_type in _HYBRID
                else ShardedLayer(plan, max_cache_len, window)
            )
            layers[-1].decoding_window = decoding_window
            layers[-1].shares_keys = sharing[index] == "store"
        # whether the ranks decode the same tokens rides on the first layer's gather (inference.cache.Agreement)
        self.agreement = Agreement(plan.group_name, plan.world_size)
        for index, layer in enumerate(layers):
            layer.agreement, layer.index = self.agreement, index
        Cache.__init__(self, layers=layers)  # not the next class in a subclass's order (a family's own cache class)
        # what it was made for: its layers report none where the first is a layer of states (Mamba2, Falcon-H1)
        self.plan, self.max_cache_len = plan, max_cache_len

    def reset(self) -> None:
        super().reset()
        self.agreement.reset()

    def check_attended(self) -> None:
        """Raises ``LocalAttentionError`` when a layer handed this rank's share of its cache to attention other
        than ``"cp_compile"`` (a model with attention code of its own) in the eager steps since the last call:
        that attention saw one rank's share alone. Where the guard of ``with plan:`` is set aside (decoding in
        ``cp_compile.hf.generate``), this is the check that takes its place."""
        missed = [i for i, layer in enumerate(self.layers) if getattr(layer, "unattended", False)]
        drop_handed_step()
        if missed:
            raise LocalAttentionError(
                f"layers {missed} of the ShardedCache handed their keys and values to attention that is not "
                f'attn_implementation="cp_compile" (attention code of the model\'s own?): it attended to this '
                "rank's share of the cache alone"
            )

    def holds_tokens(self) -> bool:
        """Whether the cache holds earlier tokens (a cache of linear layers alone has no length to ask)."""
        if all(self.is_linear):
            return any(any(layer.has_previous_state.values()) for layer in self.layers)
        return self.get_seq_length() > 0

    def update_indexer(self, keys: Tensor, layer_idx: int) -> Tensor:
        """A sparse-attention indexer's keys (``[B, n, D]``) of layer ``layer_idx``, stored; returns all it holds."""
        return self.layers[layer_idx].update_indexer(keys)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values this rank holds, over all layers."""
        return sum(getattr(layer, "nbytes", 0) for layer in self.layers)

    @contextlib.contextmanager
    def sharded_prefill(self, positions: Tensor, tokens: int):
        """Inside, the model's next forward is this rank's shard of a ``tokens``-token prompt whose slots
        sit at ``positions`` (``EMPTY_POSITION`` for padding): each layer keeps those K/V."""
        for layer in self.layers:
            if isinstance(layer, ShardedLayer):
                layer.pending_prefill = (positions, tokens)
            if isinstance(layer, ReplicatedLinearLayer):
                layer.pending_conv = tokens
        try:
            yield self
            for layer in self.layers:
                if isinstance(layer, ShardedLayer):
                    layer.prompt_tail = layer.decoding_window is not None
        finally:
            missed = [i for i, layer in enumerate(self.layers) if _pending(layer)]
            for layer in self.layers:
                if isinstance(layer, ReplicatedLinearLayer):
                    layer.pending_conv = None
                    layer.prefilled_states.clear()
            for i in missed:
                self.layers[i].pending_prefill = None
        if missed:
            raise UnsupportedAttention(
                f"the sharded prefill did not reach layers {missed} of the ShardedCache: the model keeps no "
                "transformers cache there (a state of its own, or none), and generation under CP decodes from it"
            )
