"""transformers' token mixers that are not attention, under a plan: short convolutions, Gated DeltaNet / KDA,
Mamba2.

transformers' hybrid models mix tokens outside attention through module-level functions of their modeling
files, looked up by name at every call (the names its kernel hub swaps for fused kernels):
``causal_conv1d_fn`` (every family here), ``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5, OLMo
hybrid, ...), ``chunk_kimi_delta_attention`` (Kimi Linear), ``mamba2_chunk_scan`` (Nemotron-H, Bamba,
Granite 4 hybrid, Zamba2, Falcon-H1, Mamba2) and Mamba2's fused ``mamba2_split_conv1d_scan_combined``.

When a plan is entered, each such function of a covered family's modeling module (``FAMILIES``, those
already imported) is wrapped once: outside every plan the wrapper calls the function it wraps, unchanged;
inside a plan it runs it under CP (``cp_compile.mixers``), calling the wrapped function itself (fused kernel
or torch body) on exchanged tensors:

- the convolution over this rank's chunks with the halo of the tokens before each one;
- a scan over the whole sequence for this rank's head groups (all-to-all to heads and back);
- the fused Mamba2 path returns None, as its torch body does, so the mixer takes its unfused steps above.

A model of a covered family declares these layers in ``config.layer_types`` (``linear_attention``,
``conv``, ``hybrid``), which the attention's mask function accepts for it alone (``covers``). Any other
family's such layers stay refused by name; a mixer that escapes the wrappers (a function swapped after the
plan wrapped it) and runs its torch body meets the plan's guard on ``torch.conv1d``.

Packed documents: the tokens are exchanged in the layout the plan sharded them with (``cu_seq_lens_q`` or
the plan's ``positions(cu_seqlens=...)``), and the mixers restart at documents exactly where the
one-process call does: a scan given ``cu_seqlens`` restarts there, a convolution not given ``seq_idx``
reads across the boundary, as one process does.
"""

from __future__ import annotations

import contextlib
import functools
import sys

from ..errors import UnsupportedAttention
from ..guard import set_aside
from ..mixers import Sharding
from ..mixers.conv import causal_conv1d
from ..mixers.scan import gated_delta_rule, mamba2_scan
from ..plan import ContextParallel, active_plan
from .forward import count_call

FAMILIES = (
    "bailing_hybrid",
    "bamba",
    "falcon_h1",
    "granitemoehybrid",
    "kimi_linear",
    "lara_mini",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "mamba2",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "qwen4_exp",
    "zamba2",
)
MIXER_LAYER_TYPES = ("linear_attention", "conv", "hybrid")
_MODULES = {f"transformers.models.{name}.modeling_{name}" for name in FAMILIES}
_WRAPPED: set[str] = set()  # modeling modules whose functions are wrapped


def _sharding(plan: ContextParallel, cu_seqlens) -> Sharding:
    documents = cu_seqlens if cu_seqlens is not None else plan.documents
    return Sharding(plan.group_name, plan.world_size, plan.load_balance, documents)


def _refuse_seq_idx(name: str, kwargs: dict) -> None:
    if kwargs.get("seq_idx") is not None:
        raise UnsupportedAttention(
            f"{name} under context parallelism with seq_idx (a fused kernel resetting at documents) is not supported; "
            "run without seq_idx, or without a plan"
        )


def _conv(original):
    @functools.wraps(original)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        plan = active_plan()
        if plan is None:
            return original(hidden_states, weight, bias, activation, **kwargs)
        _refuse_seq_idx("causal_conv1d_fn", kwargs)
        count_call()
        with set_aside():  # the torch body's conv1d runs on the extended shard, on purpose
            return causal_conv1d(
                hidden_states, weight, bias, activation, _sharding(plan, kwargs.get("cu_seq_lens_q")), conv=original
            )

    return conv


def _delta_rule(original):
    @functools.wraps(original)
    def delta_rule(query, key, value, g, beta, *args, **kwargs):
        plan = active_plan()
        if plan is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if args:
            kwargs["chunk_size"], *args = args
        if args:
            raise TypeError("pass the gated delta rule's options after chunk_size by name")
        count_call()
        sharding = _sharding(plan, kwargs.get("cu_seqlens"))
        return gated_delta_rule(original, query, key, value, g, beta, sharding, **kwargs)

    return delta_rule


def _mamba2(original):
    @functools.wraps(original)
    def scan(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs):
        plan = active_plan()
        if plan is None:
            return original(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs)
        if args:
            raise TypeError("pass mamba2_chunk_scan's options after chunk_size by name")
        _refuse_seq_idx("mamba2_chunk_scan", kwargs)
        count_call()
        return mamba2_scan(original, hidden_states, dt, A, B, C, chunk_size, _sharding(plan, None), **kwargs)

    return scan


def _unfused(original):
    @functools.wraps(original)
    def fused(*args, **kwargs):
        return None if active_plan() is not None else original(*args, **kwargs)

    return fused


_WRAPPERS = {
    "causal_conv1d_fn": _conv,
    "torch_chunk_gated_delta_rule": _delta_rule,
    "chunk_kimi_delta_attention": _delta_rule,
    "mamba2_chunk_scan": _mamba2,
    "mamba2_split_conv1d_scan_combined": _unfused,
}


def wrap_loaded_families() -> None:
    """Wraps the mixer functions of every covered modeling module imported so far (once each)."""
    for name in _MODULES - _WRAPPED:
        module = sys.modules.get(name)
        if module is None:
            continue
        for function, wrapper in _WRAPPERS.items():
            if hasattr(module, function):
                setattr(module, function, wrapper(getattr(module, function)))
        _WRAPPED.add(name)


@contextlib.contextmanager
def mixers_under_plans():
    """Entered with each outermost plan (``plan.while_active``): the covered families loaded by then are wrapped."""
    wrap_loaded_families()
    yield


def covers(config) -> bool:
    """Whether the model of ``config`` runs its non-attention mixers through the wrappers."""
    module = type(config).__module__.replace(".configuration_", ".modeling_")
    return module in _WRAPPED


__all__ = ["FAMILIES", "MIXER_LAYER_TYPES", "covers", "mixers_under_plans", "wrap_loaded_families"]
