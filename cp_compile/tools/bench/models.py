"""``python -m cp_compile models``: every decoder-only causal-LM family of the installed transformers under CP.

For each family of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (encoder-decoder,
encoder and multimodal families are skipped, each with its reason) a tiny
model is built from the family's own config and model classes: the config's
defaults, every known size field shrunk (hidden 64, 4/2 heads, 128 vocab,
a few small experts, windows and chunks of 16 tokens, no dropout), as many
layers as it takes to hold every layer type the family has, and a short
per-family override table where the generic shrink is not enough. Random
weights, fp32, seeded: the same on every rank and in the reference.

On C local gloo ranks (one warm ``RankPool`` for the whole sweep), with
``attn_implementation="cp_compile"``, against the same weights with ``"sdpa"``
(``"eager"`` where a family has no SDPA path) on one process:

- **train**: 64 tokens, batch 1, sharded by the plan with global
  ``position_ids``; the loss on the global shifted labels (sharded; the sum of
  token losses over the global count), backward, gradients all-reduced;
  the loss, logits and every gradient compared (relative to the largest
  magnitude of the reference's);
- **generate**: ``cp_compile.hf.generate(model, prompt, max_new_tokens=12,
  do_sample=False)`` after a 37-token prompt against ``model.generate`` on
  one process: the tokens (and the logits of every step).

Each phase is ``exact`` (within ``TOL``), ``refused`` (one of cp_compile's
own errors: ``UnsupportedAttention``, ``LocalAttentionError``, or a
``ValueError`` / ``NotImplementedError`` raised in cp_compile),
``not-loadable`` (transformers itself cannot build the model with
``attn_implementation="cp_compile"``: it looks its own attention classes up by
name), ``wrong`` (ran and differs: the silent failure), ``failed`` (any other
exception) or ``reference-failed`` (the one-process model failed: nothing to
compare).

Every family runs on process groups of its own (one per phase, with a short
timeout), so an exception on one rank that leaves another waiting in a
collective costs that family the timeout and nothing more; a family that
kills or hangs a rank is reported as failed and the pool restarts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import inspect
import io
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

SEQ, PROMPT, NEW = 64, 37, 12  # SEQ: training tokens at C=2 (see seq_len)
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 128, 64, 4, 2, 16, 128
WINDOW = 16  # sliding windows, attention chunks, sparse top-k: shorter than SEQ and PROMPT, so that they matter
TOL = 1e-4  # relative to the reference's largest magnitude, fp32
GRAD_FLOOR = 1e-3  # a gradient's scale is at least this fraction of the model's largest gradient (see _train)
STATUSES = ("exact", "refused", "not-loadable", "wrong", "failed", "reference-failed")
GROUP_TIMEOUT_S = 30.0  # a rank left waiting in a collective by a rank that raised gives up after this
# (shorter than the default group's timeout, 60 s in RankPool, on which the ranks meet between phases)
FAMILY_TIMEOUT_S = 240.0  # the whole family on every rank; beyond it the pool is restarted

# Every known size field, by the name a config stores it under, and its tiny value. Applied when the
# family's default config has the field set (to a larger value, for sizes); ``config_class()`` defaults
# for everything else.
SIZES = {
    # width, depth, heads
    "hidden_size": HIDDEN,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
    "embedding_size": HIDDEN,
    "emb_dim": HIDDEN,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "n_heads": HEADS,
    "num_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "num_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS,
    "head_dim": HEAD_DIM,
    "kv_channels": HEAD_DIM,
    "attention_head_dim": HEAD_DIM,
    "d_head": HEAD_DIM,
    "rotary_dim": HEAD_DIM // 2,
    "dim_head": HEAD_DIM,
    "swa_num_attention_heads": HEADS,
    "swa_num_key_value_heads": KV_HEADS,
    "swa_head_dim": HEAD_DIM,
    "hidden_size_global": HIDDEN,
    # feed-forward
    "intermediate_size": FFN,
    "n_inner": FFN,
    "ffn_dim": FFN,
    "d_ff": FFN,
    "ffn_hidden_size": FFN,
    "dense_intermediate_size": FFN,
    "intermediate_size_mlp": FFN,
    "feed_forward_size": FFN,
    "d_inner": FFN,
    "dim_ff": FFN,
    # mixtures of experts: 4 experts of 32, 2 per token, one shared expert where the family has them
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,  # layer 0 dense, layer 1 a MoE
    # multi-head latent attention: query/key head 16 + 8 (rope) = 24, value head 16
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    # sparse attention indexers (DSA): small, and a top-k below the sequence length
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": WINDOW,
    # linear attention / gated delta net / state-space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "mamba_d_state": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "mamba_n_groups": 1,
    "mamba_ngroups": 1,
    "n_groups": 1,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    # positions and windows
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    "sliding_window_size": WINDOW,
    "attention_window_size": WINDOW,
    "local_attention_window_len": WINDOW,
    "window_size": WINDOW,
    # multi-token prediction heads are not part of the causal LM's forward
    "num_nextn_predict_layers": 0,
    # vocabularies (hashed n-gram and per-layer input embeddings too)
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "encoder_hash_byte_group_vocab": 256,
    "ngram_vocab_size_base": 256,
    "hidden_size_per_layer_input": 16,
    "ple_embed_dim": 32,
    "hc_lowrank": 16,
    "laurel_rank": 8,
}
# Fields that, left at None by a family's defaults, its model code cannot do without; and a sliding window
# where the config has one but leaves it off (Mixtral, Phi-3, PhiMoE, Starcoder2, ...): on, so that it is tested.
WHEN_NONE = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS, "num_experts_per_tok": 2, "sliding_window": WINDOW}

# Families that are not decoder-only text LMs (besides every encoder-decoder config and every
# ...ForConditionalGeneration class, which are found from transformers itself).
ENCODER = (
    "an encoder (bidirectional attention; its causal-LM head needs is_decoder=True and serves encoder-decoder "
    "setups), not a decoder-only LM"
)
MULTIMODAL = "multimodal (images/audio and text); not a text decoder LM"
SKIP = {
    **{
        name: ENCODER
        for name in (
            "bert",
            "bert-generation",
            "big_bird",
            "camembert",
            "data2vec-text",
            "electra",
            "ernie",
            "megatron-bert",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roc_bert",
            "roformer",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xmod",
            "xlm",
        )
    },
    "trocr": "the text decoder of an image-to-text encoder-decoder (cross-attends to image features)",
    "musicgen": "an audio-codebook decoder of a text-to-music encoder-decoder; not a text LM",
    "musicgen_melody": "an audio-codebook decoder of a text-to-music encoder-decoder; not a text LM",
    **{name: MULTIMODAL for name in ("fuyu", "git", "phi4_multimodal")},
    **{
        name: "a speculative-decoding drafter: runs on its target model's embeddings and K/V (shared_kv_states), "
        "not a standalone LM"
        for name in ("gemma4_assistant", "gemma4_unified_assistant")
    },
}

# Per-family overrides, on top of SIZES (keep this short; say why).
OVERRIDES: dict[str, dict] = {
    # hybrids whose defaults (or a read-only layer_types) give no attention layer in 2 layers:
    # attention at layer 1, the family's other layer kind (conv, Mamba, LRU) at layer 0
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # layer 1 a MoE
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "smollm3": dict(no_rope_layer_interval=2),  # layer 1 without RoPE (NoPE), as every 4th layer of the family
    # defaults that do not build a model: no expert count, no RoPE parameters, DBRX's attention reads a
    # rope_theta its attention config lacks, an indexer with no sizes, an assistant validated against itself
    "dots1": dict(n_routed_experts=4, n_shared_experts=1),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dbrx": dict(
        attn_config=dict(kv_n_heads=KV_HEADS, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=FFN, moe_num_experts=4, moe_top_k=2),
    ),
    "qwen4_exp_text": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=WINDOW, indexer_compress_ratio=4
    ),
    # Dots3: its sliding-window layers are plain attention with the MLA layers' query/key head size
    **{name: dict(head_dim=SIZES["qk_nope_head_dim"] + SIZES["qk_rope_head_dim"]) for name in ("dots3_note_text",)},
    # Zamba shares one transformer block between its hybrid layers (tied weights): two of them
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    # GPT-Neo: one global and one local (window) layer
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    # Mamba2: heads x head dim must equal expand x hidden
    "mamba2": dict(num_heads=8, head_dim=16),
    # Gemma3n: per-layer FFN sizes and sparsity; its last layers reuse earlier layers' K/V
    # (num_kv_shared_layers), so two of each type, the last two sharing
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        intermediate_size=[FFN] * 4,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    ),
    # Gemma4: full-attention layers have twice the sliding layers' head dim (a per-layer config)
    **{
        name: dict(per_layer_config={"01": {"head_dim": 2 * HEAD_DIM}})
        for name in ("gemma4_text", "gemma4_unified_text")
    },
    # HRM: one layer per stack (the family repeats stacks over cycles)
    "hrm_text": dict(num_layers_per_stack=1),
    # Reformer's LM head runs only as a decoder; axial position embeddings must tile the sequence
    "reformer": dict(
        is_decoder=True,
        attn_layers=["local", "lsh"],
        axial_pos_embds_dim=[32, 32],
        axial_pos_shape=[8, 8],
        local_attn_chunk_length=WINDOW,
        lsh_attn_chunk_length=WINDOW,
    ),
}


def _dropout_like(name: str) -> bool:
    return any(part in name for part in ("dropout", "pdrop", "jitter", "layerdrop", "drop_path"))


@contextlib.contextmanager
def _quiet():
    """transformers' warnings (tiny configs, special tokens, deprecations) off, for a while."""
    import logging
    import warnings

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def causal_lm_families() -> dict[str, str]:
    """family -> causal-LM class name, as the installed transformers maps them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_class(name: str):
    import transformers

    return getattr(transformers, causal_lm_families()[name])


def skip_reason(name: str) -> Optional[str]:
    """Why a family is left out of the sweep, or None."""
    if name in SKIP:
        return SKIP[name]
    with _quiet():
        return _skip_reason(name)


def _skip_reason(name: str) -> Optional[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls_name = causal_lm_families()[name]
    if "ConditionalGeneration" in cls_name:
        return f"{MULTIMODAL} ({cls_name})"
    cls = model_class(name)
    family_config = CONFIG_MAPPING[name]
    config_class = cls.config_class or family_config
    try:
        default = config_class()
    except Exception:  # noqa: BLE001  (reported by tiny_config, which overrides what fails)
        return None
    if getattr(default, "is_encoder_decoder", False):
        return "encoder-decoder config"
    return None


WINDOWS = (
    "sliding_window",
    "attention_chunk_size",
    "sliding_window_size",
    "attention_window_size",
    "local_attention_window_len",
    "window_size",
)


def _get(config, key: str):
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001  (a per-layer attribute of a heterogeneous config)
        return None


def _layer_kinds(config) -> Optional[list[str]]:
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if isinstance(kinds, (list, tuple)) else None


def _first_of_each(kinds: list[str]) -> list[str]:
    return list(dict.fromkeys(kinds))


def _shrunk(default) -> dict[str, Any]:
    """Constructor kwargs: every SIZES field the config sets (to more), dropout 0; sub-configs alike (as dicts)."""
    from transformers import PretrainedConfig

    kwargs: dict[str, Any] = {}
    stored = default.to_dict()
    for key, value in SIZES.items():
        have = stored.get(key)
        if isinstance(have, bool) or not isinstance(have, int):
            continue
        if key == "num_nextn_predict_layers" or have > value:
            kwargs[key] = value
    for key, value in WHEN_NONE.items():
        if key in stored and stored[key] is None:
            kwargs[key] = value
    if stored.get("use_sliding_window") is False:  # Qwen2-style: windows only with use_sliding_window=True,
        kwargs["use_sliding_window"] = True  # on the layers from max_window_layers on: layer 0 full, layer 1 not
        if "max_window_layers" in stored:
            kwargs["max_window_layers"] = 1
    if stored.get("mlp_only_layers"):  # dense layers among MoE ones: layer 0 dense, the rest MoE
        kwargs["mlp_only_layers"] = [0]
    if stored.get("per_layer_config"):  # heterogeneous layers: the tiny model is homogeneous unless overridden
        kwargs["per_layer_config"] = None
    if isinstance(stored.get("qk_rope_head_dim"), int):  # MLA: head_dim is the rope part, qk_head_dim the sum
        if "num_key_value_heads" in stored:  # and keys have as many heads as queries
            kwargs["num_key_value_heads"] = HEADS
        for key, value in (
            ("head_dim", SIZES["qk_rope_head_dim"]),
            ("qk_head_dim", SIZES["qk_rope_head_dim"] + SIZES["qk_nope_head_dim"]),
        ):
            if isinstance(stored.get(key), int):
                kwargs[key] = value
    for key, value in stored.items():
        if _dropout_like(key) and isinstance(value, float) and value:
            kwargs[key] = 0.0
        try:
            sub = getattr(default, key, None) if isinstance(value, dict) else None
        except Exception:  # noqa: BLE001  (a per-layer attribute of a heterogeneous config)
            sub = None
        if isinstance(sub, PretrainedConfig):
            kwargs[key] = _shrunk(sub)
    return kwargs


def tiny_config(name: str):
    """(config, model class, note): the family's own config class, defaults shrunk, overrides applied."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = model_class(name)
    config_class = cls.config_class or CONFIG_MAPPING[name]
    note = "" if config_class is CONFIG_MAPPING[name] else f"{config_class.__name__} (the causal LM's config)"
    default = config_class()
    kwargs = _shrunk(default)
    kinds = _layer_kinds(default)
    field = getattr(config_class, "attribute_map", {}).get("layer_types", "layer_types")  # the stored name
    settable = not isinstance(getattr(config_class, field, None), property)
    if kinds is not None and len(set(kinds)) > 1 and settable:  # one layer of each type the family has
        kwargs.update({field: _first_of_each(kinds), "num_hidden_layers": len(set(kinds))})
    kwargs.update(OVERRIDES.get(name, OVERRIDES.get(config_class.model_type, {})))
    config = config_class(**kwargs)
    # a window the defaults left unset (None) but the overrides switched on comes back at full size: shrink it
    late = {key: WINDOW for key in WINDOWS if isinstance(_get(config, key), int) and _get(config, key) > WINDOW}
    # every kind of MLP (dense, MoE) the family has, in its order, the last one repeated
    mlp_kinds, layers = _get(default, "mlp_layer_types"), _get(config, "num_hidden_layers")
    if (
        isinstance(mlp_kinds, (list, tuple))
        and isinstance(layers, int)
        and not set(mlp_kinds) <= set(_get(config, "mlp_layer_types") or ())
    ):
        first = _first_of_each(mlp_kinds)
        late["mlp_layer_types"] = (first + first[-1:] * layers)[: max(layers, len(first))]
        late["num_hidden_layers"] = max(layers, len(first))
    if late:
        kwargs.update(late)
        config = config_class(**kwargs)
    missing = set(kinds or ()) - set(_layer_kinds(config) or ())
    if missing:
        note = "; ".join(filter(None, [note, f"no {', '.join(sorted(missing))} layer in the tiny model"]))
    _special_tokens(config)
    return config, cls, note


def _special_tokens(config) -> None:
    """Padding and BOS ids at the top of the tiny vocabulary (batches and prompts are drawn below them); no EOS,
    so that every generation runs all its tokens."""
    for offset, key in enumerate(("pad_token_id", "bos_token_id")):
        if isinstance(getattr(config, key, None), int) and not isinstance(getattr(config, key), bool):
            setattr(config, key, VOCAB - 1 - offset)
    if getattr(config, "eos_token_id", None) is not None:
        config.eos_token_id = None


ID_RANGE = VOCAB - 3  # token ids of the batches and prompts: below the special tokens


# --- one family, on every rank ------------------------------------------------------------------------------


def seq_len(world_size: int) -> int:
    """Training tokens: SEQ, rounded up to a multiple of 2C (the zigzag layout's chunks)."""
    return -(-SEQ // (2 * world_size)) * 2 * world_size


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(filename: str, lineno: int) -> str:
    """A short file:line: from the package (transformers/..., torch/..., cp_compile/...) down."""
    parts = Path(filename).parts
    for root in ("cp_compile", "transformers", "torch", "huggingface_hub"):
        if root in parts:
            return f"{'/'.join(parts[len(parts) - 1 - parts[::-1].index(root) :])}:{lineno}"
    return f"{Path(filename).name}:{lineno}"


_PACKAGE = Path(__file__).resolve().parents[2]  # cp_compile/
_INSTRUMENTS = _PACKAGE / "tools"  # this command and its kin: their errors are not the library's
# Inside a plan every torch call passes through the plan's TorchFunctionMode (guard.py): an error a torch op
# raises shows that frame last. It is a pass-through, not where the error comes from.
_PASS_THROUGH = (_PACKAGE / "guard.py",)


def _innermost(e: BaseException):
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() not in _PASS_THROUGH]
    return frames[-1] if frames else None


def _raised_in_cp_compile(e: BaseException) -> bool:
    """``e`` was raised by cp_compile's own code (not by this command, nor by a torch op the plan's guard
    passed through)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False
    path = Path(frames[-1].filename).resolve()
    return _PACKAGE in path.parents and path not in _PASS_THROUGH and _INSTRUMENTS not in path.parents


def _located(e: BaseException) -> str:
    frame = _innermost(e)
    return f" ({_where(frame.filename, frame.lineno)})" if frame else ""


def outcome(e: BaseException) -> tuple[str, str]:
    """(status, detail) of an exception from a CP run: ``refused`` for cp_compile's own clear errors, else
    ``failed`` (type, first line, innermost file:line)."""
    from ... import LocalAttentionError, UnsupportedAttention

    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:  # Dynamo and others wrap the error they hit
        seen.add(id(cause))
        if isinstance(cause, (UnsupportedAttention, LocalAttentionError)):
            return "refused", f"{type(cause).__name__}: {_first_line(cause)}"
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    if isinstance(e, (ValueError, NotImplementedError)) and _raised_in_cp_compile(e):
        return "refused", f"{type(e).__name__}: {_first_line(e)}"
    return "failed", f"{type(e).__name__}: {_first_line(e)}{_located(e)}"


def _reference_failed(e: BaseException) -> dict:
    return {"status": "reference-failed", "detail": f"one process: {type(e).__name__}: {_first_line(e)}{_located(e)}"}


def _rel(a, b, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor) (0 when both are all zeros)."""
    a, b = a.detach().double(), b.detach().double()
    scale = max(b.abs().max().item() if b.numel() else 0.0, floor)
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def _token_loss(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def _build(cls, config, attn: str):
    import torch

    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(config), attn_implementation=attn, dtype=torch.float32)


def _reference_model(cls, config):
    """The one-process model: "sdpa", or "eager" where the family has no SDPA path."""
    try:
        return _build(cls, config, "sdpa"), "sdpa"
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        return _build(cls, config, "eager"), "eager"


@contextlib.contextmanager
def _counting_attention(calls: list):
    """Counts the calls of the "cp_compile" attention function meanwhile: a model that never calls it does not
    go through transformers' attention interface."""
    from transformers import AttentionInterface

    from ...hf import NAME

    original = AttentionInterface._global_mapping[NAME]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    AttentionInterface.register(NAME, counted)
    try:
        yield
    finally:
        AttentionInterface.register(NAME, original)


def _train(model, reference, group) -> dict:
    """One training step on seq_len(C) tokens under CP against one process: loss, logits and summed gradients."""
    import torch
    import torch.distributed as dist

    import cp_compile

    seq = seq_len(dist.get_world_size(group))
    ids = torch.randint(0, ID_RANGE, (1, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)  # shifted on the global sequence
    items = int((labels != -100).sum())
    try:
        reference.train()
        ref_out = reference(ids, use_cache=False)
        ref_loss = _token_loss(ref_out.logits, labels) / items
        ref_loss.backward()
    except Exception as e:  # noqa: BLE001
        return _reference_failed(e)
    plan = cp_compile.ContextParallel(group)
    calls = [0]
    try:
        model.train()
        with plan, _counting_attention(calls):
            out = model(plan.shard(ids, 1), position_ids=plan.positions(seq)[None], use_cache=False)
            loss = _token_loss(out.logits, plan.shard(labels, 1)) / items  # this rank's share of the global mean
            loss.backward()
        params = [(n, p) for n, p in model.named_parameters()]
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for _, p in params])
        total = torch.cat([loss.detach().reshape(1), grads])
        dist.all_reduce(total, group=group)  # loss and gradients summed over the CP ranks
    except Exception as e:  # noqa: BLE001
        status, detail = outcome(e)
        return {"status": status, "detail": detail}
    ref_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in reference.named_parameters()}
    # Each gradient relative to its own largest magnitude, floored at GRAD_FLOOR of the model's largest: a
    # gradient that is zero analytically (a key projection's bias: softmax ignores a per-query constant) is
    # rounding noise on both sides, and noise relative to noise says nothing.
    floor = GRAD_FLOOR * max(g.abs().max().item() for g in ref_grads.values())
    worst, worst_name, offset = 0.0, None, 1
    for name, p in params:
        summed = total[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        err = _rel(summed, ref_grads[name], floor)
        if err > worst or worst_name is None:
            worst, worst_name = err, name
    metrics = {
        "loss": _rel(total[0], ref_loss.detach()),
        "logits": _rel(out.logits, plan.shard(ref_out.logits, 1)),
        "grads": worst,
        "worst_grad": worst_name,
        "attention_calls": calls[0],
    }
    return {"status": "exact" if max(metrics["loss"], metrics["logits"], worst) <= TOL else "wrong", **metrics}


def _generate(model, reference, group) -> dict:
    """Greedy generation after a PROMPT-token prompt: cp_compile.hf.generate against model.generate."""
    import torch

    import cp_compile
    import cp_compile.hf

    prompt = torch.randint(0, ID_RANGE, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    try:
        reference.eval()
        with torch.no_grad():
            ref = reference.generate(prompt, **kwargs)
    except Exception as e:  # noqa: BLE001
        return _reference_failed(e)
    plan = cp_compile.ContextParallel(group)
    try:
        model.eval()
        with plan, torch.no_grad():
            out = cp_compile.hf.generate(model, prompt, **kwargs)
    except Exception as e:  # noqa: BLE001
        status, detail = outcome(e)
        return {"status": status, "detail": detail}
    mine, theirs = out.sequences[0, PROMPT:].tolist(), ref.sequences[0, PROMPT:].tolist()
    steps = min(len(out.logits), len(ref.logits))
    logits = _rel(torch.stack(out.logits[:steps]), torch.stack(ref.logits[:steps])) if steps else 0.0
    first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    if first is None and len(mine) != len(theirs):
        first = min(len(mine), len(theirs))
    same = first is None
    return {
        "status": "exact" if same and logits <= TOL else "wrong",
        "logits": logits,
        "first_diff": first,
        "tokens": len(theirs),
        "differ": sum(a != b for a, b in zip(mine, theirs)) + abs(len(mine) - len(theirs)),
    }


def family_on_rank(name: str, group_timeout: float = GROUP_TIMEOUT_S) -> dict:
    """Runs on every rank: build the family's tiny model twice (CP, reference), then both phases.

    Each phase runs on a process group of its own (the plan's group: ``ContextParallel(group)``) with a short
    timeout, and the ranks meet on the default group after each phase: a rank left waiting in a collective
    because another rank raised gives up after the timeout, and the next phase or family starts in step, from
    clean groups."""
    import torch.distributed as dist

    import cp_compile.hf  # noqa: F401  (registers attn_implementation="cp_compile")

    groups = [dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout)) for _ in range(2)]
    try:
        with _quiet(), contextlib.redirect_stdout(io.StringIO()):  # some model code prints
            return _family(name, groups)
    finally:
        for group in groups:
            _destroy(group)


def _destroy(group) -> None:
    """Destroys a phase's group on this rank (each phase starts from a group of its own)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001  (destroyed already, or left broken by a failed collective)
        pass


def _family(name: str, groups) -> dict:
    row: dict[str, Any] = {"family": name}
    try:
        config, cls, note = tiny_config(name)
        row.update(
            model=cls.__name__,
            config=type(config).__name__,
            note=note,
            layer_types=sorted(set(_layer_kinds(config) or [])) or None,
        )
        reference, row["reference"] = _reference_model(cls, config)
    except Exception as e:  # noqa: BLE001
        failed = _reference_failed(e)
        failed["detail"] = failed["detail"].replace("one process:", "building the tiny model:", 1)
        return {**row, "train": failed, "generate": dict(failed)}
    try:
        model = _build(cls, config, "cp_compile")
        model.load_state_dict(reference.state_dict())
    except Exception as e:  # noqa: BLE001
        status, detail = outcome(e)
        if isinstance(e, KeyError) and e.args == ("cp_compile",):  # a table of the model's own attention classes
            status = "not-loadable"
            detail = (
                f"transformers cannot build {cls.__name__} with attn_implementation='cp_compile': the model "
                f"looks its attention classes up by name ({detail}); cp_compile never runs"
            )
        return {**row, "train": {"status": status, "detail": detail}, "generate": {"status": status, "detail": detail}}
    row["parameters"] = sum(p.numel() for p in model.parameters())
    row["takes_position_ids"] = "position_ids" in inspect.signature(type(model).forward).parameters
    row["train"] = _train(model, reference, groups[0])
    _between_phases(groups[0])
    row["generate"] = _generate(model, reference, groups[1])
    _between_phases(groups[1])
    return row


def _between_phases(group) -> None:
    """Every rank waits here for the others to finish the phase (on the default group, whose timeout outlasts a
    phase group's): a rank that raised early must not start the next phase's collectives while another still
    waits out a collective of this one."""
    import torch.distributed as dist

    dist.barrier()
    _destroy(group)


# --- the sweep, on the caller's side ------------------------------------------------------------------------

SEVERITY = (
    "wrong",
    "failed",
    "reference-failed",
    "not-loadable",
    "refused",
    "exact",
)  # the worst rank's status is the family's


def _merge_phase(per_rank: list[dict]) -> dict:
    statuses = [r["status"] for r in per_rank]
    worst = min(statuses, key=SEVERITY.index)
    if len(set(statuses)) > 1:  # ranks disagree: say what each saw
        detail = "; ".join(
            f"rank {i} {r['status']}: {r.get('detail') or describe_phase(r)}" for i, r in enumerate(per_rank)
        )
        return {"status": worst, "detail": detail, "ranks": per_rank}
    merged = dict(per_rank[0])
    for key in ("loss", "logits", "grads"):  # the largest difference over the ranks
        values = [r[key] for r in per_rank if key in r]
        if values:
            merged[key] = max(values)
            if key == "grads":
                merged["worst_grad"] = max(per_rank, key=lambda r: r[key])["worst_grad"]
    return merged


def describe_phase(phase: dict) -> str:
    """A short human-readable detail of one phase's result."""
    if "detail" in phase:
        return phase["detail"]
    if "grads" in phase:  # train
        worst = max(phase["loss"], phase["logits"], phase["grads"])
        text = (
            f"max rel diff {worst:.1e} (loss {phase['loss']:.1e}, logits {phase['logits']:.1e}, "
            f"grads {phase['grads']:.1e}"
        )
        if phase["status"] != "wrong":
            return text + ")"
        hint = "" if phase.get("attention_calls") else "; never called the attention interface"
        return text + f" in {phase['worst_grad']}{hint})"
    if phase.get("first_diff") is None:
        return f"{phase['tokens']} tokens same, logits {phase['logits']:.1e}"
    return (
        f"{phase['differ']} of {phase['tokens']} tokens differ from token {phase['first_diff']}, "
        f"logits {phase['logits']:.1e}"
    )


def run_family(run: Callable, name: str, timeout: float = FAMILY_TIMEOUT_S) -> dict:
    """One family on every rank through ``run(fn, *args, timeout=...)`` (``RankPool.run``, or the test
    fixture); a rank that raises outside the phases, dies or hangs makes the family ``failed``."""
    from ..launch import RankError

    start = time.perf_counter()
    try:
        per_rank = run(family_on_rank, name, timeout=timeout)
    except (RankError, TimeoutError) as e:
        if isinstance(e, RankError):
            rank, (kind, message, _) = sorted(e.errors.items())[0]
            detail = f"rank {rank} raised {kind}: {(message.strip().splitlines() or [''])[0][:160]}"
        else:
            detail = f"{type(e).__name__}: {_first_line(e)}"
        phase = {"status": "failed", "detail": detail}
        return {"family": name, "train": phase, "generate": dict(phase), "seconds": time.perf_counter() - start}
    row = {k: v for k, v in per_rank[0].items() if k not in ("train", "generate")}
    for phase in ("train", "generate"):
        row[phase] = _merge_phase([r[phase] for r in per_rank])
    row["seconds"] = time.perf_counter() - start
    return row


def sweep(
    names: list[str], run: Callable, timeout: float = FAMILY_TIMEOUT_S, on_row: Optional[Callable[[dict], None]] = None
) -> list[dict]:
    """Every family in ``names`` (skipped ones with their reason), each run on the ranks behind ``run``."""
    rows = []
    for name in names:
        reason = skip_reason(name)
        row = {"family": name, "skipped": reason} if reason else run_family(run, name, timeout)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _status(row: dict, phase: str) -> str:
    return "skipped" if row.get("skipped") else row[phase]["status"]


def detail(row: dict) -> str:
    if row.get("skipped"):
        return row["skipped"]
    train, gen = row["train"], row["generate"]
    if row.get("takes_position_ids") is False:
        row = {**row, "note": "; ".join(filter(None, [row.get("note"), "forward() has no position_ids"]))}
    if train["status"] == gen["status"] and train.get("detail") and train.get("detail") == gen.get("detail"):
        text = train["detail"]
    else:
        text = f"train: {describe_phase(train)}; generate: {describe_phase(gen)}"
    return f"{text} [{row['note']}]" if row.get("note") else text


COLUMNS = (26, 16, 16)


def table_header() -> str:
    return f"{'family':<{COLUMNS[0]}} {'train':<{COLUMNS[1]}} {'generate':<{COLUMNS[2]}} detail"


def table_row(row: dict) -> str:
    return (
        f"{row['family']:<{COLUMNS[0]}} {_status(row, 'train'):<{COLUMNS[1]}} "
        f"{_status(row, 'generate'):<{COLUMNS[2]}} {detail(row)}"
    )


def summary(rows: list[dict]) -> str:
    ran = [r for r in rows if not r.get("skipped")]
    parts = [f"{len(rows)} families: {len(ran)} run, {len(rows) - len(ran)} skipped"]
    for phase in ("train", "generate"):
        counts = {s: sum(r[phase]["status"] == s for r in ran) for s in STATUSES}
        parts.append(f"{phase}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "; ".join(parts)


def markdown(rows: list[dict], meta: dict) -> str:
    """The table as a Markdown section (what docs/guides/models.md embeds)."""

    def cell(text: str) -> str:  # Markdown-safe: no table breaks, no HTML, no emphasis from code names
        text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")
        for char in "\\`*_[]|":
            text = text.replace(char, "\\" + char)
        return text

    lines = [
        f"<!-- generated by `{meta['command']}` on {meta['date']}: transformers {meta['transformers']}, "
        f"torch {meta['torch']}, C={meta['world_size']}, {meta['seconds']:.0f} s -->",
        "",
        f"*{summary(rows)}.*",
        "",
        "| Family | Train | Generate | Detail |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| `{row['family']}` | {_status(row, 'train')} | {_status(row, 'generate')} | {cell(detail(row))} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--families",
        default=None,
        help="comma list of model types (as in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES); default: all",
    )
    p.add_argument("--world-size", "-C", type=int, default=2, help="CP ranks (default 2)")
    p.add_argument("--timeout", type=float, default=FAMILY_TIMEOUT_S, help="seconds per family on the ranks")
    p.add_argument("--out", type=Path, default=None, help="JSON with every row and its measurements")
    p.add_argument("--markdown", type=Path, default=None, help="the table as a Markdown section (for the docs)")


def main(args: argparse.Namespace) -> int:
    import sys

    import torch
    import transformers

    from ..launch import RankPool

    known = causal_lm_families()
    names = [n for n in args.families.split(",") if n] if args.families else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(
            f"not causal-LM families of transformers {transformers.__version__}: {', '.join(unknown)}", file=sys.stderr
        )
        return 2
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, C={args.world_size} gloo ranks; "
        f"train: {seq_len(args.world_size)} tokens, generate: {NEW} tokens after {PROMPT}; "
        f"exact within {TOL:g} relative"
    )
    print(table_header(), flush=True)
    start = time.perf_counter()
    with RankPool(args.world_size) as pool:
        rows = sweep(names, pool.run, args.timeout, on_row=lambda row: print(table_row(row), flush=True))
    seconds = time.perf_counter() - start
    print(summary(rows))
    print(f"{seconds:.0f} s")
    command = (
        "python -m cp_compile models"
        + (f" -C {args.world_size}" if args.world_size != 2 else "")
        + (f" --families {args.families}" if args.families else "")
    )
    meta = {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "world_size": args.world_size,
        "seconds": seconds,
        "seq": seq_len(args.world_size),
        "prompt": PROMPT,
        "new_tokens": NEW,
        "tolerance": TOL,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(rows, meta))
    return (
        1
        if any(not r.get("skipped") and "wrong" in (r["train"]["status"], r["generate"]["status"]) for r in rows)
        else 0
    )
