"""Peak-memory probes: the CUDA allocator on GPU, the process's peak RSS on CPU.

On CPU, large tensors come straight from mmap and go back on free, so the
resident-set high-water mark tracks live tensor memory. Linux lets a process
reset that mark (``/proc/self/clear_refs``), which makes it usable per region.
glibc raises its mmap threshold after the first large free and then keeps
freed blocks in the heap; a fixed threshold keeps every tensor above 128 KiB
on mmap, so frees show up in the RSS.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_M_MMAP_THRESHOLD = -3


@functools.cache
def _pin_mmap_threshold() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except OSError:  # not glibc: the probe is coarser, still an upper bound
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def release_heap() -> None:
    """Hand freed heap pages back, so the RSS baseline counts live memory only.

    Also pins the mmap threshold (see the module docstring); call it before a
    task's first large allocation for the most faithful numbers.
    """
    _pin_mmap_threshold()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes``: the peak above the start."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            release_heap()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS to the current RSS
            self._start = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_kib("VmHWM") * 1024
        self.peak_bytes = max(0, peak - self._start)
