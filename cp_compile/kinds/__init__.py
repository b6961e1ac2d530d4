"""Attention kinds: what is visible between a unit's queries and another unit's keys, and its kernels.

``base`` defines the interface (``Kind``) and the registry, ``call`` the record of one call (``Call``, with its
kind's ``Settings``), ``attend`` the per-step ops every schedule calls (``cp::attend``,
``cp::attend_backward``); each other module is one kind.
A new kind is one module: subclass ``Kind``, ``register_kind`` an instance, and
import it in ``cp_compile.registration``.
"""

from .base import GATHERED, WHOLE, Kind, Units, kind_entry, register_kind
from .call import Call

__all__ = ["GATHERED", "WHOLE", "Call", "Kind", "Units", "kind_entry", "register_kind"]
