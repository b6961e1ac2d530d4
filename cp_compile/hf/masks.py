"""What a transformers mask function means, for attention that never sees a mask tensor.

transformers builds every mask from a *mask function* ``f(batch, head, q_idx, kv_idx) -> bool``
composed in ``masking_utils`` (causal, a sliding-window overlay, a chunk overlay, padding, packed
sequences, ``and_masks`` / ``or_masks`` of those) and hands it to the mask interface. Under a plan no mask tensor
can be built (a rank holds a shard of the queries and none of the other keys), so ``mask`` (the mask function of
``"cp_compile"``, at the end of this file) reads what the function says instead and passes it on to the attention
function as a ``MaskSpec``: causal or not, a window, a chunk size. The window and the chunk thus come from the mask,
which is what one process's SDPA obeys, not from attention kwargs that a model may leave None (PhiMoE's window,
Llama 4's chunks).

A function made of anything else (a model's own mask function, ``or_masks``, a bidirectional
window, image blocks) raises ``UnsupportedAttention`` naming it: CP cannot honour a mask it does
not understand, and running causal attention instead would be silently wrong.

Eagerly the function is taken apart exactly (the code of each piece, the values it closes over).
While Dynamo traces, closures cannot be read; the spec then comes from what the mask interface is
told alongside the function (``local_size``: the window or chunk; ``use_vmap``: a custom mask
function was combined in) and the model's config, and the top-level function must be one that
transformers' own mask builders produce.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Optional

import torch
from transformers import masking_utils as _mu

from ..active import active_plan
from ..errors import UnsupportedAttention
from .cache import runs_indexers_under_cp, runs_mixers_under_cp
from .families import MIXER_LAYER_TYPES, takes_sdpa
from .forward import count_call, in_gathered_module, plan_of_shards
from .mask_spec import MaskSpec


def _cells(fn: Callable) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


_ZERO = torch.zeros(1, dtype=torch.long)
# the code of each piece transformers composes masks from
_CAUSAL = _mu.causal_mask_function.__code__
_BIDIRECTIONAL = _mu.bidirectional_mask_function.__code__
_WINDOW = _mu.sliding_window_overlay(1).__code__
_CHUNK = _mu.chunked_overlay(1, _ZERO).__code__
_PADDING = _mu.padding_mask_function(_ZERO).__code__
_PACKED = _mu.packed_sequence_mask_function(_ZERO).__code__
_REMAP = _mu.remap_positions_for_packed_sequence(_mu.causal_mask_function, _ZERO).__code__
_OFFSETS = _mu.add_offsets_to_mask_function(_mu.causal_mask_function, 0, 0).__code__
_AND = _mu.and_masks(_mu.causal_mask_function).__code__


def _unsupported(fn: Callable, model: str, what: str = "") -> UnsupportedAttention:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    return UnsupportedAttention(
        f"{model}: its attention mask is built from {name}{what}, which context parallelism cannot reproduce "
        "(cp_compile runs causal attention, sliding windows, chunked attention and packed documents); run this "
        "model without a plan, or with attn_implementation='sdpa' on one process"
    )


def _walk(fn: Callable, model: str, facts: dict) -> None:
    """Adds what ``fn`` requires to ``facts`` (an AND of everything met); raises on anything else."""
    code = getattr(fn, "__code__", None)
    if code is _CAUSAL:
        facts["causal"] = True
    elif code is _BIDIRECTIONAL:
        facts.setdefault("causal", False)
    elif code is _WINDOW:
        window = int(_cells(fn)["sliding_window"])
        facts["window"] = min(window, facts.get("window", window))
    elif code is _CHUNK:
        cells = _cells(fn)
        if bool(cells["left_padding"].any()):
            raise UnsupportedAttention(
                f"{model}: chunked attention with left padding is not supported under "
                "context parallelism; pack the documents into one row instead"
            )
        facts["chunk"] = int(cells["chunk_size"])
    elif code is _PADDING:
        pass  # padding is refused by ``mask`` unless all ones
    elif code is _PACKED:
        facts["documents"] = True  # which documents: from cu_seq_lens / the plan
    elif code in (_REMAP, _OFFSETS):
        if code is _REMAP:
            facts["documents"] = True
        cells = _cells(fn)
        if code is _OFFSETS and (cells["q_offset"] or cells["kv_offset"]):
            raise _unsupported(fn, model, " with offsets (a cache not sharded over the ranks)")
        _walk(cells["mask_function"], model, facts)
    elif code is _AND:
        for part in _cells(fn)["mask_functions"]:
            _walk(part, model, facts)
    else:
        raise _unsupported(fn, model)


def model_name(config) -> str:
    """The model's class for messages, or its model type. While Dynamo traces, the type alone: saving a checkpoint
    sets ``config.architectures``, and a guard on it would recompile the model after its first save."""
    architectures = None if torch.compiler.is_compiling() else getattr(config, "architectures", None)
    return architectures[0] if architectures else f"a {getattr(config, 'model_type', '?')} model"


def describe(mask_function: Callable, config, local_size: Optional[int] = None, use_vmap: bool = False) -> MaskSpec:
    """The ``MaskSpec`` of ``mask_function`` (see the module docstring); raises on what CP cannot run."""
    model = model_name(config)
    if not torch.compiler.is_compiling():
        facts: dict = {}
        _walk(mask_function, model, facts)
        if facts.get("causal") is False and ("window" in facts or "chunk" in facts):
            raise UnsupportedAttention(
                f"{model}: a bidirectional window or chunk is not supported under context parallelism"
            )
        return MaskSpec(
            facts.get("causal", False),
            facts.get("window"),
            facts.get("chunk"),
            model,
            documents=facts.get("documents", False),
        )
    code = getattr(mask_function, "__code__", None)
    if use_vmap or code not in (_CAUSAL, _BIDIRECTIONAL, _AND, _REMAP):
        raise _unsupported(
            mask_function, model, " (combined with a mask function of the model's own)" if use_vmap else ""
        )
    if code is _BIDIRECTIONAL:
        return MaskSpec(False, model=model)
    # while tracing, transformers keeps packed documents apart wherever the model passes it positions (its check for
    # one document is data-dependent) by ANDing a function to a full layer's causal one; a window's or a chunk's is an
    # AND already, and its closures cannot be read while Dynamo traces: unknown
    if local_size is None:
        return MaskSpec(model=model, documents=code in (_AND, _REMAP))
    if local_size == getattr(config, "attention_chunk_size", None):
        return MaskSpec(chunk=int(local_size), model=model, documents=None)
    return MaskSpec(window=int(local_size), model=model, documents=None)


INDEXED_LAYER_TYPE = "indexed_attention"  # transformers' layer type of sparse attention chosen by an indexer (DSA)

NAME = "cp_compile"


# the token mixers cp_compile runs under CP, as transformers' ``config.layer_types`` names them; "moe"
# and "mlp" layers mix nothing along the sequence
_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "moe", "mlp")


def _other_layer_types(layer_types: tuple[str, ...]) -> list[str]:
    return sorted({t for t in layer_types if t not in _LAYER_TYPES})


# eagerly every attention layer of every forward asks about the same list (Dynamo traces the plain one: it
# warns on a cached function and ignores the cache)
_other_layer_types_cached = functools.lru_cache(maxsize=64)(_other_layer_types)


def check_layer_types(config) -> None:
    """Refuses a model whose ``config.layer_types`` declares a sequence mixer that is not attention
    (linear attention, Mamba, short convolutions, hybrids of those) and that cp_compile does not run under
    CP for its family (``Family.mixes_outside_attention``): it would run on this rank's shard of
    the sequence as if the shard were the whole sequence."""
    layer_types = tuple(getattr(config, "layer_types", None) or ())
    other = (_other_layer_types if torch.compiler.is_compiling() else _other_layer_types_cached)(layer_types)
    if other and runs_mixers_under_cp(config):  # its convolutions and scans run under CP (mixers.py)
        other = [t for t in other if t not in MIXER_LAYER_TYPES]
    if other and runs_indexers_under_cp(config):  # its sparse-attention indexers run under CP (indexed.py)
        other = [t for t in other if t != INDEXED_LAYER_TYPE]
    if other:
        where = ", ".join(f"{t!r} (layer {list(layer_types).index(t)})" for t in other)
        raise UnsupportedAttention(
            f"{model_name(config)} under context parallelism: its config.layer_types declares {where}, a sequence "
            "mixer that cp_compile does not parallelise; it would run on this rank's shard of the sequence alone. "
            f"Supported layer types: {', '.join(_LAYER_TYPES)}. Run this model without a plan."
        )


def mask(*args, **kwargs):
    """The mask function of ``"cp_compile"``: outside a plan one process's (``sdpa_mask``, or ``eager_mask`` for a
    model that takes no SDPA, whose own attention code reads the mask); inside one a ``MaskSpec``.

    Inside a plan no mask tensor is built: the spec says what the mask function means (causal, a
    window, a chunk size; ``masks.py``) and travels to the attention function in its place. It
    refuses what CP cannot honour: a model whose ``config.layer_types`` declares a sequence mixer other
    than attention, a mask function it does not understand, a KV cache holding earlier tokens that is
    not a ``ShardedCache`` (whose mask sizes read as no cache) and, eagerly, a 2-D padding mask with
    padding in it (an all-ones mask, as tokenizers return, is accepted; compiled, it is ignored).
    """
    plan = active_plan()
    if plan is None:  # as one process builds it for the model: "sdpa" where its models take SDPA, else "eager"
        config = kwargs.get("config")
        return (_mu.sdpa_mask if config is None or takes_sdpa(config) else _mu.eager_mask)(*args, **kwargs)
    if in_gathered_module():  # model code over the gathered sequence: the mask of the eager attention it then runs
        return _mu.eager_mask(*args, **kwargs)
    count_call()
    config = kwargs.get("config")
    check_layer_types(config)
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if kwargs.get("q_offset", 0) != 0 or kwargs.get("kv_offset", 0) != 0 or q_length != kv_length:
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r} under context parallelism: a KV cache with earlier tokens "
            f"(q_length={q_length}, kv_length={kv_length}) that is not sharded over the ranks; generate with "
            f"cp_compile.hf.generate(model, input_ids, ...) (or pass cache=cp_compile.hf.ShardedCache(...)), "
            "or call the model with use_cache=False"
        )
    padding = kwargs.get("attention_mask")  # a MaskSpec: prepared by generate for the model's builders (this decides)
    # while cp_compile.hf.generate decodes (every rank the same tokens: no plan of shards), padding comes only from a
    # left-padded batch whose cache holds each row's own tokens (``hf.batched``): the positions mask it already
    if (
        padding is not None
        and not isinstance(padding, MaskSpec)
        and not torch.compiler.is_compiling()
        and plan_of_shards() is not None
        and not bool(padding.all())
    ):
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r} under context parallelism: a padding attention_mask is not supported; "
            "pack the documents into one row instead (plan.shard(x, 1, cu_seqlens=cu), "
            "position_ids=plan.positions(cu_seqlens=cu)[None]) and keep padding out of the loss (labels -100)"
        )
    # tested against None, not by ``or``: torch 2.11's Dynamo cannot take a function's truth
    mask_function = kwargs.get("mask_function")
    spec = describe(
        _mu.causal_mask_function if mask_function is None else mask_function,
        config,
        kwargs.get("local_size"),
        bool(kwargs.get("use_vmap", False)),
    )
    if INDEXED_LAYER_TYPE in (getattr(config, "layer_types", None) or ()) and runs_indexers_under_cp(config):
        spec = dataclasses.replace(spec, indexed=True)
    return spec


__all__ = ["NAME", "MaskSpec", "check_layer_types", "describe", "mask", "model_name"]
