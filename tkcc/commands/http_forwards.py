"""What the server serves, built through the front door: models, ``tkcc.compile``, ``tkcc.load``.

This module belongs to the API layer (beside ``tkcc serve --http``, which
uses it): it calls ``tkcc.compile`` and ``tkcc.load``; ``tkcc.serve`` only
receives what it builds (``Server(..., builder=...)``).

``--model`` is a built-in model (``tkcc.frontend.models``: seeded random
weights, served with the byte tokenizer) or a local Hugging Face model
directory (``config.json``, weights and tokenizer files; loaded with
``local_files_only``).
"""
from __future__ import annotations

import os

from tkcc.errors import TkccError


def load_model(name: str, dtype, device: str):
    """(nn.Module, served name, tokenizer directory or None) for a built-in name or a local HF directory."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise TkccError(f"--model {name}: a model directory needs a config.json (Hugging Face layout)")
        try:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True, dtype=dtype)
        except (OSError, ValueError) as e:
            raise TkccError(f"--model {name}: could not load it as a causal LM: {e}") from None
        model = model.to(device).eval()
        model.requires_grad_(False)
        return model, os.path.basename(os.path.normpath(name)), name
    if ":" in name and name.rsplit(":", 1)[0].endswith(".py"):
        raise TkccError(f"--model {name}: the HTTP server needs a model (a built-in name or an HF directory), not a "
                        "Program factory")
    from tkcc.frontend.models import build_model, get_spec

    get_spec(name)  # unknown names fail here, listing the built-in ones
    return build_model(name, dtype=dtype, device=device), name, None


def load_artifact(path: str, model, batch: int | None = None):
    """``tkcc.load(path, model)``: a saved artifact as a CompiledModel (the one place the server loads one).

    ``batch``: the sequences the server serves together; an artifact compiled for another batch is refused."""
    import tkcc

    if not os.path.isdir(path):
        raise TkccError(f"--artifact {path}: no such directory")
    compiled = tkcc.load(path, model)
    have = int(compiled.program.meta.get("slots") or 1)
    if batch is not None and have != batch:
        raise TkccError(f"--artifact {path}: compiled for batch {have}, but the server serves batch {batch}; "
                        f"serve it with --batch {have}, or compile it with tkcc.compile(..., batch={batch})")
    return compiled


class ForwardBuilder:
    """Builds forwards of one model for the server: the first one, and each candidate shipped into it."""

    def __init__(self, model, *, max_cache_len: int | None = None, mode: str = "exact", pass_modules=(),
                 batch: int = 1):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise TkccError(f"--batch {batch!r}: the sequences served together must be a positive integer")
        self.model, self.max_cache_len, self.mode, self.batch = model, max_cache_len, mode, batch
        self.pass_modules = list(pass_modules)

    def capture(self):
        """A new Program of the model (weights shared, its own KV cache; ``batch`` > 1: that many slots)."""
        from tkcc.compiler import capture

        return capture(self.model, max_cache_len=self.max_cache_len, batch=self.batch)

    def can_build_on(self, program) -> bool:
        """A Program a plan can be built on: one of this model that holds captured graphs (a loaded artifact's
        holds none: it never captured, so the first plan shipped into a server started from one captures)."""
        return program is not None and program.model is self.model and bool(program.graphs)

    def needs_program(self, spec: dict) -> bool:
        return "artifact" not in spec

    def first(self, plan=None, artifact: str | None = None, check: bool = False):
        """The forward the server starts with: ``artifact`` loaded, else ``plan`` (default plan) compiled."""
        if artifact is not None:
            compiled = load_artifact(artifact, self.model, self.batch)
            return compiled, _artifact_tag(compiled, artifact)
        return self._compile(plan, self.capture(), check=check)

    def check(self, spec) -> None:
        """A candidate's spec, checked before any work: a bad one is refused at once (it pauses nothing)."""
        if not isinstance(spec, dict):
            raise TkccError(f"a candidate to ship is a JSON object, got {type(spec).__name__}")
        unknown = set(spec) - {"plan", "baseline", "artifact", "pass_modules"}
        if unknown or not ({"plan", "baseline", "artifact"} & set(spec)):
            raise TkccError(f"cannot ship {json_keys(spec)}: a candidate is {{\"plan\": [...]}}, "
                            "{\"baseline\": true} or {\"artifact\": DIR}"
                            + (" (agent source candidates are served once saved as artifacts)"
                               if "source" in spec else ""))
        if "artifact" in spec:
            if not os.path.isdir(str(spec["artifact"])):
                raise TkccError(f"cannot ship artifact {spec['artifact']}: no such directory")
        elif not spec.get("baseline"):
            from tkcc.passes.plan import PassPlan

            PassPlan.from_json(spec["plan"])  # a PlanError (a TkccError) names the bad step
        pms = spec.get("pass_modules") or []
        if not isinstance(pms, list) or not all(isinstance(pm, str) for pm in pms):
            raise TkccError(f"cannot ship: pass_modules must be a list of module names, got {pms!r}")

    def build(self, spec: dict, program):
        """A candidate as the engine names it -> (CompiledModel, tag). Plans are compiled and golden-checked."""
        self.check(spec)
        if "artifact" in spec:
            compiled = load_artifact(str(spec["artifact"]), self.model, self.batch)
            return compiled, _artifact_tag(compiled, spec["artifact"])
        from tkcc.serve.swap import plan_of

        plan = plan_of(spec)
        for pm in spec.get("pass_modules") or ():
            if pm not in self.pass_modules:
                self.pass_modules.append(pm)
        return self._compile(plan, program, check=True)

    def _compile(self, plan, program, check: bool):
        import tkcc

        kw = {"plan": plan} if plan is not None else {}
        compiled = tkcc.compile(self.model, "azure-conv", measure=False, check=check, mode=self.mode,
                                program=program, pass_modules=tuple(self.pass_modules), **kw)
        if check and compiled.report(print_report=False).golden is not None:
            g = compiled.report(print_report=False).golden
            if not getattr(g, "ok", True):
                raise TkccError(f"plan {compiled.plan.hash()} failed its golden check: {g.summary()}")
        from tkcc.serve.server import forward_tag

        return compiled, forward_tag(compiled)


def _artifact_tag(compiled, path) -> str:
    from tkcc.serve.server import forward_tag

    return f"{forward_tag(compiled)}@{os.path.basename(os.path.normpath(str(path)))}"


def json_keys(spec) -> str:
    return "{" + ", ".join(sorted(map(str, spec))) + "}"
