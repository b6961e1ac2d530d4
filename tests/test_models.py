"""``python -m cp_compile models`` on every causal-LM family of the installed transformers: under CP each family
is exact against one process, or refused with cp_compile's own error; never silently wrong."""

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the model sweep")

# one sequence, a sliding-window layer, windows on every layer; chunked attention (applied only by the mask),
# a window applied only by the mask, soft-capped scores, attention sinks, multi-head latent attention
MUST_BE_EXACT = ["llama", "qwen2", "mistral", "llama4_text", "phimoe", "gemma2", "gpt_oss", "deepseek_v3"]
MUST_BE_EXACT += ["gpt_neox", "ctrl"]  # they call cache.update(k, v, layer_idx) without their attention kwargs
# sparse attention chosen by an indexer (DSA); an attention sink and an output gate besides (HY-v4)
MUST_BE_EXACT += ["deepseek_v32", "glm_moe_dsa", "hy_v4"]
MUST_BE_EXACT += ["gemma3n_text"]  # layers attending to an earlier layer's K/V and keeping none
MUST_BE_EXACT += ["moshi"]  # a mask without the window its cache layers apply while decoding
# attention modules of their own run on the shard without a cache (DeepSeek-V4's compressed attention: its window by
# the halo, its compressed keys pooled where their windows close and all-gathered; Qwen4-exp's block indexer and
# n-gram layers, by the same windows and the halo); given a cache, over the gathered sequence, their own cache
# classes whole on every rank
ON_THE_SHARD = ["deepseek_v4", "qwen4_exp_text"]
# hybrids whose convolutions and scans run under CP (Gated DeltaNet, KDA, Mamba2, Mamba, short convolutions), and
# Mamba2 with linear layers alone: exact in both phases
HYBRIDS = ["qwen3_next", "qwen3_5_text", "kimi_linear", "falcon_h1", "nemotron_h", "bamba", "lfm2", "jamba", "mamba2"]
# Mamba's scan per head; modules over the gathered sequence
HYBRIDS += ["zamba", "minimax", "recurrent_gemma", "zaya"]
HYBRIDS += ["rwkv"]  # its token shifts by the halo, its WKV by state passing
# generation whose every call the model builds for the whole sequence (XLNet's permutation mask over every pair of
# the step's tokens, Reformer's padding of every call to its chunk length): every rank runs it whole
GENERATED_WHOLE = ["xlnet", "reformer"]
# attention of their own: projections on the shard, attention by the schedules (ALiBi's bias as one more key
# dimension), generation from a cache sharded over the ranks (MPT's config turns the cache off: every step runs the
# whole sequence sharded)
OWN_ATTENTION = ["bloom", "mpt", "xglm", "gpt_neox_japanese"]
# Doge's dynamic mask (a bias per key, each query's top keys): this rank's queries over every rank's K/V, gathered,
# with the rows of one process's mask; it generates from a cache whose K/V every rank keeps whole
OWN_ATTENTION += ["doge"]
# Inkling's and Inkling 2's relative bias by distance and log scaling, the same way, beside their short convolutions
# by the halo (Inkling 2's dynamic ones, with per-token taps, too)
OWN_ATTENTION += ["inkling_text", "inkling2_text", "inkling2_loop_text"]
# OpenAI GPT's causal attention by its own matmuls; it keeps no transformers cache, so every generation step runs the
# whole sequence sharded, as one process runs it whole
OWN_ATTENTION += ["openai-gpt"]
# CPM-Ant's bidirectional attention blocks after the prompt rows its model puts before every call's tokens, reading
# the mask tensor: both phases (its prompt prefilled whole by generate()'s own first call, sharded)
READING_THE_MASK = ["cpmant"]
# what transformers 5.24 itself cannot do: build the model with a registered attention implementation (its
# attention classes looked up by name)
KNOWN = {"falcon": "not-loadable", "gpt_neo": "not-loadable"}


@pytest.fixture(scope="module")
def rows(ranks):
    """Every decoder-only causal-LM family of the installed transformers, on the session's 2-rank pool."""
    from cp_compile.tools.bench import models

    def run(fn, *args, timeout, **kwargs):
        return ranks(2, fn, *args, timeout=timeout, **kwargs)

    rows = models.sweep(sorted(models.causal_lm_families()), run)
    print("\n" + models.table_header())
    for row in rows:
        print(models.table_row(row))
    return {row["family"]: row for row in rows if row.get("skipped") is None}


def test_no_family_is_wrong_and_every_failure_is_known(rows):
    """A transformers upgrade that breaks a family, or a new family cp_compile gets wrong, fails here."""
    from cp_compile.tools.bench import models

    phases = ("train", "generate", "batch")
    bad = {
        name: (*(row[phase]["status"] for phase in phases), models.detail(row))
        for name, row in rows.items()
        if {row[phase]["status"] for phase in phases} - {"exact", "refused", "reference-failed", KNOWN.get(name)}
    }
    assert not bad, bad
    assert not [name for name, row in rows.items() if "wrong" in [row[phase]["status"] for phase in phases]]


# a batch of left-padded prompts generated together from one sharded cache: full and sliding-window attention, soft
# caps, sinks, MLA, and hybrids' convolution and recurrent states stacked per row
BATCH_EXACT = ["llama", "qwen2", "mistral", "phimoe", "gemma2", "gpt_oss", "deepseek_v3", "ctrl", "qwen3_5_text"]
BATCH_EXACT += ["qwen3_next", "kimi_linear", "falcon_h1", "nemotron_h", "bamba", "lfm2", "jamba", "zamba"]
BATCH_EXACT += ["xglm", "gpt_neox_japanese"]  # attention of their own, through the schedules
# refused with the reason: indexer keys per sequence, learned positions that count padding, chunks that count padding,
# layers sharing keys, states alone
BATCH_REFUSED = {
    "deepseek_v32": "indexed sparse attention",
    "llama4_text": "chunked attention",
    "gemma3n_text": "shares its keys",
    "mamba2": "keep states alone",
    "doge": "scores the cache's keys in code of its own",
    "bloom": "no position_ids",
}


@pytest.mark.parametrize("family", BATCH_EXACT)
def test_a_left_padded_batch_generates_exactly(rows, family):
    row = rows[family]["batch"]
    assert row["status"] == "exact" and row["first_diff"] is None and row["tokens"] == 4 * 12, row


@pytest.mark.parametrize("family", sorted(BATCH_REFUSED))
def test_a_batch_is_refused_with_its_reason(rows, family):
    row = rows[family]["batch"]
    assert row["status"] == "refused" and BATCH_REFUSED[family] in row["detail"], row


@pytest.mark.parametrize("family", OWN_ATTENTION)
def test_attention_of_their_own_runs_through_the_schedules(rows, family):
    row = rows[family]
    assert row["train"]["status"] == "exact" and row["train"]["grads"] < 1e-4, row["train"]
    assert row["generate"]["status"] == "exact" and row["generate"]["first_diff"] is None, row["generate"]
    assert "projections on the shard" in row["route"] and "gathered" not in row["route"], row["route"]


@pytest.mark.parametrize("family", MUST_BE_EXACT)
def test_families_whose_attention_cp_runs_are_exact(rows, family):
    row = rows[family]
    assert row["train"]["status"] == "exact", row["train"]
    assert row["generate"]["status"] == "exact", row["generate"]
    assert row["train"]["grads"] < 1e-4 and row["train"]["attention_calls"] > 0
    assert row["generate"]["first_diff"] is None and row["generate"]["tokens"] == 12


@pytest.mark.parametrize("family", ON_THE_SHARD)
def test_modules_of_their_own_on_the_shard(rows, family):
    row = rows[family]
    assert row["train"]["status"] == "exact" and row["train"]["grads"] < 1e-4, row["train"]
    assert row["generate"]["status"] == "exact", row["generate"]
    assert row["generate"]["first_diff"] is None and row["generate"]["tokens"] == 12
    assert "on the shard" in row["route"], row["route"]


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_families_are_exact(rows, family):
    row = rows[family]
    assert row["train"]["status"] == "exact" and row["train"]["grads"] < 1e-4, row["train"]
    assert row["generate"]["status"] == "exact", row["generate"]


@pytest.mark.parametrize("family", GENERATED_WHOLE)
def test_generation_cp_cannot_shard_runs_whole_on_every_rank(rows, family):
    assert rows[family]["generate"]["status"] == "exact", rows[family]["generate"]
    assert "generation: the whole model on every rank" in rows[family]["route"]


# XLNet's relative attention and Reformer's local and LSH attention (and its axial position embeddings, which tile
# the whole length) over the gathered sequence, through Reformer's reversible layers' recompute; BLT's whole model
# over the gathered bytes, its global transformer over this rank's share of the patches (its generation fails on one
# process)
@pytest.mark.parametrize("family", ["xlnet", "reformer", "blt", *READING_THE_MASK])
def test_modules_of_their_own_train_exactly_over_the_gathered_sequence(rows, family):
    row = rows[family]
    assert row["train"]["status"] == "exact" and row["train"]["grads"] < 1e-4, row["train"]
    if family in READING_THE_MASK:
        assert row["generate"]["status"] == "exact", row["generate"]


def test_xlstm_trains_by_state_passing(rows):
    """xLSTM's mLSTM by state passing; transformers' own generation fails on one process for its tiny model."""
    row = rows["xlstm"]
    assert row["train"]["status"] == "exact" and row["train"]["grads"] < 1e-4, row["train"]
    assert "state passing" in row["route"] and "gathered" not in row["route"], row["route"]
    assert row["generate"]["status"] == "reference-failed", row["generate"]


def test_sliding_windows_and_chunks_are_shorter_than_the_sequence():
    """The tiny configs keep what makes a family itself: windows and chunks that matter at 64 tokens, every layer
    type at least once, MLA's query/key head wider than its value head."""
    from cp_compile.tools.bench import model_configs

    qwen2, _, _ = model_configs.tiny_config("qwen2")
    assert qwen2.layer_types == ["full_attention", "sliding_attention"] and qwen2.sliding_window < model_configs.PROMPT
    llama4, _, _ = model_configs.tiny_config("llama4_text")
    assert set(llama4.layer_types) == {"chunked_attention", "full_attention"}
    assert llama4.attention_chunk_size < model_configs.PROMPT
    nemotron_h, _, _ = model_configs.tiny_config("nemotron_h")
    assert {"full_attention", "linear_attention"} <= set(nemotron_h.layer_types)
    deepseek, _, _ = model_configs.tiny_config("deepseek_v3")
    assert deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim != deepseek.v_head_dim
    assert (deepseek.hidden_size, deepseek.vocab_size, deepseek.attention_dropout) == (64, 128, 0.0)


def test_skipped_families_say_why():
    from cp_compile.tools.bench import model_configs

    assert "encoder-decoder" in model_configs.skip_reason("bart")
    assert "encoder" in model_configs.skip_reason("bert")
    assert "multimodal" in model_configs.skip_reason("gemma3")
    assert model_configs.skip_reason("llama") is None


def test_outcome_classifies_cp_compile_errors():
    from cp_compile import UnsupportedAttention
    from cp_compile.tools.bench import model_run

    assert model_run.outcome(UnsupportedAttention("no"))[0] == "refused"
    try:
        raise ValueError("not from cp_compile")
    except ValueError as e:
        status, detail = model_run.outcome(e)
    assert status == "failed" and "test_models.py:" in detail
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = UnsupportedAttention("inner")
    assert model_run.outcome(wrapped) == ("refused", "UnsupportedAttention: inner")


def test_outside_every_plan_each_family_is_one_process():
    """A model loaded with attn_implementation="cp_compile" and called outside every plan (a reference run, an
    evaluation, the trainer's one-process run) is one process's: its logits equal those of the model loaded with
    "sdpa", or "eager" where its family takes no SDPA (whose own attention code reads the mask tensor it is handed,
    and its modeling file's eager attention the extra arguments its model passes: sinks, a soft-cap, an indexer's
    picks). Every family of the sweep but the two whose modeling code builds attention classes by name alone."""
    import torch

    import cp_compile.hf  # noqa: F401  (registers "cp_compile")
    from cp_compile.tools.bench import model_configs, model_run

    not_loadable, wrong = [], []
    for family in model_configs.causal_lm_families():
        if model_configs.skip_reason(family):
            continue
        config, cls, _ = model_configs.tiny_config(family)
        try:
            model = model_run._build(cls, config, "cp_compile").eval()
        except KeyError:  # FALCON_ATTENTION_CLASSES[config._attn_implementation] and the like
            not_loadable.append(family)
            continue
        reference = model_run._reference_model(cls, config)[0].eval()
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(model_configs.first_id(config), model_configs.ID_RANGE, (1, 24), generator=generator)
        with torch.no_grad():
            got, expected = model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits
        error = float((got - expected).abs().max() / expected.abs().max())
        if error > 1e-6:  # fp32's rounding (a kernel's is_causal path against a mask's); a mask missed is 1e-2
            wrong.append((family, error))
    assert not wrong, wrong
    assert sorted(not_loadable) == ["falcon", "gpt_neo"], not_loadable
