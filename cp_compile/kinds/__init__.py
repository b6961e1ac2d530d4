"""Attention kinds: what is visible between a unit's queries and another unit's keys, and its kernels.

``base`` defines the interface (``Kind``) and the per-step ops every schedule
calls (``cp::attend``, ``cp::attend_backward``); each other module is one kind.
A new kind is one module: subclass ``Kind``, ``register_kind`` an instance, and
import it in ``cp_compile.registration``.
"""

from .base import GATHERED, WHOLE, Call, Kind, Units, kind_entry, register_kind

__all__ = ["GATHERED", "WHOLE", "Call", "Kind", "Units", "kind_entry", "register_kind"]
