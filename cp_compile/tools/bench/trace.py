"""Tracing one rank's step: the comm issue / wait / compute spans that ``comm hidden`` is computed from
(definitions in ``core``)."""

from __future__ import annotations

import time

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> class (comm, wait, compute, merge, other); names not listed go through ``op_class``. Plugins may add.
OP_CLASSES: dict[str, str] = {
    "_c10d_functional::wait_tensor": "wait",
    # torch 2.13 wraps every functional collective's result with this op (no transfer)
    "_c10d_functional::_wrap_tensor_autograd": "other",
    "cp::ring_shift": "comm",
    "cp::agree": "comm",
    "cp::attend": "compute",
    "cp::attend_backward": "compute",
    "cp::block_attn": "compute",
    "cp::block_attn_backward": "compute",
    "cp::merge": "merge",
    "cp::merge_": "merge",
}


def op_class(name: str) -> str:
    if name in OP_CLASSES:
        return OP_CLASSES[name]
    if name.startswith(("_c10d_functional::", "c10d::")):
        return "comm"
    if "scaled_dot_product" in name:
        return "compute"
    return "other"


def _storage_keys(value) -> list[int]:
    if isinstance(value, Tensor):
        inner = getattr(value, "elem", None)  # AsyncCollectiveTensor: key by the wrapped buffer
        if type(value) is not Tensor and isinstance(inner, Tensor):
            value = inner
        try:
            return [value.untyped_storage().data_ptr()] if value.numel() else []
        except RuntimeError:  # a wrapper subclass without storage of its own
            return []
    if isinstance(value, (list, tuple)):
        return [k for v in value for k in _storage_keys(v)]
    return []


def _nbytes(value) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class OpTracer(TorchDispatchMode):
    """Time every dispatched op with ``perf_counter``; link waits to their comm issue.

    ``events``: dicts with class, op, t0, t1 (seconds, ``perf_counter`` clock, which
    is CLOCK_MONOTONIC and thus shared by the processes of one machine), and for
    comm/wait the id of the transfer. Ops inside a custom op are not seen.
    """

    def __init__(self):
        super().__init__()
        self.events: list[dict] = []
        self._inflight: dict[int, int] = {}  # storage ptr of a receive buffer -> comm id
        self._next_id = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        span_class = op_class(name)
        t0 = time.perf_counter()
        result = func(*args, **(kwargs or {}))
        event = {"class": span_class, "op": name, "t0": t0, "t1": time.perf_counter()}
        if span_class == "comm":
            event["id"], event["bytes"] = self._next_id, _nbytes(args[0] if args else None)
            self._inflight.update(dict.fromkeys(_storage_keys(result), self._next_id))
            self._next_id += 1
        elif span_class == "wait":
            keys = _storage_keys(args[0] if args else None)
            event["id"] = self._inflight.get(keys[0], -1) if keys else -1
        self.events.append(event)
        return result

    def summary(self) -> dict:
        spent: dict[str, float] = {}
        for e in self.events:
            spent[e["class"]] = spent.get(e["class"], 0.0) + e["t1"] - e["t0"]
        return {
            "exposed_comm_s": spent.get("comm", 0.0) + spent.get("wait", 0.0),
            "wait_s": spent.get("wait", 0.0),
            "issue_s": spent.get("comm", 0.0),
            "compute_s": spent.get("compute", 0.0),
            "merge_s": spent.get("merge", 0.0),
            "other_s": spent.get("other", 0.0),
            "transfers": len({e["id"] for e in self.events if e["class"] == "comm"}),
        }

    def timeline(self, origin: float, min_other_s: float = 50e-6) -> list[dict]:
        """Events relative to ``origin``; short 'other' ops are dropped (they only clutter)."""
        return [
            {**e, "t0": e["t0"] - origin, "t1": e["t1"] - origin}
            for e in self.events
            if e["class"] != "other" or e["t1"] - e["t0"] >= min_other_s
        ]
