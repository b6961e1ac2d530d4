"""Hugging Face transformers models with attn_implementation="cp_compile" under CP, against "sdpa" on one process."""

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the HF integration")

VOCAB, SEQ = 128, 48  # SEQ splits into 2C chunks for C = 2 and 3
LENGTHS = [13, 5, 1, 22, 7]  # packed documents: no length divides by 2C = 4 or 6; sum is SEQ
TOL = 1e-4  # relative (to the reference's largest magnitude), fp32


def tiny_model(arch: str, attn: str):
    """A 2-layer, hidden-64 model with random weights (seeded; the same on every rank)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:  # layer 0 full attention, layer 1 a sliding window of 8 tokens; q/k/v have biases
        config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=attn, dtype=torch.float32)


def batch(packed: bool):
    """Global ids, shifted labels (-100 where no next token of the same document) and cu_seqlens."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    lengths = LENGTHS if packed else [SEQ]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    labels = torch.full_like(ids, -100)
    labels[0, :-1] = ids[0, 1:]
    labels[0, cu[1:].long() - 1] = -100  # the last token of every document predicts nothing
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, labels, cu, positions


def loss_of(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                             reduction="sum")


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def hf_parity(arch: str, runs: list):
    """Each run ``(mode, packed, packing_kwargs)`` against "sdpa" on one process: logits, loss, summed grads.

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
    for mode, packed, packing_kwargs in runs:
        ids, labels, cu, positions = batch(packed)
        reference.zero_grad()
        ref_logits = reference(ids, position_ids=positions, use_cache=False).logits
        ref_loss = loss_of(ref_logits, labels)
        ref_loss.backward()

        if packed:
            real = cp_compile.layout.packed_slots(cu, plan.rank, plan.world_size)["real"]
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
            kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
            plan.positions(SEQ)  # the kwargs alone say the batch is packed: forget the recorded documents
        run = model
        if mode != "eager":
            if mode not in compiled:
                backends.append(plan.backend(mode))
                compiled[mode] = torch.compile(model, backend=backends[-1], fullgraph=True)
            run = compiled[mode]
        model.zero_grad()
        with plan:
            logits = run(shard(ids), position_ids=local_positions, use_cache=False, **kwargs).logits
        loss = loss_of(logits, local_labels)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grad_err = 0.0
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            summed = p.grad.clone()
            dist.all_reduce(summed)
            grad_err = max(grad_err, rel_err(summed, ref.grad))
        results.append({
            "run": (mode, packed, packing_kwargs),
            "logits": rel_err(logits[0, real], shard(ref_logits.detach())[0, real]),
            "loss": abs(total.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grads": grad_err,
        })
    sites = [(s.kind, s.decision.get("window")) for b in backends for r in b.records for s in r.sites]
    return results, sum(counters["graph_break"].values()), sites


RUNS = [("eager", False, False), ("eager", True, False), ("aot_eager", False, False), ("aot_eager", True, False),
        ("aot_eager", True, True)]


@pytest.mark.parametrize("arch,world_size", [("llama", 2), ("qwen2", 2), ("qwen2", 3)])
def test_model_matches_sdpa_on_one_process(ranks, arch, world_size):
    for results, breaks, sites in ranks(world_size, hf_parity, arch, RUNS, timeout=600):
        assert breaks == 0
        for r in results:
            assert max(r["logits"], r["loss"], r["grads"]) < TOL, r
        print(arch, world_size, results, sites)
