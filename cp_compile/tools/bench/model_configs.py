"""The tiny model of every transformers causal-LM family that ``python -m cp_compile models`` runs.

Which families are skipped and why, the size fields shrunk, per-family overrides, and ``tiny_config``
(see ``models`` for the command).
"""

from __future__ import annotations

import contextlib
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
    # its n-gram embedding layers (off by default) on the second layer: earlier tokens' ids and a dilated convolution
    "qwen4_exp_text": dict(
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=WINDOW,
        indexer_compress_ratio=4,
        ple_layer_ids=[1],
        eos_token_id=VOCAB - 3,  # its n-gram segments end at EOS (which the batches and prompts never hold)
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
        hash_seed=0,  # the same random rotations in every call: one process's and each rank's LSH buckets agree
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
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cls_name = causal_lm_families()[name]
        if "ConditionalGeneration" in cls_name:
            return f"{MULTIMODAL} ({cls_name})"
        config_class = model_class(name).config_class or CONFIG_MAPPING[name]
        try:
            default = config_class()
        except Exception:  # noqa: BLE001  (reported by tiny_config, which overrides what fails)
            return None
        return "encoder-decoder config" if getattr(default, "is_encoder_decoder", False) else None


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


def _shrunk(default) -> dict[str, Any]:
    """Constructor kwargs: every SIZES field the config sets (to more), dropout 0; sub-configs alike (as dicts)."""
    from transformers import PretrainedConfig

    kwargs: dict[str, Any] = {}
    stored = default.to_dict()
    for key, value in SIZES.items():
        have = stored.get(key)
        if isinstance(have, int) and not isinstance(have, bool) and (key == "num_nextn_predict_layers" or have > value):
            kwargs[key] = value
    kwargs.update({key: value for key, value in WHEN_NONE.items() if key in stored and stored[key] is None})
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
        sub = _get(default, key) if isinstance(value, dict) else None
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
        kwargs.update({field: list(dict.fromkeys(kinds)), "num_hidden_layers": len(set(kinds))})
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
        first = list(dict.fromkeys(mlp_kinds))  # the first of each kind
        late["mlp_layer_types"] = (first + first[-1:] * layers)[: max(layers, len(first))]
        late["num_hidden_layers"] = max(layers, len(first))
    if late:
        kwargs.update(late)
        config = config_class(**kwargs)
    missing = set(kinds or ()) - set(_layer_kinds(config) or ())
    if missing:
        note = "; ".join(filter(None, [note, f"no {', '.join(sorted(missing))} layer in the tiny model"]))
    _special_tokens(config, keep_eos=config.model_type in NEEDS_EOS)
    return config, cls, note


# families whose model reads its EOS id (Qwen4-exp's n-gram embedding with its PLE layers on)
NEEDS_EOS = ("qwen4_exp_text",)


def _special_tokens(config, keep_eos: bool = False) -> None:
    """Padding and BOS ids at the top of the tiny vocabulary (batches and prompts are drawn below them); no EOS,
    so that every generation runs all its tokens, unless the model reads it (``keep_eos``)."""
    for offset, key in enumerate(("pad_token_id", "bos_token_id")):
        if isinstance(getattr(config, key, None), int) and not isinstance(getattr(config, key), bool):
            setattr(config, key, VOCAB - 1 - offset)
    if getattr(config, "eos_token_id", None) is not None and not keep_eos:
        config.eos_token_id = None


ID_RANGE = VOCAB - 3  # token ids of the batches and prompts: below the special tokens
# families whose model code takes id 0 for padding whatever the config says (CPM-Ant masks it out)
PADDING_AT_ZERO = ("cpmant",)


def first_id(config) -> int:
    """The lowest token id of the batches and prompts: 1 where the model takes 0 for padding, else 0."""
    return int(config.model_type in PADDING_AT_ZERO)
