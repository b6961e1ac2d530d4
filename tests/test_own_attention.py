"""Attention modules of their own code under CP (BLOOM's and MPT's ALiBi, XGLM, GPT-NeoX-Japanese): their projections
on each rank's shard, their attention by the schedules, ALiBi's bias as one more key dimension
(``cp_compile.hf.own_forwards``, ``hf.own_attention``).

Each family's own config and model classes (the model sweep's tiny configs), random weights, against one process: a
training step in fp64 at C = 1 to 4 (every gradient to 1e-12 of a plan of one rank's), compiled, in bf16 against an
fp64 reference, and generation from a cache sharded over the ranks."""

from typing import Optional

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the HF integration")

FAMILIES = ("bloom", "mpt", "xglm", "gpt_neox_japanese")
ALIBI = ("bloom", "mpt")
# transformers' XGLM fills its masked scores with torch.full((), fp64's minimum), a default-dtype (fp32) tensor that
# cannot hold it: in fp64 it is checked against a plan of one rank (and against one process in fp32 by the models sweep)
NO_FP64 = ("xglm",)
# expert layers of grouped matmuls, which take no fp64: compared with one process in the step's own dtype alone
NO_FP64_AT_ALL = ("inkling_text", "inkling2_text")


def test_bias_columns_carry_the_fp32_bias():
    """fp64 carries ``bias / scale`` in one column; bf16 in three limbs whose sum is fp32's value of it."""
    from cp_compile.hf.own_forwards import bias_columns

    slopes = torch.tensor([2**-0.5, 2**-1, 2**-4.5], dtype=torch.float32)
    positions = torch.arange(5000, dtype=torch.int64)
    bias = slopes[:, None] * (positions - 4999).float()[None]
    wide = bias_columns(slopes, positions, 4999, 0.125, torch.float64)
    assert wide.shape == (3, 5000, 1) and torch.equal(wide[..., 0], bias.double() / 0.125)
    limbs = bias_columns(slopes, positions, 4999, 0.125, torch.bfloat16)
    assert limbs.shape == (3, 5000, 3) and limbs.dtype == torch.bfloat16
    summed = limbs.float().sum(-1)
    assert ((summed - bias / 0.125).abs() <= (bias / 0.125).abs() * 2**-22).all()
    # one bf16 column alone would be off by up to 2^-9 of the bias: the limbs are what makes it fp32
    assert ((limbs[..., 0].float() - bias / 0.125).abs().max() > 1.0).item()


def test_the_widened_dot_product_is_the_scores_plus_the_bias():
    from cp_compile.hf.own_forwards import bias_columns, with_bias

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, dtype=torch.float64, generator=g) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125])
    positions = torch.arange(40)
    scale = 8**-0.5
    bias = (slopes[:, None] * positions.float()[None]).double()  # [H, L]: the key's
    scores = q @ k.transpose(-1, -2) * scale + bias[None, :, None, :]
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    expected = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    wq, wk, wv = with_bias(q, k, v, bias_columns(slopes, positions, 0, scale, torch.float64))
    out = torch.nn.functional.scaled_dot_product_attention(wq, wk, wv, is_causal=True, scale=scale)
    assert wq.shape[-1] == 9 and (out[..., 8] == 0).all()
    assert (out[..., :8] - expected).abs().max() < 1e-13


def _models(family: str, dtype, overrides: Optional[dict] = None, noise: Optional[str] = None):
    """The family's tiny model for a plan and one process's, the same weights: ``overrides`` of its config, and the
    parameters whose names end in ``noise`` drawn at random (one seed) in place of their initial values."""
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config(family)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    model, (reference, _) = model_run._build(cls, config, "cp_compile"), model_run._reference_model(cls, config)
    if noise is not None:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
                if name.endswith(noise):
                    drawn = torch.randn(mine.shape, generator=g)
                    mine.copy_(drawn), theirs.copy_(drawn)
    return config, model.to(dtype), reference.to(dtype)


def _step(model, ids, labels, items, positions):
    # BLOOM and MPT read no position_ids; a plan's model call is given them all the same (hf.checks)
    logits = model(ids, position_ids=positions, use_cache=False).logits
    wide = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    loss = torch.nn.functional.cross_entropy(wide, labels.flatten(), ignore_index=-100, reduction="sum") / items
    loss.backward()
    return loss


def train_step(
    family: str,
    dtype_name: str = "float64",
    mode: str = "eager",
    length: int = 96,
    overrides: Optional[dict] = None,
    noise: Optional[str] = None,
) -> dict:
    """One training step under the plan against one process in the same dtype and in fp64: relative errors of the
    loss and of the worst gradient (each against its own scale), and the route's modules. A family whose one process
    cannot run in fp64 (``NO_FP64``) is compared with nothing: its summed gradients alone. ``overrides``, ``noise``:
    ``_models``'."""
    import torch.distributed as dist

    import cp_compile
    import cp_compile.hf  # noqa: F401
    from cp_compile.tools.bench import model_configs

    torch._dynamo.reset()
    dtype = getattr(torch, dtype_name)
    config, model, reference = _models(family, dtype, overrides, noise)
    fp64 = family not in NO_FP64 and family not in NO_FP64_AT_ALL
    exact = _models(family, torch.float64, overrides, noise)[2] if fp64 else None
    plan = cp_compile.ContextParallel()
    seq = -(-length // (2 * plan.world_size)) * 2 * plan.world_size
    ids = torch.randint(model_configs.first_id(config), 100, (1, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    items = seq - 1
    whole = torch.arange(seq)[None]
    if family not in NO_FP64:
        ref_loss = _step(reference, ids, labels, items, whole)
    if exact is not None:
        _step(exact, ids, labels, items, whole)
    forward = model if mode == "eager" else torch.compile(model, backend=plan.backend(mode), fullgraph=True)
    with plan:
        loss = _step(forward, plan.shard(ids, 1), plan.shard(labels, 1), items, plan.positions(seq)[None])
    grads = [p.grad.double() for p in model.parameters()]
    total = torch.cat([loss.detach().double().reshape(1)] + [g.flatten() for g in grads])
    dist.all_reduce(total)

    def worst(got, against):
        floor = 1e-6 * max(float(g.abs().max()) for g in against)
        return max(
            float((a.view_as(b) - b).abs().max() / max(float(b.abs().max()), floor)) for a, b in zip(got, against)
        )

    rerouted = sum("forward" in m.__dict__ for m in model.modules())
    if family in NO_FP64:
        return {"rerouted": rerouted, "summed": total}
    summed = total[1:].split([g.numel() for g in grads])
    one = [p.grad.double() for p in reference.parameters()]
    result = {
        "loss": abs(float(total[0]) - float(ref_loss.detach())) / abs(float(ref_loss.detach())),
        "grads": worst(summed, one),
        "rerouted": rerouted,
        "summed": total,
    }
    if exact is not None:
        fp64_grads = [p.grad for p in exact.parameters()]
        result.update(grads_vs_fp64=worst(summed, fp64_grads), one_process_vs_fp64=worst(one, fp64_grads))
    return result


# transformers' BLOOM and MPT take the softmax in fp32 whatever the model's dtype: in fp64 one process is as close to
# CP as fp32's rounding of the probabilities (with its softmax in fp64, BLOOM's gradients agree to 3e-15)
ONE_PROCESS_FP64 = {"bloom": 2e-6, "mpt": 2e-6, "gpt_neox_japanese": 1e-9}


_ALONE: dict = {}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_training_step_is_exact_in_fp64(ranks, world_size):
    """Against one process (its fp32 softmax bounds the difference), and against a plan of one rank to 1e-12: the
    schedules, the shards' positions and the bias add nothing that depends on C."""
    for family in FAMILIES:
        if family not in _ALONE:  # a plan of one rank's step, once per family for the three C
            (_ALONE[family],) = ranks(1, train_step, family)
        alone = _ALONE[family]
        assert alone["rerouted"] >= 1, alone
        assert family in NO_FP64 or alone["grads"] < ONE_PROCESS_FP64[family], (family, alone)
        for result in ranks(world_size, train_step, family):
            assert family in NO_FP64 or max(result["loss"], result["grads"]) < ONE_PROCESS_FP64[family], result
            worst = float((result["summed"] - alone["summed"]).abs().max() / alone["summed"].abs().max())
            assert worst < 1e-12, (family, worst)


@pytest.mark.parametrize("world_size", [2])
def test_compiled(ranks, world_size):
    for family in ONE_PROCESS_FP64:
        for result in ranks(world_size, train_step, family, "float64", "aot_eager"):
            assert max(result["loss"], result["grads"]) < ONE_PROCESS_FP64[family], (family, result)


@pytest.mark.parametrize("world_size", [2])
def test_the_other_routes_compiled(ranks, world_size):
    """Compiled whole (``plan.backend("aot_eager")``, fullgraph), in fp64 against one process: Doge's queries over
    every rank's K/V, and RWKV's state passing (its WKV's Python loop unrolled by Dynamo at this length; its own fp32
    keys bound it). Inkling and xLSTM were checked the same way by hand (5.5e-7 in fp32, 1.9e-7)."""
    for family, bound in [("doge", 1e-10), ("rwkv", 1e-6)]:
        for result in ranks(world_size, train_step, family, "float64", "aot_eager"):
            assert max(result["loss"], result["grads"]) < bound, (family, result)


@pytest.mark.parametrize("world_size", [2])
def test_bf16_within_twice_one_process_error(ranks, world_size):
    """ALiBi's bias travels as three bf16 limbs (fp32's bits): CP's gradients are as close to fp64's as one process's
    (BLOOM's own bias is rounded to bf16; MPT keeps its fp32)."""
    for family in ONE_PROCESS_FP64:
        for result in ranks(world_size, train_step, family, "bfloat16", "eager", 256):
            assert result["grads_vs_fp64"] <= 2 * result["one_process_vs_fp64"], (family, result)


@pytest.mark.parametrize("world_size", [2, 3])
def test_packed_documents(ranks, world_size):
    """Packed documents with position_ids alone, as one process is given them: BLOOM and MPT take no positions and XGLM
    builds its mask without them, so one process attends across the documents and CP does too (the tokens sharded as
    documents, the attention over their places in the row: ``across_documents``); GPT-NeoX-Japanese passes them to
    its mask, which keeps each document to itself."""
    from test_hf_hybrids import _check
    from test_hf_hybrids import train_step as packed_step

    for family in FAMILIES:
        _check(ranks(world_size, packed_step, family, "eager", [1, 7, 19, 13]), ("packed", family))


@pytest.mark.parametrize("world_size", [3])  # C = 2 checked the same way by hand
def test_packed_documents_of_the_other_routes(ranks, world_size):
    """Packed documents with position_ids alone through the routes of modules of their own: Doge's and Inkling's
    queries over every rank's K/V, their mask rows kept to each document as one process's mask keeps them; RWKV's and
    xLSTM's state passing and OpenAI GPT's attention through the documents, as one process runs them."""
    from test_hf_hybrids import _check
    from test_hf_hybrids import train_step as packed_step

    for family in ("doge", "inkling_text", "inkling2_text", "rwkv", "xlstm", "openai-gpt"):
        _check(ranks(world_size, packed_step, family, "eager", [1, 7, 19, 13]), ("packed", family))


def generate_from_a_sharded_cache(
    family: str,
    prompt: int,
    dtype=torch.float32,
    overrides: Optional[dict] = None,
    noise: Optional[str] = None,
    distinct: bool = False,
) -> dict:
    """Greedy generation with the cache on (MPT's config has it off) against one process: tokens, logits, the cache
    class, and its keys and values per rank against one process's. ``distinct``: a prompt of distinct tokens."""
    import cp_compile
    import cp_compile.hf

    config, model, reference = _models(family, dtype, overrides, noise)
    model.eval(), reference.eval()
    g = torch.Generator().manual_seed(prompt)
    ids = (
        torch.randperm(100, generator=g)[None, :prompt] if distinct else torch.randint(0, 100, (1, prompt), generator=g)
    )
    kwargs = dict(max_new_tokens=16, do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = reference.generate(ids, **kwargs)
        with cp_compile.ContextParallel() as plan:
            out = cp_compile.hf.generate(model, ids, **kwargs)
    from cp_compile.hf.cache import ShardedCache

    cache = out.past_key_values
    full = [i for i, layer in enumerate(cache.layers) if getattr(layer, "window", None) is None]  # windows: a ring
    held = sum(cache.layers[i].keys.numel() + cache.layers[i].values.numel() for i in full)
    whole = sum(ref.past_key_values.layers[i].keys.numel() + ref.past_key_values.layers[i].values.numel() for i in full)
    logits = torch.stack(out.logits).double()
    expected = torch.stack(ref.logits).double()
    return {
        "same": torch.equal(out.sequences, ref.sequences),
        "logits": float((logits - expected).abs().max() / expected.abs().max()),
        "sharded": isinstance(cache, ShardedCache),
        "cache_ratio": held / whole if full else None,
        "world_size": plan.world_size,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_generation_keeps_a_share_of_the_cache(ranks, world_size):
    for family in FAMILIES:
        for result in ranks(world_size, generate_from_a_sharded_cache, family, 200):
            assert result["same"] and result["logits"] < 1e-5 and result["sharded"], (family, result)
            if world_size == 2:
                assert result["cache_ratio"] <= 0.6, (family, result)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_modules_scoring_their_keys_decode_from_a_share_of_the_cache(ranks, world_size):
    """Doge, Inkling, Inkling 2 and Inkling 2 Loop decode with each rank holding its share of the K/V
    (``ShardedCacheOfOwnAttention``): each rank's module scores its own keys under its bias (Inkling's by distance,
    Doge's per key), the ranks merge by log-sum-exp (Inkling 2's sinks counted once). Doge in fp64 with ``A`` random
    and a keep window shorter than the keys a query sees, so that every step's top-k is taken over every rank's keys
    (a top-k over each rank's own would keep C times as many): without a sliding window (24 of the sequence's keys)
    and with its config's (8 of 16). Its prompt's tokens are distinct: a repeated token has the same values in the
    first layer, so the same bias, and where such a tie sits at the top-k's threshold, which key the top-k keeps
    depends on the row's length, in one process too (a prompt run whole or as all but its last token, then that
    token, differ there). Tokens and logits against one process's; the cache per rank of the layers without a
    window (a window's is a ring of its own size) at C = 2 at most 0.6x one process's."""
    cases = [
        ("doge", 90, torch.float64, {"keep_window_size": 24, "sliding_window": None}, ".A"),
        ("doge", 90, torch.float64, {"keep_window_size": 8}, ".A"),
    ]
    cases += [(family, 200, torch.float32, None, None) for family in ("inkling_text", "inkling2_text")]
    cases += [("inkling2_loop_text", 200, torch.float32, None, None)]
    for family, prompt, dtype, overrides, noise in cases:
        distinct = family == "doge"
        for result in ranks(
            world_size, generate_from_a_sharded_cache, family, prompt, dtype, overrides, noise, distinct
        ):
            assert result["same"] and result["logits"] < 1e-5 and result["sharded"], (family, result)
            if world_size == 2 and result["cache_ratio"] is not None:
                assert result["cache_ratio"] <= 0.6, (family, result)


@pytest.mark.parametrize("world_size", [3])
def test_sampled_generation_with_processors(ranks, world_size):
    """Sampled with repetition penalties, n-gram bans and a stopping rule, prompts of 1 and 30 tokens (the first
    decoded from an empty cache), as one process with the same seed; ranks seeded differently all raise."""
    from test_hf_hybrids import generate_reading_the_sequence

    for family in ("bloom", "gpt_neox_japanese"):
        for results in ranks(world_size, generate_reading_the_sequence, family, [1, 30]):
            *runs, refusal = results
            for same, new, err in runs:
                assert same and new == 20 and err < 1e-5, (family, runs)
            assert "different tokens" in refusal, refusal


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_doge_dynamic_mask_over_every_rank_keys(ranks, world_size):
    """Doge's dynamic mask: a bias per key from the values, cut to each query's ``keep_window_size`` top keys. Each
    rank's queries see every rank's keys and values (gathered) through the rows of the mask one process builds, which
    the module turns into its dynamic mask as one process does. In fp64 against one process: its initial ``A = 0``
    (every key's bias 1, so the top keys are a tie the top-k breaks, the same way for the same row), and ``A`` drawn at
    random; the top-k on (a keep window shorter than the sequence) and off."""
    for keep, noise in [(2048, None), (24, None), (24, ".A")]:
        for result in ranks(world_size, train_step, "doge", overrides={"keep_window_size": keep}, noise=noise):
            assert result["rerouted"] >= 1 and max(result["loss"], result["grads"]) < 1e-10, (keep, noise, result)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_inkling_relative_bias_over_every_rank_keys(ranks, world_size):
    """Inkling's and Inkling 2's relative bias (each query's own bank of biases by distance, zero beyond
    ``rel_extent``) and log scaling, from the queries' global positions, over every rank's keys (Inkling 2: with its
    sinks, and its dynamic short convolutions by the halo): against one process, the bias reaching past a rank's
    tokens (``rel_extent`` 1024) and ending within them (20 tokens), log scaling on. In fp32: their expert layers
    take no fp64 (grouped matmuls), so the bound is fp32's rounding."""
    for family in ("inkling_text", "inkling2_text"):
        for overrides in [{}, {"rel_extent": 20, "log_scaling_n_floor": 8}]:
            for result in ranks(world_size, train_step, family, "float32", overrides=overrides):
                assert result["rerouted"] >= 1 and max(result["loss"], result["grads"]) < 2e-5, (family, result)
