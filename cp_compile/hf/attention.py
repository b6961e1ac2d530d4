"""Hugging Face transformers: ``attn_implementation="cp_compile"``.

``import cp_compile.hf`` registers, through transformers' documented extension
points, an attention function named ``"cp_compile"`` with
``transformers.AttentionInterface`` and a mask function with
``transformers.AttentionMaskInterface``. No model code is patched. A model
loaded or switched with ``attn_implementation="cp_compile"`` then runs:

- **outside every plan** exactly as ``"sdpa"``: the mask function is
  ``sdpa_mask`` and the attention function ``sdpa_attention_forward``;
- **inside ``with plan:``** (``cp_compile.active_plan()``) under context
  parallelism: the mask function builds no tensor (a rank holds a shard of the
  queries and none of the other keys) but returns a ``MaskSpec``, what the
  mask function transformers handed it means: causal or not, a sliding window,
  a chunk size (``masks.py``; a mask function it cannot read raises). The spec
  reaches the attention function in the mask's place, so a window or chunk
  applied only by the mask (PhiMoE, Llama 4) is honoured. A model whose
  ``config.layer_types`` declares a sequence mixer other than attention
  (linear attention, Mamba, convolutions) is refused there too.

What the attention runs, on this rank's shard (``[B, H, S_local, D]``):

- one causal sequence per row, no sliding window (or a window that covers
  the whole sequence): SDPA with ``is_causal=True``;
- packed documents (one row, positions restarting at each document): the
  packed-document (``varlen``) path with the documents' global
  ``cu_seqlens``, taken from the ``cu_seq_lens_q`` keyword argument (as
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` emits it,
  global), else from the enclosing ``with plan.packed(cu)`` (``plan.documents``),
  else, eagerly, from the batch the model call's shard was made for
  (``plan.shard(x, cu_seqlens=cu)``);
- a sliding window (Mistral, Qwen2's ``sliding_attention`` layers, PhiMoE)
  shorter than the sequence: the packed path as well, each row being one
  document of the zigzag layout (per-document zigzag of equal rows is exactly
  zigzag), with ``window_size=(sliding_window - 1, 0)``;
- chunked attention (Llama 4's ``chunked_attention`` layers), soft-capped
  scores (Gemma 2's ``softcap``) and attention sinks (GPT-OSS's ``s_aux``):
  the packed kind's ops directly (``cp_compile.varlen_attention`` with
  ``chunk``, ``softcap`` and ``return_lse``; the sinks fold into the merged
  result, ``kernels.merge.fold_sinks``), eager and compiled alike;
- query/key heads wider than value heads (multi-head latent attention) on
  every path: the kernels take unequal head dims.

- with a ``ShardedCache`` (generation, ``cp_compile.hf.generate``): during the
  sharded prefill, the cases above; for tokens every rank holds (decoding,
  drafts, a follow-up prompt), ``cp::cached_attention`` over every rank's
  share of the cache (``cache.py``), with the chunk, cap and sinks as well.

Eagerly those are calls of the CP ops (``plan.attention``,
``cp_compile.varlen_attention``); under ``torch.compile`` one causal sequence
and windows are plain ``F.scaled_dot_product_attention`` / ``varlen_attn``
calls, which the plan's backend rewrites, and the rest the CP ops, which its
second stage expands (so a compiled model must be run inside ``with plan:``
too, and compiled with ``plan.backend()``).
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..active import active_plan
from ..comm.agree import refuse_together
from ..errors import UnsupportedAttention
from ..inference.cached import CachedSettings
from ..kernels.merge import fold_sinks
from ..layout.packed import Packed
from ..mixers.indexed import indexed_attention, visible_keys
from ..plan import ContextParallel
from ..schedules import softmax_scale
from .cache import CACHE_STEP, step_handed_with, step_of_shared_keys
from .checks import check_outside_plan
from .families import takes_sdpa
from .forward import attention_as_one_process, check_recompute, count_call, documents_in_force, ran_batch, sharding_of
from .masks import NAME, MaskSpec, check_layer_types

__all__ = ["NAME", "attention"]


def _documents(
    plan: ContextParallel, query: Tensor, kwargs: dict, spec: MaskSpec, across: bool = False
) -> Optional[Tensor]:
    """Global cu_seqlens of packed documents, or None for one sequence per row: ``cu_seq_lens_q`` (which flash
    attention keeps apart on one process), else those of ``with plan.packed(cu)`` or of the model call's shard
    (``forward.documents_in_force``) where the model's mask keeps them apart, or where the documents see each other
    (``across``: the caller knows its model's one-process attention reads across them)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if (
            cu_k is not None
            and cu_k is not cu
            and not torch.compiler.is_compiling()
            and not torch.equal(cu_k.cpu(), cu.cpu())
        ):
            raise UnsupportedAttention(
                "cu_seq_lens_k differs from cu_seq_lens_q: CP needs self-attention over the same documents"
            )
        ran_batch(cu)
        return cu
    block = plan.documents is not None
    cu = documents_in_force(plan, None)
    if cu is None:
        return None
    # Compiled, the slot count is left unread: comparing the traced length with a Python int would
    # specialise the graph to this batch's length. The packed kind checks it at run time instead.
    if block and not torch.compiler.is_compiling() and query.shape[2] != plan.document_slots:
        raise ValueError(
            f"the packed documents in force (`with plan.packed(cu)`) give {plan.document_slots} slots per rank, but "
            f"the model got {query.shape[2]} tokens; call the model inside `with plan.packed(cu)` for the batch being "
            "run, or outside every such block for one sequence per row"
        )
    if (
        not across
        and not torch.compiler.is_compiling()
        and not spec.documents
        and cu.shape[0] > 2
        and _restart_here(plan, cu)
    ):
        error = UnsupportedAttention(
            f"{spec.model or 'the model'} builds its attention mask without the packed documents' positions, so one "
            "process attends across the documents where CP would keep them apart; pass the packed row's "
            "cu_seq_lens_q and cu_seq_lens_k (what flash attention keeps apart, as TRL's padding-free collator "
            "and DataCollatorWithFlattening(return_flash_attn_kwargs=True) give them), or one sequence per row"
        )
        # a rank whose positions run on without a break cannot tell, and goes on to the schedule's first agreement
        refuse_together(error, query, query, query, plan.group_name)
    return cu


def _restart_here(plan: ContextParallel, cu: Tensor) -> bool:
    """Whether this rank's positions of the documents ``cu`` restart somewhere: where they do, transformers finds the
    documents in them and a mask function given them keeps the documents apart; where they run on without a break
    (C = 2, documents of 4 and 12 tokens: rank 1 holds positions 1 to 8), the mask says nothing either way."""
    positions = Packed(cu.cpu()).positions(int(cu[-1]), plan.rank, plan.world_size)
    return bool((positions.diff() != 1).any())


class _Variant(NamedTuple):
    """What one attention call computes besides plain softmax attention (all read from the call)."""

    spec: MaskSpec
    softcap: float  # > 0: scores capped at softcap * tanh(score / softcap) (Gemma 2)
    sinks: Optional[Tensor]  # [H] per-head logits in every row's softmax denominator (GPT-OSS's s_aux)

    @property
    def needs_kind(self) -> bool:
        """Run through the packed kind's ops (chunks, caps and sinks are not in torch's attention calls)."""
        return bool(self.spec.chunk or self.softcap or self.sinks is not None)


def _variant(
    module, query: Tensor, key: Tensor, attention_mask, dropout: float, is_causal: Optional[bool], kwargs: dict
) -> _Variant:
    where = f"attn_implementation={NAME!r} under context parallelism ({type(module).__name__})"
    if attention_mask is None:  # a model that builds no mask: causal as the call or the module says, as SDPA does
        spec = MaskSpec(bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)))
    elif isinstance(attention_mask, MaskSpec):
        spec = attention_mask
    else:
        raise UnsupportedAttention(
            f"{where}: an attention mask tensor reached the attention (a 4-D mask passed to the model?); "
            "CP computes causal attention over the global sequence, or over packed documents"
        )
    if dropout:
        raise UnsupportedAttention(f"{where}: attention dropout ({dropout}) is not supported; set attention_dropout=0")
    if kwargs.get("position_bias") is not None:
        raise UnsupportedAttention(f"{where}: position_bias is not supported")
    if key.shape[2] != query.shape[2]:
        raise UnsupportedAttention(
            f"{where}: {query.shape[2]} queries against {key.shape[2]} keys (a KV cache?); use use_cache=False"
        )
    _check_module(module)
    return _Variant(spec, float(kwargs.get("softcap") or 0.0), kwargs.get("s_aux"))


def _declared(module, name: str, default):
    """A plain attribute of ``module``: read from its ``__dict__`` first (``nn.Module.__getattr__`` raises and
    catches for a name it does not hold, which costs more than the attention call of a decoded token)."""
    found = module.__dict__.get(name, _ABSENT)
    return getattr(module, name, default) if found is _ABSENT else found


_ABSENT = object()


def _check_module(module) -> None:
    """What a module declares that changes its queries by local position (Llama 4's temperature tuning
    of its layers without RoPE numbers the tokens of the shard from 0)."""
    if _declared(module, "attn_temperature_tuning", False) and not _declared(module, "use_rope", True):
        raise UnsupportedAttention(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) scales its queries by their "
            "position counted from the start of this rank's shard (attn_temperature_tuning on a layer without "
            "RoPE): under context parallelism the positions would be wrong. Set attn_temperature_tuning=False "
            "in the config, or run this model without a plan."
        )


def _fold_sinks(out: Tensor, lse: Tensor, sinks: Optional[Tensor], head_dim: int) -> Tensor:
    return out if sinks is None else fold_sinks(out, lse, sinks, head_dim)


def _cached(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    variant: _Variant,
    scaling: Optional[float],
    step: tuple,
    indices: Optional[Tensor],
    index: Optional[int] = None,
) -> Tensor:
    """Tokens every rank holds against the sharded cache (decoding, drafts, a follow-up prompt).

    The keys and values are the attention's own arguments: this rank's cache slots as the model made
    them from what ``ShardedCache.update`` returned, slot for slot (a model caching a compressed
    latent, as DeepSeek-V3's multi-head latent attention does, expands it after the update)."""
    layer, appended = step
    appended = appended._replace(keys=key, values=value)
    if not variant.spec.causal:
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r}: a KV cache under context parallelism needs causal attention"
        )
    left = None  # the layer's window
    if getattr(layer, "decoding_window", None) is not None and variant.spec.window is None:
        # one process's cache slides while its mask has none (Moshi): the prompt's last token, in its prefill there,
        # sees every key; later tokens see the window
        left = -1 if layer.prompt_tail else layer.decoding_window - 1
        layer.prompt_tail = False
    elif not torch.compiler.is_compiling() and variant.spec.window != layer.window:
        raise UnsupportedAttention(
            f"{type(module).__name__} attends with a window of {variant.spec.window}, but "
            f"its ShardedCache layer was made for {layer.window} (from the model's config)"
        )
    settings = CachedSettings(variant.spec.chunk or 0, variant.softcap) if variant.needs_kind else CachedSettings()
    out, lse = layer.attend(query, appended, softmax_scale(query, scaling), settings, indices, index, left)
    return _fold_sinks(out, lse, variant.sinks, 1).transpose(1, 2).contiguous()


def _indexed(
    plan: ContextParallel,
    variant: _Variant,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    indices: Tensor,
    scaling: Optional[float],
    kwargs: dict,
    values_in_keys: bool,
) -> Tensor:
    """Each of this rank's queries against the keys of the global sequence its indexer chose (``mixers.indexed``);
    ``values_in_keys``: the values are the keys' leading columns (a latent attention's, ``hf.latent``)."""
    if variant.spec.chunk or variant.softcap or variant.spec.window is not None or not variant.spec.causal:
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r} under context parallelism: sparse attention chosen by an indexer is "
            "supported causal, without a window, chunks or soft-capping"
        )
    sharding = sharding_of(plan, kwargs.get("cu_seq_lens_q"))
    out, lse = indexed_attention(
        query, key, value, indices, sharding, softmax_scale(query, scaling), values_in_keys=values_in_keys
    )
    return _fold_sinks(out, lse, variant.sinks, 1).transpose(1, 2).contiguous()


def _autocast(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Under autocast, SDPA runs in the autocast dtype (the Trainer's bf16=True, SFTConfig's default); the CP ops
    are custom ops, which autocast leaves alone, so cast as it would."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def _keep_picked(mask: Optional[Tensor], indices: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """``mask`` (True where a key is seen, or additive; None: causal from the last key) and each query's ``indices [B,
    L, k]``, the keys an indexer picked, combined: the picked keys the mask lets through."""
    length, keys = query.shape[2], key.shape[2]
    picked = torch.zeros(indices.shape[0], 1, length, keys, dtype=torch.bool, device=query.device)
    picked = picked.scatter(-1, indices.long()[:, None], True)
    if mask is None:
        mask = visible_keys(torch.arange(keys - length, keys, device=query.device), keys, None)
    if mask.dtype == torch.bool:
        return mask & picked
    return mask.masked_fill(~picked, torch.finfo(mask.dtype).min)


def _one_process(module, eager: bool, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """One process's attention: with ``eager``, its modeling file's eager attention where it has one (it reads every
    argument its model passes: a position bias, sinks), else SDPA."""
    indices = kwargs.pop("indices", None)
    if indices is not None:  # a sparse-attention indexer's choice (DSA): applied to the mask, as its model applies it
        attention_mask = _keep_picked(attention_mask, indices, query, key)
        is_causal = False
    own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None) if eager else None
    if own is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """The attention function of ``"cp_compile"`` (transformers' signature; returns (out [B, S, H, D], None))."""
    values_in_keys = bool(kwargs.pop("values_in_keys", False))  # ``hf.latent``'s: not one of transformers' kwargs
    plan = active_plan()
    check_recompute(module, plan)
    if plan is not None and attention_as_one_process(module):
        # a module over the gathered sequence (``hf.gathered``, given that sequence's mask) or over each token's own
        # states
        return _one_process(module, True, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if plan is None:
        if not torch.compiler.is_compiling():
            check_outside_plan(module, kwargs.get("position_ids"))
        config = getattr(module, "config", None)
        eager = config is not None and not takes_sdpa(config)  # as one process runs a model that takes no SDPA
        return _one_process(module, eager, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    count_call()
    config = getattr(module, "config", None)  # a module of attention of its own has none (``hf.own_attention``)
    if config is not None:
        check_layer_types(config)
    step = kwargs.pop(CACHE_STEP, None)  # (layer, what its new tokens attend to) from ShardedCache.update
    if step is None:
        step = step_handed_with(key)  # an update called without the attention kwargs
    shared = False
    if step is None and not torch.compiler.is_compiling():
        step = step_of_shared_keys(key)  # the K/V another layer's update returned (Gemma 3n's KV sharing)
        shared = step is not None
    query, key, value = _autocast(query, key, value)
    if step is not None and not torch.compiler.is_compiling():
        step[0].unattended = False  # what ShardedCache.check_attended asks
    if step is None and kwargs.get("use_cache") and not torch.is_grad_enabled():
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r} under context parallelism: a forward without gradients that fills a KV "
            "cache not sharded over the ranks (model.generate?). Generate with cp_compile.hf.generate(model, "
            "input_ids, ...), which shards the prompt and the cache; for a forward that needs no cache, pass "
            "use_cache=False"
        )
    indices = kwargs.pop("indices", None)  # the keys a sparse-attention indexer chose for each query (DSA)
    # a module of attention of its own whose one-process mask ignores packed documents (``hf.own_attention``)
    across = bool(kwargs.pop("across_documents", False))
    if step is not None and step[1] is not None:
        variant = _variant(module, query, query, attention_mask, dropout, is_causal, kwargs)
        index = module.layer_idx if shared else None  # a reused layer's gather is its own in the step's count
        return _cached(module, query, key, value, variant, scaling, step, indices, index), None
    variant = _variant(module, query, key, attention_mask, dropout, is_causal, kwargs)
    if indices is not None:
        return _indexed(plan, variant, query, key, value, indices, scaling, kwargs, values_in_keys), None
    causal, window = variant.spec.causal, variant.spec.window
    gqa = query.shape[1] != key.shape[1]
    batch, _, local, _ = query.shape
    cu = _documents(plan, query, kwargs, variant.spec, across)
    across = across and cu is not None  # rows as documents never see each other
    whole = window is None or window >= local * plan.world_size  # the window sees everything
    if cu is None and whole and not variant.needs_kind:
        # compiled, torch's attention call, which plan.backend() rewrites
        attend = torch.nn.functional.scaled_dot_product_attention if torch.compiler.is_compiling() else plan.attention
        out = attend(query, key, value, is_causal=causal, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if (window is not None or variant.spec.chunk) and not causal:
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r} under context parallelism: a bidirectional "
            "sliding window or chunk is not supported"
        )
    if cu is None:  # rows as documents: per-document zigzag of equal rows is the zigzag layout
        if not plan.layout.rows_are_packed_documents:
            raise UnsupportedAttention(
                f"attn_implementation={NAME!r} under context parallelism: a sliding window, chunked attention, "
                f"soft-capping or attention sinks need load_balance='zigzag' (the plan has {plan.load_balance!r})"
            )
        cu = torch.arange(batch + 1, dtype=torch.int32, device=query.device) * (local * plan.world_size)
    elif batch != 1:
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r}: packed documents need one row (batch 1); got batch {batch}"
        )
    left = -1 if window is None or whole else int(window) - 1  # transformers: key visible when q - k < window
    window_size = (left, 0 if causal else -1)
    q, k, v = (t.transpose(1, 2).reshape(batch * local, t.shape[1], t.shape[3]) for t in (query, key, value))
    if variant.needs_kind or across or not torch.compiler.is_compiling():
        from ..eager import varlen_attention

        group = (plan.group_name, *plan.mesh_groups) if plan.mesh_groups else plan.group_name
        out, lse = varlen_attention(
            q,
            k,
            v,
            cu,
            group,
            window_size=window_size,
            scale=scaling,
            enable_gqa=gqa,
            schedule=plan.schedule,
            chunk=variant.spec.chunk or 0,
            softcap=variant.softcap,
            return_lse=True,
            across_documents=across,
        )
        out = _fold_sinks(out, lse, variant.sinks, 1)
    else:  # rewritten by plan.backend() (varlen_attn has no CPU kernel of its own)
        from torch.nn.attention.varlen import varlen_attn

        from ..torch_compat import varlen_takes_gqa

        # max_length_q is a kernel hint the CP ops do not need; reading it would guard on its value
        max_len = local * plan.world_size
        gqa_argument = {"enable_gqa": gqa} if varlen_takes_gqa() else {}  # torch 2.11: GQA by the head counts
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=window_size, **gqa_argument)
    return out.view(batch, local, *out.shape[1:]), None
