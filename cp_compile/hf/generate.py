"""``cp_compile.hf.generate``: Hugging Face generation with the prompt and the KV cache sharded over the ranks.

``model.generate`` alone cannot shard a prompt: it feeds the whole prompt to
the model on every rank. This function runs all but the prompt's last token
once, sharded by the plan's packed layout (every rank computes 1/C of the
prefill and keeps 1/C of the K/V in a ``ShardedCache``), then hands over to
``model.generate`` with that cache: transformers continues from a cache that
already holds those tokens, so everything after the prefill (logits
processors, sampling, stopping criteria, streamers, compiled decoding with a
compileable cache) is transformers' own code, unchanged. A model of linear layers alone,
whose cache has no length for ``generate`` to slice the prompt by, continues through
``continued.continue_prefilled``, transformers' decoding loop started from the prompt's last token.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import warnings
from typing import Optional

import torch
from torch import Tensor
from transformers import StoppingCriteria, StoppingCriteriaList

from ..active import active_plan
from ..comm.gather import gather_dim0
from ..errors import UnsupportedAttention
from ..guard import LocalAttentionGuard, set_aside
from ..kernels.masked import EMPTY_POSITION
from ..layout.packed import packed_slots
from ..mixers import Sharding
from ..mixers.halo import sequence_tail
from ..plan import ContextParallel
from .attention import NAME
from .batched import CacheOfRows, why_not_in_rows
from .cache import ShardedCache, drop_handed_step
from .checks import model_calls_unfollowed, one_model_call_followed, prepare
from .continued import continue_prefilled
from .families import family_of
from .family_caches import sharded_cache
from .forward import same_tokens_on_every_rank

# generate() options refused by name: they need more than one sequence, a cache that can roll back, or
# decisions that may differ between ranks (a wall-clock limit stops each rank after its own count of tokens).
_REFUSED = {
    "num_beams": "beam search",
    "num_return_sequences": "several sequences per prompt",
    "assistant_model": "assisted decoding",
    "prompt_lookup_num_tokens": "prompt lookup decoding",
    "assistant_early_exit": "self-speculative decoding",
    "penalty_alpha": "contrastive search",
    "dola_layers": "DoLa decoding",
    "max_time": "a wall-clock limit",
}


def _generation_config(model, generate_kwargs: dict):
    config = copy.deepcopy(generate_kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in generate_kwargs.items() if k != "generation_config"})
    return config


def _check(model, input_ids: Tensor, generate_kwargs: dict, config) -> None:
    if model.config._attn_implementation != NAME:
        raise ValueError(
            f"cp_compile.hf.generate needs a model loaded with attn_implementation={NAME!r} "
            f"(it has {model.config._attn_implementation!r})"
        )
    if input_ids.dim() != 2:
        raise UnsupportedAttention(f"cp_compile.hf.generate takes input_ids [B, P]; got {tuple(input_ids.shape)}")
    for name, what in _REFUSED.items():
        value = generate_kwargs.get(name, getattr(config, name, None))
        if value not in (None, 1, 0):
            raise UnsupportedAttention(f"cp_compile.hf.generate: {what} ({name}={value!r}) is not supported")
    mask = generate_kwargs.get("attention_mask")
    if mask is None:
        return
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} is not the shape of input_ids {tuple(input_ids.shape)}")
    real = mask.bool()
    if not bool(real[:, -1].all()) or not bool((real[:, 1:] >= real[:, :-1]).all()):
        raise UnsupportedAttention(
            "cp_compile.hf.generate: padding must be on the left, each row's tokens last (padding_side='left'), "
            "and every row needs a token"
        )


def _max_tokens(config, prompt: int) -> int:
    """The cache's size: the tokens the model is fed (the generation's max_length but the last token, which is
    never fed back; transformers sizes its static cache so), or transformers' ``max_cache_len`` when larger (a cache
    size that stays the same across prompts keeps a compiled decode step's shapes)."""
    longest = prompt + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
    return max(longest - 1, getattr(config, "max_cache_len", None) or 0)


def _slot_positions(plan: ContextParallel, cu: Tensor) -> Tensor:
    """Each of this rank's slots' position in the prompt of ``cu`` (one document), ``EMPTY_POSITION`` for padding."""
    slots = packed_slots(cu, plan.rank, plan.world_size)
    return torch.where(slots["real"], slots["pos"], EMPTY_POSITION)


def sharded_prefill(model, plan: ContextParallel, cache: ShardedCache, input_ids: Tensor) -> None:
    """Run ``input_ids [1, n]`` (the same on every rank) once, sharded over ``plan``: each rank computes
    and caches its own tokens' K/V (and, for a hybrid's linear layers, every rank the whole state). The prompt
    is one packed document: the attention reads it from ``cu_seq_lens_q``, a model's convolutions and scans
    from the plan's documents while it runs (``plan.packed``)."""
    tokens = input_ids.shape[1]
    # each layer's attention is checked by the cache, and the convolutions and scans by the count of this one call
    # (the positions are the plan's, and no labels are given); the guard's mode stays on for this one call, and
    # catches a token mixer that runs on the shard alone in code no wrapper covers
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    local_ids = plan.shard(input_ids, 1, cu_seqlens=cu)
    documents = cu.to(input_ids.device)
    local_positions = plan.positions(cu_seqlens=documents, device=documents.device)
    with cache.sharded_prefill(_slot_positions(plan, cu), tokens), plan.packed(documents):
        with torch.no_grad(), one_model_call_followed(model):
            model(
                input_ids=local_ids,
                position_ids=local_positions[None],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
                cu_seq_lens_q=documents,
                cu_seq_lens_k=documents,
            )
    cache.check_attended()


def _same_on_every_rank(plan: ContextParallel, ids: Tensor) -> bool:
    """Collective: whether ``ids`` has the same length and digest on every rank (the same answer on every rank)."""
    ids = ids.flatten().long()
    weights = torch.arange(1, ids.numel() + 1, device=ids.device) % 1_000_003
    mine = torch.stack([torch.tensor(ids.numel(), device=ids.device), (ids * weights).sum()])
    return bool((gather_dim0(mine[None], plan.group_name, plan.world_size) == mine).all())


class SameTokensOnEveryRank(StoppingCriteria):
    """Hands each step's new tokens to the cache's ``Agreement``; they ride on the next step's first gather.

    Ranks that drew different tokens (sampling seeded differently) would go on to stop at different
    steps, and a rank that stops leaves the others waiting in the next layer's collective. Every rank
    learns that they differ in the same step, and this criterion then stops generation on every rank
    at once; ``generate`` raises the same error on every rank after ``Agreement.finish``.
    """

    def __init__(self, cache: ShardedCache):
        self.cache, self.agreement = cache, cache.agreement

    def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:
        self.cache.check_attended()
        if self.agreement.world_size > 1:  # one rank has no other to differ from
            self.agreement.note(input_ids[:, -1])
        return self.agreement.differs.expand(input_ids.shape[0]).clone()


def _asked_no_cache(model, generate_kwargs: dict, config) -> bool:
    """``use_cache=False`` given, or a config that turns the cache off (MPT)."""
    asked = generate_kwargs.get("use_cache", config.use_cache)
    if asked is None:  # unset (TRL's GenerationConfig): the model's generation config, then transformers' default
        asked = getattr(model.generation_config, "use_cache", None)
    return asked is False


def keeps_no_cache(model, generate_kwargs: dict, config) -> bool:
    """Whether ``model.generate`` runs ``model`` without a transformers cache: asked to, or a model whose forward
    takes none (RWKV keeps a state of its own, OpenAI GPT nothing)."""
    if _asked_no_cache(model, generate_kwargs, config):
        return True
    parameters = inspect.signature(model.forward).parameters
    return not any(name in parameters for name in ("cache", "past_key_values"))


class _EveryStepSharded:
    """Forward hooks for ``model.generate`` without a cache, whose every step runs the whole sequence: each step's
    ``input_ids`` (the same on every rank) are sharded as one packed document before the model runs, and every rank
    gets the last token's logits, which are all that ``generate`` reads, after it.

    Given a ``cache``, the prompt's call alone (the cache holds nothing yet) runs so, a sharded prefill of the whole
    prompt; the steps after it run as on one process (``cp_compile.hf.generate`` of a model whose prompt attends
    both ways)."""

    def __init__(self, model, plan: ContextParallel, cache: Optional[ShardedCache] = None):
        self.model, self.plan, self.cache = model, plan, cache
        self.calls: list[tuple[contextlib.ExitStack, Sharding]] = []
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    def before(self, module, args: tuple, kwargs: dict):
        if self.cache is not None and self.cache.holds_tokens():
            return None
        input_ids = kwargs.pop("input_ids", None) if not args else args[0]
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise UnsupportedAttention("cp_compile.hf.generate without a cache: the model is given input_ids alone")
        tokens = input_ids.shape[1]
        kwargs.pop("attention_mask", None)  # all ones (checked): the documents say the same
        kwargs.pop("position_ids", None)
        kwargs.pop("logits_to_keep", None)  # the last token's logits are on the rank that holds it: every slot's kept
        for name, value in kwargs.items():  # nothing else may hold one row per token: it would not be sharded
            if isinstance(value, Tensor) and value.dim() >= 2 and tokens in value.shape[1:]:
                raise UnsupportedAttention(
                    f"cp_compile.hf.generate without a cache: the model's step takes {name!r} {tuple(value.shape)}, "
                    f"which looks per token of the {tokens}-token sequence and cannot be sharded"
                )
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=input_ids.device)
        step = contextlib.ExitStack()
        step.enter_context(self.plan.packed(cu))
        positions = self.plan.positions(cu_seqlens=cu, device=cu.device)
        step.enter_context(one_model_call_followed(self.model))
        self.calls.append((step, Sharding(self.plan.group_name, self.plan.world_size, self.plan.load_balance, cu)))
        kwargs.update(input_ids=self.plan.shard(input_ids, 1, cu_seqlens=cu), use_cache=self.cache is not None)
        if self.cache is not None:
            step.enter_context(self.cache.sharded_prefill(_slot_positions(self.plan, cu), tokens))
            # decoding sets the guard aside and runs every module as on one process: this call runs on the shards
            step.enter_context(same_tokens_on_every_rank(False))
            step.enter_context(LocalAttentionGuard())
        # a model without position_ids reads none (RWKV), or builds them in a module over the gathered sequence
        if self.takes_positions:
            kwargs["position_ids"] = positions[None]
        return (), kwargs

    def after(self, module, args: tuple, kwargs: dict, output):
        if not self.calls:  # the pre-hook raised
            return None
        step, sharding = self.calls.pop()
        step.close()
        if output is None:  # the forward raised
            return None
        if self.cache is not None:
            self.cache.check_attended()
        output.logits = sequence_tail(output.logits, 1, 1, sharding)
        return output

    @contextlib.contextmanager
    def on(self):
        handles = [
            self.model.register_forward_pre_hook(self.before, with_kwargs=True),
            self.model.register_forward_hook(self.after, with_kwargs=True, always_call=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


_RANKS_DIFFERED = (
    "cp_compile.hf.generate: the ranks generated different tokens or stopped at different steps; sampling needs the "
    "same seed on every rank (torch.manual_seed(s) on each before generate), and a stopping rule must decide the same "
    "on every rank"
)


class _StepsAgreed(StoppingCriteria):
    """Where no cache carries the comparison: every step, the ranks all-gather their new token and what the user's
    stopping criteria decided (one small collective); ranks that differ in either all stop at once, and ``generate``
    raises (a rank that stopped alone would leave the others waiting in their next step's collectives)."""

    def __init__(self, plan: ContextParallel):
        self.plan, self.criteria, self.differ = plan, StoppingCriteriaList(), False

    def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:
        stop = self.criteria(input_ids, scores, **kwargs) if self.criteria else input_ids.new_zeros(1, dtype=torch.bool)
        mine = torch.cat([input_ids[:, -1].long(), stop.long()])
        everyone = gather_dim0(mine[None], self.plan.group_name, self.plan.world_size)
        self.differ = self.differ or not bool((everyone == mine).all())
        return torch.full((input_ids.shape[0],), self.differ or bool(stop.all()), device=input_ids.device)

    def generate(self, model, input_ids: Tensor, generate_kwargs: dict):
        """``model.generate`` with the user's stopping criteria (taken out of ``generate_kwargs``) behind this one;
        every rank raises after it where the ranks differed."""
        self.criteria = StoppingCriteriaList(generate_kwargs.pop("stopping_criteria", None) or [])
        result = model.generate(input_ids, stopping_criteria=StoppingCriteriaList([self]), **generate_kwargs)
        if self.differ:
            raise RuntimeError(_RANKS_DIFFERED)
        return result


def _generate_recomputing(model, plan: ContextParallel, input_ids: Tensor, generate_kwargs: dict):
    """``model.generate`` for a model that keeps no transformers cache: as on one process, every step runs the whole
    sequence, here sharded over the ranks (C times less compute per rank, and no cache)."""
    generate_kwargs["use_cache"] = False
    with _EveryStepSharded(model, plan).on():  # the guard stays on: every step runs on the shards
        return _StepsAgreed(plan).generate(model, input_ids, generate_kwargs)


def _generate_from_own_state(model, plan: ContextParallel, input_ids: Tensor, generate_kwargs: dict, name: str):
    """``model.generate`` for a model that keeps a recurrent state of its own (``Family.state_kwarg``: RWKV's
    ``state``): the prompt but its last token prefilled sharded as one document, which leaves every rank the state of
    the whole prefix (the same on every rank), then ``generate`` from that state, whose first call runs the prompt's
    last token alone and every step as one process runs it. Each step's token is compared across the ranks."""
    prepare(model)
    state = None
    if input_ids.shape[1] > 1:
        prefix = input_ids[:, :-1]
        cu = torch.tensor([0, prefix.shape[1]], dtype=torch.int32, device=input_ids.device)
        with plan.packed(cu), torch.no_grad(), one_model_call_followed(model):
            state = getattr(model(input_ids=plan.shard(prefix, 1, cu_seqlens=cu), use_cache=True), name)

    def last_token_alone(module, args: tuple, kwargs: dict):
        ids = kwargs.get("input_ids")
        if state is not None and kwargs.get(name) is state and ids is not None and ids.shape[1] > 1:
            kwargs["input_ids"] = ids[:, -1:]  # the state holds every token before it
        return args, kwargs

    handle = model.register_forward_pre_hook(last_token_alone, with_kwargs=True)
    try:
        with set_aside(), model_calls_unfollowed(), same_tokens_on_every_rank():
            return _StepsAgreed(plan).generate(model, input_ids, {**generate_kwargs, name: state, "use_cache": True})
    finally:
        handle.remove()


def _generate_whole(model, plan: ContextParallel, input_ids: Tensor, generate_kwargs: dict, why: str):
    """``model.generate`` run whole on every rank, as one process runs it (the prompt is the same on every rank):
    exact at C times the model's compute, with no memory saved. The ranks compare each step's token."""
    warnings.warn(
        f"cp_compile.hf.generate: every rank runs {type(model).__name__}'s whole generation (C times its compute, "
        f"nothing sharded): {why}",
        stacklevel=3,
    )
    with set_aside(), model_calls_unfollowed(), same_tokens_on_every_rank():
        return _StepsAgreed(plan).generate(model, input_ids, generate_kwargs)


def why_not_batched(model, plan: ContextParallel, generate_kwargs: Optional[dict] = None) -> Optional[str]:
    """Why ``generate`` cannot take a batch of (left-padded) prompts for ``model``, or None when it can."""
    generate_kwargs = generate_kwargs or {}
    family = family_of(model)
    if family.generated_whole is not None:
        return family.generated_whole
    if family.state_kwarg is not None:  # RWKV
        return "its forward reads no attention mask (one process runs each row's padding through its recurrence)"
    if keeps_no_cache(model, generate_kwargs, _generation_config(model, generate_kwargs)):
        return "the generation keeps no cache"
    if any(not call.causal for call in family.gathered.values()):
        return "its prompt attends both ways"
    if any(call.sharded_inside for call in family.gathered.values()):
        return "its model cuts each sequence into patches of its own"
    modeling = sys.modules[type(model).__module__]
    if getattr(model.config, "is_decoder", None) is False and hasattr(modeling, "create_bidirectional_mask"):
        return "an encoder's model (is_decoder=False) builds a bidirectional mask from the padding itself"
    if family.fresh_states is not None:
        return "it keeps states on its modules, one sequence's"
    cache = sharded_cache(model, 1, plan)  # its layers allocate nothing until they are written
    if all(cache.is_linear):
        return "its layers keep states alone"
    why = why_not_in_rows(cache)
    if why is not None:
        return why
    # one process counts the padding into these positions; a row prefilled on its own would not
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "its forward takes no position_ids (one process counts each row's padding into its positions)"
    if "chunked_attention" in (getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()):
        return "chunked attention (one process counts each row's padding into its chunks)"
    return None


def _generate_rows(model, plan: ContextParallel, input_ids: Tensor, config, generate_kwargs: dict):
    """``generate`` for a batch of prompts, left-padded: each prompt's real tokens but the last are prefilled
    sharded on their own (``hf.batched``), then ``model.generate`` decodes the batch from the rows' stacked cache,
    sampling every row at once as one process does."""
    mask = generate_kwargs.get("attention_mask")
    lengths = [input_ids.shape[1]] * input_ids.shape[0] if mask is None else mask.sum(1).tolist()
    longest = _max_tokens(config, input_ids.shape[1])
    prepare(model)
    rows = CacheOfRows(plan, len(lengths), input_ids.shape[1] - 1)
    for row, length in enumerate(lengths):
        single = sharded_cache(model, longest, plan)
        if length > 1:
            sharded_prefill(model, plan, single, input_ids[row : row + 1, -length:-1])
        rows.add(single)
    return _decoded(model, plan, input_ids, rows.cache(), generate_kwargs)


def _decoded(
    model, plan: ContextParallel, input_ids: Tensor, cache: ShardedCache, generate_kwargs: dict, prompt_call=None
):
    """``model.generate`` from ``cache`` (prefilled, or left to generate's first call, ``prompt_call``), every step
    agreed between the ranks; every rank raises where they differed."""
    criteria = StoppingCriteriaList(
        [*(generate_kwargs.pop("stopping_criteria", None) or []), SameTokensOnEveryRank(cache)]
    )
    # the steps are checked by the criterion (every layer's attention ran through "cp_compile"); the guard's
    # mode, which sees every torch call, and the model-call hooks, which take every module call off torch's
    # fast path, would cost as much host time per step as the step's own Python
    try:
        with set_aside(), model_calls_unfollowed(), same_tokens_on_every_rank():
            with prompt_call.on() if prompt_call is not None else contextlib.nullcontext():
                result = model.generate(input_ids, cache=cache, stopping_criteria=criteria, **generate_kwargs)
    finally:
        drop_handed_step()
    # a model of linear layers alone decodes with no collective to carry the agreement: its tokens are compared once
    sequences = result if isinstance(result, Tensor) else result.sequences
    # so does a model whose decoding made no gather (its attention reads the whole K/V every rank keeps)
    silent = all(cache.is_linear) or not cache.agreement.per_query
    differs = silent and not _same_on_every_rank(plan, sequences)
    if cache.agreement.finish() or differs:
        raise RuntimeError(_RANKS_DIFFERED)
    return result


def generate(model, input_ids: Tensor, cache: ShardedCache = None, **generate_kwargs):
    """``model.generate(input_ids, **generate_kwargs)`` under context parallelism, inside ``with plan:``.

    ``input_ids [1, P]`` is the whole prompt, the same on every rank; every rank returns what
    ``model.generate`` returns, the same on every rank. The prompt's first P - 1 tokens are
    prefilled sharded over the plan; the cache (``cache``, by default a ``ShardedCache`` of
    ``max_length - 1`` tokens, as transformers sizes a static cache) keeps 1/C of the K/V on each
    rank. Greedy decoding and sampling (seed every rank the same) are supported; every new token is compared across the
    ranks, and ranks that differ all raise. A family that builds every step for its whole call
    (XLNet, Reformer: ``Family.generated_whole``) generates whole on every rank, C times its
    compute, and warns. ``input_ids [B, P]`` with ``attention_mask`` padded on the left is a batch
    of prompts: each prompt is prefilled sharded on its own and the batch decoded together from
    one cache (``hf.batched``), sampled as one process samples it; a family whose rows cannot
    share one cache raises ``UnsupportedAttention`` with the reason (``why_not_batched``). Beam
    search, several sequences per prompt, assisted decoding, contrastive search, DoLa,
    ``max_time`` and right padding raise ``UnsupportedAttention``.
    """
    plan = active_plan()
    if plan is None:
        raise ValueError("cp_compile.hf.generate runs inside `with plan:`")
    config = _generation_config(model, generate_kwargs)
    _check(model, input_ids, generate_kwargs, config)
    # the first collective: what follows may raise on the prompt's length, which a rank's other prompt would change,
    # and takes the route of a batch by the mask, which a rank's other mask would change
    mask = generate_kwargs.get("attention_mask")
    if not _same_on_every_rank(plan, input_ids if mask is None else torch.cat([input_ids, mask.to(input_ids)], 1)):
        raise ValueError(
            "cp_compile.hf.generate: the ranks passed different prompts; input_ids (and attention_mask) must be the "
            "whole prompt, the same on every rank"
        )
    why_whole = family_of(model).generated_whole
    if input_ids.shape[0] > 1 or (mask is not None and not bool(mask.all())):
        why_not = why_not_batched(model, plan, generate_kwargs) or (
            "the batch's cache is made from its rows (pass no cache)" if cache is not None else None
        )
        if why_not is not None:
            raise UnsupportedAttention(f"cp_compile.hf.generate of a batch of prompts: {why_not}")
        return _generate_rows(model, plan, input_ids, config, generate_kwargs)
    if why_whole is not None:
        if cache is not None:
            raise ValueError(
                f"cp_compile.hf.generate: a cache given for {type(model).__name__}, which every rank generates whole"
            )
        return _generate_whole(model, plan, input_ids, generate_kwargs, why_whole)
    name = family_of(model).state_kwarg
    if name is not None and not _asked_no_cache(model, generate_kwargs, config):
        if cache is not None:
            raise ValueError(f"cp_compile.hf.generate: a cache given for a model that keeps its own {name!r}")
        return _generate_from_own_state(model, plan, input_ids, generate_kwargs, name)
    if keeps_no_cache(model, generate_kwargs, config):
        if cache is not None:
            raise ValueError("cp_compile.hf.generate: a cache given for a generation that keeps none (use_cache=False)")
        return _generate_recomputing(model, plan, input_ids, generate_kwargs)
    if family_of(model).cache_refused is not None:
        raise UnsupportedAttention(
            f"cp_compile.hf.generate of {type(model).__name__} with a cache: {family_of(model).cache_refused}; pass "
            "use_cache=False (each step then runs the whole sequence, sharded)"
        )
    longest = _max_tokens(config, input_ids.shape[1])
    if cache is None:
        cache = sharded_cache(model, longest, plan)
    elif cache.max_cache_len < longest and not all(cache.is_linear):  # states alone hold any length
        raise ValueError(
            f"cp_compile.hf.generate: the cache passed was made with max_cache_len={cache.max_cache_len}; this "
            f"generation needs up to {longest} tokens (the prompt and every new token but the last): make it with "
            f"max_cache_len={longest}"
        )
    all_linear = all(cache.is_linear)
    if all_linear and generate_kwargs.get("custom_generate") is not None:
        raise UnsupportedAttention(
            "cp_compile.hf.generate: custom_generate with a model of linear layers alone (its decoding loop is "
            "cp_compile's, which continues from the prefilled state)"
        )
    prepare(model)  # a one-token prompt has no sharded prefill, whose call would prepare it
    # over one rank a prompt has nothing to shard: generate() runs it as one step through the cache, as one process
    # does (sharding it would pad it to the layout and add a step); a hybrid's states come from the sharded prefill
    one_rank = plan.world_size == 1 and not any(cache.is_linear)
    # a prompt that attends both ways (CPM-Ant) is prefilled whole, by generate()'s own first call, run sharded: each
    # prompt token's K/V depends on the last one, which the prefill below leaves to the first decoding step
    both_ways = any(not call.causal for call in family_of(model).gathered.values())
    prompt_call = _EveryStepSharded(model, plan, cache) if both_ways and not one_rank else None
    if input_ids.shape[1] > 1 and not cache.holds_tokens() and not one_rank and prompt_call is None:
        sharded_prefill(model, plan, cache, input_ids[:, :-1])
    if all_linear and input_ids.shape[1] > 1:
        generate_kwargs["custom_generate"] = continue_prefilled
    return _decoded(model, plan, input_ids, cache, generate_kwargs, prompt_call)
