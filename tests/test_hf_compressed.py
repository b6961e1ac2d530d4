"""Attention modules of their own run on the shard (``GatheredModule.sharded``) against one process: DeepSeek-V4's
compressed attention (``hf.compressed``), Qwen4-exp's block-indexed attention and n-gram layers
(``hf.block_indexed``).

The model sweep's tiny configs, in float64: a training step's loss and every gradient at C = 1 to 4, on one sequence
and on packed documents. DeepSeek-V4's heavily compressed layers' rate is cut from 128 to 8 (so that their windows
exist at these lengths) and its indexer's top k to 6 (below its compressed sparse layers' windows). At C = 3 the
chunks (11 tokens) cut the windows of 4 and 8 apart; at C = 4 (8 tokens) DeepSeek-V4's sliding window of 16 and
Qwen4-exp's n-grams and dilated convolution (11 tokens back) reach back over two chunks, some of them the rank's
own. Qwen4-exp's sequence holds EOS ids on both sides of chunk boundaries (its n-grams stop at them).

Both models compute parts in fp32 inside a float64 model (DeepSeek-V4's compressors and indexer; Qwen4-exp's norms
and its Gated DeltaNet's torch body), so the two sides agree to fp32's rounding of those, not to float64's: Qwen4-exp
at C = 2 differs from one process by 1.6e-5 in its gradients, the same digits whether its modules run on the shard
or over the gathered sequence.
"""

import pytest
from test_hf_hybrids import _check, generate_tokens, train_step

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the HF integration")

RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
CASES = {
    "deepseek_v4": dict(overrides={"compress_rates": RATES, "index_topk": 6, "_experts_implementation": "eager"}),
    "qwen4_exp_text": dict(overrides={"_experts_implementation": "eager"}, eos_at=(15, 31, 33, 47)),
}
TOL = 1e-4  # fp32 rounding inside the models (module docstring), as the family sweeps allow


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("family", sorted(CASES))
def test_train_on_the_shard_at_every_c(ranks, family, world_size):
    for lengths in (None, [5, 37, 9, 13]):
        for result in ranks(world_size, train_step, family, "eager", lengths, fp64=True, **CASES[family]):
            assert result["loss"] < TOL and result["grads"] < TOL, (lengths, result)


def train_in_blocks(family: str, block_elements: int, lengths) -> dict:
    """``train_step`` with the bound on a block's temporaries (``kernels.sparse``) cut for the call: DeepSeek-V4's
    indexer then scores its queries a few rows at a time."""
    import cp_compile.kernels.sparse as sparse

    bound, sparse._BLOCK_ELEMENTS = sparse._BLOCK_ELEMENTS, block_elements
    try:
        return train_step(family, "eager", lengths, fp64=True, **CASES[family])
    finally:
        sparse._BLOCK_ELEMENTS = bound


def test_the_indexer_by_blocks_of_rows(ranks):
    """DeepSeek-V4's indexer scored by blocks of 3 query rows (its 2 heads against the sequence's 16 windows of 4):
    the step as one process's, on one sequence and on packed documents. A block's mask or scores taken from other
    rows would pick other windows."""
    for lengths in (None, [5, 37, 9, 13]):
        for result in ranks(2, train_in_blocks, "deepseek_v4", 3 * 2 * 16, lengths):
            assert result["loss"] < TOL and result["grads"] < TOL, (lengths, result)


@pytest.mark.parametrize("world_size", [3, 4])  # C = 2: the model sweep (tests/test_models.py)
def test_generate_token_for_token(ranks, world_size):
    """The prefill over the gathered prompt into the model's own cache classes, then every decoded token, against
    one process: the sweep's generate phase at C = 3 and 4."""
    for family in sorted(CASES):
        for result in ranks(world_size, generate_tokens, family):
            assert result["status"] == "exact", (family, result)


def test_compiled(ranks):
    """DeepSeek-V4 compiled whole (fullgraph) with the plan's backend, fp32 against one process; Qwen4-exp refused
    with its reason on every rank (its top blocks come from rows of data-dependent lengths)."""
    _check(ranks(2, train_step, "deepseek_v4", "aot_eager", None), "compiled")
    from cp_compile.tools.launch import RankError

    with pytest.raises(RankError, match="compiled: its indexer takes each query's top blocks") as raised:
        ranks(2, train_step, "qwen4_exp_text", "aot_eager", None)
    assert sorted(raised.value.errors) == [0, 1], raised.value


def ops_of_a_forward(family: str) -> dict:
    """The ``cp`` ops one forward of the family's tiny model under the plan dispatches, each with the widths (last
    dimension) of its first input, and the model's hidden size."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import cp_compile
    import cp_compile.hf  # noqa: F401
    from cp_compile.tools.bench import model_configs, model_run

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: dict[str, set] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "cp" and args and isinstance(args[0], torch.Tensor):
                self.seen.setdefault(func.__name__.split(".")[0], set()).add(args[0].shape[-1])
            return func(*args, **(kwargs or {}))

    config, cls, _ = model_configs.tiny_config(family)
    for name, value in CASES[family]["overrides"].items():
        setattr(config, name, value)
    model = model_run._build(cls, config, "cp_compile")
    plan = cp_compile.ContextParallel()
    ids = torch.randint(1, 100, (1, model_run.seq_len(plan.world_size)), generator=torch.Generator().manual_seed(1))
    with plan, Ops() as ops, torch.no_grad():
        model(plan.shard(ids, 1), position_ids=plan.positions(ids.shape[1])[None], use_cache=False)
    return {"ops": ops.seen, "hidden": config.hidden_size}


@pytest.mark.parametrize("family", sorted(CASES))
def test_the_hidden_states_stay_on_their_rank(ranks, family):
    """The modules exchange pooled keys and halos (Qwen4-exp's attention also gathers every rank's keys and values,
    one head's width each, as DSA's does), never a tensor as wide as the hidden states: a route that fell back to
    running a module over the gathered sequence would gather those (``cp::gather_sequence``)."""
    for seen in ranks(2, ops_of_a_forward, family):
        ops = seen["ops"]
        assert "gather_windows" in ops and "halo" in ops, ops
        assert all(width < seen["hidden"] for width in ops.get("gather_sequence", ())), ops
