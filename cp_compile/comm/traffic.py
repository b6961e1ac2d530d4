"""Traffic accounting: what this process really sent around the ring, eager or compiled."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class Traffic:
    shifts: int = 0  # ring_shift calls
    tensors_sent: int = 0
    bytes_sent: int = 0
    by_tag: dict = field(default_factory=dict)  # tag -> number of shifts


_active_traffic: list[Traffic] = []


@contextlib.contextmanager
def open_count(active: list, count):
    """``count`` kept in ``active`` (what this process's ops add to) for the block; yields it."""
    active.append(count)
    try:
        yield count
    finally:
        active.remove(count)


def count_traffic() -> contextlib.AbstractContextManager[Traffic]:
    """Count ring transfers issued by this process inside the block."""
    return open_count(_active_traffic, Traffic())


def record_shift(tensors: list[Tensor], tag: int) -> None:
    for t in _active_traffic:
        t.shifts += 1
        t.tensors_sent += len(tensors)
        t.bytes_sent += sum(x.numel() * x.element_size() for x in tensors)
        t.by_tag[tag] = t.by_tag.get(tag, 0) + 1
