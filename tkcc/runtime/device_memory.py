"""Device (GPU) memory: the engine's limit on it, and what a candidate leaves behind on it.

On a GPU candidates run in the worker (``--isolation inprocess``: a CUDA context does not survive ``fork``),
so one candidate's device memory is the next one's problem unless it is bounded and accounted:

* **The limit** is a real allocator cap (``torch.cuda.set_per_process_memory_fraction``): an allocation past
  it raises ``torch.cuda.OutOfMemoryError`` in the candidate that asked, which is that candidate's failure,
  and the worker goes on. It is derived from the device and the model (``derived_limit``): what the engine
  holds from the device after start-up, its cache emptied (weights, KV cache, the reference's captured graphs
  and their pools: ``resident``) plus a headroom of
  max(2 GiB, 2x the weights and cache, 2x the start-up's own transient peak, half of the device's free memory
  then), never more than the device less a reserve for what lives outside the caching allocator (the CUDA
  context, cuBLAS workspaces, NCCL buffers, loaded kernels). The half of what is free is what makes a
  workload's shapes fit that the start-up never saw: a candidate measured on a served 10k-token prompt keeps
  its own CUDA graphs (and their pools) at every bucket beside the reference's, which no multiple of the
  model's size predicts (the H200 serve run's watcher ran out at 12-14 GiB with 120 GiB free); the other
  half stays with whatever else shares the device (the server whose traffic the engine measures).
  ``tkcc serve --device-max-mem GiB`` overrides it (``check_given``).
* **A leak** is device memory in live tensors (``memory_allocated`` after a collection, ``synchronize`` and
  ``empty_cache``) above what the worker held before the candidate was loaded, once it is unloaded, less
  what the engine's own caches gained meanwhile (the reference's graphs for new shapes, its bank of results,
  the slots' graphs: ``held_by`` counts the bytes those structures reach). ``DeviceBudget.leak`` names it.
* **Between requests** the supervisor's watchdog pings the worker, which checks that the cap is still in
  force (a candidate may have lifted it) and that the allocator holds no more than the limit (``idle``).

Everything that reads CUDA memory goes through ``CudaMemory``; the logic takes any object with its
``read``/``collect``/``cap``/``fraction`` methods, so it is tested on a CPU with a fake one.
"""
from __future__ import annotations

import functools
import gc
from dataclasses import dataclass

from tkcc.errors import EngineError

GiB = 1 << 30
MiB = 1 << 20
MIN_HEADROOM = 2 * GiB     # a candidate's own room above the resident model, at least
RESIDENT_FACTOR = 2        # ... or this many times the weights and KV cache (a candidate that repacks them)
TRANSIENT_FACTOR = 2       # ... or this many times the start-up's transient peak (activations at its shapes)
FREE_SHARE = 0.5           # ... or this share of the device's free memory after start-up (less the reserve)
MIN_RESERVE = 1 * GiB      # device memory left outside the cap: the CUDA context, workspaces, NCCL, modules
RESERVE_FRACTION = 0.05    # ... or this fraction of the device, whichever is more
LEAK_SLACK = 64 * MiB      # device memory a candidate may leave behind without blame (allocator rounding)


@dataclass(frozen=True)
class Reading:
    """One look at the device, in bytes."""

    allocated: int  # in live tensors (the caching allocator's memory_allocated)
    reserved: int   # held from the device by the caching allocator (memory_reserved), graph pools included
    peak: int       # the most ever allocated at once (max_memory_allocated)
    total: int      # the device's memory
    free: int       # the device's free memory, every process's use taken off


class CudaMemory:
    """The one reader (and capper) of CUDA memory: torch's caching allocator and the device's totals."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, torch.device(device)

    def read(self) -> Reading:
        """The allocator's counters and the device's totals, as they are (cheap: no synchronize)."""
        c = self.torch.cuda
        free, total = c.mem_get_info(self.device)
        return Reading(c.memory_allocated(self.device), c.memory_reserved(self.device),
                       c.max_memory_allocated(self.device), total, free)

    def collect(self) -> Reading:
        """After Python's garbage is collected, the device's work is done and the allocator's cache is returned."""
        gc.collect()
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.empty_cache()
        return self.read()

    def cap(self, limit: int) -> None:
        """Make ``limit`` bytes the most the caching allocator may hold on this device (an allocation past it
        raises OutOfMemoryError)."""
        total = self.read().total
        self.torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), self.device)

    def fraction(self) -> float:
        return float(self.torch.cuda.get_per_process_memory_fraction(self.device))

    def set_fraction(self, value: float) -> None:
        self.torch.cuda.set_per_process_memory_fraction(float(value), self.device)

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def oom(self) -> type:
        """The exception an allocation past the cap raises."""
        return self.torch.cuda.OutOfMemoryError


def reserve_of(total: int) -> int:
    """Device memory the cap leaves to what lives outside the caching allocator."""
    return max(MIN_RESERVE, int(total * RESERVE_FRACTION))


def derived_limit(total: int, resident: int, model_bytes: int, transient: int = 0, free: int = 0) -> int:
    """The device-memory limit when none is given (see the module docstring): ``resident`` (what the engine
    holds after start-up) plus max(MIN_HEADROOM, 2x ``model_bytes`` (weights + KV cache), 2x ``transient``,
    half of ``free`` (the device's free memory after start-up, every process's use taken off) less the
    reserve), never more than the device less its reserve, and never below what the engine already holds."""
    headroom = max(MIN_HEADROOM, RESIDENT_FACTOR * int(model_bytes), TRANSIENT_FACTOR * max(0, int(transient)),
                   int(FREE_SHARE * max(0, int(free) - reserve_of(total))))
    return max(int(resident), min(int(resident) + headroom, int(total) - reserve_of(total)))


def check_given(given_bytes, total: int, device: str) -> int:
    """``--device-max-mem`` in bytes, checked against the device (0: derive it); a clear error if it makes no
    sense. Called before the model is built, so a bad value costs nothing."""
    try:
        given = float(given_bytes)
    except (TypeError, ValueError):
        raise EngineError(f"--device-max-mem {given_bytes!r}: expected a number of GiB") from None
    if not given >= 0:  # negative, or NaN
        raise EngineError(f"--device-max-mem {given / GiB:g} GiB: must be 0 (derived from the device and the "
                          "model) or a positive size")
    if given > total:
        raise EngineError(f"--device-max-mem {given / GiB:.1f} GiB is more than {device} has "
                          f"({total / GiB:.1f} GiB)")
    return int(given)


def held_by(roots, device_type: str = "cuda") -> int:
    """Bytes of the distinct tensor storages on ``device_type`` that ``roots`` reach through containers and
    objects' attributes (not through modules or functions: the weights are constant, and a forward's closure is
    its candidate's). What the engine's own caches hold. An object with a ``__call__`` is still an object: the
    reference's ``CapturedCall`` keeps its static inputs and outputs (at a served long prompt, gigabytes of logits)
    as attributes, and skipping it charged them to the candidate measured when they were made (the H200 watcher's
    engine: "+4289 MiB of live tensors after unload" for a candidate that held none)."""
    import types

    import torch

    functions = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType,
                 functools.partial)

    seen_obj, seen_storage, total = set(), set(), 0
    stack = list(roots)
    while stack:
        x = stack.pop()
        if x is None or isinstance(x, (str, bytes, int, float, bool, type)) or id(x) in seen_obj:
            continue
        seen_obj.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.device.type == device_type:
                st = x.untyped_storage()
                if st.data_ptr() not in seen_storage:
                    seen_storage.add(st.data_ptr())
                    total += st.nbytes()
            continue
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        elif isinstance(x, (torch.nn.Module, *functions)):
            continue
        else:
            d = getattr(x, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())
            for name in getattr(type(x), "__slots__", ()):
                stack.append(getattr(x, name, None))
    return total


@dataclass(frozen=True)
class Held:
    """What the worker holds on the device at one moment: the allocator's live bytes, and how many of them
    the engine's own caches account for."""

    allocated: int
    reserved: int
    owned: int

    @property
    def unowned(self) -> int:
        return self.allocated - self.owned


class DeviceBudget:
    """One engine's device: its limit, in force, and the account of what each candidate leaves behind.

    ``reader``: a CudaMemory (or a fake with the same methods); ``owned``: a callable returning the bytes the
    engine's own caches hold (``held_by`` over them)."""

    def __init__(self, reader, limit: int, resident: int, how: str, owned=lambda: 0, device: str = "cuda"):
        self.reader, self.limit, self.resident, self.how = reader, int(limit), int(resident), how
        self.owned, self.device = owned, device
        self.fraction = None
        self.breaches = 0

    @classmethod
    def start(cls, reader, given: int, model_bytes: int, owned=lambda: 0, device: str = "cuda") -> "DeviceBudget":
        """After the engine's start-up: measure what it holds, derive (or check) the limit, and put the cap on."""
        r = reader.collect()
        # resident: what the allocator holds from the device once its cache is emptied, the private pools of the
        # captured graphs included (the cap counts them too); transient: the start-up's activations at its peak
        resident, transient = r.reserved, max(0, r.peak - r.allocated)
        if given:
            if given < r.reserved:
                raise EngineError(f"--device-max-mem {given / GiB:.2f} GiB is below what the engine already holds "
                                  f"on {device} after start-up ({r.reserved / GiB:.2f} GiB: weights, KV cache, "
                                  "the reference's graphs)")
            limit, how = int(given), "--device-max-mem"
        else:
            limit = derived_limit(r.total, resident, model_bytes, transient, r.free)
            how = (f"derived: resident {resident / GiB:.2f} GiB + max({MIN_HEADROOM / GiB:g} GiB, "
                   f"{RESIDENT_FACTOR}x weights and KV cache {model_bytes / GiB:.2f} GiB, {TRANSIENT_FACTOR}x start-up "
                   f"transient {transient / GiB:.2f} GiB, {FREE_SHARE:g}x free {r.free / GiB:.1f} GiB less the "
                   f"reserve), at most the device {r.total / GiB:.1f} GiB less "
                   f"{reserve_of(r.total) / GiB:.1f} GiB")
        budget = cls(reader, limit, resident, how, owned, device)
        budget.enforce()
        return budget

    def enforce(self) -> None:
        """Put the cap on (again)."""
        self.reader.cap(self.limit)
        self.fraction = self.reader.fraction()

    def reference(self, run, reset=lambda: None, what: str = "", holds=None):
        """``run()`` of the model's own reference at a shape of the workload, with the room it needs: the limit
        grows to what was live before it plus 2x its transient peak, plus ``holds(result)`` (bytes the caller
        will keep beside a candidate run at this shape: validation's copies of the outputs), when that is more
        (at most the device less its reserve), and a reference that ran out of memory under the cap runs again
        with it lifted
        (``reset()`` first: put back the state the failed run left). The cap bounds candidates against the
        model's own needs; a workload's shapes that the start-up never saw (a served long prompt's logits, say)
        are the model's needs, not a candidate's failure (the H200 serve run's watcher died on exactly that).
        A limit the user gave (``--device-max-mem``) stays as given."""
        if self.how == "--device-max-mem":
            return run()
        before = self.reader.read().allocated
        self.reader.reset_peak()
        try:
            out = run()
        except self.reader.oom:
            reset()
            self.reader.collect()
            before = self.reader.read().allocated
            self.reader.reset_peak()
            total = self.reader.read().total
            self.reader.cap(total - reserve_of(total))
            out = None
            try:
                out = run()
            finally:
                self._room_for(before, what, holds(out) if holds is not None and out is not None else 0)
            return out
        self._room_for(before, what, holds(out) if holds is not None else 0)
        return out

    def _room_for(self, before: int, what: str, extra: int = 0) -> None:
        r = self.reader.read()
        need = before + TRANSIENT_FACTOR * max(0, r.peak - before) + int(extra)
        cap = r.total - reserve_of(r.total)
        if need > self.limit and self.limit < cap:
            grown = min(need, cap)
            self.how += (f"; raised {self.limit / GiB:.2f} -> {grown / GiB:.2f} GiB for the reference"
                         f"{' at ' + what if what else ''} (live {before / GiB:.2f} GiB + {TRANSIENT_FACTOR}x its "
                         f"transient {(r.peak - before) / GiB:.2f} GiB"
                         + (f" + {extra / GiB:.2f} GiB held beside a candidate" if extra else "") + ")")
            self.limit = int(grown)
        self.enforce()  # the cap back on, at the limit as it now is

    def held(self) -> Held:
        """What the worker holds now, after a collection (before a candidate's first load; after its unload)."""
        r = self.reader.collect()
        return Held(r.allocated, r.reserved, int(self.owned()))

    def leak(self, before: Held, after: Held) -> str:
        """'' if the worker holds (outside its own caches) at most LEAK_SLACK more than ``before``; else how much."""
        grew = after.unowned - before.unowned
        if grew <= LEAK_SLACK:
            return ""
        return (f"device memory ({self.device}) is {grew / MiB:.0f} MiB above what the worker held before the "
                f"candidate was loaded (allowed {LEAK_SLACK / MiB:.0f} MiB), after it was unloaded and the "
                f"allocator's cache emptied (live tensors {(after.allocated - before.allocated) / MiB:+.0f} MiB, "
                f"the engine's own caches {(after.owned - before.owned) / MiB:+.0f} MiB)")

    def restore_cap(self) -> str:
        """'' if the cap in force is the one this budget last set; else put it back and say what it was. The
        worker asks after every op that ran candidate code, the watchdog between requests."""
        now = self.reader.fraction()
        if self.fraction is None or abs(now - self.fraction) <= 1e-9:
            return ""
        self.enforce()
        return (f"the device-memory cap on {self.device} was changed (fraction {now:.4f}, set {self.fraction:.4f}) "
                "and was put back")

    def idle(self) -> tuple[str, bool]:
        """The watchdog's check between requests: (why, fatal). A lifted cap is put back; an allocator holding
        more than the limit, once its cache is emptied, is fatal (the worker restarts)."""
        why = [w for w in (self.restore_cap(),) if w]
        r = self.reader.read()
        if r.reserved > self.limit:
            r = self.reader.collect()
            if r.allocated > self.limit or r.reserved > self.limit:
                self.breaches += 1
                why.append(f"the worker holds {r.reserved / GiB:.2f} GiB of {self.device} "
                           f"({r.allocated / GiB:.2f} GiB in live tensors), over its limit of "
                           f"{self.limit / GiB:.2f} GiB")
                return "; ".join(why), True
        return "; ".join(why), False

    def explain_oom(self) -> str:
        return (f" (the engine's device-memory limit on {self.device} is {self.limit / GiB:.2f} GiB, "
                f"{self.resident / GiB:.2f} GiB of it the resident model: --device-max-mem)")

    def status(self) -> dict:
        r = self.reader.read()
        return {"limit_bytes": self.limit, "resident_bytes": self.resident, "how": self.how,
                "allocated_bytes": r.allocated, "reserved_bytes": r.reserved, "peak_bytes": r.peak,
                "device_total_bytes": r.total, "device_used_bytes": r.total - r.free,
                "outside_allocator_bytes": max(0, r.total - r.free - r.reserved), "breaches": self.breaches}
