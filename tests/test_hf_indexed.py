"""transformers' indexed sparse attention (DSA) under CP against one process.

Each family's own config and model classes (the model sweep's tiny configs: a top k of 16, below every sequence
length here), random weights, fp32: a training step's loss and every gradient, and greedy generation token for
token, at C = 3 and 4 (C = 2: the model sweep), compiled, and on packed documents. DeepSeek-V3.2 and GLM-MoE-DSA
(whose "shared" layers reuse the previous layer's choice) at every C, the other DSA families at C = 3.
"""

from typing import Optional

import pytest
import torch
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


def compiled_decoding(family: str, prompts: list, new: int) -> tuple:
    """transformers' compiled decoding (``CompileConfig``, fullgraph, aot_eager) under CP against one process with a
    static cache of the same 48 tokens: (same tokens, logits' relative error) per prompt, and the graphs made."""
    from test_generate import counted_compile_config
    from test_hf import rel_err

    import cp_compile
    import cp_compile.hf
    from cp_compile.tools.bench import model_configs, model_run

    torch._dynamo.reset()
    config, cls, _ = model_configs.tiny_config(family)
    model, reference = model_run._build(cls, config, "cp_compile"), model_run._build(cls, config, "sdpa")
    reference.load_state_dict(model.state_dict())
    compiled, graphs = counted_compile_config()
    kwargs = dict(
        max_new_tokens=new, max_cache_len=48, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    results = []
    for n in prompts:
        ids = torch.randint(model_configs.first_id(config), 100, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            ref = reference.generate(ids, **kwargs, **model_run.one_process_cache(reference))
        with cp_compile.ContextParallel(), torch.no_grad():
            out = cp_compile.hf.generate(model, ids, compile_config=compiled, **kwargs)
        results.append(
            (torch.equal(out.sequences, ref.sequences), rel_err(torch.stack(out.logits), torch.stack(ref.logits)))
        )
    return results, len(graphs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_compiled_decoding(ranks, world_size):
    """The index keys in a buffer of the cache's length written in place, the indexer's mask hiding the rows past the
    step (from the device's count alone), the picks merged over the ranks by one all-gather: one graph decodes every
    token of prompts shorter and longer than the top k (16), each token and logit as one process's."""
    for results, graphs in ranks(world_size, compiled_decoding, "deepseek_v32", [9, 30], 12, timeout=600):
        assert all(same and err < 1e-5 for same, err in results) and graphs == 1, (results, graphs)


def gathered_in_a_training_step(family: str) -> dict:
    """The shapes every ``cp::gather_sequence`` of one training step (forward and backward) takes, with the sizes of
    the family's latent attention."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import cp_compile
    import cp_compile.hf  # noqa: F401
    from cp_compile.tools.bench import model_configs, model_run

    class Gathers(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "cp" and func.__name__.startswith("gather_sequence"):
                self.shapes.add(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    config, cls, _ = model_configs.tiny_config(family)
    model = model_run._build(cls, config, "cp_compile")
    plan = cp_compile.ContextParallel()
    seq = model_run.seq_len(plan.world_size)
    ids = torch.randint(1, 100, (1, seq), generator=torch.Generator().manual_seed(1))
    with plan, Gathers() as gathers:
        out = model(plan.shard(ids, 1), position_ids=plan.positions(seq)[None], use_cache=False)
        out.logits.sum().backward()
    sizes = (config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim, config.num_attention_heads)
    return {"shapes": gathers.shapes, "sizes": sizes}


@pytest.mark.parametrize("family", EVERY_C)
def test_the_latent_is_gathered_not_the_heads(ranks, family):
    """DeepSeek-V3.2's and GLM-MoE-DSA's attention, absorbed (``hf.latent``), gathers the latent with its rotary key
    (one head of kv_lora_rank + qk_rope_head_dim, the values its leading columns) and the index keys: never the
    heads' keys and values, which a route through transformers' ``expand_kv`` would gather."""
    for seen in ranks(2, gathered_in_a_training_step, family):
        latent, rope, index, heads = seen["sizes"]
        heads_and_widths = {shape[2:] for shape in seen["shapes"] if len(shape) == 4}  # [B, T, H, D]
        index_widths = {shape[2] for shape in seen["shapes"] if len(shape) == 3}
        assert heads_and_widths == {(1, latent + rope)} and index_widths == {index} and heads > 1, seen


def test_packed_documents(ranks):
    """Documents of 1, 7, 19 and 13 tokens in one row, position_ids alone: one process's indexer and attention
    mask each document on its own (transformers finds the documents from the positions), and so do the ranks."""
    for world_size in (2, 3):
        _check(ranks(world_size, train_step, "deepseek_v32", "eager", [1, 7, 19, 13]), world_size)


def test_generate_sampled_from_a_one_token_prompt(ranks):
    """Sampled with repetition penalties and a user's stopping rule, prompts of 1 token (the indexer's hook put on
    before generate's first step, which no sharded prefill precedes), 2 and 30 (past the top k of 16); ranks seeded
    differently all raise.

    One process runs with a static cache (``model_run.one_process_cache``): the tiny model's two index heads leave
    many scores at exactly 0 after the ReLU, and ``topk`` breaks those ties by the row's length; a ``ShardedCache``
    scores every row of its buffer as a static cache does, so a prompt prefilled then stepped picks as one call."""
    for results in ranks(2, generate_reading_the_sequence, "deepseek_v32", [1, 2, 30]):
        *runs, refusal = results
        for same, new, err in runs:
            assert same and new == 20 and err < 1e-5, runs
        assert "different tokens" in refusal, refusal


def picks_across_ranks(family: str, block_elements: Optional[int] = None) -> dict:
    """One forward under the plan with every indexer's top k recorded on both sides. Per layer: the picks this
    rank's queries may see against one process's at the same global rows (as sets: the top k's order among equal
    scores is not the model's), and the share of them that another rank holds; and the logits against one
    process's. ``block_elements``: the bound on a block's temporaries (``kernels.sparse``) for the call, and the
    blocks of rows the indexer's scores then take."""
    import torch

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")
    import cp_compile.kernels.sparse as sparse
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
    bound = sparse._BLOCK_ELEMENTS
    sparse._BLOCK_ELEMENTS = block_elements or bound
    try:
        with torch.no_grad():
            want = reference(ids, use_cache=False).logits[0]
            with plan:
                places = plan.positions(seq)
                got = model(plan.shard(ids, 1), position_ids=places[None], use_cache=False).logits[0]
        blocks = len(sparse.row_blocks(seq // plan.world_size, config.index_n_heads * seq))
    finally:
        sparse._BLOCK_ELEMENTS = bound
    mine = set(places.tolist())
    layers = []
    for cp_picks, one_picks in zip(picks["cp"], picks["one"], strict=True):
        same, elsewhere, seen = True, 0, 0
        for row, place in enumerate(places.tolist()):
            chosen = {int(k) for k in cp_picks[row] if k <= place}
            same &= chosen == {int(k) for k in one_picks[place] if k <= place}
            elsewhere, seen = elsewhere + len(chosen - mine), seen + len(chosen)
        layers.append({"same": same, "elsewhere": elsewhere / seen})
    return {"layers": layers, "logits": float((got - want[places]).abs().max() / want.abs().max()), "blocks": blocks}


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


@pytest.mark.parametrize("family", EVERY_C + AT_THREE)
def test_the_indexer_by_blocks_of_rows_picks_as_one_process(ranks, family):
    """The indexer's scores by blocks of three query rows (``hf.indexed``, a bound on a block's temporaries cut for the
    test): every query picks what one process picks, at C = 2 and 3. A block's mask taken from other rows, or its
    scores from other queries, would pick otherwise."""
    for world_size in (2, 3):
        for result in ranks(world_size, picks_across_ranks, family, 3 * 2 * 64):
            assert result["logits"] < 1e-5 and result["blocks"] > 5, (world_size, result)
            assert all(layer["same"] for layer in result["layers"]), (world_size, result)
