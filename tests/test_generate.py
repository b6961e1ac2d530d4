"""Inference under CP: the sharded KV cache, cp::cached_attention, and Hugging Face generation against one process."""

import copy

import pytest
import torch
from helpers import max_err

WORLD_SIZES = [1, 2, 3, 4]


def cached_parity(window, dtype):
    """A 37-token cache dealt to the ranks in random slots (with empty ones), 5 queries at the end of the
    sequence: cp::cached_attention against SDPA over the whole cache with the same visibility, in fp64."""
    import torch.distributed as dist
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cp_compile
    from cp_compile.kernels.masked import EMPTY_POSITION

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    length, queries = 37, 5
    q, k, v = (
        torch.randn(1, h, n, 16, generator=gen, dtype=torch.float64)
        for h, n in ((4, queries), (2, length), (2, length))
    )
    owner = torch.randint(0, world, (length,), generator=gen)  # any split, any slot order
    mine = (owner == rank).nonzero().flatten()
    mine = mine[torch.randperm(mine.numel(), generator=torch.Generator().manual_seed(rank))]
    slots = mine.numel() + 3  # three empty slots
    k_pos = torch.full((slots,), EMPTY_POSITION)
    k_pos[: mine.numel()] = mine
    local_k, local_v = (
        torch.zeros(1, 2, slots, 16, dtype=torch.float64),
        torch.zeros(1, 2, slots, 16, dtype=torch.float64),
    )
    local_k[:, :, : mine.numel()], local_v[:, :, : mine.numel()] = k[:, :, mine], v[:, :, mine]
    q_pos = torch.arange(length - queries, length)  # the last 5 tokens, each sees itself and what came before

    behind = q_pos[:, None] - torch.arange(length)[None]
    visible = (behind >= 0) & ((behind < window) if window else True)
    reference = sdpa(q, k, v, attn_mask=visible, enable_gqa=True)
    single = sdpa(*(t.to(dtype) for t in (q, k, v)), attn_mask=visible, enable_gqa=True)
    out = cp_compile.cached_attention(q.to(dtype), local_k.to(dtype), local_v.to(dtype), q_pos, k_pos, window=window)
    everyone = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(everyone, out)
    return max_err(out, reference), max_err(single, reference), all(torch.equal(o, out) for o in everyone)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("window", [None, 4])
def test_cached_attention_matches_one_device(ranks, world_size, window):
    for err, _, same in ranks(world_size, cached_parity, window, torch.float64):
        assert err < 1e-12 and same
    for err, single, same in ranks(world_size, cached_parity, window, torch.bfloat16):
        assert err <= 2 * single and same, (err, single)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt", [1, 7, 24])
def test_cache_shards_hold_every_token_once_and_stay_balanced(world_size, prompt):
    """The C shards of one layer (built in one process; placement needs no collective): a prompt prefilled by
    the packed layout, then 1-, 3- and 1-token appends. Every position lives on exactly one rank, in one slot,
    and the slots that hold tokens are the first ``written()`` (what an eager decode step reads, unmasked)."""
    from cp_compile.inference.cache import CacheShard
    from cp_compile.kernels.masked import EMPTY_POSITION
    from cp_compile.layout.packed import packed_slots, shard_packed

    total = prompt + 5
    tokens = torch.randn(1, 2, total, 8)
    shards = [CacheShard("unused", r, world_size, total) for r in range(world_size)]
    cu = torch.tensor([0, prompt])
    for r, shard in enumerate(shards):
        slots = packed_slots(cu, r, world_size)
        local = shard_packed(tokens[:, :, :prompt], 2, cu, r, world_size)
        shard.prefill(local, local, torch.where(slots["real"], slots["pos"], EMPTY_POSITION), prompt)
        start = prompt
        for n in (0, 1, 3, 1):
            if n:
                step = shard.append(tokens[:, :, start : start + n], tokens[:, :, start : start + n])
                assert torch.equal(step.query_positions, torch.arange(start, start + n))
            start += n
            holds = shard.positions[: shard.capacity] != EMPTY_POSITION
            assert holds[: shard.written()].all() and not holds[shard.written() :].any()
    held = [s.positions[: s.capacity][s.positions[: s.capacity] != EMPTY_POSITION] for s in shards]
    assert sorted(torch.cat(held).tolist()) == list(range(total))
    assert max(map(len, held)) - min(map(len, held)) <= 2
    for shard, positions in zip(shards, held):
        stored = shard.keys[:, :, : shard.capacity][:, :, shard.positions[: shard.capacity] != EMPTY_POSITION]
        assert torch.equal(stored, tokens[:, :, positions])
        assert shard.capacity <= total // world_size + 3
    with pytest.raises(ValueError, match="holds"):
        shards[0].append(tokens[:, :, :1], tokens[:, :, :1])


def window_shard_steps(window: int, prompt: int, steps: list):
    """This rank's window layer after a prompt and then ``steps``: per step, the (position, key) pairs this
    rank's share lets the new tokens see, from a fixed number of slots."""
    import torch.distributed as dist

    from cp_compile.inference.cache import CacheShard
    from cp_compile.kernels.masked import EMPTY_POSITION
    from cp_compile.layout.packed import packed_slots, shard_packed
    from cp_compile.plan import ContextParallel

    plan = ContextParallel()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = torch.randn(1, 2, prompt + sum(steps), 8, generator=torch.Generator().manual_seed(3))
    shard = CacheShard(plan.group_name, rank, world, 200, window)
    cu = torch.tensor([0, prompt])
    slots = packed_slots(cu, rank, world)
    local = shard_packed(tokens[:, :, :prompt], 2, cu, rank, world)
    shard.prefill(local, local, torch.where(slots["real"], slots["pos"], EMPTY_POSITION), prompt)
    seen, start = [], prompt
    for n in steps:
        new = tokens[:, :, start : start + n]
        step = shard.append(new, new)
        assert torch.equal(step.query_positions, torch.arange(start, start + n))
        wanted = (step.key_positions > start - window) & (step.key_positions < start + n)
        positions = step.key_positions[wanted]
        assert torch.equal(step.keys[:, :, wanted], tokens[:, :, positions])  # each slot holds its own token
        seen.append(positions.tolist())
        start += n
    return shard.capacity, seen


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("steps", [[1] * 12, [20, 1, 3]])
def test_window_shards_keep_what_later_queries_see(ranks, world_size, steps):
    """A window of 6 after a 23-token prompt: each step's tokens must find, over all ranks, every position of
    their windows exactly once, from ceil(6 / C) + 1 slots per rank (a 20-token step is longer than the ring)."""
    window, prompt = 6, 23
    per_rank = ranks(world_size, window_shard_steps, window, prompt, steps)
    assert all(capacity == -(-window // world_size) + 1 for capacity, _ in per_rank)
    start = prompt
    for i, n in enumerate(steps):
        everyone = sorted(p for _, seen in per_rank for p in seen[i])
        assert everyone == list(range(start - window + 1, start + n))
        start += n


# --------------------------------------------------------------------------------------------
# Hugging Face generation
# --------------------------------------------------------------------------------------------

PROMPTS = [1, 9, 30]  # 9 and 30 are not multiples of 2C for C = 2, 3, 4
NEW = 64


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))


def hf_generate_parity(arch: str, prompts: list, new: int, sample: bool = False):
    """cp_compile.hf.generate against "sdpa" generate on one process: tokens, logits, cache bytes per rank."""
    from test_hf import rel_err, tiny_model

    import cp_compile
    import cp_compile.hf

    plan = cp_compile.ContextParallel()
    model, reference = tiny_model(arch, "cp_compile"), tiny_model(arch, "sdpa")
    reference.load_state_dict(model.state_dict())
    kwargs = dict(max_new_tokens=new, do_sample=sample, output_logits=True, return_dict_in_generate=True)
    results = []
    for n in prompts:
        torch.manual_seed(5)
        ref = reference.generate(_prompt(n), **kwargs)
        torch.manual_seed(5)
        with plan:
            out = cp_compile.hf.generate(model, _prompt(n), **kwargs)
        full = [i for i, layer in enumerate(ref.cache.layers) if not layer.is_sliding]
        sliding = [i for i, layer in enumerate(ref.cache.layers) if layer.is_sliding]
        results.append(
            dict(
                prompt=n,
                same_tokens=torch.equal(out.sequences, ref.sequences),
                logits_err=rel_err(torch.stack(out.logits), torch.stack(ref.logits)),
                cache_bytes=sum(out.cache.layers[i].nbytes for i in full),
                one_process_bytes=sum(ref.cache.layers[i].keys.nbytes * 2 for i in full),
                window_bytes=sum(out.cache.layers[i].nbytes for i in sliding),
                one_process_window_bytes=sum(ref.cache.layers[i].keys.nbytes * 2 for i in sliding),
            )
        )
    return results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_generate_matches_one_process(ranks, world_size):
    """Greedy, 64 new tokens after prompts of 1, 9 and 30 tokens; Llama, Qwen2 (a sliding-window layer) and
    Mistral (every layer a window of 8, shorter than the sequence)."""
    for arch in ("llama", "qwen2", "mistral"):
        per_rank = ranks(world_size, hf_generate_parity, arch, PROMPTS, NEW, timeout=600)
        for results in per_rank:
            for r in results:
                assert r["same_tokens"] and r["logits_err"] < 1e-5, (arch, r)
        # Full-attention layers: one process caches 93 tokens, each rank 1/C of them plus at most 5 slots.
        # Sliding layers (window 8): one process keeps 7 tokens, each rank a ring of ceil(8 / C) + 1 slots
        # and one scratch slot.
        longest = per_rank[0][-1]
        if longest["one_process_bytes"]:
            assert longest["cache_bytes"] <= longest["one_process_bytes"] * (1 / world_size + 5 / 93)
        if longest["one_process_window_bytes"]:
            slots = -(-8 // world_size) + 2
            assert longest["window_bytes"] == longest["one_process_window_bytes"] / 7 * slots


def hf_batch_parity(arch: str, lengths: list, new: int, sample: bool):
    """cp_compile.hf.generate of a left-padded batch against "sdpa" generate of the same batch on one process:
    tokens, logits, and the bytes of full-attention K/V this rank keeps against one process's."""
    from test_hf import rel_err, tiny_model

    import cp_compile
    import cp_compile.hf

    plan = cp_compile.ContextParallel()
    model, reference = tiny_model(arch, "cp_compile"), tiny_model(arch, "sdpa")
    reference.load_state_dict(model.state_dict())
    from cp_compile.tools.generate_batch import left_padded

    ids, mask = left_padded([_prompt(n)[0] for n in lengths])  # pad id 0
    kwargs = dict(
        attention_mask=mask,
        pad_token_id=0,
        max_new_tokens=new,
        do_sample=sample,
        output_logits=True,
        return_dict_in_generate=True,
    )
    torch.manual_seed(5)
    ref = reference.generate(ids, **kwargs)
    torch.manual_seed(5)
    with plan:
        out = cp_compile.hf.generate(model, ids, **kwargs)
    full = [i for i, layer in enumerate(ref.cache.layers) if not layer.is_sliding]
    return dict(
        same_tokens=torch.equal(out.sequences, ref.sequences),
        logits_err=rel_err(torch.stack(out.logits), torch.stack(ref.logits)),
        cache_bytes=sum(out.cache.layers[i].nbytes for i in full),
        one_process_bytes=sum(ref.cache.layers[i].keys.nbytes * 2 for i in full),
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_left_padded_batch_generates_as_one_process(ranks, world_size):
    """Four prompts of 9, 1, 30 and 5 tokens padded on the left, 24 new tokens each, sampled (one draw for the batch
    per step, as one process) and greedy; Llama, Qwen2 (a sliding-window layer), Mistral (every layer a window of 8).
    Each row is prefilled sharded on its own; no slot holds padding, so a rank keeps about 1/C of the batch's K/V."""
    for arch, sample in (("llama", True), ("qwen2", False), ("mistral", True)):
        for result in ranks(world_size, hf_batch_parity, arch, [9, 1, 30, 5], 24, sample, timeout=600):
            assert result["same_tokens"] and result["logits_err"] < 1e-5, (arch, result)
            # one process: 4 rows of 53 slots; a rank: 4 rows of 54 // C + 4 slots (3 of slack, 1 scratch)
            if result["one_process_bytes"]:
                assert result["cache_bytes"] <= result["one_process_bytes"] * (54 // world_size + 4) / 53, result


def why_batches_are_refused(families: list) -> dict:
    """``hf.generate.why_not_batched`` for the model sweep's tiny config of each family (no generation runs)."""
    import cp_compile
    from cp_compile.hf.generate import why_not_batched
    from cp_compile.tools.bench import model_configs, model_run

    plan = cp_compile.ContextParallel()
    reasons = {}
    for family in families:
        config, cls, _ = model_configs.tiny_config(family)
        reasons[family] = why_not_batched(model_run._build(cls, config, "cp_compile"), plan)
    return reasons


def test_a_batch_is_refused_where_its_rows_cannot_share_one_cache(ranks):
    expected = {
        "llama": None,
        "qwen3_5": None,
        "deepseek_v32": "indexed sparse attention",
        "gemma3n_text": "shares its keys",
        "mamba": "keep states alone",
        "rwkv": "reads no attention mask",
        "openai-gpt": "keeps no cache",
        "xlnet": "whole",
    }
    (reasons,) = ranks(1, why_batches_are_refused, list(expected))
    for family, text in expected.items():
        if text is None:
            assert reasons[family] is None, (family, reasons[family])
        else:
            assert reasons[family] is not None and text in reasons[family], (family, reasons[family])


def counted_compile_config() -> tuple:
    """transformers' ``CompileConfig`` for a compiled decode step (fullgraph, aot_eager) on any device, and the list
    of the graphs it makes."""
    from transformers import CompileConfig

    graphs: list = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    config = CompileConfig(fullgraph=True, backend=counting, mode=None)
    config._compile_all_devices = True  # transformers compiles decoding on its own on GPUs only
    return config, graphs


def update_without_kwargs_parity(family: str, prompts: list, new: int, compiled: bool = False):
    """A family whose attention calls cache.update(k, v, layer_idx) without its kwargs, from the model sweep's tiny
    config: cp_compile.hf.generate against "sdpa" generate on one process (tokens, logits), and the graphs a compiled
    decode made (transformers' CompileConfig, aot_eager)."""
    from test_hf import rel_err

    import cp_compile
    import cp_compile.hf
    from cp_compile.tools.bench import model_configs, model_run

    torch._dynamo.reset()
    config, cls, _ = model_configs.tiny_config(family)
    model, reference = model_run._build(cls, config, "cp_compile"), model_run._build(cls, config, "sdpa")
    reference.load_state_dict(model.state_dict())
    kwargs = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    compile_config, graphs = counted_compile_config()
    if compiled:
        kwargs["compile_config"] = compile_config
    plan = cp_compile.ContextParallel()
    results = []
    for n in prompts:
        ids = torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(n))
        ref = reference.generate(ids, **{k: v for k, v in kwargs.items() if k != "compile_config"})
        with plan:
            out = cp_compile.hf.generate(model, ids, **kwargs)
        same = torch.equal(out.sequences, ref.sequences)
        results.append((same, rel_err(torch.stack(out.logits), torch.stack(ref.logits))))
    return results, len(graphs)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("family", ["gpt_neox", "ctrl"])
def test_generate_when_the_model_updates_the_cache_without_its_kwargs(ranks, family, world_size):
    """GPT-NeoX and CTRL hand the attention only the keys cache.update returned: the step rides with them."""
    for results, _ in ranks(world_size, update_without_kwargs_parity, family, [1, 9, 30], 16):
        assert all(same and err < 1e-5 for same, err in results), results


def test_compiled_decode_when_the_model_updates_the_cache_without_its_kwargs(ranks):
    """The step handed over with the keys is traced with them: one graph for every token."""
    for results, graphs in ranks(2, update_without_kwargs_parity, "gpt_neox", [9], 16, True):
        assert all(same and err < 1e-5 for same, err in results) and graphs == 1, (results, graphs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sampling_with_one_seed_matches_one_process(ranks, world_size):
    for results in ranks(world_size, hf_generate_parity, "qwen2", [9], 32, True):
        assert results[0]["same_tokens"] and results[0]["logits_err"] < 1e-5, results


def follow_up_and_plain_generate(arch: str):
    """Two ways in that skip the sharded prefill, both multi-token steps over the sharded cache: a follow-up
    prompt against the cache of an earlier generation, and model.generate with a ShardedCache passed in."""
    from test_hf import tiny_model

    import cp_compile
    import cp_compile.hf

    plan = cp_compile.ContextParallel()
    model, reference = tiny_model(arch, "cp_compile"), tiny_model(arch, "sdpa")
    reference.load_state_dict(model.state_dict())
    first, follow = _prompt(11), _prompt(6)
    from transformers import DynamicCache

    ref_cache = DynamicCache(config=reference.config)
    ref_first = reference.generate(first, max_new_tokens=8, do_sample=False, cache=ref_cache)
    ref_second = reference.generate(
        torch.cat([ref_first, follow], 1), max_new_tokens=8, do_sample=False, cache=ref_cache
    )
    with plan:
        cache = cp_compile.hf.ShardedCache(model.config, max_cache_len=64)
        out_first = cp_compile.hf.generate(model, first, cache=cache, max_new_tokens=8, do_sample=False)
        out_second = cp_compile.hf.generate(
            model, torch.cat([out_first, follow], 1), cache=cache, max_new_tokens=8, do_sample=False
        )
        plain = model.generate(
            first, cache=cp_compile.hf.ShardedCache(model.config, 64), max_new_tokens=8, do_sample=False
        )
    return torch.equal(out_second, ref_second), torch.equal(plain, ref_first)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("world_size", [1, 3])  # one rank: each prompt is one step on the fused causal kernel
def test_follow_up_prompt_and_plain_generate_with_a_sharded_cache(ranks, arch, world_size):
    for follow_up, plain in ranks(world_size, follow_up_and_plain_generate, arch):
        assert follow_up and plain


def compiled_decode(arch: str, prompts: list, new: int):
    """transformers' own compiled decoding (a compileable cache, CompileConfig) through aot_eager, counting graphs."""
    from test_hf import tiny_model

    import cp_compile
    import cp_compile.hf

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    model, reference = tiny_model(arch, "cp_compile"), tiny_model(arch, "sdpa")
    reference.load_state_dict(model.state_dict())
    config, graphs = counted_compile_config()
    same, counts = [], []
    for n in prompts:
        ref = reference.generate(_prompt(n), max_new_tokens=new, do_sample=False)
        with plan:
            out = cp_compile.hf.generate(model, _prompt(n), max_new_tokens=new, do_sample=False, compile_config=config)
        same.append(torch.equal(out, ref))
        counts.append(len(graphs))
    return same, counts, [gm.code for gm in graphs]


@pytest.mark.parametrize("world_size", [1, 2])  # one rank: the step attends as one process does, lowered whole
def test_compiled_decode_captures_one_graph_for_every_token(ranks, world_size):
    """64 tokens from one graph; a second prompt length (a new cache size) compiles once more, a third none.
    The graphs hold neither the rank nor the position: the same code on every rank."""
    per_rank = ranks(world_size, compiled_decode, "qwen2", [9, 20, 30], NEW, timeout=600)
    for same, counts, _ in per_rank:
        assert all(same) and counts == [1, 2, 2], (same, counts)
    assert all(codes == per_rank[0][2] for _, _, codes in per_rank)
    one_rank = "cp.cached_attention" not in per_rank[0][2][0]
    assert one_rank == (world_size == 1)


def _own_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention code of a model's own: SDPA over whatever keys it is handed, the mask ignored."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


class StopAt:
    """A stopping rule that ends generation once the sequence has grown by ``steps`` tokens."""

    def __init__(self, steps: int):
        self.steps, self.start = steps, None

    def __call__(self, input_ids, scores, **kwargs):
        self.start = self.start or input_ids.shape[1] - 1
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.start >= self.steps)


def refusals():
    """What generation under CP refuses, each on every rank before any collective could hang: name -> message."""
    import torch.distributed as dist
    import transformers
    from test_hf import tiny_model

    import cp_compile
    import cp_compile.hf

    plan = cp_compile.ContextParallel()
    model = tiny_model("llama", "cp_compile")
    ids = _prompt(9)
    seen = {}

    def refused(name, fn):
        try:
            fn()
        except (cp_compile.UnsupportedAttention, ValueError, RuntimeError) as e:
            seen[name] = f"{type(e).__name__}: {e}"

    generate = lambda **kw: cp_compile.hf.generate(model, kw.pop("ids", ids), max_new_tokens=4, **kw)  # noqa: E731
    refused("outside a plan", generate)
    with plan:
        for name, kwargs in [
            ("num_beams", dict(num_beams=2)),
            ("num_return_sequences", dict(num_return_sequences=2, do_sample=True)),
            ("penalty_alpha", dict(penalty_alpha=0.6, top_k=4)),
            ("max_time", dict(max_time=10.0)),
            ("padding", dict(attention_mask=torch.tensor([[1] * 8 + [0]]))),
            ("batch", dict(ids=ids.repeat(2, 1), cache=cp_compile.hf.ShardedCache(model.config, 16))),
            ("batch without a cache", dict(ids=ids.repeat(2, 1), use_cache=False)),
            ("small cache", dict(cache=cp_compile.hf.ShardedCache(model.config, 10))),
        ]:
            refused(name, lambda: generate(**kwargs))
        refused("model.generate", lambda: model.generate(ids, max_new_tokens=4))  # the prompt would not be sharded
        refused("other prompts", lambda: generate(ids=_prompt(9) + dist.get_rank()))
        # the same ids, padding on one rank alone: the mask decides the route (a batch's), so it is agreed too
        other_mask = torch.ones(1, 9, dtype=torch.long)
        other_mask[0, 0] = dist.get_rank() == 0
        refused("other masks", lambda: generate(attention_mask=other_mask))
        torch.manual_seed(dist.get_rank())  # sampling seeded differently on each rank
        refused(
            "other seeds",
            lambda: cp_compile.hf.generate(model, ids, max_new_tokens=32, do_sample=True, temperature=5.0),
        )
        # the same tokens, but rank 0 stops after 3 of them: the others are in their next step's collectives
        stop = StopAt(3 if dist.get_rank() == 0 else 100)
        refused("other stops", lambda: cp_compile.hf.generate(model, ids, max_new_tokens=8, stopping_criteria=[stop]))
        seen["after"] = cp_compile.hf.generate(model, ids, max_new_tokens=4).shape  # nobody left waiting
        # decoding sets the guard aside: a layer whose attention leaves "cp_compile" after the prefill is caught
        cache = cp_compile.hf.ShardedCache(model.config, 16)
        cp_compile.hf.sharded_prefill(model, plan, cache, ids[:, :-1])
        transformers.AttentionInterface.register("own", _own_attention)
        own = copy.copy(model.config)
        own._attn_implementation = "own"
        model.model.layers[1].self_attn.config = own
        refused("own attention", lambda: cp_compile.hf.generate(model, ids, cache=cache, max_new_tokens=4))
        # the prefill keeps the guard on: it catches a layer that attends on its own there
        refused("own attention in the prefill", lambda: cp_compile.hf.generate(model, ids, max_new_tokens=4))
        model.model.layers[1].self_attn.config = model.config
    return seen


def test_what_generation_under_cp_refuses(ranks):
    expected = {
        "outside a plan": "inside `with plan:`",
        "num_beams": "beam search",
        "num_return_sequences": "several sequences",
        "penalty_alpha": "contrastive search",
        "max_time": "wall-clock",
        "padding": "padding must be on the left",
        "batch": "made from its rows",
        "batch without a cache": "batch of prompts: the generation keeps no cache",
        "small cache": "max_cache_len=12",  # 9 + 4 tokens, the last never fed back
        "model.generate": r"cp_compile.hf.generate",
        "other prompts": "different prompts",
        "other masks": "different prompts",
        "other seeds": "different tokens",
        "other stops": "stopped at different steps",
        "own attention": "layers [1] of the ShardedCache",
        "own attention in the prefill": "F.scaled_dot_product_attention ran eagerly inside `with plan:`",
    }
    per_rank = ranks(2, refusals, timeout=300)
    for seen in per_rank:
        assert seen.pop("after") == (1, 13)
        assert set(seen) == set(expected), set(expected) ^ set(seen)
        for name, text in expected.items():
            assert text in seen[name], (name, seen[name])
    assert per_rank[0] == per_rank[1]  # the same error on every rank


def without_a_cache() -> dict:
    """``use_cache=False``: every step runs the whole sequence, sharded; then sampling seeded differently on each
    rank, and a stopping rule that stops one rank alone, raise on every rank (none left waiting)."""
    import torch.distributed as dist
    from test_hf import rel_err, tiny_model

    import cp_compile
    import cp_compile.hf

    plan = cp_compile.ContextParallel()
    model, reference = tiny_model("llama", "cp_compile"), tiny_model("llama", "sdpa")
    ids = _prompt(9)
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = reference.generate(ids, **kwargs)
        with plan:
            out = cp_compile.hf.generate(model, ids, **kwargs)
    seen = {
        "tokens": out.sequences.tolist() == ref.sequences.tolist(),
        "logits": max(rel_err(a, b) for a, b in zip(out.logits, ref.logits)),
    }
    with plan:
        for name, call in [
            ("seeds", lambda: cp_compile.hf.generate(model, ids, max_new_tokens=16, do_sample=True, use_cache=False)),
            (
                "stops",
                lambda: cp_compile.hf.generate(model, ids, max_new_tokens=8, use_cache=False, stopping_criteria=[stop]),
            ),
        ]:
            torch.manual_seed(dist.get_rank() if name == "seeds" else 0)
            stop = StopAt(3 if dist.get_rank() == 0 else 100)
            try:
                call()
                seen[name] = "no error"
            except RuntimeError as e:
                seen[name] = str(e)
        seen["after"] = cp_compile.hf.generate(model, ids, max_new_tokens=2, use_cache=False).shape
    return seen


def test_generation_without_a_cache(ranks):
    for seen in ranks(2, without_a_cache, timeout=300):
        assert seen["tokens"] and seen["logits"] < 1e-5, seen
        assert "different tokens or stopped at different steps" in seen["seeds"], seen
        assert "different tokens or stopped at different steps" in seen["stops"], seen
        assert seen["after"] == (1, 11)


def opcheck_cached():
    from cp_compile.plan import ContextParallel

    plan = ContextParallel()
    from cp_compile.inference.cached import CachedSettings

    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    k_pos, q_pos = torch.tensor([0, 4, 2, 2**62, 1]), torch.tensor([4, 5, 6])
    for v_dim, options in [
        (8, CachedSettings().encode()),
        (6, CachedSettings(chunk=4).encode()),
        (8, CachedSettings(softcap=2.0).encode()),
    ]:
        v = torch.randn(1, 2, 5, v_dim)
        torch.library.opcheck(
            torch.ops.cp.cached_attention.default, (q, k, v, q_pos, k_pos, plan.group_name, -1, 0.3, options)
        )
    tag = torch.tensor([0.0, float(plan.rank)])  # a tag rides along: every rank's comes back, in rank order
    torch.library.opcheck(
        torch.ops.cp.cached_attention.default,
        (q, k, k, q_pos, k_pos, plan.group_name, -1, 0.3, CachedSettings().encode(), tag),
    )
    tags = torch.ops.cp.cached_attention(
        q, k, k, q_pos, k_pos, plan.group_name, -1, 0.3, CachedSettings().encode(), tag
    )[2]
    assert torch.equal(tags, torch.tensor([[0.0, 0.0], [0.0, 1.0]])), tags
    return True


def test_cached_attention_passes_opcheck(ranks):
    assert all(ranks(2, opcheck_cached))


def nothing_visible():
    """Queries before every cached key (and empty slots) on every rank: out 0, never NaN."""
    import cp_compile
    from cp_compile.kernels.masked import EMPTY_POSITION

    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 3, 8)
    return cp_compile.cached_attention(q, k, k, torch.tensor([0, 1]), torch.tensor([5, 6, EMPTY_POSITION]))


def test_a_query_that_sees_nothing_gets_zeros(ranks):
    for out in ranks(2, nothing_visible):
        assert torch.equal(out, torch.zeros_like(out))


def decode_step_syncs():
    """Device reads (``.item()``, ``int()``, ``bool()`` of a tensor) in eager decode steps of a model over a
    ShardedCache, full and sliding-window layers: each would stall a GPU step."""
    from test_hf import tiny_model
    from torch.utils._python_dispatch import TorchDispatchMode

    import cp_compile
    import cp_compile.hf

    reads = []

    class DeviceReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(func)
            return func(*args, **(kwargs or {}))

    plan = cp_compile.ContextParallel()
    model = tiny_model("qwen2", "cp_compile").eval()
    ids = _prompt(12)
    with plan, torch.no_grad():
        cache = cp_compile.hf.ShardedCache(model.config, 32)
        cp_compile.hf.sharded_prefill(model, plan, cache, ids[:, :-1])
        with DeviceReads():
            for position in (11, 12, 13):
                model(ids[:, -1:], cache=cache, use_cache=True, position_ids=torch.tensor([[position]]))
        seen = cache.get_seq_length()
    return len(reads), seen


def test_decode_steps_read_nothing_from_the_device(ranks):
    assert ranks(2, decode_step_syncs) == [(0, 14), (0, 14)]


def test_decoding_takes_the_model_call_hooks_out_and_puts_them_back_in_place():
    """While ``cp_compile.hf.generate`` decodes, module calls take torch's fast path (a global hook turns it off for
    every module); the hooks come back under the same keys, in the same order, so no compiled module recompiles."""
    from torch.nn.modules import module as torch_module

    from cp_compile.hf.checks import model_call_checks, model_calls_unfollowed

    with model_call_checks():
        pass
    others = torch_module.register_module_forward_hook(lambda *args: None)  # a hook of someone else's, after ours
    try:
        dicts = (
            torch_module._global_forward_pre_hooks,
            torch_module._global_forward_hooks,
            torch_module._global_forward_hooks_with_kwargs,
            torch_module._global_forward_hooks_always_called,
        )
        before = [list(d.items()) for d in dicts]
        with model_calls_unfollowed():
            assert not torch_module._global_forward_pre_hooks
            assert list(torch_module._global_forward_hooks) == [others.id]
        assert [list(d.items()) for d in dicts] == before
    finally:
        others.remove()
