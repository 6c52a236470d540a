"""Candidates: what the engine can swap in, built for one tier at a time.

A candidate spec (JSON, as sent over RPC) is one of:

- ``{"plan": [...]}``: a PassPlan; compiled for each tier through the
  PassManager and codegen from the same plan. ``pass_modules`` lists Python
  files defining user passes (``@register``) to import first.
- ``{"artifact": PATH}`` or ``{"artifacts": {"fast": PATH, "slow": PATH}}``:
  prebuilt artifacts, opened with ``Artifact.open`` (hashes verified); the
  manifest's program fingerprint must be the tier's.
- ``{"source": PATH, "sha256": HEX}``: a Python file defining
  ``build(program) -> {phase: callable}`` (e.g. an external agent's edited
  forward); the file's bytes are hashed and must match before they run. The
  candidate is everything Python can import from the file's folder (its
  modules and packages: ``source_tree``): their hash names it, and they are
  copied into a content-addressed snapshot that is what gets imported, so
  the same ``candidate.py`` beside other files is another candidate.
- ``{"baseline": true}``: the captured, un-rewritten forward.
- ``{"eager": true}``: the model's own eager forward (``Program.eager``), the
  same call as each phase's graph. Always inexact: it is the model's code, not
  the captured graph (HF's prefill, say, attends over the filled part of the
  cache only), so it is validated within the tier's tolerance. It is what
  ``tkcc.compile`` must never be slower than.
- ``{"compare": "inductor"}``: ``torch.compile`` (Inductor, max-autotune
  without its own CUDA graphs: the engine captures every forward the same way)
  of the eager forward: measured beside, for the report; never shipped.

``exact`` (optional, default from the passes/manifest/module) declares
whether outputs must be bit-exact; ``atol``/``rtol`` override tolerances.
Paths are read by the engine: they must be on its machine, within
``max_bytes``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import types
from dataclasses import dataclass, field

from tkcc.errors import ArtifactError, EngineError, TkccError

KINDS = ("plan", "artifact", "artifacts", "source", "baseline", "eager", "compare")
COMPARE = ("inductor",)
IMPORTABLE = (".py", ".so", ".pyd")  # what Python imports from a folder (with packages: folders with __init__.py)
MAX_SOURCE_FILES = 2000


@dataclass
class Candidate:
    id: str
    kind: str
    spec: dict
    exact: bool = True
    forwards: dict = field(default_factory=dict)   # tier -> {phase: callable}
    compile_s: dict = field(default_factory=dict)  # tier -> seconds
    info: dict = field(default_factory=dict)       # tier -> what was built (hashes, pass logs summary)


def spec_kind(spec) -> str:
    if not isinstance(spec, dict):
        raise EngineError(f"candidate: expected an object with one of {list(KINDS)}, got {type(spec).__name__}")
    kinds = [k for k in KINDS if k in spec]
    if len(kinds) != 1:
        raise EngineError(f"candidate: give exactly one of {list(KINDS)}; got {kinds or sorted(spec)}")
    return kinds[0]


def candidate_id(spec: dict, max_bytes: int = 256 << 20) -> str:
    """Names what will run: the plan, the artifacts' own hashes (so a rebuilt artifact is a new candidate), or
    every file a source candidate can import (``source_tree``)."""
    kind = spec_kind(spec)
    if kind in ("baseline", "eager"):
        return kind
    if kind == "compare":
        return f"compare-{spec['compare']}"
    if kind == "source":
        digest, _ = source_tree(spec.get("source"), max_bytes)
        key = {k: v for k, v in spec.items() if k in ("exact", "atol", "rtol")}
        if key:
            digest = hashlib.sha256((digest + json.dumps(key, sort_keys=True)).encode()).hexdigest()
        return f"src-{digest[:12]}"
    key = {k: v for k, v in spec.items() if k in ("plan", "artifact", "artifacts", "pass_modules", "exact", "atol",
                                                    "rtol", "hash")}
    if kind in ("artifact", "artifacts"):
        paths = [spec["artifact"]] if kind == "artifact" else list((spec["artifacts"] or {}).values())
        key["manifests"] = [_manifest_hash(p) for p in paths]
    blob = json.dumps(key, sort_keys=True, default=str)
    return f"{kind[:4]}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _manifest_hash(path) -> str | None:
    try:
        with open(os.path.join(str(path), "manifest.json"), "rb") as f:
            return hashlib.sha256(f.read(1 << 20)).hexdigest()
    except OSError:
        return None


def _read_bounded(path: str, max_bytes: int, what: str) -> bytes:
    if not isinstance(path, str) or not path:
        raise EngineError(f"{what}: expected a file path")
    if not os.path.isfile(path):
        raise EngineError(f"{what} {path!r} does not exist on the engine's machine")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise EngineError(f"{what} {path!r} is {size} bytes, over the engine's limit of {max_bytes} bytes")
    with open(path, "rb") as f:
        return f.read(max_bytes + 1)


def source_tree(path, max_bytes: int) -> tuple[str, list[tuple[str, bytes]]]:
    """(SHA-256, files) of everything Python can import from a source candidate's folder: the modules beside
    it (``IMPORTABLE``) and every file of the packages beside it (folders with ``__init__.py``), recursively;
    ``__pycache__`` and hidden folders skipped. Bounded by ``max_bytes`` and ``MAX_SOURCE_FILES``."""
    if not isinstance(path, str) or not path:
        raise EngineError("source candidate: expected a file path")
    if not os.path.isfile(path):
        raise EngineError(f"source candidate {path!r} does not exist on the engine's machine")
    root = os.path.dirname(os.path.abspath(path))
    rels: list[str] = []

    def package(folder: str, rel: str) -> None:
        for dirpath, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for f in sorted(files):
                rels.append(os.path.relpath(os.path.join(dirpath, f), root))
            if len(rels) > MAX_SOURCE_FILES:
                break

    try:
        entries = sorted(os.listdir(root))
    except OSError as e:
        raise EngineError(f"source candidate {path!r}: cannot list its folder {root} ({e.strerror})") from None
    for name in entries:
        full = os.path.join(root, name)
        if name.startswith(".") or name == "__pycache__":
            continue
        if os.path.isfile(full) and name.endswith(IMPORTABLE):
            rels.append(name)
        elif os.path.isdir(full) and os.path.isfile(os.path.join(full, "__init__.py")):
            package(full, name)
        if len(rels) > MAX_SOURCE_FILES:
            raise EngineError(f"source candidate {path!r}: its folder {root} holds more than {MAX_SOURCE_FILES} "
                              "importable files; put the candidate in a folder of its own")
    total, files, h = 0, [], hashlib.sha256()
    h.update(b"entry\0" + os.path.basename(path).encode() + b"\0")  # which of the files is the candidate
    for rel in rels:
        full = os.path.join(root, rel)
        size = os.path.getsize(full)
        total += size
        if total > max_bytes:
            raise EngineError(f"source candidate {path!r}: the files it can import in {root} are over the engine's "
                              f"limit of {max_bytes} bytes (at {rel}); put the candidate in a folder of its own")
        with open(full, "rb") as f:
            data = f.read(max_bytes + 1)
        files.append((rel, data))
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest(), files


def _snapshot(work_dir: str, digest: str, files: list[tuple[str, bytes]]) -> str:
    """The hashed files, written once into ``<work_dir>/src-<digest>`` (atomically): what gets imported."""
    out = os.path.join(work_dir, f"src-{digest[:32]}")
    if os.path.isdir(out):
        return out
    tmp = f"{out}.tmp-{os.getpid()}"
    for rel, data in files:
        p = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    try:
        os.rename(tmp, out)
    except OSError:  # another process wrote the same snapshot first: the same bytes
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dir_size(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def _import_file(path: str, data: bytes) -> types.ModuleType:
    """Execute exactly ``data`` (already hash-checked) as a module named after its path."""
    name = f"tkcc_user_{hashlib.sha256(data).hexdigest()[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    mod = types.ModuleType(name)
    mod.__file__ = os.path.abspath(path)
    sys.modules[name] = mod
    try:
        exec(compile(data, os.path.abspath(path), "exec"), mod.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def load_pass_modules(paths, max_bytes: int) -> None:
    for p in paths or []:
        data = _read_bounded(p, max_bytes, "pass module")
        _import_file(p, data)


def plan_is_exact(plan) -> bool:
    from tkcc.passes.base import get_pass

    return all(getattr(get_pass(s.name), "exact", True) for s in plan.steps)


def build_for_tier(cand: Candidate, tier: str, programs: dict, work_dir: str, max_bytes: int,
                   list_kernels: bool = False) -> None:
    """Compile/load ``cand`` for ``tier`` (fills cand.forwards[tier], compile_s, info). ``list_kernels``: a plan's
    build also launches its generated kernels on meta tensors (``tkcc.pipeline.build``), for discovery."""
    program = programs[tier]
    t0 = time.perf_counter()
    kind, spec = cand.kind, cand.spec
    if kind == "baseline":
        fwd, info = dict(program.graphs), {"kind": "baseline"}
    elif kind == "eager":
        if program.eager is None:
            raise EngineError(f"candidate eager: the {tier} tier's Program has no eager forward (Program.eager)")
        fwd, info = {p: program.eager for p in program.phases}, {"kind": "eager"}
        cand.exact = False
    elif kind == "compare":
        if spec["compare"] not in COMPARE or program.eager is None:
            raise EngineError(f"candidate compare: {spec['compare']!r} is not one of {list(COMPARE)} (or the "
                              f"Program has no eager forward)")
        import torch

        fn = torch.compile(program.eager, mode="max-autotune-no-cudagraphs", dynamic=False)
        fwd, info = {p: fn for p in program.phases}, {"kind": "compare", "compare": spec["compare"]}
        cand.exact = False
    elif kind == "plan":
        fwd, info = _build_plan(spec, tier, program, work_dir, max_bytes, cand, list_kernels)
    elif kind in ("artifact", "artifacts"):
        fwd, info = _open_artifact(spec, tier, programs, max_bytes, cand)
    else:
        fwd, info = _load_source(spec, program, max_bytes, cand, work_dir)
    missing = [p for p in program.phases if p not in fwd]
    extra = [p for p in fwd if p not in program.phases]
    if extra:
        raise EngineError(f"candidate {cand.id}: forwards for phases {extra} the model does not have "
                          f"(it has {program.phases})")
    if missing:
        # phases a candidate leaves alone keep the baseline forward
        fwd = {**{p: program.graphs[p] for p in missing}, **fwd}
        info["baseline_phases"] = missing
    for p, f in fwd.items():
        if not callable(f):
            raise EngineError(f"candidate {cand.id}: forward for phase {p!r} is not callable ({type(f).__name__})")
    cand.forwards[tier] = fwd
    cand.compile_s[tier] = time.perf_counter() - t0
    cand.info[tier] = info


def _build_plan(spec, tier, program, work_dir, max_bytes, cand, list_kernels: bool = False):
    from tkcc.passes.plan import PassPlan
    from tkcc.pipeline import build

    load_pass_modules(spec.get("pass_modules"), max_bytes)
    plan = PassPlan.from_json(spec["plan"])
    cand.exact = bool(spec.get("exact", plan_is_exact(plan)))
    out_dir = os.path.join(work_dir, f"{cand.id}-{tier}")
    if os.path.isdir(out_dir):
        import shutil

        shutil.rmtree(out_dir)  # a stale build of the same id (e.g. before a worker restart)
    # No per-pass numerics check and no FX Python per pass: the engine validates the whole rewritten forward
    # (fresh inputs, several shapes, poisoned, twice) before anything is swapped in or measured, and codegen
    # reads the graphs, not FX's Python. Graph lint and the placeholder check still run after every pass.
    t0 = time.perf_counter()
    try:
        b = build(program, plan, out_dir, check_numerics=False, log_code=False, tier=program.num_blocks,
                  list_kernels=list_kernels)
    except ArtifactError as e:
        tried_s = time.perf_counter() - t0
        # A graph codegen cannot emit (a Program built outside the frontend, with module calls in it) still
        # runs, is validated and measured here from its rewritten graphs; it has no artifact, so it can be
        # measured but not shipped to another process (tkcc.compile refuses to serve it).
        b = build(program, plan, check_numerics=False, log_code=False, codegen=False)
        info = {"kind": "plan", "plan": plan.to_json(), "plan_hash": plan.hash(),
                "passes": [_log_summary(lg) for lg in (b.logs or [])], "codegen": f"in-process, no artifact: {e}",
                "numerics": "checked by the engine's validation, not per pass",
                "phases_s": {**b.seconds, "codegen_s": tried_s}}
        return _generated(b.program, info), info
    art = b.artifact
    info = {"kind": "plan", "plan": plan.to_json(), "plan_hash": plan.hash(),
            "passes": [_log_summary(lg) for lg in (b.logs or [])],
            "numerics": "checked by the engine's validation, not per pass", "phases_s": dict(b.seconds),
            "artifact": out_dir, "artifact_hash": art.hash}
    if list_kernels:
        info["meta_launches"] = b.meta_launches
    cand.exact = cand.exact and all(k.get("exact", True) for k in art.manifest.get("kernels", {}).values())
    return b.forwards, info


def _generated(rewritten, info: dict) -> dict:
    """The rewritten FX graphs as the forwards, their Python generated now (counted as compile time)."""
    t = time.perf_counter()
    for gm in rewritten.graphs.values():
        _ = gm.code  # a lazy GraphModule (tkcc.passes.manager) generates its Python here
    info["phases_s"]["fx_codegen_s"] = time.perf_counter() - t
    return dict(rewritten.graphs)


def _log_summary(log) -> dict:
    out = {}
    for k in ("name", "matched", "replaced", "added", "removed", "seconds", "time_s"):
        v = getattr(log, k, None)
        if v is not None and not callable(v):
            out[k] = v
    notes = getattr(log, "notes", None)
    if notes:  # what a pass says it did (a tuner: what it timed, or whose configs it took), the last few
        out["notes"] = [str(n)[:400] for n in list(notes)[-6:]]
    return out


def _open_artifact(spec, tier, programs, max_bytes, cand):
    from tkcc.codegen.artifact import Artifact

    path = spec["artifact"] if cand.kind == "artifact" else (spec["artifacts"] or {}).get(tier)
    if path is None:
        raise EngineError(f"candidate {cand.id}: no artifact given for the {tier} tier "
                          f"(got tiers {sorted(spec['artifacts'] or {})})")
    if not isinstance(path, str) or not os.path.isdir(path):
        raise EngineError(f"artifact {path!r} is not a directory on the engine's machine")
    size = _dir_size(path)
    if size > max_bytes:
        raise EngineError(f"artifact {path!r} is {size} bytes, over the engine's limit of {max_bytes} bytes")
    try:
        art = Artifact.open(path)
    except TkccError as e:
        raise ArtifactError(f"artifact {path!r}: {e}") from None
    manifest = art.manifest
    want = spec.get("hash")
    if want is not None and want != art.hash:
        raise ArtifactError(f"artifact {path!r}: hash {art.hash} is not the expected {want}")
    fp = manifest.get("fingerprint")
    program = programs[tier]
    if fp != program.fingerprint:
        other = [t for t, p in programs.items() if p.fingerprint == fp and t != tier]
        if other:
            raise ArtifactError(f"artifact {path!r} was built for the {other[0]} tier, not the {tier} tier "
                                f"(program fingerprint {fp})")
        raise ArtifactError(f"artifact {path!r} was built for another model (program fingerprint {fp}; this "
                            f"engine's {tier} tier is {program.fingerprint}, model {program.meta.get('model')})")
    m_tier = manifest.get("tier")
    if m_tier is not None and int(m_tier) != program.num_blocks:
        raise ArtifactError(f"artifact {path!r} was built for a tier of {m_tier} blocks; this engine's {tier} tier "
                            f"has {program.num_blocks}")
    exact = all(k.get("exact", True) for k in manifest.get("kernels", {}).values())
    try:
        from tkcc.passes.plan import PassPlan

        exact = exact and plan_is_exact(PassPlan.from_json(manifest.get("plan") or []))
    except TkccError:
        pass  # a user pass not loaded here: the kernels' flags decide
    cand.exact = bool(spec.get("exact", exact))
    return dict(art.load(program)), {"kind": "artifact", "path": path, "hash": art.hash,
                                     "plan": manifest.get("plan")}


def _load_source(spec, program, max_bytes, cand, work_dir: str):
    path, want = spec["source"], spec.get("sha256")
    if not isinstance(want, str) or len(want) != 64:
        raise EngineError("source candidate: 'sha256' (64 hex digits of the file) is required")
    data = _read_bounded(path, max_bytes, "source candidate")
    got = hashlib.sha256(data).hexdigest()
    if got != want.lower():
        raise ArtifactError(f"source candidate {path!r}: sha256 {got} does not match the expected {want}")
    digest, files = source_tree(path, max_bytes)
    name = os.path.basename(os.path.abspath(path))
    if dict(files).get(name) != data:
        raise ArtifactError(f"source candidate {path!r} changed while it was being read; submit it again")
    snap = _snapshot(work_dir, digest, files)
    mod = _import_tree(os.path.join(snap, name), data, digest, snap)
    build = getattr(mod, "build", None)
    if not callable(build):
        raise EngineError(f"source candidate {path!r} defines no build(program) -> {{phase: callable}}")
    fwd = build(program)
    if not isinstance(fwd, dict):
        raise EngineError(f"source candidate {path!r}: build() returned {type(fwd).__name__}, not a dict")
    cand.exact = bool(spec.get("exact", getattr(mod, "EXACT", True)))
    return fwd, {"kind": "source", "path": path, "sha256": got, "tree_sha256": digest, "files": len(files),
                 "snapshot": snap}


def _import_tree(path: str, data: bytes, digest: str, snap: str) -> types.ModuleType:
    """Execute a source candidate from its snapshot; its sibling imports resolve in the snapshot only.

    The snapshot folder is on ``sys.path`` while the module runs; modules imported from it are then removed
    from ``sys.modules`` (the candidate keeps its references), so a later candidate's ``import helpers``
    never finds this one's."""
    name = f"tkcc_user_{digest[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, snap)
    try:
        mod = types.ModuleType(name)
        mod.__file__ = path
        sys.modules[name] = mod
        try:
            exec(compile(data, path, "exec"), mod.__dict__)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    finally:
        try:
            sys.path.remove(snap)
        except ValueError:
            pass
        prefix = snap + os.sep
        for k, m in list(sys.modules.items()):
            f = getattr(m, "__file__", None) or ""
            if k != name and isinstance(f, str) and f.startswith(prefix):
                del sys.modules[k]
    return mod


USER_PREFIX = "tkcc_user_"  # the modules a candidate's files are executed as (_import_file, _import_tree)


def user_modules() -> set[str]:
    """Names of the modules candidates' files were executed as, still in ``sys.modules``."""
    return {k for k in list(sys.modules) if k.startswith(USER_PREFIX)}


def drop_user_modules(names) -> None:
    """Forget these candidate modules and clear their globals (what a candidate stashed there goes with them)."""
    for name in names:
        mod = sys.modules.pop(name, None)
        if mod is not None and name.startswith(USER_PREFIX):
            mod.__dict__.clear()
