"""Checks on a whole transformers model call: what only the model's own arguments show.

From the first plan on (``plan.while_active``; they return at once outside every plan) a global
module forward pre-hook and forward hook follow the outermost transformers model of
each eager call (they return at once for every other module, and while Dynamo traces) and check,
once the model's forward returned and before its output is used:

- that the model reached the attention or mask function of ``"cp_compile"`` at least once (a model
  with attention code of its own, or none, had every rank process its shard alone);
- when the input is a plan's shard (``plan.shard``): that ``position_ids`` were given and global
  (transformers numbers the tokens of the shard from 0 when none are given, and RoPE then sees local
  positions), that ``labels`` came with ``shift_labels`` (transformers' causal-LM loss shifts labels
  inside the shard, pairing each shard's last token with the wrong label) and ``shift_labels`` with
  ``num_items_in_batch`` (else the loss is a mean over this rank's tokens);
- that every attention, convolution and scan ran the batch the shard and the positions were made for
  (``plan.shard(x, cu_seqlens=cu)``: those packed documents; else one sequence per row): the documents
  reach them from ``cu_seq_lens_q``, from ``with plan.packed(cu)``, or, eagerly, from the call's shard itself
  (read off the first module inside the call given a tensor a plan made); compiled, one told neither ran the
  documents as one sequence.

Outside every plan, the attention function refuses positions a plan made (``check_outside_plan``):
the model was fed a plan's shard.

Each check raises the same ``UnsupportedAttention`` on every rank (every rank runs the same model on
the same kind of input), the global-positions check under ``load_balance="contiguous"`` after one small
all-reduce of the verdicts (rank 0's own positions are right there). A plan's tensors are recognised by
``active.made_by``: views of them too, not copies. A model compiled whole is checked from its
``torch.compile`` wrapper's call; the count of attention calls is not kept for compiled models.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist
from torch._dynamo.eval_frame import OptimizedModule
from transformers import PreTrainedModel

from ..active import Made, active_plan, made_by
from ..errors import LocalAttentionError, UnsupportedAttention
from ..layout import LOAD_BALANCERS
from ..torch_compat import hooks_taken_out
from .forward import InFlight, ModelCall, in_flight
from .gathered import hook_gathered_modules
from .indexed import hook_indexers
from .mixers import wrap_loaded_families
from .own_attention import reroute_own_attention


def _transformers_model(module):
    """The transformers model a call runs: ``module``, or the model a ``torch.compile`` wrapper holds; else None."""
    model = module._orig_mod if isinstance(module, OptimizedModule) else module
    return model if isinstance(model, PreTrainedModel) else None


def _has_compiled_part(module) -> bool:
    """Attention inside a compiled module runs without calling the functions above at run time."""
    return any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()
    )


_PREPARED: weakref.WeakSet = weakref.WeakSet()  # the models whose modules have the hooks of their routes


def prepare(model) -> None:
    """Prepares ``model`` for its calls under a plan, once: the mixer functions of its family's modeling module wrapped
    (imported after the plan was entered, too), the hooks of the gathered route and of the indexers on its modules, the
    forwards of its modules of attention of their own. Its first eager call under a plan (a ``torch.compile`` wrapper's
    included) does it; a model compiled in place (``Module.compile``) traces that call whole, hooks and all, and
    must be prepared before (``ContextParallelMixin`` does it for a trainer's ``torch_compile``)."""
    if model in _PREPARED or torch.compiler.is_compiling():
        return
    wrap_loaded_families()
    hook_gathered_modules(model)
    hook_indexers(model)
    reroute_own_attention(model)
    _PREPARED.add(model)


def start_model_call(module, args: tuple) -> None:
    """Global forward pre-hook: inside a plan, follows the outermost transformers model of a call."""
    calls = in_flight()
    if calls is None:
        return
    if calls.model_calls:
        calls.model_calls[-1].see(args)
        return
    model = _transformers_model(module)
    if model is not None:
        _check_layout(model, active_plan())
        prepare(model)
        calls.model_calls.append(ModelCall(module))
        calls.model_calls[-1].see(args)


def _check_layout(model, plan) -> None:
    """A plan balanced by a BlockMask deals the mask's query blocks to the ranks: its FlexAttention calls alone know
    that order, and the same plan on every rank refuses alike."""
    if model.config._attn_implementation == "cp_compile" and plan.load_balance not in LOAD_BALANCERS:
        raise UnsupportedAttention(
            f"{type(model).__name__} under a plan balanced by a BlockMask: that layout is for FlexAttention calls "
            "(cp_compile.flex_attention, flex_attention compiled with plan.backend()); a Hugging Face model's "
            "attention and token mixers run under load_balance='zigzag' or 'contiguous'"
        )


def end_model_call(module, args: tuple, *kwargs_and_output) -> None:
    """Global forward hook (with kwargs, always called): the checks of the module docstring, once the forward
    returned. When the forward raised, torch calls it with ``(args, None)``: nothing more to say then."""
    calls = in_flight()
    if calls is None or not calls.model_calls or calls.model_calls[-1].model is not module:
        return
    forward = calls.model_calls.pop()
    calls.shard_documents_ran = forward.documents_seen() is not None
    if len(kwargs_and_output) == 2 and kwargs_and_output[1] is not None:
        _check_call_under_plan(forward, args, kwargs_and_output[0])


class _GlobalHooks:
    """The two global module hooks, installed once for the process at the first plan and kept (returning at once
    outside every plan): Dynamo guards on the set of global hooks, so hooks that came and went with each plan would
    recompile every compiled model at every step."""

    handles: tuple = ()

    def install(self) -> None:
        if self.handles:
            return
        self.handles = (
            torch.nn.modules.module.register_module_forward_pre_hook(start_model_call),
            torch.nn.modules.module.register_module_forward_hook(end_model_call, with_kwargs=True, always_call=True),
        )
        # torch warns at every call of a compiled module while global hooks exist that they fire for its
        # wrapper too: these two check a compiled model from its wrapper's call on purpose
        warnings.filterwarnings(
            "ignore", message=r"Using `torch.compile\(module\)` when there are global hooks on modules"
        )


_GLOBAL_HOOKS = _GlobalHooks()


@contextlib.contextmanager
def model_call_checks() -> Iterator[InFlight]:
    """Entered with each outermost plan (``plan.while_active``): the two global module hooks, and the record of the
    model calls made inside the block."""
    _GLOBAL_HOOKS.install()
    yield InFlight()


@contextlib.contextmanager
def model_calls_unfollowed() -> Iterator[None]:
    """Inside, the two global hooks are out of torch's dicts: module calls take torch's fast path, which a global
    hook turns off for every module of the process (a few microseconds each, as much as a small layer's work).
    For a caller that checks its model calls in its own way (decoding in ``cp_compile.hf.generate``)."""
    with hooks_taken_out(_GLOBAL_HOOKS.handles):
        yield


@contextlib.contextmanager
def one_model_call_followed(model) -> Iterator[None]:
    """Inside, the one model call a caller makes on the plan's shard is followed without the global hooks (module
    calls take torch's fast path): that attention ran through ``"cp_compile"``, and the convolutions and scans under
    CP, are counted and checked when the block ends, as the hooks check them. The caller passes the call's other
    arguments itself (global positions, no labels: ``cp_compile.hf.generate``'s sharded prefill)."""
    forward = ModelCall(model)
    prepare(model)
    calls = in_flight()
    with hooks_taken_out(_GLOBAL_HOOKS.handles):
        calls.model_calls.append(forward)
        try:
            yield
        finally:
            calls.model_calls.remove(forward)
    compiled = _has_compiled_part(model)
    _check_attention_reached(model, forward.calls, compiled)
    _check_mixers(model, forward, compiled)


def check_outside_plan(module, position_ids) -> None:
    """Outside every plan, the attention function of ``"cp_compile"`` refuses positions a plan made: the model
    was fed a plan's shard and is attending within it."""
    if made_by(position_ids) is not None:
        raise UnsupportedAttention(
            f"{type(module).__name__} was called outside `with plan:` with position_ids that a ContextParallel plan "
            "made: it would attend within this rank's shard alone. Call the model inside `with plan:`"
        )


def _check_attention_reached(model, calls: int, compiled: bool) -> None:
    if calls == 0 and not compiled:
        raise UnsupportedAttention(
            f"{type(model).__name__} ran inside `with plan:` without calling attention through transformers' "
            "attention interface (its own attention code, or a recurrent model with none), so every rank "
            "processed only its shard of the sequence; this model cannot run under context parallelism"
        )


def _mixer_layers(model) -> tuple[int, int]:
    """How many convolution and scan layers ``model``'s config declares."""
    types = list(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ())
    scans = sum(t in ("linear_attention", "hybrid") for t in types)
    return scans + types.count("conv"), scans


def _check_mixers(model, forward: ModelCall, compiled: bool) -> None:
    """Every convolution and scan layer the config declares ran under CP: one that did not (a function swapped
    after the plan wrapped it, a fused kernel the guard cannot see) mixed this rank's shard alone."""
    mixing, scanning = _mixer_layers(model)
    convs, scans = forward.convs, forward.scans
    if (convs < mixing or scans < scanning) and not compiled:
        raise LocalAttentionError(
            f"{type(model).__name__} declares {mixing} convolution and {scanning} scan layers, but {convs} "
            f"convolutions and {scans} scans ran under CP in this forward: the others mixed this rank's shard alone "
            "(a mixer function replaced after the plan wrapped it, or a kernel of the model's own)"
        )


def _inputs(args: tuple, kwargs: dict):
    inputs = kwargs["input_ids"] if "input_ids" in kwargs else (args[0] if args else None)
    return inputs if inputs is not None else kwargs.get("inputs_embeds")


def _check_call_under_plan(forward: ModelCall, args: tuple, kwargs: dict) -> None:
    module, batches = forward.model, forward.batches
    plan, model = active_plan(), _transformers_model(module)
    if plan is None:
        return
    if model.config._attn_implementation != "cp_compile":
        _check_other_attention(model, module, plan, args, kwargs)
        return
    compiled = _has_compiled_part(module)  # one walk of the modules per call, read by every check below
    _check_attention_reached(model, forward.calls, compiled)
    shard = made_by(_inputs(args, kwargs))
    if shard is None or shard.plan is not plan or shard.what != "shard":
        return  # not a shard of this plan: tokens every rank holds (decoding), or the caller's own layout
    if compiled:  # not counted: what the graphs read while traced, and read again when run
        given = kwargs.get("cu_seq_lens_q")
        batches = [plan.documents if given is None else given] + [plan.documents] * (_mixer_layers(model)[0] > 0)
    _check_batch(model, shard, kwargs, batches, compiled)
    _check_positions(model, plan, shard, kwargs.get("position_ids"))
    _check_labels(model, kwargs)
    _check_mixers(model, forward, compiled)


def _describe(documents: Optional[tuple[int, ...]]) -> str:
    return "one sequence per row" if documents is None else f"the packed documents cu_seqlens={list(documents)}"


# what a padding-free collator (TRL's, ``DataCollatorWithFlattening``) passes the model for a packed row
_DOCUMENT_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def _check_batch(model, shard: Made, kwargs: dict, batches: list, compiled: bool) -> None:
    """The attention, convolutions and scans ran the batch the shard was made for, and the positions are the
    same batch's. Every rank made its shard with the same call, and so raises alike. Eagerly the documents reach them
    from the shard; they ran others where they were told others (``cu_seq_lens_q``, ``with plan.packed(cu)``) or,
    compiled, where they were told none."""
    where = f"{type(model).__name__} under context parallelism"
    made = made_by(kwargs.get("position_ids"))
    if made is not None and made.what == "positions" and made.documents != shard.documents:
        raise UnsupportedAttention(
            f"{where}: its input is a shard of {_describe(shard.documents)}, but its position_ids were made for "
            f"{_describe(made.documents)}"
        )
    passed = " and ".join(f"{name}=" for name in _DOCUMENT_KWARGS if kwargs.get(name) is not None)
    for cu in batches:
        ran = None if cu is None else tuple(cu.tolist())
        if ran == shard.documents:
            continue
        said = "`with plan.packed(cu)`" if active_plan().documents is not None else passed
        if ran is not None:
            fix = f", as {said} said. Say the shard's documents there, or nothing: the shard carries them"
        elif compiled:
            fix = (
                (f" (the {passed} you passed reach its attention alone)" if passed else "")
                + ". Compiled, a shard's documents do not reach the graph: pass cu_seq_lens_q= and cu_seq_lens_k= "
                "(its attention) and call it inside `with plan.packed(cu):` (its convolutions and scans)"
            )
        else:
            fix = ": give it the plan's shard and positions of that batch, or call it inside `with plan.packed(cu):`"
        raise UnsupportedAttention(
            f"{where}: its input is a shard of {_describe(shard.documents)}, but its attention or token mixers ran "
            f"{_describe(ran)}{fix}"
        )


# transformers' attention implementations whose calls ``plan.backend()`` rewrites (torch's SDPA and FlexAttention)
_REWRITTEN_WHEN_COMPILED = ("sdpa", "flex_attention")


def _check_other_attention(model, module, plan, args: tuple, kwargs: dict) -> None:
    """A model on another attention implementation, given this plan's shard or positions, attended within
    this rank's shard: transformers' "eager" attention is matmuls that neither the guard nor the compiler
    recognises, compiled or not. SDPA and FlexAttention in a compiled model were rewritten (or refused) by
    ``plan.backend()``, and the guard stops them where they run eagerly."""
    if model.config._attn_implementation in _REWRITTEN_WHEN_COMPILED and _has_compiled_part(module):
        return
    given = (_inputs(args, kwargs), kwargs.get("position_ids"))
    if any(made is not None and made.plan is plan for made in map(made_by, given)):
        raise LocalAttentionError(
            f"{type(model).__name__} ran inside `with plan:` on this plan's shard with "
            f"attn_implementation={model.config._attn_implementation!r}, which attends within this rank's shard "
            'alone. Load the model with attn_implementation="cp_compile" (import cp_compile.hf first), or call '
            'model.set_attn_implementation("cp_compile"), or compile it with plan.backend()'
        )


def _check_positions(model, plan, shard: Made, positions) -> None:
    where = f"{type(model).__name__} under context parallelism"
    if positions is None:
        raise UnsupportedAttention(
            f"{where}: no position_ids; transformers would number this rank's shard from 0, so RoPE would see "
            "local positions. Pass position_ids=plan.positions(seq_len)[None] (packed documents: "
            "plan.positions(cu_seqlens=cu)[None])"
        )
    made = made_by(positions)
    if (made is not None and made.plan is plan) or plan.world_size == 1:
        return
    local = positions.shape[-1]
    if plan.layout.starts_on_rank_zero:  # rank 0's own positions are 0..L-1: compare with the layout's
        expected = plan.layout.positions(local * plan.world_size, plan.rank, plan.world_size, positions.device)
        wrong = shard.documents is None and not bool((positions == expected).all())
        verdict = torch.tensor([int(wrong)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=plan.group)
        wrong = bool(verdict.item())
    else:  # the other layouts' shards never hold 0..L-1 in order at C > 1
        wrong = bool((positions == torch.arange(local, device=positions.device)).all())
    if wrong:
        raise UnsupportedAttention(
            f"{where}: position_ids number this rank's shard from 0, as if it were the whole sequence, so RoPE "
            "would see local positions. Pass position_ids=plan.positions(seq_len)[None] (packed documents: "
            "plan.positions(cu_seqlens=cu)[None])"
        )


def _check_labels(model, kwargs: dict) -> None:
    where = f"{type(model).__name__} under context parallelism"
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise UnsupportedAttention(
            f"{where}: labels= without shift_labels=; transformers' loss shifts labels inside this rank's shard "
            "(pairing the shard's last token with the wrong label) and means over its tokens. Shift the labels on "
            "the global sequence (-100 at each document's end), shard them with plan.shard, and pass them as "
            "labels= and shift_labels=, with num_items_in_batch= the global count of labels that are not -100"
        )
    if kwargs.get("shift_labels") is not None and kwargs.get("num_items_in_batch") is None:
        raise UnsupportedAttention(
            f"{where}: shift_labels= without num_items_in_batch=; the loss would be the mean over this rank's "
            "tokens. Pass num_items_in_batch= the global count of labels that are not -100 (then each rank's loss "
            "is its share of the global mean: sum them, or all-reduce the gradients)"
        )


__all__ = [
    "check_outside_plan",
    "prepare",
    "model_call_checks",
    "model_calls_unfollowed",
    "one_model_call_followed",
]
