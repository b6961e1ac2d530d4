"""What the benchmark runs: configurations, inputs, the variant registry and its plugins, one fwd+bwd step.

The definitions of what is measured are in ``core``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SINGLE = "single device"
OURS = "ours eager"
TORCH_A2A = "torch ring (alltoall)"
TORCH_AG = "torch ring (allgather)"
TORCH_RINGS = (TORCH_A2A, TORCH_AG)

# Modules imported (if present) before variants are listed, so a later file can
# register e.g. "ours compiled" without restructuring this one.
PLUGIN_MODULES: list[str] = [
    "cp_compile.tools.bench.compiled",
    "cp_compile.tools.bench.allgather",
    "cp_compile.tools.bench.schedules",
    "cp_compile.tools.bench.packed",
]

# name -> hook(problem, summarised variants, runner) -> dict kept in the config's "extras" and
# printed under it (e.g. the cost model's choice against the measured times)
CONFIG_HOOKS: dict[str, Callable] = {}


@dataclass(frozen=True)
class Problem:
    """One benchmark configuration. ``seq_len`` is the global sequence length."""

    batch: int
    heads: int
    head_dim: int
    seq_len: int
    world_size: int
    causal: bool
    dtype: str = "float32"

    @property
    def local_len(self) -> int:
        return self.seq_len // self.world_size

    @property
    def flops(self) -> float:
        """Model FLOPs of full-sequence attention fwd+bwd (see module docstring)."""
        fwd = 4.0 * self.batch * self.heads * self.seq_len**2 * self.head_dim
        return 3.0 * fwd * (0.5 if self.causal else 1.0)

    def label(self) -> str:
        return f"{'causal' if self.causal else 'full  '} C={self.world_size} S={self.seq_len}"


@dataclass
class Inputs:
    """Per rank: global tensors (identical on every rank) and this rank's zigzag shards."""

    q_full: Tensor
    k_full: Tensor
    v_full: Tensor
    do_full: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    rank: int
    world_size: int
    device: torch.device


@dataclass(frozen=True)
class Variant:
    """A way of computing attention fwd+bwd, run on every rank (or rank 0 only)."""

    name: str
    setup: Callable[[Problem, Inputs], Callable[[], tuple]]
    description: str = ""
    single_rank: bool = False  # True: rank 0 runs the full sequence, others wait
    traced_setup: Optional[Callable[[Problem, Inputs, bool], Callable[[], tuple]]] = None
    meter: Optional[Callable[[], AbstractContextManager]] = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    warmup: int = 2
    stub: Optional[Callable[[], AbstractContextManager]] = None


VARIANTS: dict[str, Variant] = {}


def register_variant(variant: Variant) -> Variant:
    """Add (or replace) a variant; the registry order is the report order."""
    VARIANTS[variant.name] = variant
    return variant


def load_plugins(modules: list[str] = ()) -> None:
    """Import variant plugins; the ones in PLUGIN_MODULES only if they exist."""
    for name in PLUGIN_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    for name in modules:
        importlib.import_module(name)


def make_inputs(p: Problem, rank: int, world_size: int, device: torch.device, seed: int = 0) -> Inputs:
    from ...layout import Zigzag

    g = torch.Generator().manual_seed(seed)
    full = [
        torch.randn(p.batch, p.heads, p.seq_len, p.head_dim, generator=g).to(device, DTYPES[p.dtype]) for _ in range(4)
    ]
    local = [Zigzag().shard(t, 2, rank, world_size) for t in full]
    return Inputs(*full, *local, rank=rank, world_size=world_size, device=device)


def _scale(p: Problem) -> float:
    return 1.0 / math.sqrt(p.head_dim)


def _take_grads(leaves: list[Tensor]) -> list[Tensor]:
    """The leaves' gradients, detached from the leaves.

    A step must hold nothing once its results are dropped: the harness frees
    them before the memory measurement, so every variant's peak includes
    allocating its own outputs and gradients.
    """
    grads = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    return grads


def fwd_bwd_step(attention, inputs, dout):
    """A variant's ``step``: ``attention(q, k, v) -> out`` forward and backward on
    fresh leaf copies of ``inputs``; returns (out, dq, dk, dv), detached."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def step():
        out = attention(*leaves)
        out.backward(dout)
        return (out.detach(), *_take_grads(leaves))

    return step
