"""Hugging Face transformers: ``attn_implementation="cp_compile"``.

``import cp_compile.hf`` registers, through transformers' documented extension
points, an attention function named ``"cp_compile"`` with
``transformers.AttentionInterface`` and a mask function with
``transformers.AttentionMaskInterface``. No model code is patched. A model
loaded or switched with ``attn_implementation="cp_compile"`` then runs:

- **outside every plan** exactly as ``"sdpa"``: the mask function is
  ``sdpa_mask`` and the attention function ``sdpa_attention_forward``;
- **inside ``with plan:``** (``cp_compile.active_plan()``) under context
  parallelism: the mask function returns None (no mask tensor is built from
  the local ``position_ids``; under CP a zigzag shard's positions would look
  like two documents to transformers' packed-sequence detection), and the
  attention function runs causal attention over the global sequence, or over
  packed documents.

What the attention runs, on this rank's shard (``[B, H, S_local, D]``):

- one causal sequence per row, no sliding window (or a window that covers
  the whole sequence): SDPA with ``is_causal=True``;
- packed documents (one row, positions restarting at each document): the
  packed-document (``varlen``) path with the documents' global
  ``cu_seqlens``, taken from the ``cu_seq_lens_q`` keyword argument (as
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` emits it,
  global), else from the plan's latest ``positions(cu_seqlens=...)`` call
  (``plan.documents``);
- a sliding window (Mistral, Qwen2's ``sliding_attention`` layers) shorter
  than the sequence: the packed path as well, each row being one document of
  the zigzag layout (per-document zigzag of equal rows is exactly zigzag), with
  ``window_size=(sliding_window - 1, 0)``.

- with a ``ShardedCache`` (generation, ``cp_compile.hf.generate``): during the
  sharded prefill, the cases above; for tokens every rank holds (decoding,
  drafts, a follow-up prompt), ``cp::cached_attention`` over every rank's
  share of the cache (``cache.py``).

Eagerly those are calls of the CP ops (``plan.attention``,
``cp_compile.varlen_attention``); under ``torch.compile`` they are plain
``F.scaled_dot_product_attention`` / ``varlen_attn`` calls, which the plan's
backend rewrites (so a compiled model must be run inside ``with plan:`` too,
and compiled with ``plan.backend()``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..eager import softmax_scale
from ..passes.rewrite import UnsupportedAttention
from ..passes.unrewritten import LocalAttentionError
from ..plan import ContextParallel, active_plan
from .cache import CACHE_STEP

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("cp_compile.hf needs transformers >= 5 (pip install 'cp_compile[hf]')") from e

NAME = "cp_compile"

__all__ = ["NAME", "attention", "mask"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def mask(*args, **kwargs):
    """The mask function of ``"cp_compile"``: ``sdpa_mask`` outside a plan; None inside one.

    Inside a plan it refuses what CP cannot honour: a KV cache holding earlier
    tokens that is not a ``ShardedCache`` (whose mask sizes read as no cache) and, eagerly, a 2-D padding mask with padding in it (an
    all-ones mask, as tokenizers return, is accepted; compiled, it is ignored).
    """
    plan = active_plan()
    if plan is None:
        return sdpa_mask(*args, **kwargs)
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if kwargs.get("q_offset", 0) != 0 or kwargs.get("kv_offset", 0) != 0 or q_length != kv_length:
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r} under context parallelism: a KV cache with earlier tokens "
            f"(q_length={q_length}, kv_length={kv_length}) that is not sharded over the ranks; generate with "
            f"cp_compile.hf.generate(model, input_ids, ...) (or pass cache=cp_compile.hf.ShardedCache(...)), "
            "or call the model with use_cache=False"
        )
    padding = kwargs.get("attention_mask")
    if padding is not None and not _compiling() and not bool(padding.all()):
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r} under context parallelism: a padding attention_mask is not supported; "
            "pack the documents into one row instead (plan.shard(x, 1, cu_seqlens=cu), "
            "position_ids=plan.positions(cu_seqlens=cu)[None]) and keep padding out of the loss (labels -100)"
        )
    return None


def _documents(plan: ContextParallel, query: Tensor, kwargs: dict) -> Optional[Tensor]:
    """Global cu_seqlens of packed documents, or None for one sequence per row."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k is not cu and not _compiling() and not torch.equal(cu_k.cpu(), cu.cpu()):
            raise UnsupportedAttention("cu_seq_lens_k differs from cu_seq_lens_q: CP needs self-attention over "
                                       "the same documents")
        return cu
    cu = plan.documents
    if cu is None:
        return None
    # Compiled, the slot count is left unread: comparing the traced length with a Python int would
    # specialise the graph to this batch's length. The packed kind checks it at run time instead.
    if not _compiling() and query.shape[2] != plan.document_slots:
        local = plan.document_slots
        raise ValueError(
            f"the plan's documents (from its latest positions(cu_seqlens=...) call) give {local} slots per rank, "
            f"but the model got {query.shape[2]} tokens; call plan.positions(seq_len) for one sequence per row, "
            "or plan.positions(cu_seqlens=cu) for the batch being run"
        )
    return cu


def _check(module, query: Tensor, key: Tensor, attention_mask, dropout: float, kwargs: dict) -> None:
    where = f"attn_implementation={NAME!r} under context parallelism ({type(module).__name__})"
    if attention_mask is not None:
        raise UnsupportedAttention(
            f"{where}: an attention mask tensor reached the attention (a 4-D mask passed to the model?); "
            "CP computes causal attention over the global sequence, or over packed documents"
        )
    if dropout:
        raise UnsupportedAttention(f"{where}: attention dropout ({dropout}) is not supported; set attention_dropout=0")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"{where}: {name} is not supported")
    if key.shape[2] != query.shape[2]:
        raise UnsupportedAttention(
            f"{where}: {query.shape[2]} queries against {key.shape[2]} keys (a KV cache?); use use_cache=False"
        )


def _cached(module, query: Tensor, attention_mask, dropout: float, scaling: Optional[float], causal: bool,
            step: tuple, kwargs: dict) -> Tensor:
    """Tokens every rank holds against the sharded cache (decoding, drafts, a follow-up prompt)."""
    layer, appended = step
    _check(module, query, query, attention_mask, dropout, kwargs)
    if not causal:
        raise UnsupportedAttention(f"attn_implementation={NAME!r}: a KV cache under context parallelism needs "
                                   "causal attention")
    window = kwargs.get("sliding_window")
    if not _compiling() and window != layer.window:
        raise UnsupportedAttention(f"{type(module).__name__} attends with sliding_window={window}, but its "
                                   f"ShardedCache layer was made for {layer.window} (from the model's config)")
    return layer.attend(query, appended, softmax_scale(query, scaling)).transpose(1, 2).contiguous()


def _check_recompute(module, plan: Optional[ContextParallel]) -> None:
    """Eagerly, a checkpointed layer recomputes its forward during backward: outside the plan that ran
    the forward, it would attend to the shard alone. Each module remembers whether its latest forward
    ran under a plan; a recompute (a forward inside backward) without one raises."""
    recomputing = torch._C._current_autograd_node() is not None
    if recomputing and plan is None and getattr(module, "_cp_compile_under_plan", False):
        raise LocalAttentionError(
            f"{type(module).__name__} recomputes its attention during backward (activation checkpointing) "
            "outside `with plan:`, while its forward ran inside the plan: the recompute would attend to this "
            "rank's shard of the sequence alone. Call loss.backward() inside `with plan:` as well."
        )
    if not recomputing:
        module._cp_compile_under_plan = plan is not None


def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
              scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """The attention function of ``"cp_compile"`` (transformers' signature; returns (out [B, S, H, D], None))."""
    plan = active_plan()
    if not _compiling():
        _check_recompute(module, plan)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    step = kwargs.pop(CACHE_STEP, None)  # (layer, what its new tokens attend to) from ShardedCache.update
    if step is None and kwargs.get("use_cache") and not torch.is_grad_enabled():
        raise UnsupportedAttention(
            f"attn_implementation={NAME!r} under context parallelism: a forward without gradients that fills a KV "
            "cache not sharded over the ranks (model.generate?). Generate with cp_compile.hf.generate(model, "
            "input_ids, ...), which shards the prompt and the cache; for a forward that needs no cache, pass "
            "use_cache=False")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if step is not None and step[1] is not None:
        return _cached(module, query, attention_mask, dropout, scaling, causal, step, kwargs), None
    _check(module, query, key, attention_mask, dropout, kwargs)
    gqa = query.shape[1] != key.shape[1]
    batch, _, local, _ = query.shape
    window = kwargs.get("sliding_window")
    cu = _documents(plan, query, kwargs)
    if cu is None and (window is None or window >= local * plan.world_size):  # the window sees everything
        if _compiling():  # rewritten by plan.backend()
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=causal,
                                                                   scale=scaling, enable_gqa=gqa)
        else:
            out = plan.attention(query, key, value, is_causal=causal, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if window is not None and not causal:
        raise UnsupportedAttention(f"attn_implementation={NAME!r} under context parallelism: a bidirectional "
                                   "sliding window is not supported")
    if cu is None:  # rows as documents: per-document zigzag of equal rows is the zigzag layout
        if plan.load_balance != "zigzag":
            raise UnsupportedAttention(
                f"attn_implementation={NAME!r} under context parallelism: a sliding window needs "
                f"load_balance='zigzag' (the plan has {plan.load_balance!r})"
            )
        cu = torch.arange(batch + 1, dtype=torch.int32, device=query.device) * (local * plan.world_size)
    elif batch != 1:
        raise UnsupportedAttention(f"attn_implementation={NAME!r}: packed documents need one row (batch 1); "
                                   f"got batch {batch}")
    left = -1 if window is None else int(window) - 1  # transformers: key visible when q - k < sliding_window
    window_size = (left, 0 if causal else -1)
    q, k, v = (t.transpose(1, 2).reshape(batch * local, t.shape[1], t.shape[3]) for t in (query, key, value))
    if _compiling():  # rewritten by plan.backend() (varlen_attn has no CPU kernel of its own)
        from torch.nn.attention.varlen import varlen_attn

        # max_length_q is a kernel hint the CP ops do not need; reading it would guard on its value
        max_len = local * plan.world_size
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=window_size,
                          enable_gqa=gqa)
    else:
        from ..eager import varlen_attention

        if plan.schedule == "hybrid":
            raise UnsupportedAttention(f"attn_implementation={NAME!r}: eager packed attention with "
                                       "schedule='hybrid' needs the mesh; compile with plan.backend()")
        out = varlen_attention(q, k, v, cu, plan.group_name, window_size=window_size, scale=scaling,
                               enable_gqa=gqa, schedule=plan.schedule)
    return out.view(batch, local, *out.shape[1:]), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, mask)
