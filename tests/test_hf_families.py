"""The attention of the model families users bring, as transformers runs them, under CP against one process.

Each family's own config and model classes, tiny sizes, random weights (fp32, seeded, the same on every
rank and in the reference), ``attn_implementation="cp_compile"`` under a plan against ``"sdpa"`` (``"eager"``
where the family has no SDPA path) on one process:

- Llama 4: chunked attention (a layer of chunks of 16, a full-attention layer), applied only by its mask;
- PhiMoE: a sliding window applied only by its mask;
- Gemma 2: soft-capped scores, window and full layers alternating;
- GPT-OSS: attention sinks, window and full layers alternating;
- DeepSeek-V3: multi-head latent attention (query/key head 24, value head 16), a latent KV cache.
"""

import contextlib

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the HF integration")

VOCAB, SEQ, PROMPT, NEW = 128, 72, 37, 12  # SEQ splits into 2C chunks for C = 2 and 3
LENGTHS = [21, 5, 38, 8]  # packed documents, none a multiple of 2C, one longer than two chunks of 16
TOL = 1e-4  # relative to the reference's largest magnitude (over the whole model for gradients), fp32

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attention_dropout=0.0,
)
FAMILIES = {
    "llama4_text": dict(
        attention_chunk_size=16,
        layer_types=["chunked_attention", "full_attention"],
        head_dim=16,
        intermediate_size_mlp=128,
        num_local_experts=2,
        attn_temperature_tuning=False,
    ),
    "phimoe": dict(sliding_window=16, num_local_experts=2),
    "gemma2": dict(sliding_window=16, head_dim=16, attn_logit_softcapping=5.0, query_pre_attn_scalar=16),
    "gpt_oss": dict(
        sliding_window=16,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kv_lora_rank=16,
        q_lora_rank=None,
        n_routed_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
}
NO_SDPA = ("gemma2", "gpt_oss")  # transformers refuses "sdpa" for them: the reference runs "eager"


def tiny(family: str, attn: str, **overrides):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[family](**{**COMMON, **FAMILIES.get(family, {}), **overrides})
    if attn == "sdpa" and family in NO_SDPA:
        attn = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def train_parity(family: str, mode: str, packed: bool) -> dict:
    """One training step under the plan (eager, or compiled with ``mode`` as plan.backend()'s inner compiler)
    against one process: loss, logits and every all-reduced gradient."""
    import torch.distributed as dist

    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    model, reference = tiny(family, "cp_compile"), tiny(family, "sdpa")
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(1))
    x = ids[:, :-1]
    labels = ids[:, 1:].clone()
    lengths = LENGTHS if packed else [SEQ]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    labels[0, cu[1:].long() - 1] = -100  # the last token of every document predicts nothing
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    count = (labels != -100).sum()

    def loss_of(logits, lab):
        return torch.nn.functional.cross_entropy(logits[0], lab[0], ignore_index=-100, reduction="sum") / count

    ref_logits = reference(x, position_ids=positions, use_cache=False).logits
    loss_of(ref_logits, labels).backward()
    forward = model if mode == "eager" else torch.compile(model, backend=plan.backend(mode), fullgraph=True)
    with plan, plan.packed(cu) if packed else contextlib.nullcontext():
        if packed:
            local_x, local_labels = plan.shard(x[0], 0, cu_seqlens=cu)[None], plan.shard(labels[0], 0, cu_seqlens=cu)
            local_labels = torch.where(layout_real(plan, cu), local_labels, -100)[None]  # padding slots: no loss
            kwargs = dict(position_ids=plan.positions(cu_seqlens=cu)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        else:
            local_x, local_labels = plan.shard(x, 1), plan.shard(labels, 1)
            kwargs = dict(position_ids=plan.positions(SEQ)[None])
        logits = forward(local_x, use_cache=False, **kwargs).logits
        loss = loss_of(logits, local_labels)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    scale = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    worst = 0.0
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        if theirs.grad is None:
            continue
        grad = mine.grad.clone() if mine.grad is not None else torch.zeros_like(theirs.grad)
        dist.all_reduce(grad)
        worst = max(worst, ((grad - theirs.grad).abs().max() / scale).item())
    if packed:
        real = layout_real(plan, cu)
        logits_err = rel(logits[0].detach()[real], plan.shard(ref_logits[0].detach(), 0, cu_seqlens=cu)[real])
    else:
        logits_err = rel(logits.detach(), plan.shard(ref_logits.detach(), 1))
    return {"loss": abs(total.item() - loss_of(ref_logits, labels).item()), "logits": logits_err, "grads": worst}


def layout_real(plan, cu):
    from cp_compile.layout import packed

    return packed.packed_slots(cu, plan.rank, plan.world_size)["real"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_eager_and_compiled(ranks, family):
    for mode in ("eager", "aot_eager"):
        for result in ranks(2, train_parity, family, mode, False):
            assert result["loss"] < TOL and result["logits"] < TOL and result["grads"] < TOL, (mode, result)


@pytest.mark.parametrize("family", ["llama4_text", "gemma2"])
def test_packed_documents_with_chunks_and_caps(ranks, family):
    """Chunks count from each document's start (transformers remaps positions in packed rows), caps per tile."""
    for mode in ("eager", "aot_eager"):
        for result in ranks(2, train_parity, family, mode, True):
            assert result["loss"] < TOL and result["logits"] < TOL and result["grads"] < TOL, (mode, result)


def test_inductor_and_three_ranks(ranks):
    for result in ranks(2, train_parity, "gpt_oss", "inductor", False):
        assert result["loss"] < TOL and result["grads"] < TOL, result
    for family in ("llama4_text", "deepseek_v3"):
        for result in ranks(3, train_parity, family, "eager", False):
            assert result["loss"] < TOL and result["grads"] < TOL, (family, result)


def generate_parity(family: str, compiled: bool = False) -> bool:
    """Greedy generation under the plan against one process; ``compiled``: transformers compiles the decode
    step (its ``CompileConfig``, as on GPUs), with every new token's attention over the sharded cache."""
    import cp_compile
    import cp_compile.hf

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    model, reference = tiny(family, "cp_compile"), tiny(family, "sdpa")
    reference.load_state_dict(model.state_dict())
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    want = reference.generate(prompt, max_new_tokens=NEW, do_sample=False)
    kwargs = {}
    if compiled:
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True, mode=None, backend="aot_eager")
        config._compile_all_devices = True  # transformers compiles decoding by itself on GPUs only
        kwargs["compile_config"] = config
    with plan:
        got = cp_compile.hf.generate(model, prompt, max_new_tokens=NEW, do_sample=False, **kwargs)
    return torch.equal(got, want)


@pytest.mark.parametrize("world_size", [2, 3])
def test_generate_token_for_token(ranks, world_size):
    for family in FAMILIES:
        assert all(ranks(world_size, generate_parity, family)), family


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "deepseek_v3"])
def test_compiled_decoding(ranks, family):
    assert all(ranks(2, generate_parity, family, True)), family


# ----------------------------------------------------------------------------
# Refused by name, on every rank, before anything mixes a shard alone.
# ----------------------------------------------------------------------------


def refusal(family: str, overrides: dict, phase: str) -> str:
    import cp_compile.hf  # noqa: F401  (registers "cp_compile" before the model is built)

    return _refused(tiny(family, "cp_compile", **overrides), phase)


def _refused(model, phase: str) -> str:
    """The error ``model`` raises under a plan in training or generation (``"no error"`` when it runs)."""
    import cp_compile
    import cp_compile.hf

    plan = cp_compile.ContextParallel()
    ids = torch.randint(0, 100, (1, SEQ), generator=torch.Generator().manual_seed(1))  # every tiny vocabulary
    try:
        with plan:
            if phase == "train":
                model(plan.shard(ids, 1), position_ids=plan.positions(SEQ)[None], use_cache=False)
            else:
                cp_compile.hf.generate(model, ids[:, :PROMPT], max_new_tokens=2, do_sample=False)
    except (cp_compile.UnsupportedAttention, cp_compile.LocalAttentionError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("phase", ["train", "generate"])
def test_mixer_layers_are_refused_by_their_declared_type(ranks, phase):
    """A model whose config declares a convolution layer of a family cp_compile does not run such layers for (Qwen2
    given layer_types), both phases."""
    overrides = {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2}
    for message in ranks(2, refusal, "qwen2", overrides, phase):
        assert "'conv'" in message, message


def escaped_convolution() -> str:
    """Mamba with its convolution function put back unwrapped after the plan wrapped it (and after the model's first
    call under the plan, which wraps what its modeling module holds then)."""
    import importlib

    import cp_compile

    module = importlib.import_module("transformers.models.mamba.modeling_mamba")
    plan = cp_compile.ContextParallel()
    model = tiny("mamba", "cp_compile", state_size=8)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with plan:  # wraps the mixers of the families loaded so far
        model(plan.shard(ids, 1), position_ids=plan.positions(SEQ)[None], use_cache=False)
        wrapped = module.causal_conv1d_fn
        module.causal_conv1d_fn = wrapped.__wrapped__
        try:
            model(plan.shard(ids, 1), position_ids=plan.positions(SEQ)[None], use_cache=False)
        except cp_compile.LocalAttentionError as error:
            return f"LocalAttentionError: {error}"
        finally:
            module.causal_conv1d_fn = wrapped
    return "no error"


def test_a_convolution_that_escapes_the_plan_meets_the_guard(ranks):
    """A state-space model's convolution run on the shard alone (its function swapped after the plan wrapped it):
    the plan's guard stops ``torch.conv1d``."""
    for message in ranks(2, escaped_convolution):
        assert message.startswith("LocalAttentionError") and "1-D convolution" in message, message


def test_temperature_tuning_on_positions_of_the_shard_is_refused(ranks):
    overrides = dict(attn_temperature_tuning=True, no_rope_layers=[1, 0])  # layer 1 has no RoPE
    for message in ranks(2, refusal, "llama4_text", overrides, "train"):
        assert "attn_temperature_tuning" in message, message


def mask_refusals() -> list:
    """The mask function under a plan: what it reads, and what it refuses."""
    from transformers import LlamaConfig
    from transformers import masking_utils as mu

    import cp_compile
    import cp_compile.hf

    plan = cp_compile.ContextParallel()
    config = LlamaConfig(**COMMON)
    config.architectures = ["LlamaForCausalLM"]

    def call(fn, **kwargs):
        return cp_compile.hf.mask(batch_size=1, q_length=32, kv_length=32, mask_function=fn, config=config, **kwargs)

    zeros = torch.zeros(1, dtype=torch.long)
    with plan:
        specs = [
            call(mu.causal_mask_function),
            call(mu.sliding_window_causal_mask_function(7)),
            call(mu.chunked_causal_mask_function(8, zeros)),
            call(mu.and_masks(mu.chunked_causal_mask_function(8, zeros), mu.sliding_window_overlay(5))),
        ]
        messages = []
        for fn in (
            mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv == 0),
            lambda b, h, q, kv: kv <= q,
            mu.sliding_window_bidirectional_mask_function(4),
        ):
            try:
                call(fn)
                messages.append("no error")
            except cp_compile.UnsupportedAttention as error:
                messages.append(str(error))
        try:
            specs[0][:, 0]  # model code indexing the mask (a sparse-attention indexer)
        except cp_compile.UnsupportedAttention as error:
            messages.append(str(error))
    return [(s.causal, s.window, s.chunk) for s in specs], messages


def test_mask_functions_read_or_refused(ranks):
    for specs, messages in ranks(2, mask_refusals):
        assert specs == [(True, None, None), (True, 7, None), (True, None, 8), (True, 5, 8)]
        assert "or_mask" in messages[0] and "LlamaForCausalLM" in messages[0]
        assert "<lambda>" in messages[1]
        assert "bidirectional" in messages[2] or "sliding_window_bidirectional" in messages[2]
        assert "uses the attention mask as a tensor" in messages[3]


def explained() -> str:
    import cp_compile
    import cp_compile.hf

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    model = tiny("gemma2", "cp_compile")
    ids = torch.randint(0, VOCAB, (1, SEQ))
    with plan:
        return str(
            cp_compile.explain(
                model, plan.shard(ids, 1), position_ids=plan.positions(SEQ)[None], use_cache=False, plan=plan
            )
        )


def test_explain_lists_the_ops_a_model_calls_itself(ranks):
    """Soft-capped layers call the CP op directly; explain lists each with its options and the model's line."""
    for report in ranks(2, explained):
        assert report.startswith("cp_compile: 2 attention site(s), 1 graph(s), 0 graph break(s)"), report
        assert "left=15 right=0 softcap=5.0" in report and "left=-1 right=0 softcap=5.0" in report, report
        assert report.count("modeling_gemma2.py") == 2, report


def _generate_reusing_keys() -> list:
    from test_hf_hybrids import generate_reading_the_sequence

    import cp_compile
    import cp_compile.hf
    from cp_compile.hf.forward import in_flight
    from cp_compile.tools.bench import model_configs, model_run

    results = generate_reading_the_sequence("gemma3n_text", [1, 30])
    config, cls, _ = model_configs.tiny_config("gemma3n_text")
    model = model_run._build(cls, config, "cp_compile").eval()
    ids = torch.randint(model_configs.first_id(config), 100, (1, 30), generator=torch.Generator().manual_seed(30))
    with cp_compile.ContextParallel(), torch.no_grad():
        cp_compile.hf.generate(model, ids, max_new_tokens=4, do_sample=False)
        return [*results, len(in_flight().shared_steps)]  # what the plan's record still holds after it


@pytest.mark.parametrize("world_size", [2, 3])
def test_layers_reusing_another_layers_keys_generate(ranks, world_size):
    """Gemma 3n's "reuse" layers attend to the K/V of the last "store" layer of their type and keep no cache: each
    decoded step's share of the store layer reaches them with its keys. Sampled (prompts of 1 and 30 tokens)
    against one process with the same seed; ranks seeded differently all raise (each reused layer's gather is
    counted, so a rank that stops first joins the other's step)."""
    for results in ranks(world_size, _generate_reusing_keys):
        *runs, refusal, shared_left = results
        assert shared_left == 0, "the shared steps outlived the generation (they hold the cache's layers)"
        for same, new, err in runs:
            assert same and new == 20 and err < 1e-5, runs
        assert "different tokens" in refusal, refusal
