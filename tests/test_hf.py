"""Hugging Face transformers models with attn_implementation="cp_compile" under CP, against "sdpa" on one process."""

import contextlib
import tempfile

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the HF integration")

VOCAB, SEQ = 128, 48  # SEQ splits into 2C chunks for C = 2 and 3
LENGTHS = [13, 5, 1, 22, 7]  # packed documents: no length divides by 2C = 4 or 6; sum is SEQ
OTHER = [13, 5, 2, 21, 7]  # other documents, the same slots per rank: a compiled graph must read them anew
TOL = 1e-4  # relative (to the reference's largest magnitude), fp32


def tiny_model(arch: str, attn: str):
    """A 2-layer, hidden-64 model with random weights (seeded; the same on every rank)."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if arch == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "mistral":  # every layer a sliding window of 8 tokens
        config, cls = transformers.MistralConfig(**common, sliding_window=8), transformers.MistralForCausalLM
    else:  # layer 0 full attention, layer 1 a sliding window of 8 tokens; q/k/v have biases
        config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=attn, dtype=torch.float32)


def batch(lengths):
    """Global ids, shifted labels (-100 where no next token of the same document) and cu_seqlens."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    lengths = lengths or [SEQ]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    labels = torch.full_like(ids, -100)
    labels[0, :-1] = ids[0, 1:]
    labels[0, cu[1:].long() - 1] = -100  # the last token of every document predicts nothing
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, labels, cu, positions


def loss_of(logits, labels):
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def hf_parity(arch: str, runs: list):
    """Each run ``(mode, lengths, packing_kwargs)`` against "sdpa" on one process: logits, loss, summed grads.

    mode: "eager", or the inner compiler of plan.backend() ("aot_eager", "inductor"). One compiled model
    serves every compiled run of one inner compiler (a new batch kind recompiles, nothing more).
    """
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")

    torch._dynamo.reset()
    counters.clear()
    plan = cp_compile.ContextParallel()
    model, reference = tiny_model(arch, "cp_compile"), tiny_model(arch, "sdpa")
    reference.load_state_dict(model.state_dict())
    compiled, backends, results = {}, [], []
    for mode, lengths, packing_kwargs in runs:
        packed = lengths is not None
        ids, labels, cu, positions = batch(lengths)
        reference.zero_grad()
        # transformers' own loss: labels already shifted (shift_labels), mean over every rank's items
        items = torch.tensor((labels != -100).sum().item())
        loss_kwargs = lambda lab: dict(labels=lab, shift_labels=lab, num_items_in_batch=items)  # noqa: E731
        ref = reference(ids, position_ids=positions, use_cache=False, **loss_kwargs(labels))
        ref_logits, ref_loss = ref.logits, ref.loss
        ref_loss.backward()

        if packed:
            real = cp_compile.layout.packed.packed_slots(cu, plan.rank, plan.world_size)["real"]
            shard = lambda t: plan.shard(t, 1, cu_seqlens=cu)  # noqa: E731
            local_labels = torch.where(real, shard(labels), -100)  # padding slots stay out of the loss
            local_positions = plan.positions(cu_seqlens=cu)[None]
        else:
            real = torch.ones(SEQ // plan.world_size, dtype=torch.bool)
            shard = lambda t: plan.shard(t, 1)  # noqa: E731
            local_labels = shard(labels)
            local_positions = plan.positions(SEQ)[None]
        kwargs = {}
        if packing_kwargs:  # as DataCollatorWithFlattening(return_flash_attn_kwargs=True) emits them: global
            kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        # without the kwargs, the model learns the documents from the block (the kwargs alone say it otherwise)
        documents = plan.packed(cu) if packed and not packing_kwargs else contextlib.nullcontext()
        run = model
        if mode != "eager":
            if mode not in compiled:
                backends.append(plan.backend(mode))
                compiled[mode] = torch.compile(model, backend=backends[-1], fullgraph=True)
            run = compiled[mode]
        model.zero_grad()
        with plan, documents:
            out = run(shard(ids), position_ids=local_positions, use_cache=False, **kwargs, **loss_kwargs(local_labels))
        logits, loss = out.logits, out.loss
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grad_err = 0.0
        for p, ref in zip(model.parameters(), reference.parameters()):
            summed = p.grad.clone()
            dist.all_reduce(summed)
            grad_err = max(grad_err, rel_err(summed, ref.grad))
        results.append(
            {
                "run": (mode, lengths, packing_kwargs),
                "logits": rel_err(logits[0, real], shard(ref_logits.detach())[0, real]),
                "loss": abs(total.item() - ref_loss.item()) / abs(ref_loss.item()),
                "grads": grad_err,
            }
        )
    sites = [(s.pattern, s.decision.schedule) for b in backends for r in b.records for s in r.sites]
    return results, sum(counters["graph_break"].values()), sites, [len(b.records) for b in backends]


EAGER = [("eager", None, False), ("eager", LENGTHS, False)]
COMPILED = [
    ("aot_eager", None, False),
    ("aot_eager", LENGTHS, False),
    ("aot_eager", OTHER, False),
    ("aot_eager", LENGTHS, True),
]


@pytest.mark.parametrize(
    "arch,world_size,runs",
    [
        # Inductor: the random-packing test below, tests/test_compile.py and test_hf_families' three ranks
        ("llama", 2, EAGER + COMPILED),
        ("qwen2", 2, EAGER + COMPILED[:2]),
        ("qwen2", 3, EAGER + COMPILED),
    ],
)
def test_model_matches_sdpa_on_one_process(ranks, arch, world_size, runs):
    for results, breaks, sites, _ in ranks(world_size, hf_parity, arch, runs, timeout=600):
        assert breaks == 0  # fullgraph=True, and no break in a recompile either
        for r in results:
            assert max(r["logits"], r["loss"], r["grads"]) < TOL, r
        print(arch, world_size, results, sites)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_no_plan_behaves_like_sdpa(arch):
    """Outside every plan "cp_compile" is "sdpa": the same logits and gradients, bit for bit, eager and compiled."""
    import cp_compile.hf  # noqa: F401

    model, reference = tiny_model(arch, "cp_compile"), tiny_model(arch, "sdpa")
    reference.load_state_dict(model.state_dict())
    switched = tiny_model(arch, "sdpa")
    switched.set_attn_implementation("cp_compile")
    assert (model.config._attn_implementation, switched.config._attn_implementation) == ("cp_compile",) * 2
    for lengths, compiled in ((None, False), (LENGTHS, False), (LENGTHS, True)):
        ids, labels, _, positions = batch(lengths)
        grads = []
        for m in (model, reference):
            m.zero_grad()
            run = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
            logits = run(ids, position_ids=positions, use_cache=False).logits
            loss_of(logits, labels).backward()
            grads.append([logits.detach()] + [p.grad for p in m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), (lengths, compiled)


@pytest.mark.parametrize(
    "arch,world_size,mode,packing_kwargs",
    [
        ("llama", 2, "inductor", True),
        ("qwen2", 3, "aot_eager", False),
    ],
)
def test_random_splits_compile_at_most_twice(ranks, arch, world_size, mode, packing_kwargs):
    """24 random packings of the same budget through one compiled model: at most two graphs (the first
    split's, then a dynamic one), every step's logits, loss and gradients as one process's. The documents
    reach the attention as HF's kwargs (cu_seq_lens_q) or from ``with plan.packed(cu)``."""
    from test_dynamic import random_lengths

    gen = torch.Generator().manual_seed(12)
    runs = [(mode, random_lengths(gen, SEQ), packing_kwargs) for _ in range(24)]
    for results, breaks, _, graphs in ranks(world_size, hf_parity, arch, runs, timeout=900):
        assert breaks == 0
        assert graphs == [graphs[0]] and graphs[0] <= 2, graphs
        for r in results:
            assert max(r["logits"], r["loss"], r["grads"]) < TOL, r


def saved_between_steps() -> int:
    """A compiled model's steps with a checkpoint saved between them (``save_pretrained`` sets
    ``config.architectures``, which a model built from its config lacks): the graphs the plan's backend compiled."""
    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    model = tiny_model("qwen2", "cp_compile")
    backend = plan.backend("aot_eager")
    run = torch.compile(model, backend=backend, fullgraph=True)
    ids, _, _, _ = batch(None)
    for _ in range(2):
        with plan:
            run(plan.shard(ids, 1), position_ids=plan.positions(SEQ)[None], use_cache=False).logits.sum().backward()
        with tempfile.TemporaryDirectory() as checkpoint:
            model.save_pretrained(checkpoint)
    return len(backend.records)


def test_a_checkpoint_saved_between_steps_recompiles_nothing(ranks):
    """The names in cp_compile's messages are read outside the traced code: a guard on ``config.architectures``
    recompiled every compiled model after its first checkpoint (TRL's chunked loss then broke the graph again)."""
    assert ranks(2, saved_between_steps) == [1, 1]


def _unsupported_cause(error):
    from cp_compile import UnsupportedAttention

    cause = error
    while cause is not None and not isinstance(cause, UnsupportedAttention):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    return cause


@pytest.mark.parametrize("attn,in_plan", [("sdpa", True), ("cp_compile", False)])
def test_mask_from_hf_under_cp_backend_names_the_fix(fake_plan, attn, in_plan):
    """ "sdpa" (or "cp_compile" outside ``with plan:``) gives SDPA the mask HF builds from the local positions."""
    import contextlib

    import cp_compile.hf  # noqa: F401

    torch._dynamo.reset()
    plan = fake_plan
    model = tiny_model("llama", attn)
    ids, _, _, _ = batch(None)
    compiled = torch.compile(model, backend=plan.backend("aot_eager"), fullgraph=True)
    with pytest.raises(Exception) as info, plan if in_plan else contextlib.nullcontext():
        compiled(plan.shard(ids, 1), position_ids=plan.positions(SEQ)[None], use_cache=False)
    cause = _unsupported_cause(info.value)
    assert cause is not None, info.value
    message = str(cause)
    assert "attn_mask" in message and 'attn_implementation="cp_compile"' in message
    assert "import cp_compile.hf" in message and "with plan:" in message


def test_what_cp_cannot_do_is_refused_inside_a_plan(fake_plan):
    import cp_compile.hf
    from cp_compile import UnsupportedAttention

    plan = fake_plan
    model = tiny_model("llama", "cp_compile")
    ids = plan.shard(batch(None)[0], 1)
    padding = torch.ones_like(ids)
    padding[0, -3:] = 0
    with plan, pytest.raises(UnsupportedAttention, match="padding attention_mask"):
        model(ids, attention_mask=padding, position_ids=plan.positions(SEQ)[None], use_cache=False)
    with plan, pytest.raises(UnsupportedAttention, match="KV cache"):  # decoding: 1 new query, 24 cached keys
        cp_compile.hf.mask(batch_size=1, q_length=1, kv_length=25, q_offset=24, kv_offset=0)
    other = plan.packed(torch.tensor([0, 13, 18, 19, 41, 48]))  # 30 slots per rank; the model gets 24
    with plan, other, pytest.raises(ValueError, match="30 slots per rank"):  # another batch's documents: said
        cp_compile.hf.attention(model.model.layers[0].self_attn, *(torch.zeros(1, 4, 24, 16),) * 3, None)
    assert cp_compile.active_plan() is None


def test_a_model_run_on_another_batch_than_its_shard_is_refused(fake_plan):
    """A packed shard says its documents: nothing else needs to. Told another batch (``plan.packed``), the attention ran
    that one, and positions made for other documents are another batch's: both raise when the model returns, naming
    what said the batch."""
    import cp_compile.hf  # noqa: F401
    from cp_compile import UnsupportedAttention

    plan = fake_plan
    model = tiny_model("llama", "cp_compile")
    ids, _, cu, _ = batch(LENGTHS)
    other = batch(OTHER)[2]  # the same slots per rank
    shard = plan.shard(ids, 1, cu_seqlens=cu)
    with plan:
        model(shard, position_ids=plan.positions(cu_seqlens=cu)[None], use_cache=False)
    with plan, plan.packed(other), pytest.raises(UnsupportedAttention, match=r"as `with plan.packed\(cu\)` said"):
        model(shard, position_ids=plan.positions(cu_seqlens=cu)[None], use_cache=False)
    with plan, plan.packed(cu), pytest.raises(UnsupportedAttention, match=r"position_ids were made for the packed"):
        model(shard, position_ids=plan.positions(cu_seqlens=other)[None], use_cache=False)
    with plan, plan.packed(cu):  # the same batch: no error (the fake group's values are not checked)
        model(shard, position_ids=plan.positions(cu_seqlens=cu)[None], use_cache=False)


@pytest.mark.parametrize("packed", [False, True])
def test_another_backend_inside_a_plan_raises_instead_of_attending_locally(fake_plan, packed):
    """Compiled inside ``with plan:`` by a backend other than plan.backend(), "cp_compile" would run plain
    SDPA / varlen_attn on the shard: the plan's guard raises when the graph runs, before any value is used."""
    import cp_compile.hf  # noqa: F401
    from cp_compile import LocalAttentionError

    torch._dynamo.reset()
    plan = fake_plan
    model = tiny_model("llama", "cp_compile")
    ids, _, cu, _ = batch(LENGTHS if packed else None)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    shard = (lambda t: plan.shard(t, 1, cu_seqlens=cu)) if packed else (lambda t: plan.shard(t, 1))  # noqa: E731
    positions = (plan.positions(cu_seqlens=cu) if packed else plan.positions(SEQ))[None]
    documents = plan.packed(cu) if packed else contextlib.nullcontext()
    with plan, documents, pytest.raises(LocalAttentionError, match="backend other than plan.backend()"):
        compiled(shard(ids), position_ids=positions, use_cache=False)


def checkpointed_eager(backward: str):
    """Eager "cp_compile" with HF's gradient checkpointing: the layers recompute during backward, run
    ``"inside"`` the plan, ``"outside"`` it, or (packed documents) after leaving the ``"documents"`` block alone,
    or inside the same documents' block entered ``"again"``."""
    import torch.distributed as dist

    import cp_compile
    import cp_compile.hf  # noqa: F401

    plan = cp_compile.ContextParallel()
    model, reference = tiny_model("llama", "cp_compile"), tiny_model("llama", "sdpa")
    reference.load_state_dict(model.state_dict())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    packed = backward in ("documents", "again")
    ids, labels, cu, whole_positions = batch(LENGTHS if packed else None)
    loss_of(reference(ids, position_ids=whole_positions, use_cache=False).logits, labels).backward()
    shard = (lambda t: plan.shard(t, 1, cu_seqlens=cu)) if packed else (lambda t: plan.shard(t, 1))  # noqa: E731
    positions = (plan.positions(cu_seqlens=cu) if packed else plan.positions(SEQ))[None]
    local_labels = shard(labels + 100) - 100  # padding slots: -100
    try:
        with plan:
            with plan.packed(cu) if packed else contextlib.nullcontext():
                out = model(shard(ids), position_ids=positions, use_cache=False)
                loss = loss_of(out.logits, local_labels)
                if backward == "inside":
                    loss.backward()
            with plan.packed(cu) if backward == "again" else contextlib.nullcontext():
                if packed:
                    loss.backward()
        if backward == "outside":
            loss.backward()
    except cp_compile.LocalAttentionError as e:
        return str(e)
    errs = []
    for p, ref in zip(model.parameters(), reference.parameters()):
        summed = p.grad.clone()
        dist.all_reduce(summed)
        errs.append(rel_err(summed, ref.grad))
    return max(errs)


def test_checkpoint_recompute_outside_the_plan_raises(ranks):
    """A checkpointed layer recomputes in backward: inside the plan it is CP again (exact); outside it, or outside
    the packed documents' block, it raises on every rank instead of attending to the shard alone or across the
    documents; inside the same documents' block entered again, it is exact."""
    runs = (ranks(2, checkpointed_eager, where) for where in ("inside", "outside", "documents", "again"))
    for inside, outside, documents, again in zip(*runs):
        assert inside < TOL and again < TOL, (inside, again)
        for message in (outside, documents):
            assert "recomputes its forward during backward" in message and "with plan.packed(cu):" in message
