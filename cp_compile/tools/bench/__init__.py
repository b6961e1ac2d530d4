"""``python -m cp_compile bench``: CP attention against PyTorch's ring and one device.

For every configuration (causal or not, C ranks, global sequence length S;
B, H, D and dtype fixed per run) one task runs on C local gloo ranks (one
thread each) and measures every registered *variant*: fwd+bwd time, host time
per ring step, parallel efficiency, peak memory, bytes per rank, communication
hidden behind compute and GFLOP/s per rank.

Before anything is timed every variant's output and input gradients are
checked against the single-device result (sharded alike); a variant that
disagrees is reported invalid and not timed.

Adding a variant (e.g. "ours compiled") without touching this package: write a
module that builds a :class:`Variant` from module-level functions and calls
:func:`register_variant`; pass ``--import that.module`` on the command line (or
add its name to :data:`PLUGIN_MODULES`). A variant is, per rank::

    setup(problem, inputs) -> step          # step() runs fwd+bwd once and returns
                                           # (out, dq, dk, dv), local shards
    traced_setup(problem, inputs, stub)     # optional: the same schedule with its
                                           # inner ops visible to OpTracer; stub=True
                                           # swaps attention kernels for stand-ins
    meter()                                 # optional: context manager whose value
                                           # has .bytes after one step

    stub()                                  # optional: context manager in which the
                                           # variant's attention kernels are zero-cost
                                           # stand-ins (for host time per step)

``warmup`` says how many untimed steps it needs: a compiled variant compiles its
backward lazily on the first backward and settles after a few steps.

Modules: ``variants`` (configurations, inputs, the variant registry), ``core`` (measurement and its
definitions), ``trace`` (one rank's comm and compute spans), ``builtin`` (ours eager,
PyTorch's ring, one device), ``cli`` (report, command line), the plugins named in
``PLUGIN_MODULES`` and ``virtual`` (``--device cuda``: the ring taken apart on one device).
"""

from ..launch import LocalPools, torchrun_runner  # noqa: F401
from .builtin import _ours_meter, _ours_setup, _stub_our_kernels  # noqa: F401  (and registers the built-in variants)
from .cli import add_arguments, main, options_from_args, plot, table, write_outputs  # noqa: F401
from .core import TINY, BenchOptions, Runner, bench_rank, run_benchmark, summarise  # noqa: F401
from .trace import OP_CLASSES, OpTracer, op_class  # noqa: F401
from .variants import (  # noqa: F401
    CONFIG_HOOKS,
    DTYPES,
    OURS,
    PLUGIN_MODULES,
    SINGLE,
    TORCH_A2A,
    TORCH_AG,
    TORCH_RINGS,
    VARIANTS,
    Inputs,
    Problem,
    Variant,
    _take_grads,
    fwd_bwd_step,
    load_plugins,
    make_inputs,
    register_variant,
)
