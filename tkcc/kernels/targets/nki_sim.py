"""A NumPy model of the subset of the NKI language (AWS Trainium) that tkcc's kernels use.

The Neuron compiler cannot be installed from the package registries (the
`neuronx-cc` and `nki` names on PyPI are placeholders), so tkcc checks its NKI
kernels in two ways: the source is parsed and every `nl.*` name it uses must
exist in this model (an unknown API is an error, not a silent pass), and the
kernels are *executed* here on NumPy arrays against the PyTorch references.
What this model enforces of the hardware: tiles live in on-chip memory with
the partition dimension first and at most ``tile_size.pmax`` (128) rows;
HBM tensors are touched only through ``load``/``store``. What it cannot tell:
whether neuronx-cc accepts the kernel, its instruction schedule, or its speed.
"""
from __future__ import annotations

import ast
import types
from dataclasses import dataclass

import numpy as np

from tkcc.errors import TkccError

PMAX = 128


class HBM:
    """A device-memory tensor: indexable to an access pattern, never computed on directly."""

    def __init__(self, data: np.ndarray, name: str = ""):
        self.data, self.name = data, name

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    def reshape(self, shape):
        return HBM(self.data.reshape(shape), self.name)

    def __getitem__(self, key):
        return Access(self, key if isinstance(key, tuple) else (key,))


@dataclass
class Access:
    tensor: HBM
    key: tuple

    def resolve(self):
        key = tuple(k.v if isinstance(k, Tile) else k for k in self.key)
        return key


class Tile:
    """An on-chip tile (SBUF/PSUM); arithmetic is elementwise with NumPy broadcasting."""

    def __init__(self, v, check: bool = True):
        self.v = np.asarray(v)
        if check and self.v.ndim >= 1 and self.v.shape[0] > PMAX and self.v.ndim >= 2:
            raise TkccError(f"NKI tile has partition dimension {self.v.shape[0]} > {PMAX}")

    shape = property(lambda self: self.v.shape)
    dtype = property(lambda self: self.v.dtype)

    def _b(self, o, f):
        return Tile(f(self.v, o.v if isinstance(o, Tile) else o), check=False)

    __add__ = lambda s, o: s._b(o, np.add)
    __radd__ = __add__
    __sub__ = lambda s, o: s._b(o, np.subtract)
    __rsub__ = lambda s, o: s._b(o, lambda a, b: b - a)
    __mul__ = lambda s, o: s._b(o, np.multiply)
    __rmul__ = __mul__
    __truediv__ = lambda s, o: s._b(o, np.divide)
    __lt__ = lambda s, o: s._b(o, np.less)
    __le__ = lambda s, o: s._b(o, np.less_equal)
    __ge__ = lambda s, o: s._b(o, np.greater_equal)
    __gt__ = lambda s, o: s._b(o, np.greater)
    __and__ = lambda s, o: s._b(o, np.logical_and)
    __neg__ = lambda s: Tile(-s.v, check=False)

    __array_ufunc__ = None  # NumPy defers to Tile's reflected operators (ndarray < tile, ...)
    __floordiv__ = lambda s, o: s._b(o, np.floor_divide)

    def __int__(self):
        return int(self.v.reshape(-1)[0])

    __index__ = __int__

    def __getitem__(self, key):
        return Tile(self.v[key], check=False)

    def __setitem__(self, key, value):
        self.v[key] = _v(value)

    def broadcast_to(self, shape):
        return Tile(np.broadcast_to(self.v, shape))


def _v(x):
    return x.v if isinstance(x, Tile) else x


def _cast(a, dtype):
    return Tile(np.asarray(a).astype(dtype) if dtype is not None else np.asarray(a))


def _language() -> types.ModuleType:
    nl = types.ModuleType("nki_sim.language")
    nl.float32, nl.float16, nl.bfloat16, nl.int32 = np.float32, np.float16, np.float32, np.int32
    nl.shared_hbm, nl.sbuf, nl.psum, nl.hbm = "shared_hbm", "sbuf", "psum", "hbm"
    nl.tile_size = types.SimpleNamespace(pmax=PMAX, gemm_stationary_fmax=128, gemm_moving_fmax=512,
                                         psum_fmax=2048)

    def ndarray(shape, dtype, buffer="sbuf"):
        if buffer in ("shared_hbm", "hbm"):
            return HBM(np.zeros(shape, dtype=dtype))
        return Tile(np.zeros(shape, dtype=dtype))

    def load(access, mask=None, dtype=None):
        if not isinstance(access, Access):
            raise TkccError("nl.load takes an indexed HBM tensor (tensor[i, j])")
        key = access.resolve()
        idx = np.broadcast_arrays(*[np.asarray(k) for k in key])
        if mask is not None:
            m = np.broadcast_to(_v(mask), idx[0].shape)
            safe = [np.where(m, i, 0) for i in idx]
            out = np.where(m, access.tensor.data[tuple(safe)], 0)
        else:
            out = access.tensor.data[tuple(idx)]
        return Tile(out.astype(dtype) if dtype is not None else out)

    def store(access, value, mask=None):
        if not isinstance(access, Access):
            raise TkccError("nl.store writes an indexed HBM tensor (tensor[i, j])")
        key = access.resolve()
        idx = np.broadcast_arrays(*[np.asarray(k) for k in key], _v(value))
        val, idx = idx[-1], idx[:-1]
        if mask is not None:
            m = np.broadcast_to(_v(mask), val.shape)
            idx = [i[m] for i in idx]
            val = val[m]
        access.tensor.data[tuple(idx)] = val.astype(access.tensor.dtype)

    def arange(n):
        return np.arange(n)

    def affine_range(n):
        return range(int(n))

    nl.ndarray, nl.load, nl.store, nl.arange = ndarray, load, store, arange
    nl.affine_range = nl.sequential_range = nl.static_range = affine_range
    nl.zeros = lambda shape, dtype, buffer="sbuf": Tile(np.zeros(shape, dtype=dtype))
    nl.full = lambda shape, fill_value, dtype, buffer="sbuf": Tile(np.full(shape, fill_value, dtype=dtype))
    for name, f in [("add", np.add), ("subtract", np.subtract), ("multiply", np.multiply),
                    ("divide", np.divide), ("maximum", np.maximum), ("minimum", np.minimum),
                    ("equal", np.equal), ("greater", np.greater), ("less", np.less)]:
        setattr(nl, name, (lambda f: lambda a, b, dtype=None: _cast(f(_v(a), _v(b)), dtype))(f))
    for name, f in [("exp", np.exp), ("square", np.square), ("sqrt", np.sqrt), ("negative", np.negative),
                    ("rsqrt", lambda x: 1.0 / np.sqrt(x)), ("copy", np.array),
                    ("silu", lambda x: x / (1.0 + np.exp(-x))), ("reciprocal", lambda x: 1.0 / x)]:
        setattr(nl, name, (lambda f: lambda a, dtype=None: _cast(f(_v(a)), dtype))(f))
    for name, f in [("sum", np.sum), ("max", np.max), ("mean", np.mean), ("min", np.min)]:
        setattr(nl, name, (lambda f: lambda a, axis, dtype=None, keepdims=False:
                           _cast(f(_v(a), axis=tuple(axis) if isinstance(axis, (list, tuple)) else axis,
                                   keepdims=keepdims), dtype))(f))
    nl.where = lambda c, a, b, dtype=None: _cast(np.where(_v(c), _v(a), _v(b)), dtype)

    def matmul(x, y, transpose_x=False):
        a, b = _v(x), _v(y)
        if transpose_x:
            a = a.T
        return Tile(np.matmul(a.astype(np.float32), b.astype(np.float32)), check=False)

    nl.matmul = matmul
    nl.transpose = lambda x, dtype=None: _cast(_v(x).T, dtype)
    return nl


language = _language()


def jit(fn):
    """Run a kernel on NumPy arrays: inputs become HBM tensors; HBM results come back as arrays."""

    def run(*args):
        conv = [HBM(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a for a in args]
        out = fn(*conv)
        if isinstance(out, tuple):
            return tuple(o.data if isinstance(o, HBM) else o for o in out)
        return out.data if isinstance(out, HBM) else out

    run.__wrapped__ = fn
    return run


nki = types.SimpleNamespace(jit=jit, language=language)


def check_source(source: str) -> list[str]:
    """Parse an NKI kernel source; every nl.* it uses must exist. Returns the kernel names."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise TkccError(f"NKI kernel does not parse: line {e.lineno}: {e.msg}") from e
    unknown = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id == "nl" and not hasattr(language, n.attr)})
    if unknown:
        raise TkccError(f"NKI kernel uses nki.language names tkcc does not model: {unknown}")
    kernels = [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
               and any((isinstance(d, ast.Attribute) and d.attr == "jit") for d in f.decorator_list)]
    if not kernels:
        raise TkccError("NKI source defines no @nki.jit kernel")
    return kernels


def load_kernels(source: str) -> dict:
    """Execute an NKI source against this model; returns {kernel name: callable on NumPy arrays}."""
    names = check_source(source)
    import sys

    ns: dict = {}
    neuronxcc = types.ModuleType("neuronxcc")
    neuronxcc.nki = types.ModuleType("neuronxcc.nki")
    neuronxcc.nki.jit = jit
    neuronxcc.nki.language = language
    saved = {k: sys.modules.get(k) for k in ("neuronxcc", "neuronxcc.nki", "neuronxcc.nki.language")}
    sys.modules.update({"neuronxcc": neuronxcc, "neuronxcc.nki": neuronxcc.nki,
                        "neuronxcc.nki.language": language})
    try:
        exec(compile(source, "<nki kernel>", "exec"), ns)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return {n: ns[n] for n in names}
