"""Every attention kind, schedule and kernel op of ``torch.ops.cp``, registered in this one place.

Each module below defines its custom ops (``torch.library.custom_op``) and enters its kind
(``kinds.base.register_kind``) or schedule (``schedules.registry.register_schedule``) when it is
imported. ``import cp_compile`` imports this module first, so every op, kind and schedule exists
before any other part of the package runs; nothing else imports a module for that effect. A new
kind or schedule is one module plus its line here. (The marker of ``compiler.unrewritten`` is defined with the
functions that call it, and imported for those.)
"""

from .comm import agree, gather  # noqa: F401  cp::agree (+ _tensors, _cu_seqlens), cp::packed_sequence_order
from .comm import ring as comm_ring  # noqa: F401  cp::ring_shift, cp::send_buffers
from .inference import cached  # noqa: F401  cp::cached_attention
from .kernels import block, merge, triton_merge  # noqa: F401  cp::block_attn, cp::merge, cp::merge_
from .kinds import attend, flex, packed, sdpa  # noqa: F401  cp::attend (+ _backward) and the kinds it dispatches to
from .mixers import gathered, halo, heads  # noqa: F401  cp::halo, cp::to_head_groups, cp::gather_sequence, ...
from .schedules import allgather, hybrid, ring, ulysses  # noqa: F401  cp::<schedule>_attention (+ _backward)
