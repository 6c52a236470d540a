"""The worker's process-global state, audited around candidate code that runs in the worker.

With ``--isolation inprocess`` (a GPU, where a CUDA context does not survive ``fork``; ``--tp``) candidate
code runs in the engine's worker. After each operation that ran it, the worker compares its global state
with a snapshot taken at start-up, before any candidate was imported, and puts back what it can:

* torch's function table: every attribute of every module of torch, tkcc, triton, numpy and the standard
  modules the engine relies on, and of every class found in them (``torch.Tensor`` and
  ``torch._C.TensorBase`` included), plus each function's code, defaults and closure;
* the dispatcher: every registration of every operator (``torch._C._dispatch_dump``), and the torch
  function / dispatch mode stacks;
* thread counts and backend flags (mkldnn, cuDNN, TF32, matmul precision, deterministic algorithms,
  flush-denormal, grad mode) and the default dtype (the device-memory cap is the engine's
  ``DeviceBudget``'s to audit: it raises the cap itself, mid-op);
* the interpreter: recursion limit, switch interval, trace and profile hooks, gc, ``sys.path`` and the
  import hooks, standard streams, signal handlers, warning filters, environment, working directory;
* threads the candidate left running, and child processes it left behind.

What can be put back (a patched attribute, a flag, the default dtype) is, and the record says what was.
What cannot (a dispatcher registration, a new mode on the stack, a live thread, a changed code object the
audit cannot restore) means the worker cannot be proven clean: it exits and the supervisor starts a fresh
one. Memory above what the worker held before a candidate (after it is unloaded, and after ``gc`` and
``malloc_trim``; on the device, after ``empty_cache``) is charged to that candidate
(``tkcc.runtime.memory_ledger``).

A determined adversary in the same process can still hide from any audit (ctypes writes into memory);
process isolation (``tkcc.runtime.trial``) is the design that rules that out, and the engine's default
wherever a fork is safe.
"""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import threading
import types
import warnings
from dataclasses import dataclass, field

import torch

# every module of tkcc, and these (with the classes they hold): torch's function table and the rest of what
# the engine's own code calls into
WATCHED = {"torch", "torch.functional", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.nn.modules.module",
           "torch._C", "torch._C._VariableFunctions", "torch._C._nn", "torch._C._linalg", "torch._C._fft",
           "torch._C._special", "torch._tensor", "torch.linalg", "torch.fft", "torch.special", "torch.autograd",
           "torch.autograd.grad_mode", "torch.cuda", "torch.cuda.graphs", "torch.cuda.streams", "torch.random",
           "torch.backends", "torch.backends.cudnn", "torch.backends.mkldnn", "torch.backends.cuda", "torch.fx",
           "torch.fx.graph_module", "torch.library", "torch._ops", "torch.overrides", "torch.utils._pytree",
           "torch.export", "triton", "triton.language", "triton.runtime.jit", "numpy", "builtins", "math", "time",
           "operator", "functools", "os", "sys", "random", "threading", "gc", "copy", "pickle", "struct", "itertools",
           "statistics", "hashlib", "json", "ctypes", "signal", "mmap", "socket", "select", "subprocess",
           "multiprocessing", "multiprocessing.connection", "secrets", "zlib"}
SKIP_ATTRS = {"__builtins__", "__loader__", "__spec__", "__cached__", "__warningregistry__",
              "__slotnames__"}  # set lazily by copyreg on the first copy or pickle of an instance
MEMORY_SLACK = 64 << 20  # bytes a worker may differ by, before and after a candidate, without blame


def _watched(name: str) -> bool:
    return name in WATCHED or name == "tkcc" or name.startswith("tkcc.")


def _function_parts(f) -> tuple:
    return (f.__code__, f.__defaults__, f.__kwdefaults__, f.__closure__, f.__globals__ is not None)


@dataclass
class Snapshot:
    attrs: dict = field(default_factory=dict)      # (owner id, name) -> (owner, value)
    owners: dict = field(default_factory=dict)     # owner id -> (owner, set of names)
    functions: dict = field(default_factory=dict)  # function id -> (function, parts)
    modules: dict = field(default_factory=dict)    # name -> module object (watched ones)
    dispatch: dict = field(default_factory=dict)   # operator -> registrations text
    flags: dict = field(default_factory=dict)      # name -> value (with its setter in FLAGS)
    interp: dict = field(default_factory=dict)     # name -> value
    threads: set = field(default_factory=set)      # ids of live Python threads
    children: set = field(default_factory=set)     # pids of child processes
    memory: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------ flags
def _flush_denormal() -> bool:
    """True when denormals are flushed to zero (torch.set_flush_denormal has no getter: measure it)."""
    x = torch.tensor([1e-39], dtype=torch.float32)
    return bool((x * 1.0).item() == 0.0)


def _getset(obj, name):
    return (lambda: getattr(obj, name), lambda v: setattr(obj, name, v))


def _flags() -> dict:
    """name -> (get, set) of every setting the audit restores."""
    b = torch.backends
    out = {
        "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "num_threads": (torch.get_num_threads, torch.set_num_threads),
        "grad_enabled": (torch.is_grad_enabled, torch.set_grad_enabled),
        "deterministic_algorithms": (lambda: (torch.are_deterministic_algorithms_enabled(),
                                              torch.is_deterministic_algorithms_warn_only_enabled()),
                                     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        "flush_denormal": (_flush_denormal, torch.set_flush_denormal),
        "mkldnn.enabled": _getset(b.mkldnn, "enabled"),
        "cudnn.enabled": _getset(b.cudnn, "enabled"),
        "cudnn.benchmark": _getset(b.cudnn, "benchmark"),
        "cudnn.deterministic": _getset(b.cudnn, "deterministic"),
        "cudnn.allow_tf32": _getset(b.cudnn, "allow_tf32"),
        "cuda.matmul.allow_tf32": _getset(b.cuda.matmul, "allow_tf32"),
        "cuda.matmul.allow_fp16_reduced_precision_reduction":
            _getset(b.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
        "cuda.matmul.allow_bf16_reduced_precision_reduction":
            _getset(b.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    }
    if hasattr(b, "opt_einsum"):
        out["opt_einsum.enabled"] = _getset(b.opt_einsum, "enabled")
    return out


def _interp() -> dict:
    out = {
        "recursionlimit": sys.getrecursionlimit(),
        "switchinterval": sys.getswitchinterval(),
        "trace": sys.gettrace(),
        "profile": sys.getprofile(),
        "threading.trace": getattr(threading, "_trace_hook", None),
        "threading.profile": getattr(threading, "_profile_hook", None),
        "gc.enabled": gc.isenabled(),
        "gc.threshold": gc.get_threshold(),
        "sys.path": list(sys.path),
        "sys.meta_path": list(sys.meta_path),
        "sys.path_hooks": list(sys.path_hooks),
        "sys.stdout": sys.stdout, "sys.stderr": sys.stderr, "sys.stdin": sys.stdin,
        "sys.excepthook": sys.excepthook, "sys.displayhook": sys.displayhook,
        "warnings.filters": list(warnings.filters),
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "torch_function_modes": torch._C._len_torch_function_stack(),
        "torch_dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "autocast.cpu": torch.is_autocast_enabled("cpu") if _autocast_takes_device() else None,
    }
    umask = os.umask(0)
    os.umask(umask)
    out["umask"] = umask
    out["signals"] = {s: signal.getsignal(s) for s in _signals()}
    return out


def _autocast_takes_device() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
        return True
    except TypeError:
        return False


def _signals() -> list:
    return [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


# ------------------------------------------------------------------------------------ taking one
def take() -> Snapshot:
    """The worker's global state now (before any candidate: its start-up; ~0.1 s)."""
    snap = Snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        classes = {}
        for name, mod in list(sys.modules.items()):
            if mod is None or not _watched(name):
                continue
            snap.modules[name] = mod
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            _own(snap, mod, d)
            for v in list(d.values()):
                if isinstance(v, type):
                    classes[id(v)] = v
        for cls in classes.values():
            try:
                _own(snap, cls, dict(vars(cls)))
            except TypeError:
                continue
        ops = torch._C._dispatch_get_all_op_names()
        snap.dispatch = {op: torch._C._dispatch_dump(op) for op in ops}
    snap.flags = {k: get() for k, (get, _) in _flags().items()}
    snap.interp = _interp()
    snap.threads = {id(t) for t in threading.enumerate() if t.is_alive()}
    from tkcc.runtime import procs

    snap.children = set(procs.children(os.getpid()))
    snap.memory = memory_now()
    return snap


def _own(snap: Snapshot, owner, d: dict) -> None:
    names = set()
    for k, v in list(d.items()):
        if k in SKIP_ATTRS:
            continue
        names.add(k)
        snap.attrs[(id(owner), k)] = (owner, v)
        f = v.__func__ if isinstance(v, (classmethod, staticmethod)) else v
        if isinstance(f, types.FunctionType) and id(f) not in snap.functions:
            snap.functions[id(f)] = (f, _function_parts(f))
    snap.owners[id(owner)] = (owner, names)


def memory_now() -> dict:
    """This process's host memory after a collection: RSS after ``gc`` and ``malloc_trim`` (device memory is
    ``tkcc.runtime.device_memory``'s)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    from tkcc.runtime import procs

    return {"rss_bytes": procs.rss(os.getpid())}


# ------------------------------------------------------------------------------------ the audit
@dataclass
class Audit:
    restored: list = field(default_factory=list)   # what the candidate changed and was put back
    unproven: list = field(default_factory=list)   # what could not be put back: the worker must restart

    @property
    def clean(self) -> bool:
        return not self.unproven

    def to_json(self) -> dict:
        return {"restored": self.restored[:50], "unproven": self.unproven[:50], "clean": self.clean}


def audit(base: Snapshot) -> Audit:
    """Compare the worker's global state with ``base``; restore what can be restored (see the module doc)."""
    out = Audit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _audit_attrs(base, out)
        _audit_dispatch(base, out)
    _audit_flags(base, out)
    _audit_interp(base, out)
    _audit_threads(base, out)
    return out


def _lazy_state(name: str, before, now) -> bool:
    """A private, non-callable value (``_initialized``, a cache, a lazily computed constant): libraries set
    these themselves on first use, so a change there is not taken for a candidate's. A private function,
    class or method (``tkcc.runtime.timing._perf_counter_ns``) is always audited."""
    if not name.startswith("_") or name.startswith("__"):
        return False
    return not any(callable(x) or isinstance(x, (classmethod, staticmethod, property)) for x in (before, now)
                   if x is not None and x is not _MISSING)


def _label(owner) -> str:
    return getattr(owner, "__name__", None) or type(owner).__name__


def _audit_attrs(base: Snapshot, out: Audit) -> None:
    for name, mod in base.modules.items():
        if sys.modules.get(name) is not mod:
            sys.modules[name] = mod
            out.restored.append(f"sys.modules[{name!r}] was replaced")
    for oid, (owner, names) in base.owners.items():
        d = getattr(owner, "__dict__", None)
        if d is None:
            continue
        for k in names:
            _, v = base.attrs[(oid, k)]
            cur = d.get(k, _MISSING)
            if cur is v:
                continue
            if _lazy_state(k, v, cur):
                continue
            where = f"{_label(owner)}.{k}"
            try:
                setattr(owner, k, v)
                out.restored.append(f"{where} was {'deleted' if cur is _MISSING else 'replaced'}")
            except (AttributeError, TypeError) as e:
                out.unproven.append(f"{where} was changed and cannot be put back ({e})")
        for k in [k for k in list(d) if k not in names and k not in SKIP_ATTRS]:
            if isinstance(owner, types.ModuleType) and isinstance(d.get(k), types.ModuleType):
                continue  # a submodule imported since: the import system sets it
            if _lazy_state(k, None, d.get(k)):
                continue
            try:
                delattr(owner, k)
                out.restored.append(f"{_label(owner)}.{k} was added")
            except (AttributeError, TypeError) as e:
                out.unproven.append(f"{_label(owner)}.{k} was added and cannot be removed ({e})")
    for f, parts in base.functions.values():
        now = _function_parts(f)
        if now == parts:
            continue
        where = f"{getattr(f, '__module__', '?')}.{f.__qualname__}"
        try:
            f.__code__, f.__defaults__, f.__kwdefaults__ = parts[0], parts[1], parts[2]
            if now[3] is not parts[3]:
                out.unproven.append(f"{where}: its closure was replaced")
            else:
                out.restored.append(f"{where}: its code or defaults were replaced")
        except (AttributeError, TypeError, ValueError) as e:
            out.unproven.append(f"{where} was changed and cannot be put back ({e})")


def _audit_dispatch(base: Snapshot, out: Audit) -> None:
    ops = torch._C._dispatch_get_all_op_names()
    new = [op for op in ops if op not in base.dispatch]
    for op in ops:
        if op in base.dispatch and torch._C._dispatch_dump(op) != base.dispatch[op]:
            out.unproven.append(f"the dispatcher's registrations of {op} changed (a kernel was registered over it)")
    for op in new:
        if not op.startswith(("tkcc", "triton", "tkcc_user")):
            dump = torch._C._dispatch_dump(op)
            if "aten" in op.split("::")[0]:
                out.unproven.append(f"a new aten operator {op} was registered ({dump.splitlines()[0] if dump else ''})")


def _audit_flags(base: Snapshot, out: Audit) -> None:
    for k, (get, set_) in _flags().items():
        want = base.flags.get(k)
        try:
            cur = get()
        except Exception as e:  # noqa: BLE001
            out.unproven.append(f"torch setting {k} cannot be read ({e})")
            continue
        if cur == want:
            continue
        try:
            set_(want)
            again = get()
        except Exception as e:  # noqa: BLE001
            out.unproven.append(f"torch setting {k} is {cur!r} (was {want!r}) and cannot be put back ({e})")
            continue
        if again == want:
            out.restored.append(f"torch setting {k} was {cur!r} (put back to {want!r})")
        else:
            out.unproven.append(f"torch setting {k} is {cur!r} (was {want!r}) and does not go back")


def _audit_interp(base: Snapshot, out: Audit) -> None:
    now = _interp()
    setters = {
        "recursionlimit": sys.setrecursionlimit, "switchinterval": sys.setswitchinterval,
        "trace": sys.settrace, "profile": sys.setprofile,
        "threading.trace": lambda v: setattr(threading, "_trace_hook", v),
        "threading.profile": lambda v: setattr(threading, "_profile_hook", v),
        "gc.enabled": lambda v: gc.enable() if v else gc.disable(),
        "gc.threshold": lambda v: gc.set_threshold(*v),
        "sys.path": lambda v: sys.path.__setitem__(slice(None), v),
        "sys.meta_path": lambda v: sys.meta_path.__setitem__(slice(None), v),
        "sys.path_hooks": lambda v: sys.path_hooks.__setitem__(slice(None), v),
        "sys.stdout": lambda v: setattr(sys, "stdout", v), "sys.stderr": lambda v: setattr(sys, "stderr", v),
        "sys.stdin": lambda v: setattr(sys, "stdin", v),
        "sys.excepthook": lambda v: setattr(sys, "excepthook", v),
        "sys.displayhook": lambda v: setattr(sys, "displayhook", v),
        "warnings.filters": lambda v: warnings.filters.__setitem__(slice(None), v),
        "environ": _set_environ, "cwd": os.chdir, "umask": os.umask,
        "signals": lambda v: [signal.signal(s, h) for s, h in v.items() if h is not None],
    }
    for k, want in base.interp.items():
        cur = now.get(k)
        if _same(cur, want):
            continue
        set_ = setters.get(k)
        if set_ is None:
            out.unproven.append(f"{k} is {cur!r}, was {want!r}")
            continue
        try:
            set_(want)
            out.restored.append(f"{k} was changed")
        except Exception as e:  # noqa: BLE001
            out.unproven.append(f"{k} was changed and cannot be put back ({e})")


def _same(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] or a[k] == b[k] for k in a)
    return a is b or a == b


def _set_environ(v: dict) -> None:
    for k in [k for k in os.environ if k not in v]:
        del os.environ[k]
    for k, x in v.items():
        if os.environ.get(k) != x:
            os.environ[k] = x


def _audit_threads(base: Snapshot, out: Audit) -> None:
    from tkcc.runtime import procs

    for t in threading.enumerate():
        if t.is_alive() and id(t) not in base.threads and t is not threading.current_thread():
            out.unproven.append(f"a thread the candidate started is still running ({t.name!r}); threads cannot be "
                                "stopped from outside")
    for pid in set(procs.children(os.getpid())) - base.children:
        if _is_own_helper(pid):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, os.WNOHANG)
            out.restored.append(f"a child process the candidate left running (pid {pid}) was killed")
        except (ProcessLookupError, ChildProcessError):
            pass


def _is_own_helper(pid: int) -> bool:
    """Processes the engine itself starts (rank followers, multiprocessing's helpers)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return True
    return b"multiprocessing" in cmd or b"tkcc-rank" in cmd


def leaked(before: dict, after: dict) -> str:
    """'' if host memory ``after`` (memory_now) is within MEMORY_SLACK (or 10 %) of ``before``, else how much more."""
    if "rss_bytes" not in before or "rss_bytes" not in after:
        return ""
    slack = max(MEMORY_SLACK, before["rss_bytes"] // 10)
    grew = after["rss_bytes"] - before["rss_bytes"]
    if grew > slack:
        return (f"host memory is {grew / 2**20:.0f} MiB above what the worker held before the candidate was loaded "
                f"(allowed {slack / 2**20:.0f} MiB), after it was unloaded and memory collected")
    return ""


_MISSING = object()
