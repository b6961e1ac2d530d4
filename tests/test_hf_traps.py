"""Hugging Face calls that would train wrong under CP without a word raise instead, on every rank.

Each route as a user would write it (HF Llama, C=2, 64 tokens), eager and compiled with the plan's
backend: positions the shard's own (none given, or 0..L-1), ``labels=`` without ``shift_labels=``,
``shift_labels=`` without ``num_items_in_batch=``, and a plan's shards or positions fed to the model
outside ``with plan:``. The right calls next to them run (and match one process: ``tests/test_hf.py``).
"""

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the HF integration")

VOCAB, SEQ = 128, 64


def llama(attn: str = "cp_compile"):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float32)


ROUTES = [
    "no positions",
    "local positions",
    "labels",
    "shift_labels without count",
    "outside the plan",
    "positions outside the plan",
]


def route(name: str, mode: str, load_balance: str = "zigzag") -> str:
    """The message each rank raised (or "no error") for one route."""
    import cp_compile
    import cp_compile.hf  # noqa: F401  (registers "cp_compile")

    torch._dynamo.reset()
    if load_balance == "blockmask":  # a causal BlockMask's query blocks dealt to the ranks
        from torch.nn.attention.flex_attention import create_block_mask

        load_balance = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, SEQ, SEQ, device="cpu", BLOCK_SIZE=16)
    plan = cp_compile.ContextParallel(load_balance=load_balance)
    model = llama()
    if mode != "eager":
        model = torch.compile(model, backend=plan.backend(mode), fullgraph=True)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    local, positions = plan.shard(ids, 1), plan.positions(SEQ)[None]
    labels = plan.shard(torch.roll(ids, -1, 1), 1)
    calls = {
        "no positions": lambda: model(local, use_cache=False),
        "local positions": lambda: model(
            local, position_ids=torch.arange(SEQ // plan.world_size)[None], use_cache=False
        ),
        "labels": lambda: model(local, position_ids=positions, labels=labels, use_cache=False),
        "shift_labels without count": lambda: model(
            local, position_ids=positions, labels=labels, shift_labels=labels, use_cache=False
        ),
        "outside the plan": lambda: model(local, position_ids=positions, use_cache=False),
        "positions outside the plan": lambda: model(
            ids[:, : SEQ // plan.world_size], position_ids=positions, use_cache=False
        ),
        "right": lambda: model(
            local,
            position_ids=positions,
            labels=labels,
            shift_labels=labels,
            num_items_in_batch=torch.tensor(SEQ),
            use_cache=False,
        ),
    }
    try:
        if name.endswith("outside the plan"):
            calls[name]()
        else:
            with plan:
                calls[name]()
    except Exception as error:  # noqa: BLE001  (Dynamo wraps what a compiled call raises)
        while not isinstance(error, cp_compile.UnsupportedAttention):
            inner = getattr(error, "inner_exception", None) or error.__cause__
            if inner is None:
                break
            error = inner
        return f"{type(error).__name__}: {error}"
    return "no error"


EXPECTED = {
    "no positions": "no position_ids",
    "local positions": "position_ids number this rank's shard from 0",
    "labels": "labels= without shift_labels=",
    "shift_labels without count": "shift_labels= without num_items_in_batch=",
    # compiled, plan.backend() refuses the mask transformers builds outside a plan first, also naming `with plan:`
    "outside the plan": "with plan:",
    "positions outside the plan": "with plan:",
}


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_each_trap_raises_on_every_rank(ranks, mode):
    for name in ROUTES:
        messages = ranks(2, route, name, mode)
        assert all(m.startswith("UnsupportedAttention") and EXPECTED[name] in m for m in messages), (name, messages)
    assert ranks(2, route, "right", mode) == ["no error", "no error"]


def test_local_positions_under_the_contiguous_layout(ranks):
    """Rank 0's own positions are right there: the ranks agree first, and every rank raises."""
    for load_balance, expected in (
        ("contiguous", EXPECTED["local positions"]),
        ("zigzag", EXPECTED["local positions"]),
    ):
        messages = ranks(2, route, "local positions", "eager", load_balance)
        assert all(expected in m for m in messages), (load_balance, messages)
    assert ranks(2, route, "right", "eager", "contiguous") == ["no error", "no error"]


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_a_plan_balanced_by_a_blockmask_is_refused_by_name(ranks, mode):
    """Its layout deals the mask's query blocks to the ranks, an order only its FlexAttention calls know."""
    for message in ranks(2, route, "right", mode, "blockmask"):
        assert message.startswith("UnsupportedAttention") and "plan balanced by a BlockMask" in message, message


def outside_any_plan() -> bool:
    """A "cp_compile" model never given a plan's tensors runs as "sdpa", bit for bit."""
    model, reference = llama(), llama("sdpa")
    ids = torch.randint(0, VOCAB, (1, SEQ))
    return torch.equal(model(ids).logits, reference(ids).logits)


def test_a_model_never_given_a_plans_tensors_runs_as_sdpa(ranks):
    assert all(ranks(2, outside_any_plan))


def other_attention(attn: str, mode: str) -> str:
    """A model on another attention implementation, fed a plan's shard and positions inside the plan."""
    import cp_compile
    import cp_compile.hf  # noqa: F401

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    model = llama(attn)
    if mode != "eager":
        model = torch.compile(model, backend=plan.backend(mode), fullgraph=True)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    try:
        with plan:
            model(plan.shard(ids, 1), position_ids=plan.positions(SEQ)[None], use_cache=False)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("attn,mode", [("eager", "eager"), ("eager", "aot_eager"), ("sdpa", "eager")])
def test_other_attention_implementations_raise_under_a_plan(ranks, attn, mode):
    """transformers' "eager" attention (Gemma 2's and GPT-OSS's default) is matmuls nothing can rewrite, eager or
    compiled; "sdpa" run eagerly meets the guard. Every rank raises, naming the fix."""
    messages = ranks(2, other_attention, attn, mode)
    assert messages[0] == messages[1] and messages[0].startswith("LocalAttentionError"), messages
    assert "cp_compile" in messages[0]
    if attn == "eager":
        assert "attn_implementation='eager'" in messages[0], messages[0]
