"""torchtitan's Llama3 under CP, applied the torchtitan way: every transformer block compiled with the
CP backend (fullgraph=True), FSDP2 (``fully_shard``) over the mesh dimension CP shares, selective
activation checkpointing on every block, RoPE positions passed as the model's ``positions`` input.

Configurations (C=2, torchtitan's "debugmodel" cut to 2 layers, 128 tokens):

- ``attn_backend="varlen"`` on packed documents, two SGD steps (the second on another document split,
  so each block is compiled again, with the local length marked dynamic), forward and backward. torchtitan
  casts q/k/v to bf16 and calls ``varlen_attn(..., num_splits=1)``. Against one process with the
  same weights; errors against an fp64 reference at most 2x the one-process error in the same dtypes.
- ``attn_backend="flex"`` with torchtitan's own causal packed-document BlockMask, sharded by the
  plan: forward only (Dynamo refuses FlexAttention backward on CPU).
- fp64 FSDP2 + per-block compile + SAC (torchtitan's ScaledDotProductAttention as the inner
  attention: the one kind whose whole block runs in fp64 on CPU), gradients equal to one process.

varlen_attn has no CPU kernel in torch 2.13: the CP model runs because the backend replaces it by
``cp::varlen_attention`` (the project's packed tile kernel). The one-process reference instead runs
per-document causal SDPA (``per_document_varlen``), an independent computation of the same math.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[titan]')")
# torchtitan 0.3.0's models import torch.distributed.fsdp.DataParallelMeshDims, which torch 2.11 lacks
pytest.importorskip(
    "torchtitan.models.llama3",
    reason=f"torchtitan's models do not import on torch {torch.__version__}",
    exc_type=ImportError,
)

# packed documents of a 128-token sequence; over C=2 each is cut into 4 chunks on its own, and all
# but the 60-token one end in padding slots (37 -> 4 x 10, 5 -> 4 x 2, 26 -> 4 x 7): 68 local slots
LENGTHS = [37, 5, 60, 26]
SEQ = sum(LENGTHS)
# the next batch: 64 local slots, so Dynamo compiles each block again, marking the length dynamic
NEXT_LENGTHS = [100, 28]
VOCAB = 2048


def titan_llama(attn_backend: str, layers: int = 2, max_seq_len: int = SEQ):
    """torchtitan's Llama3 debugmodel with ``layers`` blocks, seeded: the same weights on every rank."""
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend=attn_backend)
    config.layers = config.layers[:layers]
    for layer in config.layers:  # what torchtitan's trainer does for training.seq_len
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=max_seq_len)
    torch._dynamo.reset()  # each case compiles afresh (the rank workers are shared by tests)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def per_document_varlen(
    q,
    k,
    v,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    num_splits=None,
    return_aux=None,
    **unused,
):
    """``varlen_attn`` on one CPU process: each document on its own through SDPA (causal or full)."""
    assert cu_seq_k is cu_seq_q and tuple(window_size) in ((-1, 0), (-1, -1)) and return_aux is None
    bounds = cu_seq_q.tolist()
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        tq, tk, tv = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            tq, tk, tv, is_causal=tuple(window_size) == (-1, 0), scale=scale, enable_gqa=enable_gqa
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


class Fp64PerDocument(torch.nn.Module):
    """The fp64 reference of torchtitan's VarlenAttention: the same per-document causal attention
    without its bf16 cast (inputs [B, L, N, H], packed to [B*L, N, H])."""

    def forward(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **unused):
        b, s = q.shape[:2]
        out = per_document_varlen(
            *(t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)),
            attention_masks.cu_seq_q,
            attention_masks.cu_seq_q,
            0,
            0,
            scale=scale,
            window_size=(-1, 0),
            enable_gqa=enable_gqa,
        )
        return out.view(b, s, *out.shape[1:])


def fp64_copy(model):
    """A copy with fp64 parameters (the complex RoPE cache keeps its dtype: Module.to would drop its
    imaginary part)."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.data = p.data.double()
    return model


def apply_titan_cp(model, plan, mesh, sac: str = "titan", inner: str = "inductor"):
    """What torchtitan's parallelize_llama does, with the CP backend: AC on every block, then
    per-block compile, then FSDP2; gradients of a summed loss are not divided.

    ``sac``: "titan" (torchtitan's SelectiveAC, its own op list) or "cp" (``cp_compile.sac_context``).
    Returns the backend (one object for every block: ``backend.explain()`` reports them all).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import cp_compile

    if sac == "titan":
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        SelectiveAC(SelectiveAC.Config()).apply(model)
    else:
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(block, context_fn=cp_compile.sac_context()))
    backend = plan.backend(inner)
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the loss is a sum over ranks: no mean over them
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return backend


def fsdp_cp_mesh(cp: int):
    """The 1-D mesh FSDP2 shards over, which CP shares (torchtitan's "fsdp" = dp_shard x cp; dp_shard=1)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (cp,), mesh_dim_names=("fsdp",))


def packed_batch(seed: int = 1, lengths=LENGTHS):
    """Global tokens [1, S], next-token labels, per-document positions and torchtitan's VarlenMetadata."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return tokens[:, :-1], tokens[:, 1:], positions, create_varlen_metadata_for_document(positions)


def summed_loss(logits, labels, n_tokens):
    """Cross entropy summed over this rank's real tokens, divided by the global token count:
    the sum over ranks is the one-process mean."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100)
    return loss / n_tokens


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# ----------------------------------------------------------------------------
# varlen: packed documents, two training steps.
# ----------------------------------------------------------------------------


def titan_varlen_case(splits=(LENGTHS, NEXT_LENGTHS), lr: float = 0.5):
    """One step per document split in ``splits``; SGD with ``lr`` after each."""
    import torch.distributed as dist
    from torchtitan.models.common import attention as titan_attention

    import cp_compile
    from cp_compile.compiler.site import _example

    model = titan_llama("varlen")
    single = copy.deepcopy(model)  # as shipped: fp32 weights, bf16 attention
    ref64 = fp64_copy(model)
    for block in ref64.layers.values():
        block.attention.inner_attention = Fp64PerDocument()

    def one_process_step(m, inputs, labels, positions, varlen_meta):
        patched, titan_attention.varlen_attn = titan_attention.varlen_attn, per_document_varlen
        try:
            logits = m(inputs, positions, varlen_meta)
        finally:
            titan_attention.varlen_attn = patched
        loss = summed_loss(logits, labels, SEQ)
        loss.backward()
        return loss.detach(), logits.detach()

    mesh = fsdp_cp_mesh(2)
    plan = cp_compile.ContextParallel(mesh)
    backend = apply_titan_cp(model, plan, mesh, sac="titan")

    def cp_step(inputs, labels, positions, varlen_meta):
        cu = varlen_meta.cu_seq_q  # the global documents, as on one process
        real = cp_compile.layout.packed.packed_slots(cu, plan.rank, plan.world_size)["real"]
        local_inputs = plan.shard(inputs[0], 0, cu_seqlens=cu).unsqueeze(0)  # [1, local slots], padding 0
        local_labels = plan.shard(labels[0], 0, cu_seqlens=cu).masked_fill(~real, -100).unsqueeze(0)
        local_positions = plan.positions(cu_seqlens=cu).unsqueeze(0)  # position inside each document
        # max_q/max_k as the token budget: hints CP ignores, fixed so that a block does not guard on them
        varlen_meta = varlen_meta._replace(max_q=SEQ, max_k=SEQ)
        logits = model(local_inputs, local_positions, varlen_meta)
        loss = summed_loss(logits, local_labels, SEQ)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total, plan.unshard(logits.detach()[0], 0, cu_seqlens=cu).unsqueeze(0)  # without padding

    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, single, ref64)]
    losses, logits = {"cp": [], "single": [], "ref64": []}, {"cp": [], "single": [], "ref64": []}
    grads = {}
    for step, lengths in enumerate(splits):
        batch = packed_batch(seed=1 + step, lengths=lengths)
        for key, run in (
            ("cp", cp_step),
            ("single", functools.partial(one_process_step, single)),
            ("ref64", functools.partial(one_process_step, ref64)),
        ):
            loss, out = run(*batch)
            losses[key].append(loss)
            logits[key].append(out)
        for (name, p), q, r in zip(model.named_parameters(), single.parameters(), ref64.parameters()):
            grads[f"step {step} {name}"] = (max_err(p.grad.full_tensor(), r.grad), max_err(q.grad, r.grad))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    loss_errs = [(max_err(c, r), max_err(s, r)) for c, s, r in zip(losses["cp"], losses["single"], losses["ref64"])]
    logit_errs = [(max_err(c, r), max_err(s, r)) for c, s, r in zip(logits["cp"], logits["single"], logits["ref64"])]
    report = backend.explain()
    return {
        "loss": [float(x) for x in losses["cp"]],
        "single_loss": [float(x) for x in losses["single"]],
        "loss_errs": loss_errs,
        "logit_errs": logit_errs,
        "grads": grads,
        "report": str(report),
        "sites": [(s.schedule, s.dtype) for s in report.sites],
        "local_lengths": [type(_example(r.sites[0].query).shape[0]).__name__ for r in backend.records],
        "slots": sorted(
            {
                len(cp_compile.layout.packed.packed_slots(packed_batch(lengths=x)[3].cu_seq_q, 0, 2)["pos"])
                for x in splits
            }
        ),
    }


def test_titan_varlen_trains_like_one_process(ranks):
    results = ranks(2, titan_varlen_case, timeout=600)
    assert results[0]["loss"] == results[1]["loss"]  # the all-reduced loss
    for r in results:
        assert r["sites"] and all(dtype == "bfloat16" for _, dtype in r["sites"])  # torchtitan's cast
        # 68 local slots, then 64, so Dynamo compiles again with the length dynamic (the graph's length is
        # a SymInt; the rewrite costs the site at the call's length)
        assert r["local_lengths"] == ["int", "SymInt"]
        assert "varlen.py" not in r["report"] and "attention.py" in r["report"]  # names torchtitan's line
        assert_as_close_as_one_process(r)


def assert_as_close_as_one_process(r: dict) -> None:
    """The rule on every tensor: CP error against fp64 at most 2x the one-process error in the same dtypes."""
    for step, (cp, single) in enumerate(r["logit_errs"]):
        assert cp <= 2 * single, f"step {step} logits: CP error {cp:.3g} vs one process {single:.3g}"
    # a scalar is too few samples for a ratio: the loss equals the one-process loss to bf16-attention noise
    for step, (cp, single) in enumerate(r["loss_errs"]):
        assert cp < 1e-4 and single < 1e-4, (step, cp, single)
    for name, (cp, single) in r["grads"].items():
        assert cp <= 2 * single, f"{name}: CP error {cp:.3g} vs one process {single:.3g}"


def test_titan_varlen_random_splits_compile_at_most_twice(ranks):
    """40 random document splits of the same token budget: every block compiled at most twice, and every
    step's logits, loss and gradients as close to fp64 as one process's (the weights held fixed)."""
    from test_dynamic import random_lengths

    gen = torch.Generator().manual_seed(11)
    splits = [random_lengths(gen, SEQ) for _ in range(40)]
    for r in ranks(2, titan_varlen_case, splits, 0.0, timeout=900):
        assert len(r["slots"]) > 3  # the local slot count changed from split to split
        assert len(r["local_lengths"]) <= 2, r["local_lengths"]
        assert_as_close_as_one_process(r)


# ----------------------------------------------------------------------------
# flex: torchtitan's own document-causal BlockMask, sharded by the plan; forward.
# ----------------------------------------------------------------------------


def titan_flex_case():
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    import cp_compile

    model = titan_llama("flex")
    single, ref64 = copy.deepcopy(model), fp64_copy(model)
    inputs, _, positions, _ = packed_batch()
    block_mask = model.get_attention_masks(positions)  # torchtitan's causal + packed-document BlockMask

    compiled_flex, FlexAttention._compiled_flex_attn = FlexAttention._compiled_flex_attn, flex_attention
    try:  # eager flex on one process (fp64 has no Inductor CPU lowering)
        with torch.no_grad():
            ref_out, single_out = ref64(inputs, positions, block_mask), single(inputs, positions, block_mask)
    finally:
        FlexAttention._compiled_flex_attn = compiled_flex

    mesh = fsdp_cp_mesh(2)
    plan = cp_compile.ContextParallel(mesh)
    backend = apply_titan_cp(model, plan, mesh, sac="titan")
    with torch.no_grad():
        local_positions = plan.shard(positions, 1)  # torchtitan's in-document positions of this rank's tokens
        out = model(plan.shard(inputs, 1), local_positions, plan.shard(block_mask))
    out = plan.unshard(out, 1)
    return max_err(out, ref_out), max_err(single_out, ref_out), [s.schedule for s in backend.explain().sites]


def test_titan_flex_forward_matches_one_process(ranks):
    for cp, single, schedules in ranks(2, titan_flex_case, timeout=600):
        assert schedules and all(s in ("ring", "allgather", "ulysses") for s in schedules)
        assert cp <= 2 * single, f"logits: CP error {cp:.3g} vs one process {single:.3g}"


# ----------------------------------------------------------------------------
# FSDP2 + per-block compile + SAC, fp64: gradients equal to one process.
# ----------------------------------------------------------------------------


def titan_fsdp_sac_fp64_case():
    import torch.distributed as dist
    from torchtitan.models.common.attention import ScaledDotProductAttention

    import cp_compile
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    model = titan_llama("flex")
    for block in model.layers.values():  # causal over the whole sequence, fp64 on CPU
        block.attention.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    model = fp64_copy(model)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ref_loss = summed_loss(ref(inputs, torch.arange(SEQ).unsqueeze(0)), labels, SEQ)
    ref_loss.backward()

    mesh = fsdp_cp_mesh(2)
    plan = cp_compile.ContextParallel(mesh, schedule="ring")
    backend = apply_titan_cp(model, plan, mesh, sac="cp")
    loss = summed_loss(model(plan.shard(inputs, 1), plan.positions(SEQ).unsqueeze(0)), plan.shard(labels, 1), SEQ)
    with cp_compile.count_traffic() as backward:
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    errs = {
        name: max_err(p.grad.full_tensor(), r.grad) for (name, p), r in zip(model.named_parameters(), ref.parameters())
    }
    sharded = all(
        p.to_local().shape[0] * 2 >= p.shape[0] and p.to_local().shape[0] < p.shape[0] for p in model.parameters()
    )
    return (
        max_err(total, ref_loss),
        errs,
        backward.by_tag,
        {TAG_KV: "kv", TAG_DKV: "dkv"},
        sharded,
        len(backend.explain().sites),
    )


def test_titan_fsdp2_per_block_compile_sac_fp64(ranks):
    for loss_err, errs, by_tag, names, sharded, sites in ranks(2, titan_fsdp_sac_fp64_case, timeout=600):
        assert sharded  # every parameter is a DTensor sharded over the mesh CP shares
        assert loss_err < 1e-10
        assert max(errs.values()) < 1e-8, errs
        # the backward ring alone per block (C-1 K/V and C dK/dV transfers): SAC did not re-run the forward ring
        assert {names[tag]: n for tag, n in by_tag.items()} == {"kv": 2 * 1, "dkv": 2 * 2}
        assert sites >= 1
