"""``Trainer`` and TRL's ``SFTTrainer`` under CP (``cp_compile.hf.ContextParallelMixin``), as users launch them.

The end-to-end runs go through ``examples/sft_trl.py``, which launches each run in processes of its own
(``torchrun`` or ``accelerate launch``), compares every logged loss with the same script without CP and
exits 1 above 1e-4 (relative, fp32): packed SFT eager and compiled, evaluation, a resume at another C,
transformers' Trainer with ``DataCollatorWithFlattening``, gradient accumulation, SGD and a 2-D mesh of
2 replicas of C=2. The batch sharding itself is checked on gloo ranks against the global batch.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs TRL and accelerate (pip install -e '.[train]'): the trainers under test")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "sft_trl.py"
DPO_EXAMPLE = ROOT / "examples" / "dpo_trl.py"
GRPO_EXAMPLE = ROOT / "examples" / "grpo_trl.py"


def run_example(*args: str, example: Path = EXAMPLE) -> str:
    run = subprocess.run([sys.executable, str(example), *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


@pytest.mark.launches
def test_sft_trainer_packed_compiled_evaluated_resumed(tmp_path):
    """SFTTrainer(packing=True) at C=2 compiled with the plan's backend (aot_eager behind it), evaluated every 3
    steps, then its checkpoint of step 3 resumed on one process: every logged loss within
    1e-4 of one process's. The CP run adds no graph break to the one the one-process run has (TRL's fused LM
    head), and the model's graph compiles once."""
    plot = tmp_path / "sft.png"
    out = run_example("--steps", "6", "--compile", "aot_eager", "--eval-steps", "3", "--plot", str(plot))
    assert "SFTTrainer under CP (C=2, torchrun): 6 steps" in out
    assert "evaluation loss: 2 steps" in out and "C=2 checkpoint of step 3 resumed at C=1: 3 steps" in out
    assert "num_tokens: as one process's at every logged step" in out  # TRL's count, padding slots left out
    breaks = {
        line.split(":")[0]: int(line.split(": ")[1].split()[0]) for line in out.splitlines() if "graph breaks" in line
    }
    assert breaks["cp"] == breaks["reference"], out
    assert plot.stat().st_size > 10_000


@pytest.mark.launches
def test_sft_trainer_packed_hybrid_restarts_at_documents():
    """Qwen3.5 (Gated DeltaNet beside full attention) under SFTTrainer(packing=True) at C=2: TRL's padding-free
    collator passes seq_idx and cu_seq_lens, at which the convolution and the scan restart; the one-process run
    restarts them with stand-ins of the fused kernels (each document alone). Every logged loss within 1e-4 of one
    process's (a resume is the Llama run's: checkpoints hold nothing of the model's kind)."""
    out = run_example("--model", "qwen3_5", "--steps", "4", "--resume-at", "0")
    assert "SFTTrainer under CP (C=2, torchrun): 4 steps" in out


@pytest.mark.launches
def test_trainer_accelerate_data_parallel_accumulation_resume_at_larger_c():
    """transformers' Trainer with DataCollatorWithFlattening, launched by accelerate on 4 processes (2 replicas
    of C=2), SGD with 2 accumulation steps, against the same script on 2 processes without CP; then a run on 2
    processes without CP (the reference run itself) resumed from its checkpoint of step 2 at C=2 on 4."""
    out = run_example(
        "--trainer",
        "trainer",
        "--launcher",
        "accelerate",
        "--dp",
        "2",
        "--steps",
        "4",
        "--accum",
        "2",
        "--optim",
        "sgd",
        "--stop-cp",
        "1",
        "--resume-cp",
        "2",
    )
    assert "Trainer under CP (C=2 x 2 replicas, accelerate): 4 steps" in out
    assert "C=1 checkpoint of step 2 resumed at C=2: 2 steps" in out


@pytest.mark.launches
def test_dpo_trainer_at_c3_evaluated_resumed_from_one_process():
    """TRL's DPOTrainer (its defaults: padded rows, activation checkpointing; a reference model) at C=3 with a mix of
    two loss types, evaluated every 2 steps, and one process's checkpoint of step 2 resumed at C=3: every logged
    metric (losses, rewards, log-probabilities, mean logits, entropy, accuracies, num_tokens, grad_norm) within 1e-4
    of one process's, the rewards against BETA x |logps| (examples/dpo_trl.py says why)."""
    out = run_example(
        *("--compare", "--cp", "3", "--loss-type", "sigmoid,ipo", "--eval-steps", "2", "--stop-cp", "1"),
        *("--resume-at", "2"),
        example=DPO_EXAMPLE,
    )
    assert "DPOTrainer under CP (C=3, torchrun), llama, loss sigmoid,ipo: step 4" in out
    assert "rewards/margins" in out and "eval_logps/chosen: 2 steps" in out and "num_tokens: 4 steps" in out
    assert "C=1 checkpoint of step 2 resumed at C=3, every logged metric after it:" in out


@pytest.mark.launches
def test_dpo_trainer_compiled():
    """DPOTrainer with torch_compile=True at C=2: the policy compiled in place with the plan's backend (aot_eager
    behind it), the rows packed and gathered eagerly around the compiled call; every logged metric within 1e-4 of
    the compiled one-process run's."""
    out = run_example("--compare", "--compile", "aot_eager", "--steps", "2", example=DPO_EXAMPLE)
    assert "cp: the plan's backend compiled" in out and "loss: 2 steps" in out


@pytest.mark.launches
def test_dpo_trainer_hybrid_on_a_mesh_with_precomputed_reference():
    """Qwen3.5 (Gated DeltaNet beside full attention) under DPOTrainer on 4 processes launched by accelerate, 2
    replicas of C=2, against DDP on 2 processes, with the reference log-probabilities precomputed (no reference
    model): every logged metric within 1e-4 of the DDP run's. Under CP each row is a document of a packed row, at
    which the convolutions and the scan restart (the padding-free collator's seq_idx and cu_seq_lens)."""
    out = run_example(
        *("--compare", "--model", "qwen3_5", "--dp", "2", "--launcher", "accelerate", "--precompute"),
        example=DPO_EXAMPLE,
    )
    assert "DPOTrainer under CP (C=2 x 2 replicas, accelerate), qwen3_5, loss sigmoid: step 4" in out
    assert "against one process (DDP on 2), every logged metric:" in out and "logps/rejected: 4 steps" in out


@pytest.mark.launches
def test_grpo_trainer_at_c3_with_reference_model_clipped_and_evaluated():
    """TRL's GRPOTrainer at C=3 on tiny Qwen3: 3 completions per prompt generated sharded over the replica's ranks
    (the same tokens as one process's), a reference model (beta > 0, the KL term), each batch trained on twice (the old
    policy's log-probabilities, clipping), rewards scaled by the batch's deviation (Bessel's correction over the
    replica's completions, each counted once), evaluated every 2 steps: every logged metric within 1e-4 of one
    process's (the KL against 1e-3 where smaller, examples/grpo_trl.py says why)."""
    out = run_example(
        *("--compare", "--cp", "3", "--beta", "0.04", "--iterations", "2", "--scale-rewards", "batch"),
        *("--eval-steps", "2", "--batch", "6", "--generations", "3"),
        example=GRPO_EXAMPLE,
    )
    assert "GRPOTrainer under CP (C=3, torchrun), qwen3, loss dapo: step 4" in out
    assert "completions generated sharded" in out  # cp_compile.hf.generate of the replica's left-padded prompts
    # 2 generations of 6 (each trained on twice), and 2 evaluations of the 8 prompts x 3
    assert "replica 0: 60 completions, the same token for token" in out
    assert "kl (against 1e-03 where smaller): 4 steps" in out and "eval_reward_std: 2 steps" in out
    assert "clip_ratio/region_mean: 4 steps" in out


@pytest.mark.launches
def test_grpo_trainer_hybrid_on_a_mesh_resumed_from_one_process():
    """Qwen3.5 (Gated DeltaNet beside full attention) under GRPOTrainer on 4 processes launched by accelerate, 2
    replicas of C=2, against DDP on 2 processes (each replica samples its DDP process's completions), then the DDP
    run's checkpoint of step 2 resumed on the 2x2 mesh: the same completions after the resume (the random state of
    each replica is checkpointed as its process's), every logged metric within 1e-4, and the completions table of
    log_completions one process's."""
    out = run_example(
        *("--compare", "--model", "qwen3_5", "--dp", "2", "--launcher", "accelerate", "--beta", "0.04"),
        *("--stop-cp", "1", "--resume-at", "2", "--log-completions"),
        example=GRPO_EXAMPLE,
    )
    # GRPOTrainer's completions table: each completion once, in one process's order (gathered C times from every
    # process, the first rank of each replica kept)
    assert "completions table (log_completions): 8 rows, the same as one process's" in out
    assert "GRPOTrainer under CP (C=2 x 2 replicas, accelerate), qwen3_5, loss dapo: step 4" in out
    assert "completions generated sharded" in out
    assert "replica 1: 16 completions, the same token for token" in out
    assert "C=1 checkpoint of step 2 resumed at C=2: completions after it" in out
    assert "replica 1: 8 completions, the same token for token" in out


# -- the batch a rank gets -----------------------------------------------------------------------------


def shard_packed_batch():
    """On each rank: TRL's collator output for 3 examples (one packed row), sharded; the shards gathered back
    must give the global positions, and the labels shifted on the global sequence with -100 at document ends."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    import cp_compile
    from cp_compile.hf.trainer import shard_batch

    plan = cp_compile.ContextParallel()
    lengths = [5, 1, 12]
    examples = [
        {"input_ids": list(range(10 * i + 1, 10 * i + 1 + n)), "seq_lengths": [n]} for i, n in enumerate(lengths)
    ]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    local = shard_batch(plan, batch)
    cu = batch["cu_seq_lens_q"]
    whole = {key: plan.unshard(local[key], 1, cu_seqlens=cu) for key in ("input_ids", "labels", "position_ids")}
    ids = batch["input_ids"][0]
    expected_labels = torch.cat([ids[1:], torch.tensor([-100])])
    expected_labels[cu[1:].long() - 1] = -100  # no document predicts the next one's first token
    return (
        torch.equal(whole["input_ids"][0], ids),
        torch.equal(whole["labels"][0], expected_labels),
        torch.equal(whole["position_ids"][0], batch["position_ids"][0]),
        torch.equal(local["labels"], local["shift_labels"]),
        sorted(local),
    )


def refusals():
    import cp_compile
    from cp_compile.hf.trainer import shard_batch

    plan = cp_compile.ContextParallel()
    ids = torch.arange(1, 9)[None]
    messages = []
    for batch in (
        {"input_ids": ids.repeat(2, 1), "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])},
        {"input_ids": ids, "pixel_mask": torch.ones(1, 8, 3)},
    ):
        try:
            shard_batch(plan, batch)
            messages.append("no error")
        except cp_compile.UnsupportedAttention as e:
            messages.append(str(e))
    return messages


def test_shard_batch_round_trip(ranks):
    for same_ids, same_labels, same_positions, labels_are_shifted, keys in ranks(2, shard_packed_batch):
        assert same_ids and same_labels and same_positions and labels_are_shifted
        # the flash kernels' length hints are dropped (a compiled model would recompile on each value)
        assert keys == [
            "cu_seq_lens_k",
            "cu_seq_lens_q",
            "input_ids",
            "labels",
            "position_ids",
            "seq_idx",
            "shift_labels",
        ]


def test_shard_batch_refuses_what_cp_cannot_run_exactly(ranks):
    for padded, unknown in ranks(2, refusals):
        assert "padding" in padded and "packing=True" in padded
        assert "'pixel_mask' looks per token" in unknown


def replica_of_groups():
    import torch.distributed as dist

    import cp_compile
    from cp_compile.hf.trainer import _replica_of

    blocks = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rank = dist.get_rank()
    mine = _replica_of(cp_compile.ContextParallel(blocks[rank // 2]))
    try:
        _replica_of(cp_compile.ContextParallel(strided[rank % 2]))
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return mine, refused


def test_replicas_are_blocks_of_consecutive_ranks(ranks):
    """A plan on mesh['cp'] of init_device_mesh(..., (dp, cp)) holds consecutive ranks: replica = rank // C.
    Any other grouping is refused, naming the mesh to build."""
    results = ranks(4, replica_of_groups)
    assert [mine for mine, _ in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert all("init_device_mesh" in refused for _, refused in results)


def autocast_errors():
    """HF Llama at C=2 (packed row) and on one process ("sdpa"), both under CPU bf16 autocast, against the fp64
    model: the largest logit error of each, relative to the reference's largest logit."""
    import copy

    import transformers

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")
    from cp_compile.hf.trainer import shard_batch

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="cp_compile")
    reference = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    reference.load_state_dict(model.state_dict())
    plan = cp_compile.ContextParallel()
    lengths = [13, 5, 1, 22, 7]
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    local = shard_batch(plan, {"input_ids": ids, "position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    with torch.no_grad():
        exact = reference.double()(ids, position_ids=positions, use_cache=False).logits
        reference.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            one = reference(ids, position_ids=positions, use_cache=False).logits
            with plan:
                cp = model(**local, use_cache=False).logits
    cp = plan.unshard(cp.float(), 1, cu_seqlens=cu)
    scale = exact.abs().max()
    return ((cp.double() - exact).abs().max() / scale).item(), ((one.double() - exact).abs().max() / scale).item()


def test_bf16_autocast_within_twice_one_process(ranks):
    """SFTConfig trains in bf16 autocast by default: the CP attention casts q, k, v as autocast casts SDPA's
    (custom ops are left alone by autocast) and stays within 2x the one-process bf16 error against fp64."""
    for cp_error, one_error in ranks(2, autocast_errors):
        assert 0 < one_error and cp_error <= 2 * one_error, (cp_error, one_error)


def trainer_without_the_group(output_dir: str) -> str:
    """A trainer built on gloo ranks that accelerate does not see (no launcher's environment, no use_cpu=True):
    accelerate runs one process while torch.distributed has two."""
    import transformers
    from transformers import Trainer, TrainingArguments

    from cp_compile.hf import ContextParallelMixin

    class CPTrainer(ContextParallelMixin, Trainer):
        pass

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    try:
        CPTrainer(model=model, args=TrainingArguments(output_dir=output_dir, report_to=[]))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_trainer_that_accelerate_runs_single_process_names_the_cause(ranks, tmp_path):
    messages = ranks(2, trainer_without_the_group, str(tmp_path))
    assert messages[0] == messages[1] and "accelerate runs 1 process(es) but torch.distributed has 2" in messages[0]
    assert "use_cpu=True" in messages[0]


@pytest.mark.launches
@pytest.mark.parametrize("model", ["qwen3_5", "bloom", "doge"])
def test_sft_trainer_compiled_with_activation_checkpointing(model):
    """SFTTrainer's defaults (activation checkpointing on) with torch_compile (the model compiled in place, its
    modules prepared before Dynamo traces its first call) on Qwen3.5 (Gated DeltaNet beside full attention: the
    mixers' agreements run once, in the forward, their exchanges recomputed with each checkpointed layer on every rank
    alike), BLOOM (ALiBi, attention of its own through the schedules) and Doge (its dynamic mask over every rank's
    keys); every logged loss within 1e-4 of the compiled one-process run's (whose BLOOM attends across the packed
    documents, which it cannot tell apart)."""
    out = run_example("--model", model, "--compile", "aot_eager", "--steps", "2", "--resume-at", "0")
    assert "SFTTrainer under CP (C=2, torchrun): 2 steps, largest relative difference against one process" in out


# -- padded rows scored by the trainer (DPOTrainer) -----------------------------------------------------------


def scored_rows_against_one_process():
    """A tiny fp64 Llama with TRL's fused LM head, called on padded rows (right, left and both-sided padding, a
    prompt masked out of the labels) under ``ScoredRows``, against the same call on one process: every per-token
    output, and the gradient of a loss of the log-probabilities (summed over the ranks and divided by C, as the
    data-parallel all-reduce averages it). Also what the backbone was given: this rank's slots only.

    TRL's fused head computes in fp32 whatever the model's dtype: the per-token outputs are compared to fp64's
    1e-10, the loss and the gradient (sums of fp32 values, in another order) relative to their size."""
    import copy

    import torch.distributed as dist
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")
    from cp_compile.hf.rows import PER_TOKEN_FIELDS, PackedRows, ScoredRows
    from cp_compile.layout.packed import packed_local_len

    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="cp_compile").double()
    reference = copy.deepcopy(model)
    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    add_fused_lm_head(model, outputs=fields)
    add_fused_lm_head(reference, outputs=fields)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (4, 12), generator=generator)
    mask = torch.zeros(4, 12, dtype=torch.long)
    for row, (start, stop) in enumerate(((0, 7), (9, 12), (2, 12), (3, 8))):
        mask[row, start:stop] = 1
    labels = ids.masked_fill(mask.cumsum(1) <= 2, -100)  # padding, and a prompt of 2 tokens as DPOTrainer masks it
    labels = labels.masked_fill(mask == 0, -100)
    weights = torch.rand(4, 11, generator=generator, dtype=torch.float64)
    call = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, fused_lm_head=True)

    expected = reference(**call)
    (expected.log_probs * weights).sum().backward()
    plan = cp_compile.ContextParallel()
    rows = PackedRows(mask)
    seen = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    with plan, plan.packed(rows.cu_seqlens), ScoredRows(plan, [model]):
        got = model(**call)
        (got.log_probs * weights).sum().backward()
    errors = {
        name: (getattr(got, name).double() - getattr(expected, name).double()).abs().max().item() for name in fields
    }
    loss_error = ((got.loss - expected.loss).abs() / expected.loss.abs()).item()
    grad_error = 0.0
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        summed = mine.grad.clone()
        dist.all_reduce(summed, group=plan.group)
        error = (summed / plan.world_size - theirs.grad).abs().max() / theirs.grad.abs().max()
        grad_error = max(grad_error, error.item())
    shapes = tuple(got.log_probs.shape) == tuple(expected.log_probs.shape) and set(PER_TOKEN_FIELDS) >= set(fields)
    return errors, loss_error, grad_error, seen == [packed_local_len(rows.cu_seqlens, plan.world_size)], shapes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_scored_rows_match_one_process(ranks, world_size):
    for errors, loss_error, grad_error, sharded, shapes in ranks(world_size, scored_rows_against_one_process):
        assert max(errors.values()) < 1e-10, errors
        assert loss_error < 1e-6 and grad_error < 1e-6, (loss_error, grad_error)
        assert sharded and shapes


def scored_rows_refusals():
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    import cp_compile
    import cp_compile.hf  # noqa: F401
    from cp_compile.hf.rows import PackedRows, ScoredRows

    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="cp_compile")
    add_fused_lm_head(model)
    plan = cp_compile.ContextParallel()
    ids = torch.arange(1, 9)[None].repeat(2, 1)
    messages = []
    try:
        PackedRows(torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [1] * 8]))
    except cp_compile.UnsupportedAttention as e:
        messages.append(str(e))
    try:
        PackedRows(torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])).next_targets(ids)
    except cp_compile.UnsupportedAttention as e:
        messages.append(str(e))
    with plan, ScoredRows(plan, [model]):
        try:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        except cp_compile.UnsupportedAttention as e:
            messages.append(str(e))
    return messages


def test_scored_rows_refuse_what_they_cannot_run(ranks):
    for hole, first, logits in ranks(2, scored_rows_refusals):
        assert "rows [0] of the batch have padding between their tokens" in hole
        assert "rows [0] are padded on the left and their first token has a label" in first
        assert "only fused_lm_head=True calls" in logits


# -- a replica seen as one process --------------------------------------------------------------------


def replica_reductions():
    import torch.distributed as dist

    import cp_compile
    from cp_compile.hf.replicas import ReplicaAccelerator, data_parallel_group, one_copy_per_replica

    rank = dist.get_rank()
    blocks = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    plan = cp_compile.ContextParallel(blocks[rank // 2])
    group = data_parallel_group(plan, 2)
    seen = ReplicaAccelerator(object(), rank // 2, 2, group)
    replica = rank // 2  # the ranks of a replica hold the same values
    values = torch.arange(3.0) + 10 * replica
    flags = torch.tensor([replica == 0, True])
    padded = seen.pad_across_processes(torch.ones(2 + replica), pad_index=-1)
    every = torch.cat([torch.full((1, 2), float(r // 2)) for r in range(4)])
    diverging = every.clone()
    diverging[1] += 1  # rank 1 disagrees with rank 0, its replica's first
    try:
        one_copy_per_replica(diverging, 2, 2)
        refused = "no error"
    except cp_compile.UnsupportedAttention as e:
        refused = str(e)
    return (
        seen.process_index,
        seen.num_processes,
        seen.gather(values).tolist(),
        seen.gather(flags).tolist(),
        seen.gather(torch.tensor(5.0 + replica)).tolist(),
        seen.reduce(values, "sum").tolist(),
        seen.reduce(values, "mean").tolist(),
        padded.tolist(),
        one_copy_per_replica(every, 2, 2).tolist(),
        refused,
    )


def test_a_replica_reduces_as_one_process_of_r(ranks):
    """On a 2x2 mesh each rank sees its replica as one process of 2: its index, gathers, sums and means over one rank
    of each replica (a 0-d value gathered as one element per process, booleans kept), padding to the longest of the
    replicas; values gathered from every process keep one copy per replica, and copies that differ are refused."""
    results = ranks(4, replica_reductions)
    for rank, (index, count, gathered, flags, scalar, total, mean, padded, kept, refused) in enumerate(results):
        assert (index, count) == (rank // 2, 2)
        assert gathered == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0] and flags == [True, True, False, True]
        assert scalar == [5.0, 6.0] and total == [10.0, 12.0, 14.0] and mean == [5.0, 6.0, 7.0]
        assert padded == ([1.0, 1.0, -1.0] if rank < 2 else [1.0, 1.0, 1.0])
        assert kept == [[0.0, 0.0], [1.0, 1.0]]
        assert "a reward function must be deterministic" in refused


def diverging_completions():
    import types

    import torch.distributed as dist

    import cp_compile
    from cp_compile.hf import ContextParallelMixin

    class Sampler(ContextParallelMixin):  # the mixin's check alone: it runs before the trainer's rewards
        pass

    sampler = Sampler.__new__(Sampler)
    sampler.plan = cp_compile.ContextParallel()
    sampler.accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    try:
        sampler._calculate_rewards([], [], [], [[5, 6, dist.get_rank()]])
        return "no error"
    except cp_compile.UnsupportedAttention as e:
        return str(e)


def test_ranks_of_a_replica_that_sampled_differently_are_refused(ranks):
    """Completions that differ between the ranks of a replica (generation not deterministic on the device) stop the
    step on every rank before they are scored as one batch."""
    for message in ranks(2, diverging_completions):
        assert "sampled different completions" in message


def test_a_trainer_that_generates_refuses_what_its_ranks_cannot_share():
    """GRPOConfig under CP: vLLM and continuous batching, tools (each rank would call them), torch_compile and a
    generation batch without whole groups are refused by name; the generation batch becomes R processes' (TRL sized
    it for every process)."""
    from trl import GRPOConfig

    import cp_compile
    from cp_compile.hf.trainer import _sampling_per_replica

    def config(**kwargs):
        return GRPOConfig(
            **{"output_dir": "unused", "use_cpu": True, "report_to": "none", "num_generations": 2, **kwargs}
        )

    sampling = _sampling_per_replica(config(per_device_train_batch_size=4), replicas=1, size=1, kwargs={})
    assert sampling.generation_batch_size == 4
    base = config(per_device_train_batch_size=4)
    base.generation_batch_size = 4 * 4  # as TRL sizes it on 4 processes: 2 replicas of C=2
    assert _sampling_per_replica(base, replicas=2, size=2, kwargs={}).generation_batch_size == 8
    with pytest.raises(cp_compile.UnsupportedAttention, match="vLLM generation"):
        _sampling_per_replica(config(use_vllm=True), replicas=1, size=2, kwargs={})
    with pytest.raises(cp_compile.UnsupportedAttention, match="tools="):
        _sampling_per_replica(config(), replicas=1, size=2, kwargs={"tools": [print]})
    with pytest.raises(cp_compile.UnsupportedAttention, match="torch_compile"):
        _sampling_per_replica(config(torch_compile=True), replicas=1, size=2, kwargs={})
    odd = config(per_device_train_batch_size=3, num_generations=3)
    odd.num_generations = 2  # 3 completions per replica cannot hold pairs
    with pytest.raises(ValueError, match="whole groups of 2 generations"):
        _sampling_per_replica(odd, replicas=1, size=1, kwargs={})
