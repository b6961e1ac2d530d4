"""transformers' token mixers that are not attention, under a plan: short convolutions, Gated DeltaNet / KDA,
Mamba2.

transformers' hybrid models mix tokens outside attention through module-level functions of their modeling
files, looked up by name at every call (the names its kernel hub swaps for fused kernels):
``causal_conv1d_fn`` (every family here), ``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5, OLMo
hybrid, ...), ``chunk_kimi_delta_attention`` (Kimi Linear), ``mamba2_chunk_scan`` (Nemotron-H, Bamba,
Granite 4 hybrid, Zamba2, Falcon-H1, Mamba2), ``mamba_selective_scan`` (Jamba, Mamba, FalconMamba) and the
fused ``mamba2_split_conv1d_scan_combined`` and ``mamba_inner_fn``.

When a plan is entered, each such function of a covered family's modeling module (``FAMILIES``, those
already imported) is wrapped once: outside every plan the wrapper calls the function it wraps, unchanged;
inside a plan it runs it under CP (``cp_compile.mixers``), calling the wrapped function itself (fused kernel
or torch body) on exchanged tensors:

- the convolution over this rank's chunks with the halo of the tokens before each one;
- a scan over the whole sequence for this rank's head groups (all-to-all to heads and back), or state passing
  (each chunk from a zero state, one fp32 summary per chunk exchanged), as ``plan.scan_route`` says or the
  cost model picks (``cost.mixers``);
- a selective scan (Mamba1) over the whole sequence for this rank's channels (all-to-all to channels, B and C
  to every rank, and back);
- the fused Mamba paths return None, as their torch bodies do, so the mixer takes its unfused steps above.

A model of a covered family declares these layers in ``config.layer_types`` (``linear_attention``,
``conv``, ``hybrid``), which the attention's mask function accepts for it alone
(``inference.hf_cache.runs_mixers_under_cp``). Any other
family's such layers stay refused by name; a mixer that escapes the wrappers (a function swapped after the
plan wrapped it) and runs its torch body meets the plan's guard on ``torch.conv1d``.

Packed documents: the tokens are exchanged in the layout the plan sharded them with (``cu_seq_lens_q`` or
``with plan.packed(cu)``; a model whose shard was packed and whose mixers got neither is refused when it returns,
``hf.forward``), and the mixers restart at documents exactly where the
one-process call does: a gated delta rule given ``cu_seqlens`` and a convolution or Mamba2 scan given
``seq_idx`` (what TRL's padding-free collator passes) restart there, as the fused kernels do (transformers'
torch bodies refuse them); without, they read across the boundary, as one process does.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..active import active_plan
from ..cost.mixers import ScanShape, choose_route
from ..cost.model import default_machine
from ..errors import UnsupportedAttention
from ..guard import set_aside
from ..inference.hf_cache import INDEXED_MODULES, WRAPPED_MODULES
from ..layout.runs import chunk_count
from ..mixers import Sharding
from ..mixers.conv import causal_conv1d
from ..mixers.scan import gated_delta_rule, mamba2_scan, selective_scan
from ..plan import ContextParallel
from .forward import count_call, ran_batch

FAMILIES = (
    "bailing_hybrid",
    "bamba",
    "falcon_h1",
    "falcon_mamba",
    "granitemoehybrid",
    "inkling",
    "inkling2",
    "inkling2_loop",
    "jamba",
    "kimi_linear",
    "lara_mini",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "mamba",
    "mamba2",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "qwen4_exp",
    "zamba",
    "zamba2",
)
# layer types whose mixers run under CP for the families above (Qwen4-exp's indexed attention: over the gathered
# sequence)
MIXER_LAYER_TYPES = (
    "linear_attention",
    "conv",
    "hybrid",
    "hybrid_sliding",
    "indexed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
# the modeling modules whose mixer functions are wrapped under a plan
WRAPPED_FAMILIES = frozenset(f"transformers.models.{name}.modeling_{name}" for name in FAMILIES)


class ShardedInside(NamedTuple):
    """A module inside a gathered one that runs over this rank's share of a sequence of its own, by the attention
    schedules: BLT's global transformer over the patches its model cuts the gathered bytes into. Its ``sequence``
    arguments (that sequence whole, the same on every rank) are cut to this rank's rows in the plan's layout, padded
    at the end to the layout's multiple (the module is causal: no row sees the padding after it), its ``positions``
    argument is given those rows' places and its ``mask`` the causal spec; its output is gathered back whole."""

    sequence: tuple[str, ...]
    positions: str
    mask: str


class GatheredModule(NamedTuple):
    """How a module with mixing code of its own is called: its arguments that hold one row per token (gathered; a
    tuple of such tensors, as RoPE's (cos, sin), each), those it takes but does not read (passed as None), and the
    places of its outputs that hold one row per token (this rank's rows kept); every one of those tensors has the
    tokens along dim ``dim`` (1, or 0 for a time-major model: XLNet). ``mask``: the argument holding the attention
    mask, which the module reads as a tensor (adds to its scores): given the mask one process builds for the whole
    sequence, additive (0 where a key is visible, the dtype's minimum elsewhere, ``[B, 1, T, T]``)."""

    sequence: tuple[str, ...]
    unread: tuple[str, ...] = ()
    outputs: tuple[int, ...] = (0,)
    mask: Optional[str] = None
    # arguments the model built from the shard's own positions (BLOOM's ALiBi bias), built again for the gathered
    # sequence (and for a decoding step's keys) by the family's builder: (name, f(module, model, hidden, keys))
    rebuilt: tuple[tuple[str, Callable], ...] = ()
    dim: int = 1
    # the config's field that says how many rows the model puts before every call's tokens (CPM-Ant's prompt): the
    # same on every rank, not gathered; the module sees them once, before the whole sequence
    prefix: Optional[str] = None
    # whether a row sees only the rows before it: False for CPM-Ant, whose every row sees the whole call
    causal: bool = True
    # whether it attends over K/V it stores in the cache itself (every rank keeps them whole); so does every module
    # given a mask
    whole_kv: bool = False
    # masks the model built per pair of the shard's tokens, 1 where a key is hidden: under a plan they must hide
    # none (no padding, no causal or permutation order), and the module is given None (the same scores exactly)
    hiding_nothing: tuple[str, ...] = ()
    # arguments a plan cannot give the module, with what the user passed to get them: refused by name when not None
    refused: tuple[tuple[str, str], ...] = ()
    # modules inside it, by class name, that run over this rank's share of a sequence of their own (``ShardedInside``)
    sharded_inside: tuple[tuple[str, ShardedInside], ...] = ()


def _bloom_alibi(module, model, hidden: Tensor, keys: int) -> Tensor:
    """BLOOM's ALiBi bias over ``keys`` tokens, as its model builds it for a sequence without padding (``hidden``:
    the module's hidden states, for the batch, dtype and device)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    ones = torch.ones(hidden.shape[0], keys, dtype=torch.long, device=hidden.device)
    return build_alibi_tensor(ones, module.num_heads, hidden.dtype)


def _inkling2_distance(module, model, hidden: Tensor, keys: int) -> Tensor:
    """Inkling 2's distance from each of ``hidden``'s queries, the last of ``keys`` tokens, to each key."""
    places = torch.arange(keys, device=hidden.device)
    return places[keys - hidden.shape[1] :, None] - places[None, :]


def _xlnet_relative_positions(module, model, hidden: Tensor, keys: int) -> Tensor:
    """XLNet's sinusoids of every relative position among ``keys`` tokens, as its model builds them for a call of
    that length (``hidden``: time-major, for the batch and device), its dropout after."""
    positions = model.base_model.relative_positional_encoding(keys, keys, hidden.shape[1], hidden.device)
    return F.dropout(positions, model.config.dropout, module.training)


def _cpmant_position_bias(module, model, hidden: Tensor, keys: int) -> Tensor:
    """CPM-Ant's bias over ``keys`` rows (its prompt, then tokens none of which is 0: the padding-free call its mask
    lets through), from its model's own position embedding module: segment 0 for the prompt, 2 for the tokens."""
    prompt = model.config.prompt_length
    places = torch.arange(keys, dtype=torch.int32, device=hidden.device).repeat(hidden.shape[0], 1)
    segments = torch.full_like(places, 2)
    segments[:, :prompt] = 0
    return model.base_model.position_bias(places, places, segments, segments)


def _cpmant_everything_visible(module, model, hidden: Tensor, keys: int) -> Tensor:
    """CPM-Ant's mask of a call without padding: every row sees every row (its attention is bidirectional)."""
    return torch.ones(hidden.shape[0], keys, keys, dtype=torch.bool, device=hidden.device)


def _inkling2(prefix: str) -> dict:
    # the key and value projections' inputs are the layer's own (full attention) or the queries' (sliding: None);
    # position_ids set the queries' log scaling
    call = GatheredModule(
        ("hidden_states", "key_hidden_states", "value_hidden_states", "position_ids"),
        mask="attention_mask",
        rebuilt=(("relative_distance", _inkling2_distance),),
    )
    return {f"{prefix}SlidingAttention": call, f"{prefix}FullAttention": call}


# families whose token mixers are modules with code of their own, no function to wrap: their modules run over the
# gathered sequence (``hf.gathered``), by class name
GATHERED_MIXERS = {
    "minimax": {"MiniMaxLightningAttention": GatheredModule(("hidden_states",), ("position_embeddings",))},
    # its RG-LRU restarts where position_ids are 0: they are gathered with the tokens
    "recurrent_gemma": {"RecurrentGemmaRecurrentBlock": GatheredModule(("input_states", "position_ids"))},
    # time mixing (its WKV recurrence) and channel mixing (a shift by one token)
    "rwkv": {"RwkvSelfAttention": GatheredModule(("hidden",)), "RwkvFeedForward": GatheredModule(("hidden",))},
    # attention with a relative-position bias and log scaling from positions counted within its call: the whole
    # module over the gathered sequence, its attention call as one process's (its short convolutions by the halo)
    "inkling": {"InklingAttention": GatheredModule(("hidden_states",), mask="attention_mask")},
    "inkling2": _inkling2("Inkling2"),
    "inkling2_loop": _inkling2("Inkling2Loop"),
    # a dynamic mask: the mask tensor plus a bias per key from the values, cut to each head's top keys
    "doge": {"DogeAttention": GatheredModule(("hidden_states", "position_embeddings"), mask="attention_mask")},
    # its attention reads the mask tensor in a sparse indexer of its own (blocks of pooled keys, a loop per query),
    # and its n-gram embedding layers read earlier tokens' ids (segments by EOS) and a dilated convolution of its own
    "qwen4_exp": {
        "Qwen4ExpTextAttention": GatheredModule(("hidden_states", "position_embeddings"), mask="attention_mask"),
        "Qwen4ExpTextPLELayer": GatheredModule(("hidden_states", "input_ids")),
    },
    # compressed attention: blocks of the sequence compressed into extra keys (and scored by an indexer), with a bias
    # from its own mask over them
    "deepseek_v4": {
        "DeepseekV4Attention": GatheredModule(
            ("hidden_states", "position_embeddings", "position_ids"), mask="attention_mask"
        )
    },
    "openai": {"Attention": GatheredModule(("x",))},  # attention of its own: scores by matmul under a causal buffer
    "xlstm": {"xLSTMLayer": GatheredModule(("x",))},  # the mLSTM cell's chunked recurrence
    # bidirectional attention of its own after a prompt its model puts before every call's tokens, with a bias from
    # positions counted within the call
    "cpmant": {
        "CpmAntSelfAttentionBlock": GatheredModule(
            ("hidden_states",),
            prefix="prompt_length",
            causal=False,
            whole_kv=True,
            rebuilt=(("attention_mask", _cpmant_everything_visible), ("position_bias", _cpmant_position_bias)),
        )
    },
    # chunked local and LSH attention of its own (buckets hashed over the whole sequence, kept whole for the
    # reversible layers' recompute), and axial position embeddings that tile the whole sequence's length in training
    "reformer": {
        "ReformerAttention": GatheredModule(("hidden_states",)),
        "AxialPositionEmbeddings": GatheredModule(("position_ids",)),
    },
    # bytes cut into patches where a small model's entropy crosses a threshold, pooled into them and cross-attended
    # by them, a global transformer over the patches, the bytes cross-attending back: masks built from the whole call's
    # patch boundaries. The model runs over the gathered bytes; its global transformer over this rank's patches
    "blt": {
        "BltModel": GatheredModule(
            ("input_ids", "inputs_embeds", "position_ids"),
            refused=(("patch_lengths", "patch lengths (patch_lengths)"),),
            sharded_inside=(
                ("BltGlobalTransformer", ShardedInside(("inputs_embeds",), "position_ids", "attention_mask")),
            ),
        )
    },
    # relative attention of its own, time-major; its model builds the relative positions from the call's length
    "xlnet": {
        "XLNetRelativeAttention": GatheredModule(
            ("h",),
            dim=0,
            rebuilt=(("r", _xlnet_relative_positions),),
            hiding_nothing=("attn_mask_h", "attn_mask_g"),
            refused=(
                ("g", "a query stream (perm_mask and target_mapping: the permutation objective)"),
                ("seg_mat", "segments (token_type_ids)"),
                ("mems", "memories of earlier segments (mems)"),
            ),
        )
    },
    # attention of their own, scores by matmul plus the mask tensor (MPT: its ALiBi bias, built for its longest
    # sequence, cut to the whole sequence's length)
    "xglm": {"XGLMAttention": GatheredModule(("hidden_states",), mask="attention_mask")},
    "mpt": {"MptAttention": GatheredModule(("hidden_states",), mask="attention_mask")},
    "bloom": {
        "BloomAttention": GatheredModule(
            ("hidden_states", "residual"), mask="attention_mask", rebuilt=(("alibi", _bloom_alibi),)
        )
    },
    "gpt_neox_japanese": {
        "GPTNeoXJapaneseAttention": GatheredModule(
            ("hidden_states", "position_ids", "position_embeddings"), mask="attention_mask"
        )
    },
    # queries and keys by a convolution of its own, values half from the token before: the projection is gathered,
    # the attention after it runs by the schedules
    "zaya": {"ZayaCCAProjection": GatheredModule(("hidden_states",), outputs=(0, 1, 2))},
}
GATHERED_MODULES = {f"transformers.models.{name}.modeling_{name}": classes for name, classes in GATHERED_MIXERS.items()}
# families whose generation every rank runs whole, as one process runs it (C times its compute, nothing sharded), with
# why no finer route runs it
GENERATED_WHOLE = {
    f"transformers.models.{name}.modeling_{name}": why
    for name, why in {
        "reformer": "Reformer pads every call to a multiple of its chunk length while generating, and the padding "
        "moves its LSH buckets' chunk boundaries: a shard would be padded in the middle of the sequence",
        "xlnet": "each XLNet step passes a permutation mask over every pair of the step's tokens and a query stream "
        "for the one token it predicts, which its model builds for its own whole call",
    }.items()
}
# modules that call the attention function over something other than the sequence (Inkling 2's attention of each
# token over its own residual blocks): it runs on each rank's tokens as on one process
ATTENTION_WITHIN_TOKENS = {
    "Inkling2BlockAttentionResidual",
    "Inkling2LoopBlockAttentionResidual",
    "Inkling2LoopMessageAttentionResidual",
}
# nothing to wrap: their modules take the hooks at their model's first call under a plan, whenever it was imported
WRAPPED_MODULES.update(GATHERED_MODULES)


class _Steps:
    """What the mixers' steps run over now; an instance's attributes, not a class's, since torch 2.11's Dynamo
    cannot trace setting a class attribute."""

    def __init__(self):
        self.on_every_rank = False
        # a module runs over the gathered sequence: the attention it calls runs as on one process
        self.in_gathered_module = False


_STEPS = _Steps()


def _plan_of_shards() -> Optional[ContextParallel]:
    """The active plan while the mixers are given this rank's shard of a sequence: none outside every plan, and
    none while every rank runs the same tokens (``same_tokens_on_every_rank``)."""
    return None if _STEPS.on_every_rank else active_plan()


@contextlib.contextmanager
def over_the_gathered_sequence(gathered: bool = True):
    """While a module runs over the gathered sequence (``hf.gathered``), every rank holds the same tokens: the
    mixers and the attention it calls run as on one process. ``gathered=False``: while a module inside such a module
    runs over this rank's share of a sequence of its own (``ShardedInside``), the attention it calls runs by the
    schedules again."""
    before = _STEPS.on_every_rank, _STEPS.in_gathered_module
    _STEPS.on_every_rank = _STEPS.in_gathered_module = gathered
    try:
        yield
    finally:
        _STEPS.on_every_rank, _STEPS.in_gathered_module = before


def in_gathered_module() -> bool:
    """Whether a module runs over the gathered sequence now: the masks its model code builds are one process's."""
    return _STEPS.in_gathered_module


def attention_as_one_process(module) -> bool:
    """Whether ``module``'s attention call runs as on one process under a plan: called by a module that runs over
    the gathered sequence, or over something other than the sequence."""
    return _STEPS.in_gathered_module or type(module).__name__ in ATTENTION_WITHIN_TOKENS


@contextlib.contextmanager
def same_tokens_on_every_rank(same: bool = True):
    """The steps of ``model.generate`` after a sharded prefill: every rank feeds the model the same tokens and
    holds the whole conv and recurrent state, so a mixer that runs over several tokens (a prompt of one token, a
    follow-up prompt) runs as one process runs it. ``same=False``: a step among them that runs on the shards (a
    prompt prefilled by ``generate()``'s own first call)."""
    before, _STEPS.on_every_rank = _STEPS.on_every_rank, same
    try:
        yield
    finally:
        _STEPS.on_every_rank = before


def _sharding(plan: ContextParallel, cu_seqlens) -> Sharding:
    documents = cu_seqlens if cu_seqlens is not None else plan.documents
    ran_batch(documents)
    return Sharding(plan.group_name, plan.world_size, plan.load_balance, documents)


def _restarts_at_documents(name: str, kwargs: dict, sharding: Sharding) -> bool:
    """Whether the model asks ``name`` to restart at documents (``seq_idx``, which a fused kernel reads and the
    torch body refuses); the documents are then the batch's global ones, which the ranks need to know."""
    if kwargs.get("seq_idx") is None:
        return False
    if sharding.cu_seqlens is None:
        raise UnsupportedAttention(
            f"{name} under context parallelism with seq_idx but no documents: call the model inside "
            "`with plan.packed(cu):` so that every rank knows where the documents start"
        )
    return True


def _conv(original):
    @functools.wraps(original)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        plan = _plan_of_shards()
        if plan is None:
            return original(hidden_states, weight, bias, activation, **kwargs)
        sharding = _sharding(plan, kwargs.get("cu_seq_lens_q"))
        # restarting at documents, the halo holds zeros before each document's first token: the convolution of
        # the extended shard needs no seq_idx of its own (each chunk of the shard lies within one document)
        reset = _restarts_at_documents("causal_conv1d_fn", kwargs, sharding)
        count_call(convs=1)
        with set_aside():  # the torch body's conv1d runs on the extended shard, on purpose
            return causal_conv1d(hidden_states, weight, bias, activation, sharding, conv=original, reset=reset)

    return conv


def _route(plan: ContextParallel, shape: ScanShape, device) -> str:
    """The plan's scan route, or the one the cost model picks (the same on every rank: shapes, C and the plan's
    machine)."""
    if plan.scan_route != "auto":
        return plan.scan_route
    machine = plan.machine if plan.machine is not None else default_machine(device.type)
    return choose_route(shape, machine)[0].route


def _delta_rule(original):
    @functools.wraps(original)
    def delta_rule(query, key, value, g, beta, *args, **kwargs):
        plan = _plan_of_shards()
        if plan is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if args:
            kwargs["chunk_size"], *args = args
        if args:
            raise TypeError("pass the gated delta rule's options after chunk_size by name")
        count_call(scans=1)
        # fla's kernels restart at cu_seqlens alone; seq_idx, which some families pass on, is not theirs to read
        kwargs.pop("seq_idx", None)
        sharding = _sharding(plan, kwargs.get("cu_seqlens"))
        b, local_len, hk, dk = key.shape
        hv, dv = value.shape[-2:]
        chunks = chunk_count(sharding.layout, plan.world_size, sharding.cu_seqlens)
        shape = ScanShape.delta_rule(
            b, local_len, plan.world_size, chunks, hk, dk, hv, dv, g[0, 0].numel(), value.element_size()
        )
        route = _route(plan, shape, value.device)
        return gated_delta_rule(original, query, key, value, g, beta, sharding, route=route, **kwargs)

    return delta_rule


def _mamba2(original):
    @functools.wraps(original)
    def scan(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs):
        plan = _plan_of_shards()
        if plan is None:
            return original(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs)
        if args:
            raise TypeError("pass mamba2_chunk_scan's options after chunk_size by name")
        count_call(scans=1)
        sharding = _sharding(plan, kwargs.get("cu_seq_lens_q"))
        _restarts_at_documents("mamba2_chunk_scan", kwargs, sharding)
        b, local_len, heads, p = hidden_states.shape
        groups, n = B.shape[2], B.shape[3]
        chunks = chunk_count(sharding.layout, plan.world_size, sharding.cu_seqlens)
        shape = ScanShape.mamba2(
            b, local_len, plan.world_size, chunks, heads, p, groups, n, hidden_states.element_size()
        )
        route = _route(plan, shape, hidden_states.device)
        return mamba2_scan(original, hidden_states, dt, A, B, C, chunk_size, sharding, route=route, **kwargs)

    return scan


def _selective(original):
    @functools.wraps(original)
    def scan(hidden_states, dt, A, B, C, *args, **kwargs):
        plan = _plan_of_shards()
        if plan is None:
            return original(hidden_states, dt, A, B, C, *args, **kwargs)
        if args:
            raise TypeError("pass the selective scan's options after C by name")
        count_call(scans=1)
        sharding = _sharding(plan, kwargs.get("cu_seq_lens_q"))
        return selective_scan(original, hidden_states, dt, A, B, C, sharding, **kwargs)

    return scan


def _unfused(original):
    @functools.wraps(original)
    def fused(*args, **kwargs):
        return None if _plan_of_shards() is not None else original(*args, **kwargs)

    return fused


_WRAPPERS = {
    "causal_conv1d_fn": _conv,
    "torch_chunk_gated_delta_rule": _delta_rule,
    "chunk_kimi_delta_attention": _delta_rule,
    "mamba2_chunk_scan": _mamba2,
    "mamba2_split_conv1d_scan_combined": _unfused,
    "mamba_selective_scan": _selective,
    "mamba_inner_fn": _unfused,
}


_FUNCTIONS_WRAPPED: set[str] = set()  # the modeling modules whose mixer functions are wrapped


def wrap_loaded_families() -> None:
    """Wraps the mixer functions of every covered modeling module imported so far (once each)."""
    for name in WRAPPED_FAMILIES - _FUNCTIONS_WRAPPED:
        module = sys.modules.get(name)
        if module is None:
            continue
        for function, wrapper in _WRAPPERS.items():
            if hasattr(module, function):
                setattr(module, function, wrapper(getattr(module, function)))
        _FUNCTIONS_WRAPPED.add(name)
        WRAPPED_MODULES.add(name)


def mixes_outside_attention(model) -> bool:
    """Whether ``model`` has token mixers that are not attention (wrapped functions or gathered modules)."""
    return type(model).__module__ in WRAPPED_FAMILIES | set(GATHERED_MODULES)


def route_of(model) -> str:
    """How ``model``'s tokens mix under a plan, for the model table: attention by the CP schedules, and each token
    mixer that is not attention by its route and what that costs."""
    module = type(model).__module__
    if module in GATHERED_MODULES:
        calls = GATHERED_MODULES[module]
        route = f"attention schedules; {', '.join(calls)} over the gathered sequence (C times its compute)"
        route += "".join(
            f", its {name} over this rank's share by the schedules"
            for call in calls.values()
            for name, _ in call.sharded_inside
        )
        if module in GENERATED_WHOLE:
            route += "; generation: the whole model on every rank (C times its compute)"
        return route
    if module in WRAPPED_FAMILIES:
        return "attention schedules; convolution halo; scans by all-to-all or state passing"
    if module in INDEXED_MODULES:
        return "sparse attention: index keys, keys and values gathered (the sequence's on every rank)"
    return "attention schedules"


@contextlib.contextmanager
def mixers_under_plans():
    """Entered with each outermost plan (``plan.while_active``): the covered families loaded by then are wrapped."""
    wrap_loaded_families()
    yield


__all__ = [
    "FAMILIES",
    "GatheredModule",
    "ShardedInside",
    "GATHERED_MIXERS",
    "GATHERED_MODULES",
    "GENERATED_WHOLE",
    "ATTENTION_WITHIN_TOKENS",
    "attention_as_one_process",
    "in_gathered_module",
    "MIXER_LAYER_TYPES",
    "WRAPPED_FAMILIES",
    "mixers_under_plans",
    "mixes_outside_attention",
    "over_the_gathered_sequence",
    "route_of",
    "same_tokens_on_every_rank",
    "wrap_loaded_families",
]
