"""Inside ``with plan:``, no plain attention call runs on a shard.

``ContextParallel.__enter__`` pushes a ``LocalAttentionGuard``: a
``TorchFunctionMode`` that sees every call of ``F.scaled_dot_product_attention``,
``varlen_attn`` (its op ``torch_attn._varlen_attn``) and FlexAttention (its
higher-order op). Eagerly such a call raises ``LocalAttentionError``. While
Dynamo traces (it inlines the mode), the call gets ``cp::unrewritten`` in front
of it, which ``plan.backend()`` removes as it rewrites the call and which
raises under any other backend (``compiler.unrewritten``).

cp_compile's own ops are custom ops: the mode sees the op, not the attention
kernels it runs inside, so the eager CP paths pass untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.attention.varlen  # noqa: F401  (registers torch.ops.torch_attn, which the guard watches)
from torch._higher_order_ops.flex_attention import flex_attention as _FLEX
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .compiler.unrewritten import eager_message
from .errors import LocalAttentionError

_NAMES = {  # what the guard watches, as the user wrote it
    torch._C._nn.scaled_dot_product_attention: "F.scaled_dot_product_attention",
    torch.ops.torch_attn._varlen_attn: "varlen_attn",
    torch.ops.torch_attn._varlen_attn.default: "varlen_attn",
    _FLEX: "flex_attention",
}


# sequence mixers other than attention that cp_compile does not make CP: a short causal convolution (Mamba,
# DeltaNet, LFM's "conv" layers) would see the tokens of this rank's shard alone
_MIXERS = {
    torch.conv1d: "a 1-D convolution (F.conv1d / nn.Conv1d: a state-space, DeltaNet or short-convolution "
    "layer mixing tokens along the sequence)"
}


# a Python-level Tensor method that Dynamo cannot inline when the mode hands it over (it calls
# ``super().unflatten``): while it traces, called as the tensor's own method, which it traces as any other
_UNFLATTEN = torch.Tensor.unflatten


def mixer_message(what: str) -> str:
    return (
        f"{what} ran inside `with plan:`: cp_compile does not parallelise it, so it would mix only the tokens "
        "of this rank's shard of the sequence. Run this model without a plan (a model with such layers declares "
        "them in config.layer_types, which cp_compile.hf refuses by name)."
    )


class LocalAttentionGuard(TorchFunctionMode):
    """Raises on plain attention run eagerly; marks it for ``plan.backend()`` while Dynamo traces. Raises on
    the sequence mixers of ``_MIXERS`` eagerly and while Dynamo traces."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mixer = _MIXERS.get(func)
        if mixer is not None and not _WHOLE.sequence:
            raise LocalAttentionError(mixer_message(mixer))
        if func is _UNFLATTEN and torch.compiler.is_compiling():
            return args[0].unflatten(*args[1:], **kwargs)
        name = _NAMES.get(func)
        if name is not None:
            if not torch.compiler.is_compiling():
                raise LocalAttentionError(eager_message(name))
            args, kwargs = _marked(name, list(args), dict(kwargs))
        return func(*args, **kwargs)


class _Whole:
    """Whether the mixers run over the whole sequence now: an instance's attribute, not a class's, since torch
    2.11's Dynamo cannot trace setting a class attribute."""

    def __init__(self):
        self.sequence = False


_WHOLE = _Whole()


@contextlib.contextmanager
def mixers_over_the_whole_sequence() -> Iterator[None]:
    """Inside, the sequence mixers the guard watches run over every rank's tokens (a module over the gathered
    sequence: RecurrentGemma's recurrent block and its convolution), and pass. A flag the guard reads, so that it
    holds while Dynamo traces too (the mode stack, ``set_aside``, is left as it is there)."""
    before, _WHOLE.sequence = _WHOLE.sequence, True
    try:
        yield
    finally:
        _WHOLE.sequence = before


@contextlib.contextmanager
def set_aside() -> Iterator[None]:
    """The guards on top of the torch function mode stack, taken off inside the block and put back after.

    A mode sees every torch call; for a caller that checks in its own way what the guard would catch and runs
    many small steps (decoding over a ``ShardedCache``, which checks that each layer's attention ran through
    cp_compile), that costs as much as the step's host work. Guards under another mode stay."""
    taken = []
    stack = _get_current_function_mode_stack()
    while stack and isinstance(stack[-1], LocalAttentionGuard):
        taken.append(stack.pop())
        taken[-1].__exit__(None, None, None)
    try:
        yield
    finally:
        for guard in reversed(taken):
            guard.__enter__()


def _marked(name: str, args: list, kwargs: dict) -> tuple[list, dict]:
    """The call's arguments with its query behind ``cp::unrewritten``."""
    if args:
        args[0] = torch.ops.cp.unrewritten(args[0], name)
    else:
        kwargs["query"] = torch.ops.cp.unrewritten(kwargs["query"], name)
    return args, kwargs


__all__ = ["LocalAttentionError", "LocalAttentionGuard", "mixers_over_the_whole_sequence", "set_aside"]
