"""transformers' hybrid families (short convolutions, Gated DeltaNet / KDA, Mamba2, Mamba) under CP against one
process.

Each family's own config and model classes (the model sweep's tiny configs: one layer of each type), random
weights, fp32: a training step's loss and every gradient (each against its own scale, as the model sweep checks
it) at C = 2, 3 and 4, eagerly, compiled with the plan's backend, and on packed documents.
"""

import contextlib
import sys
from typing import Optional

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the HF integration")

TOL = 1e-4  # relative, fp32: transformers' torch bodies of the scans compute in fp32
COVERED = [
    "bamba",
    "deepseek_v4",  # compressed attention on the shard (windows, halo); its prefill over the gathered prompt
    "falcon_h1",
    "granitemoehybrid",
    "inkling_text",  # attention over the gathered sequence (a bias from positions within the call), convolutions
    "inkling2_text",
    "jamba",
    "kimi_linear",
    "lfm2",
    "lfm3",
    "mamba",
    "mamba2",
    "minimax",  # its lightning attention, a module with code of its own, by state passing
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5_text",
    "qwen3_next",
    "qwen4_exp_text",  # its attention (a block indexer of its own) and n-gram layers on the shard
    "recurrent_gemma",  # its RG-LRU blocks' convolution by the halo and recurrence by state passing
    "zamba",  # Mamba's selective scan once per head
    "zamba2",
    "zaya",  # its q/k/v projection (a convolution and a one-token delay of its own) over the gathered sequence
]


def train_step(
    family: str,
    mode: str,
    lengths,
    checkpointing: bool = False,
    scan_route: str = "auto",
    restart: bool = False,
    packed_block: bool = True,
    overrides: Optional[dict] = None,
    fp64: bool = False,
    eos_at: tuple = (),
) -> dict:
    """One training step under the plan (``mode``: "eager" or plan.backend()'s inner compiler) against one
    process; ``lengths``: packed documents (positions restart at each; no cu_seq_lens, as the one-process
    model is given none) or None for one sequence. ``restart``: the documents come with what TRL's padding-free
    collator adds (``cu_seq_lens_q/k``, ``seq_idx``), with which the model restarts its mixers at each document
    (the fused kernels do; transformers' torch bodies refuse): one process runs each document on its own.
    ``overrides``: config fields set on the tiny config; ``fp64``: both models in float64; ``eos_at``: places of the
    sequence given the config's EOS id."""
    import torch.distributed as dist

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile", wraps the mixers when a plan is entered)
    from cp_compile.tools.bench import model_configs, model_run
    from cp_compile.tools.restarting import restarting_kernels

    torch._dynamo.reset()
    config, cls, _ = model_configs.tiny_config(family)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    model, (reference, _) = model_run._build(cls, config, "cp_compile"), model_run._reference_model(cls, config)
    if fp64:
        model, reference = model.double(), reference.double()
    if checkpointing:  # the mixers run again in the backward, their exchanges with them, on every rank alike
        for m in (model, reference):
            m.gradient_checkpointing_enable()
            m.train()  # checkpointing applies in training mode (the tiny configs have no dropout)
    plan = cp_compile.ContextParallel(scan_route=scan_route)
    seq = model_run.seq_len(plan.world_size) if lengths is None else sum(lengths)
    ids = torch.randint(model_configs.first_id(config), 100, (1, seq), generator=torch.Generator().manual_seed(1))
    if eos_at:
        ids[0, list(eos_at)] = config.eos_token_id
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    if lengths is None:
        positions, cu = torch.arange(seq)[None], None
    else:
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = torch.tensor([0, *lengths]).cumsum(0)
        labels[0, cu[1:] - 1] = -100
    items = int((labels != -100).sum())
    collated, kernels = {}, contextlib.nullcontext()
    if restart:
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
        collated = {"cu_seq_lens_q": cu.to(torch.int32), "cu_seq_lens_k": cu.to(torch.int32)}
        kernels = restarting_kernels(sys.modules[cls.__module__])
        collated_whole = dict(collated, seq_idx=seq_idx[None])
    with kernels:
        ref_out = reference(ids, position_ids=positions, use_cache=False, **(collated_whole if restart else {}))
    ref_loss = model_run._token_loss(ref_out.logits, labels) / items
    ref_loss.backward()
    forward = model if mode == "eager" else torch.compile(model, backend=plan.backend(mode), fullgraph=True)
    with plan, contextlib.nullcontext() if cu is None or not packed_block else plan.packed(cu):
        if cu is None:
            local_ids, local_labels, local_positions = plan.shard(ids, 1), plan.shard(labels, 1), plan.positions(seq)
        else:
            real = cp_compile.layout.packed.packed_slots(cu, plan.rank, plan.world_size)["real"]
            local_ids = plan.shard(ids[0], 0, cu_seqlens=cu)[None]
            local_labels = torch.where(real, plan.shard(labels[0], 0, cu_seqlens=cu), -100)[None]
            local_positions = plan.positions(cu_seqlens=cu)
            if restart:
                collated["seq_idx"] = plan.shard(seq_idx, 0, cu_seqlens=cu)[None]
        out = forward(local_ids, position_ids=local_positions[None], use_cache=False, **collated)
        loss = model_run._token_loss(out.logits, local_labels) / items
        loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    total = torch.cat([loss.detach().reshape(1)] + [g.flatten() for g in grads])
    dist.all_reduce(total)
    ref_grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in reference.parameters()]
    # each gradient against its own scale, floored as the model sweep floors it (a gradient that is zero
    # analytically is rounding noise on both sides)
    floor = model_configs.GRAD_FLOOR * max(float(g.abs().max()) for g in ref_grads)
    summed = total[1:].split([g.numel() for g in ref_grads])
    return {
        "loss": model_run._rel(total[0], ref_loss.detach()),
        "grads": max(model_run._rel(a.view_as(b), b, floor) for a, b in zip(summed, ref_grads)),
    }


def _check(results, what):
    for result in results:
        assert result["loss"] < TOL and result["grads"] < TOL, (what, result)


@pytest.mark.parametrize("world_size", [3, 4])  # C = 2: the model sweep (tests/test_models.py)
def test_train_eager_at_every_c(ranks, world_size):
    for family in COVERED:
        _check(ranks(world_size, train_step, family, "eager", None), family)


@pytest.mark.parametrize("world_size", [3])
def test_modules_of_their_own_over_the_gathered_sequence(ranks, world_size):
    """XLNet's relative attention
    (time-major; its model's relative positions built again for the whole sequence) and CPM-Ant's attention blocks
    (bidirectional, after the prompt rows its model puts before every call's tokens, which every rank holds),
    modules with mixing code of their own, with no layer types declared, and BLT's whole model over the gathered
    bytes, its global transformer over this rank's share of the patches, padded at the end to the layout's multiple
    (C = 2: the model sweep; C = 4 by `python -m cp_compile models -C 4`; the route itself at C = 1 to 4:
    tests/test_mixers.py)."""
    for family in ("xlnet", "cpmant", "blt"):
        _check(ranks(world_size, train_step, family, "eager", None), family)


@pytest.mark.parametrize("world_size", [2, 3])
def test_modules_reading_the_mask_generate(ranks, world_size):
    """Sampled, prompts of 1 and 30 tokens, against one process with the same seed, and ranks seeded differently all
    raise. Doge keeps a share of the K/V on each rank and scores it under its dynamic mask (its ranks' tokens ride on
    each step's merge). CPM-Ant's cache keeps the whole K/V on every rank (``WholeKVCache``): the sharded prefill
    stores the gathered prompt's, decoding runs the module as one process does, given the step's mask, with no
    collective, so the ranks' tokens are compared once at the end; its prompt attends both ways: generate()'s own
    first call prefills it whole, sharded."""
    for family in ("doge", "cpmant"):
        for results in ranks(world_size, generate_reading_the_sequence, family, [1, 30]):
            *runs, refusal = results
            for same, new, err in runs:
                assert same and new == 20 and err < 1e-5, (family, runs)
            assert "different tokens" in refusal, refusal


def generate_whole(family: str, prompts: list) -> tuple:
    """``generate_reading_the_sequence`` of a family every rank generates whole, with the warnings it raised."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        results = generate_reading_the_sequence(family, prompts)
    return results, [str(w.message) for w in seen if "cp_compile" in str(w.message)]


@pytest.mark.parametrize("world_size", [3])
def test_generation_no_shard_can_run_runs_whole_on_every_rank(ranks, world_size):
    """XLNet's steps pass a permutation mask over every pair of their tokens, Reformer pads every call to its chunk
    length: every rank runs one process's generation, says so, and the ranks compare every step's token (Reformer's
    one process fails on a one-token prompt: its LSH attention picks its bucket count from the first call it runs)."""
    for family, prompts in (("xlnet", [1, 30]), ("reformer", [30])):
        for (*runs, refusal), said in ranks(world_size, generate_whole, family, prompts):
            for same, new, err in runs:
                assert same and new == 20 and err < 1e-5, (family, runs)
            # Reformer seeds torch's generator again in every LSH call (its config's hash_seed): ranks seeded
            # differently sample the same tokens, as they would on one process each
            assert ("different tokens" in refusal) if family == "xlnet" else refusal == "no error", refusal
            assert said and all("every rank runs" in message for message in said), said


# RecurrentGemma's recurrent block runs its convolution by the halo and its RG-LRU by state passing, Zaya's projection
# its convolutions over the gathered sequence;
# XLNet's relative positions are built again while Dynamo traces
COMPILED = ["qwen3_5_text", "nemotron_h", "lfm2", "falcon_h1", "recurrent_gemma", "zaya", "xlnet", "minimax"]


@pytest.mark.parametrize("family", COMPILED)
def test_train_compiled(ranks, family):
    _check(ranks(2, train_step, family, "aot_eager", None), family)


# Nemotron-H, BLOOM, MPT, XGLM, Doge and Inkling checked the same way by hand (BLOOM and Doge through SFTTrainer:
# tests/test_trainer.py); GPT-NeoX-Japanese and OpenAI GPT take no checkpointing in transformers, and RecurrentGemma
# stops in one process too (its blocks write their states on the module inside the checkpointed region)
@pytest.mark.parametrize("family", ["qwen3_5_text", "minimax", "rwkv", "xlstm", "inkling2_text"])
def test_train_compiled_with_activation_checkpointing(ranks, family):
    """Compiled with every decoder layer checkpointed: the mixers' agreements (ops with a side effect, which a
    checkpointed region may not recompute) are saved from the forward; their exchanges run again in the backward.
    The recurrences by state passing (RWKV, xLSTM) and the attention of a module's own over every rank's keys
    (Inkling 2: relative bias, sinks, dynamic convolutions by the halo) recompute alike."""
    _check(ranks(2, train_step, family, "aot_eager", None, True), family)


def compiled_error(family: str) -> str:
    try:
        train_step(family, "aot_eager", None)
    except Exception as e:  # Dynamo's wrapper of the error raised while it traced
        return str(e)
    return "no error"


def test_a_mask_built_from_the_shards_values_is_refused_compiled(ranks):
    """CPM-Ant builds its mask from its token ids (0 is padding): eagerly the gathered route reads it, while Dynamo
    traces it cannot, and refuses by name on every rank."""
    for message in ranks(2, compiled_error, "cpmant"):
        assert "CpmAntSelfAttentionBlock under context parallelism, compiled: its model builds" in message, message


def test_gathered_modules_compiled_on_packed_documents(ranks):
    """Compiled, modules over the gathered sequence on packed documents with padding slots: the slots stay after the
    tokens, zeroed (the real length would be data in the graph; no token of these causal modules sees a later
    one). GPT-NeoX-Japanese's mask keeps each document to itself, as its one-process mask does given positions (the
    ranks cannot agree while Dynamo traces: transformers keeps documents apart wherever positions are passed then);
    MiniMax's lightning attention, a module of its own, takes the all-to-all to heads (state passing reads the
    documents on the host). A window layer's mask cannot be read
    while tracing: refused by name. (XGLM, whose mask reads across documents, and RWKV were checked the same way by
    hand, and GPT-NeoX-Japanese at C = 3.)"""
    lengths = [1, 7, 19, 13]
    for family in ("gpt_neox_japanese", "minimax"):
        _check(ranks(2, train_step, family, "aot_eager", lengths), family)
    with pytest.raises(Exception, match="cannot tell while Dynamo traces whether the model's mask keeps them apart"):
        ranks(2, train_step, "doge", "aot_eager", lengths)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_train_by_state_passing(ranks, world_size):
    """The scans by state passing (``scan_route="states"``), eager, for the gated delta rule, KDA and Mamba2."""
    for family in ("qwen3_next", "kimi_linear", "nemotron_h", "falcon_h1"):
        _check(ranks(world_size, train_step, family, "eager", None, scan_route="states"), family)
    if world_size == 2:
        _check(ranks(2, train_step, "qwen3_5_text", "aot_eager", None, scan_route="states"), "compiled")
    # packed documents, read across (position_ids alone) and restarting at each (what the padding-free collator adds)
    for family in ("qwen3_5_text", "nemotron_h"):
        for restart in (False, True):
            results = ranks(
                world_size, train_step, family, "eager", [1, 7, 19, 13], scan_route="states", restart=restart
            )
            _check(results, (family, "packed", restart))


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "rwkv"])
def test_gradient_checkpointing(ranks, family):
    """The mixers run again in the backward under the plan (RWKV: its modules' forwards on the shard)."""
    _check(ranks(2, train_step, family, "eager", None, checkpointing=True), family)


def recompute_outside_the_plan() -> str:
    """RWKV checkpointed (no attention layer to catch it; its mixing modules' forwards of their own): the forward
    inside the plan, the backward outside."""
    import cp_compile
    import cp_compile.hf  # noqa: F401
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config("rwkv")
    model = model_run._build(cls, config, "cp_compile")
    model.gradient_checkpointing_enable()
    model.train()
    plan = cp_compile.ContextParallel()
    seq = model_run.seq_len(plan.world_size)
    ids = torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(1))
    with plan:
        out = model(plan.shard(ids, 1), position_ids=plan.positions(seq)[None], use_cache=False)
    try:
        out.logits.sum().backward()
    except cp_compile.LocalAttentionError as e:
        return str(e)
    return "no error"


def padding_on_one_rank() -> str:
    """Zaya's q/k/v projection (over the gathered sequence) given a padding mask with padding in rank 1's shard alone:
    every rank raises, none waits in the gather."""
    import torch.distributed as dist

    import cp_compile
    from cp_compile.hf.gathered import hook_gathered_modules
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config("zaya")
    model = model_run._build(cls, config, "cp_compile")
    hook_gathered_modules(model)
    module = next(m for m in model.modules() if type(m).__name__ == "ZayaCCAProjection")
    plan = cp_compile.ContextParallel()
    hidden = torch.randn(1, 8, config.hidden_size)
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 0] = int(dist.get_rank() != 1)
    try:
        with plan:
            module(hidden_states=hidden, cache=None, conv_mask=mask)
    except (cp_compile.UnsupportedAttention, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def xlnet_refusals() -> dict:
    """XLNet under a plan given what its model builds per pair of the shard's tokens: padding in rank 1's shard
    alone, the permutation objective's inputs, segments."""
    import torch.distributed as dist

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config("xlnet")
    model = model_run._build(cls, config, "cp_compile")
    plan = cp_compile.ContextParallel()
    ids = torch.randint(0, 100, (1, 8))
    padding = torch.ones(1, 8)
    padding[0, 0] = float(dist.get_rank() != 1)
    calls = {
        "padding": dict(attention_mask=padding),
        "permutation": dict(perm_mask=torch.zeros(1, 8, 8), target_mapping=torch.eye(8)[None, :1]),
        "segments": dict(token_type_ids=torch.zeros(1, 8, dtype=torch.long)),
    }
    messages = {}
    for name, kwargs in calls.items():
        try:
            with plan:
                model(plan.shard(torch.cat([ids] * plan.world_size, 1), 1), **kwargs)
            messages[name] = "no error"
        except (cp_compile.UnsupportedAttention, ValueError) as e:  # ValueError: refused on another rank
            messages[name] = str(e)
    return messages


def blt_refusals() -> dict:
    """BLT under a plan given its own patch lengths (cut for the shard's bytes), and on packed documents (its global
    transformer runs over a sequence of patches that knows none)."""
    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config("blt")
    model = model_run._build(cls, config, "cp_compile")
    plan = cp_compile.ContextParallel()
    ids = torch.randint(0, 100, (1, 16))
    cu = torch.tensor([0, 5, 16])
    messages = {}
    with plan:
        shard, positions = plan.shard(ids, 1), plan.positions(16)[None]
        for name, call in {
            "patch lengths": lambda: model(
                shard, position_ids=positions, patch_lengths=torch.ones(1, 16), use_cache=False
            ),
            "packed": lambda: packed_call(model, plan, ids, cu),
        }.items():
            try:
                call()
                messages[name] = "no error"
            except cp_compile.UnsupportedAttention as e:
                messages[name] = str(e)
    return messages


def packed_call(model, plan, ids, cu):
    with plan.packed(cu):
        shard, positions = plan.shard(ids[0], 0, cu_seqlens=cu)[None], plan.positions(cu_seqlens=cu)[None]
        return model(shard, position_ids=positions, use_cache=False)


def test_what_blt_cannot_be_given_is_refused_on_every_rank(ranks):
    for messages in ranks(2, blt_refusals, timeout=120):
        assert "patch lengths (patch_lengths)" in messages["patch lengths"], messages
        assert "BltGlobalTransformer under context parallelism on packed documents" in messages["packed"], messages


def test_what_xlnet_cannot_be_given_is_refused_on_every_rank(ranks):
    results = ranks(2, xlnet_refusals, timeout=120)
    assert "attn_mask_h hides keys" in results[1]["padding"], results
    for messages in results:
        assert "ranks [1] refused this call" in messages["padding"], messages
        assert "a query stream (perm_mask and target_mapping" in messages["permutation"], messages
        assert "segments (token_type_ids)" in messages["segments"], messages


def test_padding_on_one_rank_is_refused_on_every_rank(ranks):
    other, own = ranks(2, padding_on_one_rank, timeout=120)
    assert all("ranks [1] refused this call before its first transfer" in m for m in (own, other)), (own, other)
    assert "UnsupportedAttention" in own and "padding mask (conv_mask)" in own, own


def test_a_gathered_module_recomputed_outside_the_plan_raises(ranks):
    for message in ranks(2, recompute_outside_the_plan):
        assert "RwkvSelfAttention recomputes its forward during backward" in message, message


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "lfm2", "minimax", "recurrent_gemma"])
def test_packed_documents_as_one_process_runs_them(ranks, family):
    """Documents of 1, 7, 19 and 13 tokens in one row, with position_ids alone: one process's convolution and
    scan read across document boundaries (its torch bodies reset only given cu_seqlens / seq_idx, which they
    refuse without the fused kernels), and so do the ranks, in the per-document layout."""
    for world_size in (2, 3):
        _check(ranks(world_size, train_step, family, "eager", [1, 7, 19, 13]), (family, world_size))


# Granite 4 hybrid builds its attention mask without the positions: one process's SDPA attends across the documents
# that cu_seq_lens_q keeps apart (flash attention reads them), so no CPU reference exists for it. Inkling's attention
# modules run over the gathered sequence and call their convolution with seq_idx there, which the torch body refuses
# (on one process too) without causal-conv1d
RESTARTING = [family for family in COVERED if family != "granitemoehybrid" and not family.startswith("inkling")]


def restarting_families(families) -> dict:
    return {family: train_step(family, "eager", [1, 7, 19, 13], restart=True) for family in families}


@pytest.mark.parametrize("world_size", [2, 3])
def test_packed_documents_restarting_at_each_document(ranks, world_size):
    """What TRL's padding-free collator gives (cu_seq_lens_q/k, seq_idx) makes a model restart its convolutions and
    scans at each document where the fused kernels do (causal-conv1d and mamba_ssm at seq_idx, fla at cu_seqlens;
    transformers' torch bodies refuse them): against one process with stand-ins of those kernels (each document
    alone), documents of 1, 7, 19 and 13 tokens."""
    for results in ranks(world_size, restarting_families, RESTARTING):
        _check(results.values(), (world_size, results))


def test_packed_documents_restarting_at_c4(ranks):
    for results in ranks(4, restarting_families, ["qwen3_5_text", "nemotron_h", "lfm2", "kimi_linear"]):
        _check(results.values(), results)


def said_once(family: str) -> list:
    """A packed row whose documents are said once, by its shard and positions: with TRL's padding-free kwargs and
    without, against one process; then what cannot read them from the shard, each refused by name: a checkpointed
    layer recomputed in the backward (no model call in flight), and a compiled model."""
    results = [
        train_step(family, "eager", [1, 7, 19, 13], restart=True, packed_block=False),
        train_step(family, "eager", [1, 7, 19, 13], packed_block=False),
    ]
    for mode, checkpointing in (("eager", True), ("aot_eager", False)):
        try:  # by positions alone (the stand-in kernels of one process do not reach its own recompute)
            train_step(family, mode, [1, 7, 19, 13], checkpointing, packed_block=False)
            results.append("no error")
        except Exception as e:  # compiled: Dynamo's wrapper of the error the model call raised
            results.append(str(e))
    return results


@pytest.mark.parametrize("family", ["nemotron_h", "kimi_linear"])
def test_packed_documents_said_once_by_the_shard(ranks, family):
    """The mixers read the documents off the model call's shard, whether or not the model hands them cu_seq_lens_q
    (Kimi Linear hands it to its attention alone). A refusal says what cannot read them there and what works."""
    for *runs, recomputed, compiled in ranks(2, said_once, family):
        _check(runs, family)
        assert "recomputes its forward during backward" in recomputed and "plan.packed(cu)" in recomputed, recomputed
        assert "ran one sequence per row. Compiled, a shard's documents do not reach the graph" in compiled, compiled
        assert "with plan.packed(cu)" in compiled, compiled


def generate_into_the_users_cache(family: str) -> dict:
    """A follow-up generation into a ``ShardedCache`` the user made (96 tokens, then 8), against one process."""
    import cp_compile
    import cp_compile.hf
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config(family)
    model, (reference, _) = model_run._build(cls, config, "cp_compile"), model_run._reference_model(cls, config)
    model.eval(), reference.eval()
    prompt = torch.randint(model_configs.first_id(config), 100, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    plan = cp_compile.ContextParallel()
    result = {}
    with plan, torch.no_grad():
        cache = cp_compile.hf.ShardedCache(model.config, 96, plan)
        out = cp_compile.hf.generate(model, prompt, cache=cache, max_new_tokens=6, do_sample=False)
        result["same"] = torch.equal(out, expected)
        try:
            small = cp_compile.hf.ShardedCache(model.config, 8, plan)
            cp_compile.hf.generate(model, prompt, cache=small, max_new_tokens=6, do_sample=False)
            result["small"] = "no error"
        except ValueError as e:
            result["small"] = str(e)
    return result


@pytest.mark.parametrize("family", ["mamba2", "falcon_h1"])
def test_generate_into_the_users_cache(ranks, family):
    """A cache the user passes holds as many tokens as it was made for (a model of states alone: any number);
    one too small is refused with the max_cache_len it was made with."""
    for result in ranks(2, generate_into_the_users_cache, family):
        assert result["same"], result
        if family == "mamba2":  # its states hold any length
            assert result["small"] == "no error", result
        else:
            assert "made with max_cache_len=8" in result["small"] and "max_cache_len=17" in result["small"], result


def documents_the_mask_does_not_see(lengths) -> str:
    """Granite 4 hybrid packed by positions alone: its mask, built without them, reads across the documents on one
    process; every rank raises rather than keep them apart."""
    try:
        train_step("granitemoehybrid", "eager", lengths)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_documents_the_models_mask_does_not_see_are_refused(ranks):
    for message in ranks(2, documents_the_mask_does_not_see, [1, 7, 19, 13]):
        assert message.startswith("UnsupportedAttention") and "without the packed documents' positions" in message
    # documents of 4 and 12 tokens at C = 2: rank 1 holds positions 1 to 8, without a break, and cannot tell what
    # the mask does with them; rank 0 refuses, and rank 1 raises at the schedule's first agreement, none left waiting
    first, second = ranks(2, documents_the_mask_does_not_see, [4, 12])
    assert first.startswith("ValueError") and "without the packed documents' positions" in first, first
    assert second.startswith("ValueError") and "ranks [0] refused this call" in second, second


def test_positions_without_a_break_on_one_rank_train_exactly(ranks):
    """The same documents for Llama and GPT-NeoX-Japanese (attention of its own over the gathered sequence, given the
    mask one process builds), whose masks keep the documents apart where they see them: rank 1's mask sees none, and
    the documents are kept apart on every rank all the same (as one process does)."""
    for family in ("llama", "gpt_neox_japanese"):
        _check(ranks(2, train_step, family, "eager", [4, 12]), family)


def swapped_scan() -> list[str]:
    """A scan function replaced after the plan wrapped it (and after the model's first call, which wraps what its
    modeling module holds then) runs on this rank's shard alone: the model call raises, and so does generation's
    sharded prefill (which follows its one model call without the global hooks)."""
    import importlib

    import cp_compile
    import cp_compile.hf

    plan = cp_compile.ContextParallel()
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    messages = []
    for route in ("forward", "generate"):
        try:
            with plan:  # entering the plan wraps the mixers of the families loaded so far
                model, inputs = _tiny_inputs("qwen3_5_text", plan)
                model(**inputs)
                wrapped = module.torch_chunk_gated_delta_rule

                def own_kernel(*args, cu_seqlens=None, **kwargs):  # a kernel of the user's, blind to the plan
                    return wrapped.__wrapped__(*args, **kwargs)

                module.torch_chunk_gated_delta_rule = own_kernel
                try:
                    if route == "forward":
                        model(**inputs)
                    else:
                        prompt = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(2))
                        cp_compile.hf.generate(model, prompt, max_new_tokens=2, do_sample=False)
                finally:
                    module.torch_chunk_gated_delta_rule = wrapped
        except cp_compile.LocalAttentionError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def _tiny_inputs(family, plan):
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config(family)
    model = model_run._build(cls, config, "cp_compile")
    seq = model_run.seq_len(plan.world_size)
    ids = torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(1))
    return model, dict(input_ids=plan.shard(ids, 1), position_ids=plan.positions(seq)[None], use_cache=False)


def test_a_scan_that_escapes_the_wrappers_raises(ranks):
    import cp_compile.hf  # noqa: F401

    for messages in ranks(2, swapped_scan):
        assert len(messages) == 2 and all("scans ran under CP" in m for m in messages), messages


def generate_tokens(family: str) -> dict:
    """Greedy generation after a sharded prefill against one process (the model sweep's generate phase)."""
    import torch.distributed as dist

    import cp_compile.hf  # noqa: F401
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config(family)
    model, (reference, _) = model_run._build(cls, config, "cp_compile"), model_run._reference_model(cls, config)
    return model_run._generate(model, reference, dist.group.WORLD)


@pytest.mark.parametrize("world_size", [3, 4])  # C = 2: the model sweep (tests/test_models.py)
def test_generate_token_for_token(ranks, world_size):
    for family in COVERED:
        for result in ranks(world_size, generate_tokens, family):
            assert result["status"] == "exact", (family, result)


def generate_a_left_padded_batch(family: str, lengths: list) -> tuple:
    """A left-padded batch sampled with one seed, against the family's own attention on one process: the rows'
    convolution and recurrent states, each from its own sharded prefill, decoded as one batch."""
    import cp_compile
    import cp_compile.hf
    from cp_compile.tools.bench import model_configs, model_run
    from cp_compile.tools.generate_batch import left_padded

    config, cls, _ = model_configs.tiny_config(family)
    model, (reference, _) = model_run._build(cls, config, "cp_compile"), model_run._reference_model(cls, config)
    seeded = (torch.Generator().manual_seed(n) for n in lengths)
    ids, mask = left_padded([torch.randint(1, 50, (n,), generator=g) for n, g in zip(lengths, seeded)])
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=12, do_sample=True, return_dict_in_generate=True)
    torch.manual_seed(5)
    ref = reference.generate(ids, output_logits=True, **kwargs)
    torch.manual_seed(5)
    with cp_compile.ContextParallel():
        out = cp_compile.hf.generate(model, ids, output_logits=True, **kwargs)
    logits = max(float((a - b).norm() / b.norm()) for a, b in zip(out.logits, ref.logits))
    return torch.equal(out.sequences, ref.sequences), logits


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])  # linear-attention layers; Mamba beside attention
def test_a_left_padded_batch_generates_as_one_process(ranks, family, world_size):
    for same, logits in ranks(world_size, generate_a_left_padded_batch, family, [9, 1, 30, 5]):
        assert same and logits < TOL, (family, logits)


class _StopAtLength:
    """A user's stopping rule that reads the whole sequence: stops once it holds ``length`` tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def generate_reading_the_sequence(family: str, prompts: list) -> list:
    """What reads the whole sequence (repetition penalties, n-gram bans, minimum lengths, a user's own stopping
    rule, sampling with one seed) decides as on one process, also for a model of linear layers alone, whose
    decoding loop starts from the prompt's last token; then ranks seeded differently all raise."""
    import torch.distributed as dist
    from test_hf import rel_err
    from transformers import StoppingCriteriaList

    import cp_compile
    import cp_compile.hf
    from cp_compile.tools.bench import model_configs, model_run

    config, cls, _ = model_configs.tiny_config(family)
    model, (reference, _) = model_run._build(cls, config, "cp_compile"), model_run._reference_model(cls, config)
    model.eval(), reference.eval()
    plan = cp_compile.ContextParallel()
    results = []
    for n in prompts:
        ids = torch.randint(model_configs.first_id(config), 100, (1, n), generator=torch.Generator().manual_seed(n))
        kwargs = dict(
            max_new_tokens=24,
            min_new_tokens=4,
            repetition_penalty=1.5,
            no_repeat_ngram_size=2,
            do_sample=True,
            top_k=5,
            output_logits=True,
            return_dict_in_generate=True,
        )
        stop = StoppingCriteriaList([_StopAtLength(n + 20)])
        torch.manual_seed(3)
        with torch.no_grad():
            ref = reference.generate(ids, stopping_criteria=stop, **kwargs, **model_run.one_process_cache(reference))
        torch.manual_seed(3)
        with plan, torch.no_grad():
            out = cp_compile.hf.generate(model, ids, stopping_criteria=stop, **kwargs)
        err = rel_err(torch.stack(out.logits), torch.stack(ref.logits))
        results.append((torch.equal(out.sequences, ref.sequences), out.sequences.shape[1] - n, err))
    torch.manual_seed(dist.get_rank())
    try:
        with plan:
            cp_compile.hf.generate(model, ids, max_new_tokens=16, do_sample=True, temperature=5.0)
    except RuntimeError as e:
        results.append(str(e))
    else:
        results.append("no error")
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_generate_sampled_with_processors(ranks, world_size):
    """Mamba (linear layers alone; Mamba2's loop is the same), Qwen3.5 and RecurrentGemma (states on its modules):
    prompts of 1, 2 and 30 tokens (the first step's mixers run over the whole prompt on every rank, one token
    prefilled, 29)."""
    for family in ("mamba", "qwen3_5_text", "recurrent_gemma"):
        for results in ranks(world_size, generate_reading_the_sequence, family, [1, 2, 30]):
            *runs, refusal = results
            for same, new, err in runs:
                assert same and new == 20 and err < 1e-5, (family, runs)
            assert ("different tokens" in refusal) if world_size > 1 else refusal == "no error", refusal


def explained_mixers(family: str) -> list:
    import cp_compile
    import cp_compile.hf  # noqa: F401

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    model, inputs = _tiny_inputs(family, plan)
    with plan:
        report = cp_compile.explain(model, plan=plan, **inputs)
    return [(m.route, m.received_bytes) for m in report.mixers] + [str(report).splitlines()[0]]


def test_explain_lists_the_mixers(ranks):
    """The compiled model's convolution halo and its scan's exchanges, each with its route and bytes."""
    for result in ranks(2, explained_mixers, "qwen3_5_text"):
        *mixers, header = result
        routes = {route for route, _ in mixers}
        assert "halo" in routes and ({"heads all-to-all", "heads all-to-all (back)"} <= routes or "states" in routes)
        assert all(n > 0 for _, n in mixers) and "mixer op(s)" in header, result


def test_explain_lists_lightning_attention_by_state_passing(ranks):
    """MiniMax's lightning attention, compiled whole (no graph break): per linear layer, two all-gathers of the
    summaries of state passing; one rank receives the other's two chunks' decays (2 x 4 heads, fp32) and states
    (2 x 4 heads x 16 x 16, fp32), whatever the sequence's length."""
    for result in ranks(2, explained_mixers, "minimax"):
        *mixers, header = result
        assert mixers == [("states", 2 * 4 * 4), ("states", 2 * 4 * 16 * 16 * 4)], result
        assert "0 graph break(s)" in header, result


def test_a_mask_spec_passes_through_a_checkpointed_region_while_compiled():
    """Compiled, activation checkpointing wraps a layer's call in a region handed the layer's arguments as they are:
    a mask spec passed positionally reaches the code inside (RecurrentGemma's layers take theirs so); any other torch
    use of the spec still raises."""
    from torch.utils.checkpoint import checkpoint

    from cp_compile.errors import UnsupportedAttention
    from cp_compile.hf.masks import MaskSpec

    def layer(x, spec):
        return x * (2.0 if spec.causal else 3.0)

    def model(x, spec):
        return checkpoint(layer, x, spec, use_reentrant=False)

    torch._dynamo.reset()
    x = torch.randn(4, requires_grad=True)
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x, MaskSpec(True))
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))
    with pytest.raises(UnsupportedAttention, match="uses the attention mask as a tensor"):
        torch.add(x, MaskSpec(True))
