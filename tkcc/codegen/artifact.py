"""Artifact: what the engine loads — generated forward source, kernel modules, AOT binaries, a manifest.

Layout of an artifact directory (see docs/codegen.md)::

    manifest.json            plan + plan hash, program fingerprint, targets, tier, phases, versions,
                             SHA-256 of every other file, and the artifact hash over all of it
    _rt.py                   verbatim copy of tkcc/kernels/rt.py (the only support code generated code imports)
    forward_<phase>.py       one per phase: bind(model, state, constants) -> forward(*inputs)
    kernels/__init__.py
    kernels/<kernel>.py      one per generated kernel: @triton.jit kernel, reference(), launch
    constants.pt             small tensor constants of the graph (never weights), if any
    aot/<kernel>-<cfg>.<target>.{cubin,hsaco}   ahead-of-time binaries, when asked for

``build_artifact`` writes into a temporary sibling directory and renames it
into place, so a reader never sees half an artifact. ``Artifact.open``
verifies every file against the manifest; ``Artifact.load`` executes the
verified bytes as a private package (``tkcc_artifact_<hash>``) that imports
torch, triton and ``_rt`` only: no tkcc.passes, no tkcc.frontend, so it loads
in a fresh process or on another machine.

Targets: ``targets`` lists every kernel target the forwards run (``triton``
for generated kernels and Triton decode ops, ``cuda`` for decode ops the plan
put on the CUDA C++ kernels) and ``target`` names it, or ``"mixed"`` when
there are several. ``load`` refuses a target the model's device cannot run
(``cuda`` off an NVIDIA GPU) before executing anything. Forwards that call the
decode ops import ``tkcc.kernels.ops`` (listed under ``runtime``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch

from tkcc.errors import ArtifactError, TkccError
from tkcc.version import __version__

MANIFEST = "manifest.json"
FORMAT = 2  # 2: no module nodes (the fused decode step's fallback modules, 'aux', are gone)
TARGETS = ("triton",)

# Kernel modules already executed in this process, by (file name, SHA-256 of the kernel file, SHA-256 of
# _rt.py, TRITON_INTERPRET, which @triton.jit reads when the module runs). Artifacts of one plan for
# several tiers, and plans that fuse the same groups, ship identical kernel files: executing them once
# keeps one @triton.jit function per kernel, so Triton compiles (or loads from its cache) each kernel once
# per process, not once per artifact. Only bytes verified against a manifest get here, and the same bytes
# make the same module; a launcher's ``stats`` then count the calls of every artifact that shares it.
_KERNEL_MODULES: dict[tuple, types.ModuleType] = {}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def artifact_hash(manifest: dict) -> str:
    """Hash of the manifest without its own hash field: covers every file through their SHA-256s."""
    return _sha256(_canonical({k: v for k, v in manifest.items() if k != "artifact_hash"}))[:32]


def _plan_json(plan):
    if plan is None:
        return [], "none"
    if hasattr(plan, "to_json"):
        return plan.to_json(), plan.hash()
    if isinstance(plan, (list, str)):
        from tkcc.passes.plan import PassPlan

        p = PassPlan.from_json(plan)
        return p.to_json(), p.hash()
    raise ArtifactError(f"plan must be a PassPlan or its JSON, got {type(plan).__name__}")


def build_artifact(program, plan, out_dir, target: str = "triton", tier: int | None = None,
                   aot_targets: tuple[str, ...] = ()) -> "Artifact":
    """Lower ``program`` (already rewritten by ``plan``) to an artifact directory at ``out_dir``.

    ``plan`` is recorded, not applied. ``aot_targets`` (e.g. ``("sm_90", "gfx942")``) adds ahead-of-time
    binaries of every generated kernel, specialised to the shapes of the captured graphs.
    """
    import triton

    from tkcc.codegen import aot as aot_mod
    from tkcc.codegen.forward_source import emit_forward
    from tkcc.kernels import rt

    if target not in TARGETS:
        raise ArtifactError(f"target {target!r} is not supported; codegen targets: {', '.join(TARGETS)}")
    for t in aot_targets:
        if t not in aot_mod.AOT_TARGETS:
            raise ArtifactError(f"aot target {t!r} is not known; known: {', '.join(sorted(aot_mod.AOT_TARGETS))}")
    out_dir = Path(out_dir)
    plan_json, plan_hash = _plan_json(plan)
    files: dict[str, bytes] = {"_rt.py": Path(rt.__file__).read_bytes(), "kernels/__init__.py": b""}
    phases: dict[str, dict] = {}
    kernels: dict[str, object] = {}
    constants: dict[str, torch.Tensor] = {}
    calls: list[tuple[str, dict]] = []
    used_targets: set[str] = set()
    runtime: set[str] = set()  # kernel-library modules the forwards import (tkcc.kernels.*, never the compiler)
    for phase, gm in program.graphs.items():
        header = (f"Phase {phase!r} of program {program.fingerprint}, plan {plan_hash}.\n\n"
                  f"Load with tkcc.codegen.Artifact.open(path).load(program_or_model)[{phase!r}].")
        fs = emit_forward(gm, phase, program.model, getattr(program, "state", None), header)
        fname = f"forward_{phase}.py"
        files[fname] = fs.source.encode()
        for k, v in fs.constants.items():
            if k in constants and not torch.equal(constants[k], v):
                raise ArtifactError(f"phase {phase!r}: constant {k!r} differs from another phase's")
            constants[k] = v
        kernels.update(fs.kernels)
        calls += [(phase, c) for c in fs.kernel_calls]
        used_targets |= fs.targets
        runtime |= set(fs.runtime) | ({"tkcc.kernels.ops"} if fs.op_calls else set())
        phases[phase] = {"module": fname, "inputs": fs.inputs, "bindings": fs.bindings,
                         "kernels": sorted(fs.kernels), "ops": fs.op_calls, "targets": sorted(fs.targets),
                         "runtime": sorted(fs.runtime)}
    for name, k in sorted(kernels.items()):
        files[f"kernels/{name}.py"] = k.source.encode()
    if constants:
        tmp = tempfile.NamedTemporaryFile(suffix=".pt", delete=False)
        tmp.close()
        try:
            torch.save(constants, tmp.name)
            files["constants.pt"] = Path(tmp.name).read_bytes()
        finally:
            os.unlink(tmp.name)

    aot_entries = []
    if aot_targets and calls:
        requests, seen = [], set()
        for phase, c in calls:
            k = kernels[c["kernel"]]
            cfg = k.launcher.launch_config([tuple(s) for s in c["shapes"]], c["dtypes"])
            cfg_hash = _sha256(_canonical(cfg))[:8]
            for t in aot_targets:
                key = (k.name, cfg_hash, t)
                if key in seen:
                    continue
                seen.add(key)
                requests.append({"source": k.source, "kernel_name": f"{k.name}_kernel", "signature": cfg["signature"],
                                 "target": t, "num_warps": cfg["num_warps"], "exact": cfg["exact"]})
                ext = aot_mod.AOT_TARGETS[t][3]
                aot_entries.append({"kernel": k.name, "phase": phase, "node": c["node"], "target": t,
                                    "file": f"aot/{k.name}-{cfg_hash}.{t}.{ext}", "signature": cfg["signature"],
                                    "num_warps": cfg["num_warps"]})
        binaries = aot_mod.compile_many(requests)
        for entry, blob in zip(aot_entries, binaries):
            files[entry["file"]] = blob

    targets = sorted(used_targets)
    manifest = {
        "format": FORMAT,
        "target": (targets[0] if len(targets) == 1 else "mixed") if targets else target,
        "targets": targets,
        "runtime": sorted(runtime),
        "tier": tier,
        "plan": plan_json,
        "plan_hash": plan_hash,
        "fingerprint": program.fingerprint,
        "model_class": type(program.model).__name__,
        "phases": phases,
        "kernels": {n: {"file": f"kernels/{n}.py", "exact": k.spec["exact"],
                        "uses": [{"phase": ph, "node": c["node"], "origin": c["origin"]} for ph, c in calls
                                 if c["kernel"] == n]}
                    for n, k in sorted(kernels.items())},
        "aot": aot_entries,
        "versions": {"tkcc": __version__, "torch": torch.__version__, "triton": triton.__version__},
        "files": {rel: _sha256(data) for rel, data in sorted(files.items())},
    }
    manifest["artifact_hash"] = artifact_hash(manifest)
    files[MANIFEST] = json.dumps(manifest, indent=2, sort_keys=True).encode()
    _write_atomically(out_dir, files)
    art = Artifact.open(out_dir)
    art.kernel_calls = [{**c, "phase": phase} for phase, c in calls]  # this build's, not part of the artifact
    return art


def _write_atomically(out_dir: Path, files: dict[str, bytes]) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for rel, data in files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "a")
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class Artifact:
    """A verified artifact directory. ``open`` checks every hash; ``load`` binds it to a resident model."""

    def __init__(self, path: Path, manifest: dict, blobs: dict[str, bytes]):
        self.path, self.manifest, self._blobs = path, manifest, blobs
        self.kernel_calls: list[dict] = []  # set by build_artifact: each generated kernel's call, with its shapes

    def launch_generated(self) -> int:
        """Launch every generated kernel once at the shapes its call had in the captured graph, on meta tensors
        (nothing computes; see ``tkcc.kernels.discovery``, whose ``deferring`` block turns the launches into
        the list of compiles they need). Returns how many launches were made."""
        launchers = self.launchers() if self.kernel_calls else {}
        n = 0
        for c in self.kernel_calls:
            strides = c.get("strides") or [None] * len(c["shapes"])
            args = [torch.empty_strided(sh, st, dtype=getattr(torch, dt.split(".")[-1]), device="meta")
                    if st is not None else torch.empty(sh, dtype=getattr(torch, dt.split(".")[-1]), device="meta")
                    for sh, dt, st in zip(c["shapes"], c["dtypes"], strides)]
            launchers[c["kernel"]].launch(args)
            n += 1
        return n

    # ---- opening and verification ------------------------------------------------------
    @classmethod
    def open(cls, path) -> "Artifact":
        path = Path(path)
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise ArtifactError(f"{path}: not an artifact (no {MANIFEST})")
        try:
            manifest = json.loads(mpath.read_bytes())
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{mpath}: manifest is not valid JSON: {e}") from None
        for key in ("format", "files", "artifact_hash", "phases", "fingerprint"):
            if key not in manifest:
                raise ArtifactError(f"{mpath}: manifest has no field {key!r}")
        if manifest["format"] != FORMAT:
            raise ArtifactError(f"{mpath}: format {manifest['format']} is not {FORMAT}; rebuild the artifact")
        blobs = {}
        for rel, digest in manifest["files"].items():
            p = path / rel
            if not p.is_file():
                raise ArtifactError(f"{p}: listed in the manifest but missing")
            data = p.read_bytes()
            if _sha256(data) != digest:
                raise ArtifactError(f"{p}: SHA-256 does not match the manifest (file changed after the build)")
            blobs[rel] = data
        extra = sorted(str(p.relative_to(path)) for p in path.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts and str(p.relative_to(path)) != MANIFEST
                       and str(p.relative_to(path)) not in manifest["files"])
        if extra:
            raise ArtifactError(f"{path}: files not in the manifest: {', '.join(extra)}")
        if artifact_hash(manifest) != manifest["artifact_hash"]:
            raise ArtifactError(f"{mpath}: artifact_hash does not match the manifest's contents (manifest edited)")
        return cls(path, manifest, blobs)

    @property
    def hash(self) -> str:
        return self.manifest["artifact_hash"]

    @property
    def phases(self) -> list[str]:
        return list(self.manifest["phases"])

    def source(self, phase: str) -> str:
        return self._blobs[self.manifest["phases"][phase]["module"]].decode()

    def __repr__(self):
        return f"Artifact({str(self.path)!r}, hash={self.hash}, phases={self.phases})"

    # ---- loading -------------------------------------------------------------------------
    def load(self, program_or_model, state=None) -> dict:
        """``{phase: forward}``, bound to the resident model (and state) by qualified name.

        Accepts a Program (its model, state and fingerprint are used) or an nn.Module. Raises
        ArtifactError if the artifact was built for another model.
        """
        if hasattr(program_or_model, "graphs") and hasattr(program_or_model, "fingerprint"):
            prog = program_or_model
            if prog.fingerprint != self.manifest["fingerprint"]:
                raise ArtifactError(f"{self.path}: built for program fingerprint {self.manifest['fingerprint']}, "
                                    f"this program has {prog.fingerprint} (another model, dtype or device)")
            model, state = prog.model, state if state is not None else getattr(prog, "state", None)
        elif isinstance(program_or_model, torch.nn.Module):
            model = program_or_model
        else:
            raise ArtifactError(f"load() takes a Program or an nn.Module, got {type(program_or_model).__name__}")
        self._check_targets(model, program_or_model)
        want = self.manifest.get("model_class")
        if want and type(model).__name__ != want:
            raise ArtifactError(f"{self.path}: built for a {want}, got a {type(model).__name__}")
        for phase, meta in self.manifest["phases"].items():
            self._check_bindings(phase, meta, model, state)
        pkg = self._import()
        constants = {}
        if "constants.pt" in self._blobs:
            import io

            constants = torch.load(io.BytesIO(self._blobs["constants.pt"]), weights_only=True)
        out = {}
        for phase, meta in self.manifest["phases"].items():
            mod = sys.modules[f"{pkg.__name__}.{meta['module'][:-3]}"]
            out[phase] = mod.bind(model, state, constants)
        return out

    def launchers(self) -> dict:
        """Kernel name -> launcher of the loaded artifact (``.stats`` counts kernel vs reference runs)."""
        pkg = self._import()
        return {name: sys.modules[f"{pkg.__name__}.kernels.{name}"].launch for name in self.manifest["kernels"]}

    @property
    def targets(self) -> list[str]:
        """Kernel targets the forwards run (older manifests: their single ``target``)."""
        t = self.manifest.get("targets")
        if t is None:
            t = [self.manifest.get("target", "triton")]
        return list(t)

    def _check_targets(self, model, program_or_model) -> None:
        """ArtifactError when the model's device cannot run one of the artifact's kernel targets."""
        from tkcc.kernels.targets import OP_TARGETS, check_target

        p = next(iter(model.parameters()), None)
        dev = p.device.type if p is not None else torch.device(
            (getattr(program_or_model, "meta", None) or {}).get("device", "cpu")).type
        for t in self.targets:
            if t not in OP_TARGETS:
                raise ArtifactError(f"{self.path / MANIFEST}: unknown kernel target {t!r} (targets {self.targets}); "
                                    f"this tkcc loads {list(OP_TARGETS)}")
            if t == "triton":
                continue  # Triton kernels take their PyTorch reference off the kernel devices
            try:
                check_target(t, dev)
            except TkccError as e:
                raise ArtifactError(f"{self.path}: the artifact runs {t!r} kernels, which cannot run on this "
                                    f"model's device {dev!r}: {e}") from None

    def _check_bindings(self, phase, meta, model, state) -> None:
        roots = {"model": model, "state": state}
        for b in meta["bindings"]:
            if b["root"] == "constants":
                continue
            where = f"{self.path / meta['module']}: {b['root']}.{b['name']}"
            root = roots[b["root"]]
            if root is None:
                raise ArtifactError(f"{where}: the artifact needs a {b['root']} module, none was given")
            obj = root
            try:
                for part in b["name"].split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                raise ArtifactError(f"{where}: not found (artifact built for another model)") from None
            if not isinstance(obj, torch.Tensor):
                raise ArtifactError(f"{where}: is a {type(obj).__name__}, expected a tensor")
            if list(obj.shape) != b["shape"] or str(obj.dtype) != b["dtype"] or obj.device.type != b["device"]:
                raise ArtifactError(f"{where}: is {list(obj.shape)} {obj.dtype} on {obj.device.type}, the artifact "
                                    f"was built for {b['shape']} {b['dtype']} on {b['device']} (another model)")

    def _import(self) -> types.ModuleType:
        """Execute the verified bytes as package ``tkcc_artifact_<hash>`` (no .pyc written)."""
        pkg_name = f"tkcc_artifact_{self.hash[:16]}"
        pkg = sys.modules.get(pkg_name)
        if pkg is not None and getattr(pkg, "__tkcc_path__", None) == str(self.path):
            return pkg
        pkg = _new_module(pkg_name, self.path / "__init__.py", package=True, path=self.path)
        pkg.__tkcc_path__ = str(self.path)
        made = [pkg_name]
        try:
            self._exec(pkg_name + "._rt", "_rt.py")
            kpkg = _new_module(pkg_name + ".kernels", self.path / "kernels" / "__init__.py", package=True,
                               path=self.path / "kernels")
            pkg.kernels = kpkg
            made.append(kpkg.__name__)
            rt_digest = self.manifest["files"]["_rt.py"]
            for rel in sorted(self._blobs):
                if rel.startswith("kernels/") and rel.endswith(".py") and rel != "kernels/__init__.py":
                    fullname = f"{pkg_name}.kernels.{rel[8:-3]}"
                    key = (rel, self.manifest["files"][rel], rt_digest, os.environ.get("TRITON_INTERPRET", ""))
                    shared = _KERNEL_MODULES.get(key)
                    if shared is None:
                        shared = _KERNEL_MODULES[key] = self._exec(fullname, rel)
                    else:  # the same verified bytes were executed before: share the module and its JIT cache
                        sys.modules[fullname] = shared
                        setattr(kpkg, rel[8:-3], shared)
                    made.append(fullname)
            for meta in self.manifest["phases"].values():
                made.append(self._exec(f"{pkg_name}.{meta['module'][:-3]}", meta["module"]).__name__)
        except ArtifactError:
            for m in made:
                sys.modules.pop(m, None)
            raise
        except Exception as exc:
            for m in made:
                sys.modules.pop(m, None)
            raise ArtifactError(f"{self.path}: generated code failed to import: {type(exc).__name__}: {exc}") from exc
        return pkg

    def _exec(self, fullname: str, rel: str) -> types.ModuleType:
        mod = _new_module(fullname, self.path / rel)
        code = compile(self._blobs[rel], str(self.path / rel), "exec")
        exec(code, mod.__dict__)  # noqa: S102 - verified generated code is the point
        parent, _, child = fullname.rpartition(".")
        setattr(sys.modules[parent], child, mod)
        return mod


def _new_module(name: str, file: Path, package: bool = False, path: Path | None = None) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = str(file)
    if package:
        mod.__path__ = [str(path)]
        mod.__package__ = name
    else:
        mod.__package__ = name.rpartition(".")[0]
    sys.modules[name] = mod
    return mod
