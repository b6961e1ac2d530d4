"""transformers' indexed sparse attention (DSA) under CP against one process.

Each family's own config and model classes (the model sweep's tiny configs: a top k of 16, below every sequence
length here), random weights, fp32: a training step's loss and every gradient, and greedy generation token for
token, at C = 3 and 4 (C = 2: the model sweep), compiled, and on packed documents. DeepSeek-V3.2 and GLM-MoE-DSA
(whose "shared" layers reuse the previous layer's choice) at every C, the other DSA families at C = 3.
"""

import pytest
from test_hf_hybrids import _check, generate_reading_the_sequence, generate_tokens, train_step

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the HF integration")

EVERY_C = ["deepseek_v32", "glm_moe_dsa"]
AT_THREE = ["hy_v4", "axk2", "dots3_note_text"]  # attention sinks and an output gate (HY-v4); AXK2; dots3


@pytest.mark.parametrize("world_size", [3, 4])
def test_train_eager_at_every_c(ranks, world_size):
    for family in EVERY_C + (AT_THREE if world_size == 3 else []):
        _check(ranks(world_size, train_step, family, "eager", None), family)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_generate_token_for_token(ranks, world_size):
    """The prompt's index keys gathered into every rank's cache layer in the sharded prefill; each decoded token's
    indexer over all of them, its attention over every rank's share of what it chose (C = 1: the prompt run as one
    step through the cache, no sharded prefill)."""
    for family in EVERY_C + (AT_THREE if world_size == 3 else []):
        for result in ranks(world_size, generate_tokens, family):
            assert result["status"] == "exact", (family, result)


def test_train_compiled(ranks):
    """DeepSeek-V3.2 compiled whole (fullgraph) with the plan's backend: the indexer's hook, the gathers and the
    sparse attention trace without a break."""
    _check(ranks(2, train_step, "deepseek_v32", "aot_eager", None), "compiled")


def test_packed_documents(ranks):
    """Documents of 1, 7, 19 and 13 tokens in one row, position_ids alone: one process's indexer and attention
    mask each document on its own (transformers finds the documents from the positions), and so do the ranks."""
    for world_size in (2, 3):
        _check(ranks(world_size, train_step, "deepseek_v32", "eager", [1, 7, 19, 13]), world_size)


def test_generate_sampled_from_a_one_token_prompt(ranks):
    """Sampled with repetition penalties and a user's stopping rule, prompts of 1 token (the indexer's hook put on
    before generate's first step, which no sharded prefill precedes) and 2; ranks seeded differently all raise.

    Short prompts: one process runs a prompt in one call, and its top k of tied index scores (the tiny model's two
    index heads leave many at exactly 0 after the ReLU) may differ from its own prefill-then-step choice (2.4e-3 on
    the last logits for a 30-token prompt, on one process alone); within the top k of the prompt's prefix, no
    choice is made."""
    for results in ranks(2, generate_reading_the_sequence, "deepseek_v32", [1, 2]):
        *runs, refusal = results
        for same, new, err in runs:
            assert same and new == 20 and err < 1e-5, runs
        assert "different tokens" in refusal, refusal


def picks_across_ranks(family: str) -> dict:
    """One forward under the plan with every indexer's top k recorded on both sides. Per layer: the picks this
    rank's queries may see against one process's at the same global rows (as sets: the top k's order among equal
    scores is not the model's), and the share of them that another rank holds; and the logits against one
    process's."""
    import torch

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")
    from cp_compile.hf.families import family_of
    from cp_compile.tools.bench import model_configs, model_run

    torch._dynamo.reset()
    config, cls, _ = model_configs.tiny_config(family)
    model, (reference, _) = model_run._build(cls, config, "cp_compile"), model_run._reference_model(cls, config)
    picks: dict[str, list] = {"cp": [], "one": []}
    for side, m in (("cp", model), ("one", reference)):
        for module in m.modules():
            if family_of(module).indexer == type(module).__name__:
                module.register_forward_hook(lambda _m, _a, out, side=side: picks[side].append(out[0].long()))
    plan = cp_compile.ContextParallel()
    seq = model_run.seq_len(plan.world_size)
    ids = torch.randint(model_configs.first_id(config), 100, (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids, use_cache=False).logits[0]
        with plan:
            places = plan.positions(seq)
            got = model(plan.shard(ids, 1), position_ids=places[None], use_cache=False).logits[0]
    mine = set(places.tolist())
    layers = []
    for cp_picks, one_picks in zip(picks["cp"], picks["one"], strict=True):
        same, elsewhere, seen = True, 0, 0
        for row, place in enumerate(places.tolist()):
            chosen = {int(k) for k in cp_picks[row] if k <= place}
            same &= chosen == {int(k) for k in one_picks[place] if k <= place}
            elsewhere, seen = elsewhere + len(chosen - mine), seen + len(chosen)
        layers.append({"same": same, "elsewhere": elsewhere / seen})
    return {"layers": layers, "logits": float((got - want[places]).abs().max() / want.abs().max())}


@pytest.mark.parametrize("family", EVERY_C)
def test_picks_cross_ranks_in_every_layer_and_match_one_process(ranks, family):
    """The tiny configs' top k (16) is a quarter of the sequence or less, and each query's picks are spread over
    the whole causal prefix: in every layer and on every rank, some of the keys a query chose live on another rank
    (a share of at least a tenth), and every query chose what one process chose, at C = 2, 3 and 4. An indexer
    that scored its own shard alone, or took its top k in local places, would choose otherwise."""
    for world_size in (2, 3, 4):
        for result in ranks(world_size, picks_across_ranks, family):
            assert result["logits"] < 1e-5, (world_size, result)
            for layer in result["layers"]:
                assert layer["same"] and layer["elsewhere"] > 0.1, (world_size, result)
