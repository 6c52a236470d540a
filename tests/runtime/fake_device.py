"""A device whose memory is the test's: ``FakeDevice`` has ``tkcc.runtime.device_memory.CudaMemory``'s methods
(read, collect, cap, fraction, set_fraction, reset_peak, oom) and counts as allocated the bytes of the ``Block`` objects alive.

A block is freed when the last reference to it goes, as a tensor's memory is, so a candidate that keeps one
in a module global leaks it for real (and dropping the module frees it). Like the caching allocator, freed
bytes stay reserved until ``collect`` empties the cache, and an allocation past the cap raises.
"""
from __future__ import annotations

import gc
import weakref

from tkcc.runtime.device_memory import Reading

GiB, MiB = 1 << 30, 1 << 20
CURRENT = None  # the device the test installed (candidates' code finds it here)


class OutOfMemoryError(RuntimeError):
    pass


class FakeDevice:
    def __init__(self, total: int = 80 * GiB, context: int = 500 * MiB):
        self.total, self.context = int(total), int(context)
        self.allocated = self.cached = self.peak = 0
        self.frac = 1.0
        self.others = 0  # another process's use of the device

    def alloc(self, nbytes: int) -> "Block":
        return Block(self, int(nbytes))

    def _take(self, n: int) -> None:
        if self.allocated + n > self.frac * self.total:
            raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n / MiB:.0f} MiB")
        self.allocated += n
        self.cached = max(0, self.cached - n)
        self.peak = max(self.peak, self.allocated)

    def _give(self, n: int) -> None:
        self.allocated -= n
        self.cached += n

    # -- CudaMemory's interface
    def read(self) -> Reading:
        reserved = self.allocated + self.cached
        return Reading(self.allocated, reserved, self.peak, self.total,
                       self.total - reserved - self.context - self.others)

    def collect(self) -> Reading:
        gc.collect()
        self.cached = 0
        return self.read()

    def cap(self, limit: int) -> None:
        self.frac = min(1.0, limit / self.total)

    def fraction(self) -> float:
        return self.frac

    def set_fraction(self, value: float) -> None:
        self.frac = float(value)

    def reset_peak(self) -> None:
        self.peak = self.allocated

    oom = OutOfMemoryError


class Block:
    """``nbytes`` of the fake device, held while this object lives."""

    def __init__(self, dev: FakeDevice, nbytes: int):
        dev._take(nbytes)
        self.nbytes = nbytes
        weakref.finalize(self, dev._give, nbytes)


def alloc(nbytes: int) -> Block:
    """For candidates: allocate on the device the test installed."""
    return CURRENT.alloc(nbytes)
