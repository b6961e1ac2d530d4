"""One record per transformers family that needs more than attention under a plan: what mixes its tokens, by
which route, how it generates, and why.

Every other part of ``cp_compile.hf`` reads a family from here (``family_of``): the mixer wrappers (``mixers.py``),
the gathered route's hooks (``gathered.py``), the indexers' hook (``indexed.py``), the caches (``cache.py``,
``family_caches.py``), generation (``generate.py``), the trainer and the models table (``Family.route``). A family
not listed runs its attention through ``"cp_compile"`` and nothing else. Adding a family is one record here.

Families named by ``model_type``, whose modeling module is ``transformers.models.<name>.modeling_<name>``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel

from .block_indexed import qwen4_exp_attention, qwen4_exp_ple
from .compressed import deepseek_v4_attention
from .latent import mla_absorbed_attention
from .own_forwards import (
    bloom_attention,
    bloom_slopes,
    doge_attention,
    gpt_neox_japanese_attention,
    inkling2_attention,
    inkling_attention,
    minimax_lightning,
    mpt_attention,
    mpt_slopes,
    openai_attention,
    xglm_attention,
)
from .own_steps import (
    inkling2_dynamic_convolution_on_shards,
    recurrent_gemma_steps,
    rwkv_channel_mixing_on_shards,
    rwkv_time_mixing_on_shards,
    xlstm_backend_on_shards,
)

# layer types whose mixers run under CP for the families with ``wrapped`` mixers (Qwen4-exp's indexed attention: over
# the gathered sequence)
MIXER_LAYER_TYPES = (
    "linear_attention",
    "conv",
    "hybrid",
    "hybrid_sliding",
    "indexed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


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
    # arguments the model built from the shard's own positions (CPM-Ant's position bias), built again for the gathered
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
    # its forward on this rank's shard, ``f(module, sharding, **arguments)``, for a call given no cache (training, a
    # prefill without one); a call given a cache runs over the gathered sequence, whose states the cache keeps whole
    sharded: Optional[Callable] = None


class OwnAttention(NamedTuple):
    """A module whose attention is code of its own, run under a plan with its projections on this rank's shard and its
    attention through the schedules (``hf.own_attention``). ``forward(module, attend, *args, **kwargs)``: the module's
    forward around ``attend``; ``slopes(module)``: its ALiBi slopes, per head (fp32), or None; ``anchor_last``: the bias
    of a key is counted from the call's last key (MPT) rather than from position 0 (BLOOM); ``across_documents``: its
    model builds its mask without packed documents' positions, so one process attends across them. ``mixing``:
    "softmax" attention, "lightning" (MiniMax's decayed linear attention, by state passing; tokens every rank
    holds, decoding from the state its cache keeps, run the module's own forward), or "mask_rows" (a mask the module
    builds from every key, Doge's: this rank's queries over every rank's keys, gathered, with one process's rows of
    the mask; decoding, each rank scores its share of the cache, merged by log-sum-exp), or "latent" (DSA's multi-head
    latent attention absorbed, ``hf.latent``: the latent gathered and cached, not the heads' K/V)."""

    forward: Callable
    slopes: Optional[Callable] = None
    anchor_last: bool = False
    across_documents: bool = False
    mixing: str = "softmax"

    @property
    def how(self) -> str:
        """The route's words for the models table."""
        if self.mixing == "lightning":
            return "projections on the shard, lightning attention by state passing"
        if self.mixing == "latent":
            return "queries absorbed into the latent (its heads' keys and values never built)"
        if self.mixing == "mask_rows":
            return "projections on the shard, this rank's queries over every rank's K/V with its own mask or bias"
        return "projections on the shard" + (", ALiBi as one more key dimension" if self.slopes else "")


@dataclass(frozen=True)
class Family:
    """What ``cp_compile.hf`` does for one family under a plan, besides its attention through ``"cp_compile"``."""

    name: str
    # its modeling module's mixer functions (convolutions, scans) are wrapped and run under CP (``hf.mixers``)
    wrapped: bool = False
    # modules that mix tokens in code of their own, run over the gathered sequence (``hf.gathered``), by class name
    gathered: Mapping[str, GatheredModule] = field(default_factory=dict)
    why_gathered: str = ""  # what in those modules keeps them off the finer routes
    # the sparse-attention indexer's class (DSA), run under CP with every rank's index keys (``hf.indexed``)
    indexer: Optional[str] = None
    # the rotary function of its modeling module that the indexer applies, where ``hf.indexed`` scores a shard's queries
    # by blocks of rows (DeepSeek-V3.2's code of the indexer); None: the indexer's own code, every query at once
    indexer_rope: Optional[str] = None
    # HY-v4's code of it: each head's rotary half last, the keys normed in the norm's dtype, the scale on the weights
    indexer_rotary_last: bool = False
    # the cache class its model requires (``hf.family_caches``), by name; None: ``ShardedCache`` (or ``WholeKVCache``
    # where a gathered module reads its mask or keeps its K/V whole)
    cache: Optional[str] = None
    # a model that keeps its recurrent states on its modules and zeroes them only when given no cache: started anew
    # for each new cache, as its own call would (``f(model)``)
    fresh_states: Optional[Callable] = None
    # modules whose attention is their own code, by class name: projections on the shard, attention by the schedules
    own_attention: Mapping[str, OwnAttention] = field(default_factory=dict)
    # modules whose token-mixing steps (or whose forward itself), by class name, are put on the instance for a plan,
    # run on the shard there and as the model's own elsewhere (``hf.own_steps``): ``f(module, sharded, count)``
    own_steps: Mapping[str, Callable] = field(default_factory=dict)
    # the keyword under which its model takes and returns a recurrent state of its own instead of a cache (RWKV's
    # ``state`` list): generation prefills it sharded and decodes from it (``hf.generate``)
    state_kwarg: Optional[str] = None
    # why every rank generates whole, as one process does (C times its compute); None: the sharded prefill
    generated_whole: Optional[str] = None
    # why it generates under a plan without a cache alone (each step over the whole sequence, sharded); None: with one
    cache_refused: Optional[str] = None
    # its attention masks have no window while its cache layers slide (Moshi): one process attends to every token in
    # its prefill, and decodes within the window its cache keeps
    window_at_decoding_only: bool = False
    # modules that call the attention function over something other than the sequence (Inkling 2's attention of each
    # token over its own residual blocks): they run on each rank's tokens as on one process
    attention_within_tokens: frozenset[str] = frozenset()

    @property
    def module(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"

    @property
    def mixes_outside_attention(self) -> bool:
        lightning = any(own.mixing != "softmax" for own in self.own_attention.values())
        return self.wrapped or bool(self.gathered) or lightning or bool(self.own_steps)

    @property
    def keeps_whole_kv(self) -> bool:
        """Whether a gathered module attends over K/V of its own that every rank keeps whole (``WholeKVCache``)."""
        return any(call.mask is not None or call.whole_kv for call in self.gathered.values())

    @property
    def route(self) -> str:
        """How its tokens mix under a plan, for the models table."""
        if self.gathered:
            whole = [name for name, call in self.gathered.items() if call.sharded is None]
            on_shard = [name for name, call in self.gathered.items() if call.sharded is not None]
            route = "attention schedules"
            if whole:
                route += f"; {', '.join(whole)} over the gathered sequence (C times its compute)"
            if on_shard:
                route += f"; {', '.join(on_shard)} on the shard (given a cache: over the gathered sequence)"
            route += "".join(
                f", its {name} over this rank's share by the schedules"
                for call in self.gathered.values()
                for name, _ in call.sharded_inside
            )
            if self.generated_whole is not None:
                route += "; generation: the whole model on every rank (C times its compute)"
            return route
        owns = "".join(f"; {name}: {own.how}" for name, own in self.own_attention.items())
        if self.wrapped:
            return "attention schedules; convolution halo; scans by all-to-all or state passing" + owns
        if self.indexer is not None:
            gathered = "index keys and the MLA latent" if owns else "index keys, keys and values"
            return f"sparse attention: {gathered} gathered (the sequence's on every rank){owns}"
        if self.own_attention:
            return "attention schedules" + owns
        if self.own_steps:
            mixing = "token shifts and convolutions by the halo, recurrences by state passing"
            return f"attention schedules; {', '.join(self.own_steps)}: {mixing}"
        return "attention schedules"


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


def _fresh_module_states(model) -> None:
    """RecurrentGemma's model zeroes its blocks' states only when it is given no cache."""
    embeddings = model.get_input_embeddings().weight
    model.base_model._setup_cache(model.config, 1, embeddings.device, embeddings.dtype)


def _inkling2(name: str, prefix: str) -> Family:
    own = OwnAttention(inkling2_attention, mixing="mask_rows")
    within = ("BlockAttentionResidual",) + (("MessageAttentionResidual",) if prefix == "Inkling2Loop" else ())
    return Family(
        name,
        wrapped=True,
        own_attention={f"{prefix}SlidingAttention": own, f"{prefix}FullAttention": own},
        own_steps={f"{prefix}DynamicShortConvolution": inkling2_dynamic_convolution_on_shards},
        attention_within_tokens=frozenset(prefix + cls for cls in within),
        cache="ShardedCacheOfOwnAttention",
    )


_WRAPPED = (
    "bailing_hybrid bamba falcon_h1 falcon_mamba granitemoehybrid jamba kimi_linear lara_mini lfm2 lfm2_moe lfm3 mamba "
    "mamba2 nemotron_h olmo_hybrid qwen3_5 qwen3_5_moe qwen3_next zamba zamba2"
).split()

_LATENT = OwnAttention(mla_absorbed_attention, mixing="latent")
_RECORDS = (
    *(Family(name, wrapped=True) for name in _WRAPPED),
    Family(
        "inkling",
        wrapped=True,
        own_attention={"InklingAttention": OwnAttention(inkling_attention, mixing="mask_rows")},
        cache="ShardedCacheOfOwnAttention",
    ),
    _inkling2("inkling2", "Inkling2"),
    _inkling2("inkling2_loop", "Inkling2Loop"),
    Family(
        "qwen4_exp",
        wrapped=True,
        gathered={
            "Qwen4ExpTextAttention": GatheredModule(
                ("hidden_states", "position_embeddings"), mask="attention_mask", sharded=qwen4_exp_attention
            ),
            "Qwen4ExpTextPLELayer": GatheredModule(("hidden_states", "input_ids"), sharded=qwen4_exp_ple),
        },
        why_gathered="the indexer's keys and the n-gram layers' states in its cache: given a cache (a prefill), its "
        "attention and n-gram layers run over the gathered sequence; without one, on the shard (the indexer's blocks "
        "pooled where they close and all-gathered, the picked tokens of every rank's K/V; the n-grams and the "
        "dilated convolution by the halo)",
    ),
    Family(
        "minimax",
        own_attention={"MiniMaxLightningAttention": OwnAttention(minimax_lightning, mixing="lightning")},
        cache="ShardedMiniMaxCache",
    ),
    Family(
        "recurrent_gemma",
        # its RG-LRU restarts where position_ids are 0: a gate of zero there, which the state passing carries
        own_steps={"RecurrentGemmaRecurrentBlock": recurrent_gemma_steps},
        cache="ShardedCacheOfModuleStates",
        fresh_states=_fresh_module_states,
    ),
    Family(
        "rwkv",
        own_steps={
            "RwkvSelfAttention": rwkv_time_mixing_on_shards,
            "RwkvFeedForward": rwkv_channel_mixing_on_shards,
        },
        state_kwarg="state",
    ),
    Family(
        "doge",
        own_attention={"DogeAttention": OwnAttention(doge_attention, mixing="mask_rows")},
        cache="ShardedCacheOfOwnAttention",
    ),
    Family(
        "deepseek_v4",
        gathered={
            "DeepseekV4Attention": GatheredModule(
                ("hidden_states", "position_embeddings", "position_ids"),
                mask="attention_mask",
                sharded=deepseek_v4_attention,
            )
        },
        why_gathered="its compressors' states in its cache: given a cache (a prefill), its compressed attention runs "
        "over the gathered sequence; without one, on the shard (its window by the halo, the compressed keys pooled "
        "where their windows close and all-gathered)",
    ),
    Family("openai", own_attention={"Attention": OwnAttention(openai_attention, across_documents=True)}),
    Family(
        "xlstm",
        own_steps={"xLSTMBackend": xlstm_backend_on_shards},
        cache_refused="its model keeps its recurrent state in a cache of its own class (xLSTMCache), which the sharded "
        "prefill does not fill (one process's own generation with that cache fails where the key and value head "
        "dimensions differ)",
    ),
    Family(
        "cpmant",
        gathered={
            "CpmAntSelfAttentionBlock": GatheredModule(
                ("hidden_states",),
                prefix="prompt_length",
                causal=False,
                whole_kv=True,
                rebuilt=(("attention_mask", _cpmant_everything_visible), ("position_bias", _cpmant_position_bias)),
            )
        },
        why_gathered="bidirectional attention of its own after a prompt its model puts before every call's tokens, "
        "with a bias from positions counted within the call",
    ),
    Family(
        "reformer",
        gathered={
            "ReformerAttention": GatheredModule(("hidden_states",)),
            "AxialPositionEmbeddings": GatheredModule(("position_ids",)),
        },
        why_gathered="chunked local and LSH attention of its own (buckets hashed over the whole sequence, kept whole "
        "for the reversible layers' recompute), and axial position embeddings that tile the whole sequence's length",
        generated_whole="Reformer pads every call to a multiple of its chunk length while generating, and the padding "
        "moves its LSH buckets' chunk boundaries: a shard would be padded in the middle of the sequence",
    ),
    Family(
        "blt",
        gathered={
            "BltModel": GatheredModule(
                ("input_ids", "inputs_embeds", "position_ids"),
                refused=(("patch_lengths", "patch lengths (patch_lengths)"),),
                sharded_inside=(
                    ("BltGlobalTransformer", ShardedInside(("inputs_embeds",), "position_ids", "attention_mask")),
                ),
            )
        },
        why_gathered="bytes cut into patches where a small model's entropy crosses a threshold, pooled into them and "
        "cross-attended by them: masks built from the whole call's patch boundaries (its global transformer runs "
        "over this rank's patches)",
    ),
    Family(
        "xlnet",
        gathered={
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
        why_gathered="relative attention of its own, time-major; its model builds the relative positions from the "
        "call's length",
        generated_whole="each XLNet step passes a permutation mask over every pair of the step's tokens and a query "
        "stream for the one token it predicts, which its model builds for its own whole call",
    ),
    Family(
        "mpt",
        own_attention={
            "MptAttention": OwnAttention(mpt_attention, mpt_slopes, anchor_last=True, across_documents=True)
        },
    ),
    Family(
        "bloom",
        own_attention={"BloomAttention": OwnAttention(bloom_attention, bloom_slopes, across_documents=True)},
    ),
    Family("xglm", own_attention={"XGLMAttention": OwnAttention(xglm_attention, across_documents=True)}),
    Family(
        "gpt_neox_japanese",
        own_attention={"GPTNeoXJapaneseAttention": OwnAttention(gpt_neox_japanese_attention)},
    ),
    Family(
        "zaya",
        gathered={"ZayaCCAProjection": GatheredModule(("hidden_states",), outputs=(0, 1, 2))},
        why_gathered="queries and keys by a convolution of its own, values half from the token before (the "
        "attention after the projection runs by the schedules)",
    ),
    *(
        Family(name, indexer=indexer, own_attention={latent: _LATENT} if latent else {}, indexer_rope=rope)
        for name, indexer, latent, rope in (
            ("deepseek_v32", "DeepseekV32Indexer", "DeepseekV32Attention", "apply_rotary_pos_emb"),
            ("glm_moe_dsa", "GlmMoeDsaIndexer", "GlmMoeDsaAttention", "apply_rotary_pos_emb_interleave"),
            # output gates and latent scales of their own: the heads' K/V gathered; their indexers are DeepSeek-V3.2's
            # and GLM-MoE-DSA's
            ("axk2", "AXK2Indexer", None, "apply_rotary_pos_emb"),
            ("dots3_note", "Dots3NoteTextIndexer", None, "apply_rotary_pos_emb_interleave"),
        )
    ),
    # attention sinks and an output gate: the heads' K/V gathered
    Family("hy_v4", indexer="HYV4Indexer", indexer_rope="apply_rotary_pos_emb", indexer_rotary_last=True),
    Family("moshi", window_at_decoding_only=True),
)

# by modeling module name, as ``type(model).__module__`` gives it; made here and never changed (a plain dict: Dynamo
# reads it while tracing the attention and the hooks)
FAMILIES: dict[str, Family] = {family.module: family for family in _RECORDS}
_NONE = Family("")


def family_of(obj) -> Family:
    """The record of the family of ``obj`` (a model, one of its modules, its config, or a modeling module's name); a
    family with no record runs attention alone (an empty record)."""
    name = obj if isinstance(obj, str) else type(obj).__module__.replace(".configuration_", ".modeling_")
    return FAMILIES.get(name, _NONE)


@torch.compiler.assume_constant_result  # a compiled call outside every plan reads it as the constant it is
def _sdpa_in(modeling: str) -> bool:
    return _sdpa_in_module(modeling)


@functools.cache
def _sdpa_in_module(modeling: str) -> bool:
    module = sys.modules.get(modeling)
    if module is None:
        return True
    models = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == modeling
    ]
    return all(c._supports_sdpa for c in models)


def takes_sdpa(config) -> bool:
    """Whether the models of ``config``'s modeling module take SDPA: one process runs the others "eager", whose code
    reads the mask tensor it is given (a causal mask is never left out for the kernel to apply)."""
    return _sdpa_in(type(config).__module__.replace(".configuration_", ".modeling_"))


def gathered_call(module) -> Optional[GatheredModule]:
    """How ``module`` is called over the gathered sequence; None when its class is not gathered."""
    return family_of(module).gathered.get(type(module).__name__)


__all__ = [
    "FAMILIES",
    "Family",
    "GatheredModule",
    "MIXER_LAYER_TYPES",
    "OwnAttention",
    "ShardedInside",
    "family_of",
    "gathered_call",
    "takes_sdpa",
]
