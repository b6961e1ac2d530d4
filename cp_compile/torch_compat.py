"""The private torch APIs cp_compile depends on, in one place.

Tested with torch 2.11, 2.13 and 2.15 (``pyproject.toml`` admits ``>=2.11,<2.16``;
CI runs the suite on 2.13 and 2.15, and its core on 2.11, the torch of many GPU
images). Everything here is something torch does not promise to keep. When a
release moves or changes one, this is the file to change, and ``missing()``
makes the failure name the API and the torch version instead of surfacing as an
AttributeError deep inside a compile.

Imports that pull in Inductor or functorch are made on first use, so that
``import cp_compile`` stays as cheap as ``import torch``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator

import torch

# torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is first
# imported (torch._dynamo imports it, at the first custom op call). Imported after init_process_group,
# those defaults hold the default group past destroy_process_group: gloo's worker threads then still run
# at interpreter exit, and one that drops a finished collective's tensors there needs the GIL Python is
# tearing down, which aborts the process ("terminate called without an active exception"). Importing it
# with cp_compile, before the group exists, binds None instead.
import torch.distributed.nn.functional  # noqa: F401
from torch import distributed as dist

TESTED_TORCH = ("2.11", "2.13", "2.15")

# c10d: a Python-side Work, registered on tensors, is what lets the functional
# ``wait_tensor`` complete our own asynchronous transfers.
from torch._C._distributed_c10d import PythonCallbackWork  # noqa: E402, F401  (re-exported)
from torch._C._distributed_c10d import _register_work as register_work  # noqa: E402, F401  (re-exported)

# Opaque objects: a Python object a custom op takes as an argument, eager and compiled (a compiled
# graph holds it as a constant).
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type  # noqa: E402
from torch._opaque_base import OpaqueBase  # noqa: E402, F401  (re-exported)
from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: E402

# The single-tensor collectives under their 2.13 names; 2.11 and 2.12 know them only as all_gather_into_tensor
# and reduce_scatter_tensor, names 2.13 deprecates (a FutureWarning at every call).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_process_group(group_name: str) -> torch.distributed.ProcessGroup:
    """The process group registered under ``group_name`` (torch types the name as its own ``GroupName``)."""
    return _resolve_process_group(group_name)  # type: ignore[arg-type]


def opaque_reference_type(cls: type) -> str:
    """Register ``cls`` (an ``OpaqueBase``) as an opaque reference type; returns its name in op schemas."""
    register_opaque_type(cls, typ="reference")
    return get_opaque_type_name(cls)


def assume_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does (Dynamo calls ``fn`` while tracing and keeps its
    result as a constant), without importing Dynamo, which that function does and ``import cp_compile`` must not."""
    fn._dynamo_marked_constant = True
    return fn


@contextlib.contextmanager
def hooks_taken_out(handles) -> Iterator[None]:
    """The module hooks of ``handles`` (``register_module_forward_hook``'s) out of torch's dicts inside the block, put
    back under the same keys in the same order: Dynamo guards on those dicts, and hooks registered anew would make
    every compiled module that ran with them recompile."""
    taken: dict = {}  # id of a dict -> (the dict, its keys before, the hooks taken out of it by key)
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            hooks = ref()
            if hooks is not None and handle.id in hooks:
                _, _, ours = taken.setdefault(id(hooks), (hooks, list(hooks), {}))
                ours[handle.id] = hooks.pop(handle.id)
    try:
        yield
    finally:
        for hooks, before, ours in taken.values():
            hooks.update(ours)
            for key in [*(k for k in before if k in hooks), *(k for k in list(hooks) if k not in before)]:
                hooks.move_to_end(key)


def missing(what: str) -> RuntimeError:
    return RuntimeError(
        f"cp_compile needs {what}, which torch {torch.__version__} does not provide "
        f"(tested with torch {', '.join(TESTED_TORCH)}); see cp_compile/torch_compat.py"
    )


def _attribute(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise missing(f"{module}.{name}") from err


@functools.cache
def preserve_node_ordering():
    """Inductor's control dependencies: pins the ring's comm/compute order in a graph."""
    return _attribute("torch._inductor.fx_passes.control_dependencies", "preserve_node_ordering")


@functools.cache
def higher_order_operator() -> type:
    """The class of torch's higher-order ops (activation checkpointing's wrapper of a region while Dynamo traces)."""
    return _attribute("torch._ops", "HigherOrderOperator")


@functools.cache
def flex_index_helpers():
    """(TransformGetItemToIndex, _vmap_for_bhqkv): evaluating a mask_mod over index grids as flex does."""
    return (
        _attribute("torch._dynamo._trace_wrapped_higher_order_op", "TransformGetItemToIndex"),
        _attribute("torch.nn.attention.flex_attention", "_vmap_for_bhqkv"),
    )


_PARTITIONER_API = (
    "min_cut_rematerialization_partition",
    "default_partition",
    "is_sym_node",
    "classify_nodes",
    "_extract_fwd_bwd_modules",
    "reordering_to_mimic_autograd_engine",
    "raise_getitems",
)


@functools.cache
def partitioners():
    """``torch._functorch.partitioners``, checked for every function the CP partitioner calls."""
    module = importlib.import_module("torch._functorch.partitioners")
    absent = [name for name in _PARTITIONER_API if not hasattr(module, name)]
    if absent:
        raise missing(f"torch._functorch.partitioners.{{{', '.join(absent)}}}")
    return module


def extract_forward_backward(joint, saved: list, *, num_fwd_outputs: int, static_lifetime_input_nodes):
    """The forward and backward graphs of ``joint`` with the forward saving ``saved`` (tensors, symbolic sizes and
    opaque objects): ``partitioners._extract_fwd_bwd_modules``, whose 2.13 form takes each kind in a list of its own
    and whose 2.11 form sorts the opaque objects out of the tensors itself."""
    P = partitioners()
    sym = [n for n in saved if P.is_sym_node(n)]
    values = [n for n in saved if not P.is_sym_node(n)]
    opaque_kw = {}
    if hasattr(P, "is_opaque_node"):
        opaque_kw["saved_opaque_nodes"] = [n for n in values if P.is_opaque_node(n)]
        values = [n for n in values if not P.is_opaque_node(n)]
    return P._extract_fwd_bwd_modules(
        joint,
        values,
        saved_sym_nodes=sym,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=static_lifetime_input_nodes,
        **opaque_kw,
    )


def release() -> tuple[int, int]:
    """torch's (major, minor) release."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def inductor_lowers_opaque_objects() -> bool:
    """Whether Inductor lowers a custom op whose argument is an opaque object (the flex kind's mods): 2.13 does;
    2.11 takes the object for a tensor when it lowers the op ("'Mods' object has no attribute 'stride'")."""
    return release() >= (2, 13)


@assume_constant_result  # read while Dynamo traces a model: called, not traced (an lru_cache it would warn of)
def varlen_takes_gqa() -> bool:
    """Whether torch's ``varlen_attn`` takes ``enable_gqa`` (2.13); 2.11's takes no such argument."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def size_hint(size) -> int:
    """A size as an int: a symbolic one as the value it had in the example inputs (its hint)."""
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint  # 2.13; 2.11
    return int(hint(size))


def node_argument(node, name: str):
    """The argument ``name`` of an FX node calling an operator overload, found by the operator's schema
    (``OpOverload._schema``) rather than by its position."""
    names = [a.name for a in node.target._schema.arguments]
    i = names.index(name)
    return node.args[i] if i < len(node.args) else node.kwargs[name]
