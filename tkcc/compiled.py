"""What ``tkcc.compile`` returns and ``tkcc.load`` rebuilds: the shipped forward, callable like the model.

A ``CompiledModel`` serves one of two things, whichever the loop measured
fastest on the workload: an artifact (generated forwards and their kernels,
``tkcc.codegen.artifact``), or the model's own eager forward. Either way:

- ``compiled(input_ids, ...)`` returns what the model returns (an HF
  ``CausalLMOutput...`` for an HF causal LM, built from the compiled prefill's
  logits); any call the compiled prefill does not take (padding, a cache of
  the caller's, embeddings instead of ids, labels) runs the model's own
  forward, so it is a drop-in replacement that is never wrong;
- ``generate`` and ``stream`` run the one greedy loop
  (``tkcc.frontend.generate``) over the shipped forwards; on a GPU the decode
  step replays from a CUDA graph (``tkcc.kernels.graph_replay.GraphCache``, the
  one capture utility), as the engine measured it. A model compiled for ``batch`` B > 1
  (``tkcc.frontend.slots``) decodes up to B prompts together through its
  ``decode_slots`` step (``tkcc.frontend.slot_batch``), one prompt included;
- ``save(path)`` writes ``tkcc.json`` (what was compiled, for which model,
  device and library versions, and the report) beside the artifact;
  ``tkcc.load(path, model)`` checks all of it and rebuilds the forwards
  without capturing graphs or running any search.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import torch

from tkcc.errors import ArtifactError, TkccError

SAVE_FORMAT = 1
SAVE_FILE = "tkcc.json"


def versions() -> dict:
    """The library versions a saved artifact is bound to (generated code and kernels depend on them)."""
    from tkcc.version import __version__

    out = {"tkcc": __version__, "torch": torch.__version__}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - not installed: recorded as absent
            out[mod] = None
    return out


def device_name(device) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


@dataclasses.dataclass
class CompileReport:
    """What ``compiled.report()`` shows: what serves and why, the side-by-side numbers, and what they ran on."""

    model: str
    plan: list
    plan_hash: str
    mode: str
    logs: list
    golden: object | None
    speed: dict | None
    artifact: str | None
    timings: dict
    program: dict
    checks: dict = dataclasses.field(default_factory=dict)
    loop: dict | None = None  # the campaign: budget, candidates, noise, ship decisions, side-by-side objectives

    def to_json(self) -> dict:
        from tkcc.passes.log import PassLog

        return {
            "model": self.model, "mode": self.mode, "plan": self.plan, "plan_hash": self.plan_hash,
            "passes": [log.summary() if isinstance(log, PassLog) else log for log in self.logs],
            "golden": self.golden.to_json() if hasattr(self.golden, "to_json") else self.golden,
            "speed": self.speed, "artifact": self.artifact, "timings_s": self.timings, "program": self.program,
            "checks": self.checks, "loop": self.loop,
        }

    def text(self) -> str:
        from tkcc.passes.log import PassLog, format_logs

        lines = [f"tkcc compile: {self.model} ({self.program.get('dtype')} on {self.program.get('device')}), "
                 f"mode={self.mode}, plan {self.plan_hash}",
                 "plan: " + (" -> ".join(s["name"] for s in self.plan) or "(empty)")]
        if self.logs and all(isinstance(lg, PassLog) for lg in self.logs):
            lines.append("passes:")
            lines += ["  " + ln for ln in format_logs(self.logs).splitlines()]
        if self.loop:
            lines += _loop_lines(self.loop)
        if self.golden is not None and hasattr(self.golden, "summary"):
            lines.append(self.golden.summary())
        elif isinstance(self.golden, dict):
            g = self.golden
            pol = g.get("policy") or {}
            lines.append(f"validation (the engine's, on fresh inputs at {len(g.get('shapes') or [])} shapes): "
                         f"{'PASS' if g.get('ok') else 'FAIL'} in {g.get('mode') or pol.get('mode')} mode"
                         + (f", bound {pol['bound']:.3g} of the output's scale" if pol.get("bound") else ""))
        vs = (self.checks or {}).get("vs_model_eager")
        if vs and not hasattr(self.golden, "summary"):
            lines.append(f"  vs the model's own eager forward: max abs err {vs.get('max_abs_err', 0):.3g}, "
                         f"greedy-token agreement {100 * (vs.get('token_agreement') or 0):.0f}%")
        if self.speed and self.speed.get("buckets"):
            lines += speed_lines(self.speed)
        if self.artifact:
            lines.append(f"artifact: {self.artifact}")
        lines.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()))
        return "\n".join(lines)


def _loop_lines(loop: dict) -> list[str]:
    out = [f"search: {loop.get('experiments', 0)} experiments in {loop.get('seconds', 0):.0f} s of a "
           f"{loop.get('budget_s', 0):g} s budget ({loop.get('note', '')})".rstrip(" ()")]
    side = loop.get("side_by_side") or {}
    if side:
        out.append(f"objective ({loop.get('objective_name', 'objective')}, slow tier, one run, on "
                   f"{loop.get('device', '?')}):")
        ref = side.get("eager")
        for k, v in side.items():
            if v is None:
                out.append(f"  {k:<16} failed or not measured")
                continue
            ratio = f"  x{v / ref:.2f} vs eager" if ref and k != "eager" else ""
            out.append(f"  {k:<16} {v:10.4g}{ratio}")
    if loop.get("serving"):
        out.append(f"serving: {loop['serving']} ({loop.get('why', '')})")
    return out


def speed_lines(s: dict) -> list[str]:
    """The speed section of a compile report: each ratio with its interval, and what it was measured on."""
    from tkcc.traffic.ratios import Ratio

    def ratio_text(d: dict | None, value: float) -> str:
        if not d:
            return f"x{value:.2f}"
        lo = d["low"] if d.get("low") is not None else -math.inf
        hi = d["high"] if d.get("high") is not None else math.inf
        return Ratio(value, lo, hi, d.get("confidence", 0.95), d.get("source", "")).text()

    m = s["measured_on"]
    lines = ["speed vs eager (" + m.get("baseline", "") + "):"]
    for r in s["buckets"]:
        if "skipped" in r:
            lines.append(f"  {r['bucket']:<28} skipped: {r['skipped']}")
        elif r.get("speedup"):
            lines.append(f"  {r['bucket']:<28} weight {r['weight']:.3f}  eager {r['eager_s'] * 1e3:8.3f} ms  "
                         f"compiled {r['compiled_s'] * 1e3:8.3f} ms  {ratio_text(r.get('interval'), r['speedup'])}"
                         f"  (n={r.get('samples')})")
    geo = s.get("weighted_geomean_speedup")
    timed = [r for r in s["buckets"] if r.get("speedup")]
    if geo:
        cover = m.get("weight_measured")
        cover = (" covering " + " and ".join(f"{v:.0%} of the {ph} weight" for ph, v in cover.items())
                 if isinstance(cover, dict) and cover else "")
        lines.append(f"  weighted geomean speedup {ratio_text(s.get('interval'), geo)} over {len(timed)} "
                     f"bucket{'s' if len(timed) != 1 else ''}{cover}")
        if s.get("within_noise"):
            n, secs = m.get("total_samples"), m.get("measure_s")
            spent = f" ({n} samples per side in {secs:.1f} s)" if n and secs is not None else ""
            lines.append(f"  within noise: the timing noise of this machine over these samples{spent} is larger "
                         "than any difference between the compiled forward and eager")
    clipped = m.get("clipped_fraction")
    if clipped:
        lines.append(f"  {clipped:.0%} of the trace's requests are longer than the {m.get('max_context')} tokens "
                     "measured here; they are timed at that length")
    lines.append("  measured on: " + ", ".join(f"{k}={m[k]}" for k in ("device", "dtype", "torch", "triton",
                                                                        "samples_per_bucket") if k in m)
                 + f"; {m.get('samples', '')}; {m.get('timing')}")
    return lines


def load_settings(program, mode: str | None = None) -> dict:
    """What ``tkcc.load`` needs to rebuild the Program a saved model serves (and the mode it was compiled in)."""
    out = {"kind": program.meta.get("kind"), "max_cache_len": program.meta.get("max_cache_len"),
           "batch": program.meta.get("batch"), "exact": program.meta.get("exact", True)}
    if mode is not None:
        out["mode"] = mode
    return out


class CompiledModel:
    """A compiled model: call it like the model; ``generate``/``stream`` for LMs; ``report()``; ``save()``."""

    def __init__(self, program, forwards: dict, report: CompileReport, artifact=None, *, serves: str = "artifact",
                 compiled_program=None, settings: dict | None = None, output_type=None):
        self.program = program  # as captured (its eager module, state and weights are what the forwards bind)
        self.compiled_program = compiled_program
        self.artifact = artifact
        self.serves = serves  # "artifact" | "eager" | "graphs" (the rewritten FX graphs, no codegen)
        self.settings = dict(settings or {})
        if program.meta.get("slots"):
            self.settings.setdefault("slots", int(program.meta["slots"]))
        self._report = report
        self._output_type = output_type
        self.forwards = _graphed(program, forwards)
        _settle_heap()

    def _moved(self, old: Path, new: Path) -> None:
        """The compile's work directory was renamed into place: point at the same verified bytes there."""
        if self.artifact is not None:
            from tkcc.codegen.artifact import Artifact

            rel = Path(self.artifact.path).relative_to(old)
            self.artifact = Artifact.open(new / rel)
        if self._report.artifact and self._report.artifact.startswith(str(old)):
            self._report.artifact = str(new / Path(self._report.artifact).relative_to(old))
        loop = self._report.loop
        if loop and str(loop.get("store", "")).startswith(str(old)):
            loop["store"] = str(new / Path(loop["store"]).relative_to(old))

    # ---- what it is -------------------------------------------------------------------------------------
    @property
    def plan(self):
        from tkcc.passes.plan import PassPlan

        return PassPlan.from_json(self._report.plan)

    @property
    def logs(self) -> list:
        return self._report.logs

    def report(self, print_report: bool = True) -> CompileReport:
        if print_report:
            print(self._report.text())
        return self._report

    # ---- calling it -------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if not _is_lm(self.program):
            with torch.no_grad():
                return self.forwards[self.program.phases[0]](*args, **kwargs)
        ids, why = _prefill_call(args, kwargs)
        if ids is not None and ids.shape[0] != int(self.program.meta.get("batch", ids.shape[0])):
            ids = None  # another batch than the prefill was captured for
        if ids is None:  # a call the compiled prefill does not take: the model's own forward, unchanged
            return self.program.model(*args, **kwargs)
        with torch.no_grad():
            self.program.reset_state()
            try:
                pos = torch.arange(ids.shape[1], device=ids.device)
                logits = self.forwards["prefill"](ids, pos)
            finally:
                self.program.reset_state()
        return self._wrap(logits, kwargs)

    def _wrap(self, logits, kwargs):
        out_type = self._output_type
        if out_type is None:
            return logits
        if kwargs.get("return_dict", getattr(self.program.model.config, "return_dict", True)) is False:
            return (logits,)
        return out_type(logits=logits)

    def generate(self, prompt_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy decoding with the shipped forwards: the ``new_tokens`` tokens after ``prompt_ids`` ([B, n])."""
        if not _is_lm(self.program):
            raise TkccError("generate() is for causal LMs (a Program with prefill and decode phases)")
        if self.program.meta.get("slots"):
            return torch.stack(list(self._slot_steps(prompt_ids, new_tokens)), dim=1)
        from tkcc.frontend import greedy

        with torch.no_grad():
            return greedy(self.program, prompt_ids, new_tokens, forwards=self.forwards)

    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int):
        """Greedy decoding one token at a time: yields each new token as a [B] tensor (the serving path).

        Stopping the iteration (a stop sequence, a cancelled request) stops the decoding there."""
        if not _is_lm(self.program):
            raise TkccError("stream() is for causal LMs (a Program with prefill and decode phases)")
        if self.program.meta.get("slots"):
            yield from self._slot_steps(prompt_ids, max_new_tokens)
            return
        from tkcc.frontend import greedy_steps

        with torch.no_grad():
            for tok, _ in greedy_steps(self.program, prompt_ids, max_new_tokens, forwards=self.forwards):
                yield tok

    def _slot_steps(self, prompt_ids: torch.Tensor, new_tokens: int):
        from tkcc.frontend.slot_batch import generate_slots

        yield from generate_slots(self.program, self.forwards, prompt_ids, new_tokens)

    # ---- saving -----------------------------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write what serves to ``path`` (a new or empty directory): ``tkcc.json`` and the artifact."""
        from tkcc.atomic import replace_dir

        path = Path(path)
        if path.exists() and any(path.iterdir()) and not (path / SAVE_FILE).is_file():
            raise TkccError(f"{path}: exists and is not a saved tkcc model; save into a new or empty directory")
        if self.serves == "graphs":
            raise TkccError("this compiled model runs rewritten FX graphs (compiled with codegen=False); "
                            "only an artifact or the eager forward can be saved")
        meta = {"format": SAVE_FORMAT, "serves": self.serves, "settings": self.settings,
                "fingerprint": self.program.fingerprint, "model_class": type(self.program.model).__name__,
                "device": str(self.program.meta.get("device")), "device_name": device_name(
                    self.program.meta.get("device", "cpu")), "dtype": self.program.meta.get("dtype"),
                "versions": versions(), "plan": self._report.plan,
                "artifact_hash": self.artifact.hash if self.artifact is not None else None,
                "report": _jsonable(self._report.to_json())}
        path.parent.mkdir(parents=True, exist_ok=True)
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            if self.artifact is not None:
                shutil.copytree(self.artifact.path, tmp / "artifact")
            (tmp / SAVE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
            replace_dir(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return path


def _settle_heap() -> None:
    """Collect once, then freeze what is alive: a compile leaves millions of long-lived Python objects (graphs,
    the engine's records) that the cyclic collector would otherwise re-scan in the middle of decode loops,
    stalling the host long enough to drain the GPU's queue (the serving frameworks do the same at start-up).
    What an earlier call froze is unfrozen first: a forward swapped out of a server since (or a compiled model
    the caller dropped) is freed here, with its caches, instead of staying frozen for the process's life.
    The device memory the compile's engine cached and no longer uses goes back to the device, so another
    process (a server loading the saved artifact) can have it."""
    import gc

    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def _is_lm(program) -> bool:
    return set(program.meta.get("phases") or program.graphs) >= {"prefill", "decode"} and \
        program.meta.get("kind") == "causal_lm"


_PREFILL_KWARGS = {"input_ids", "attention_mask", "use_cache", "return_dict", "output_attentions",
                   "output_hidden_states", "past_key_values", "logits_to_keep"}


def _prefill_call(args, kwargs) -> tuple[torch.Tensor | None, str]:
    """The input ids when the compiled prefill computes this call exactly as the model would, else (None, why)."""
    if len(args) > 1:
        return None, "positional arguments beyond input_ids"
    extra = set(kwargs) - _PREFILL_KWARGS
    if extra:
        return None, f"arguments {sorted(extra)}"
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
        return None, "no [batch, tokens] input_ids"
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return None, "an attention_mask with padding"
    if kwargs.get("past_key_values") is not None:
        return None, "a cache of the caller's"
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return None, "attentions or hidden states asked for"
    if kwargs.get("logits_to_keep") not in (None, 0):
        return None, "logits_to_keep"
    return ids.long(), ""


def _graphed(program, forwards: dict) -> dict:
    """On a GPU, the decode step replays from a CUDA graph, as the engine measured it."""
    out = dict(forwards)
    dev = str(program.meta.get("device", "cpu"))
    if not dev.startswith("cuda"):
        return out
    from tkcc.kernels.graph_replay import GraphCache

    for phase in ("decode", "decode_slots"):  # the slots step of a model compiled for a batch (frontend.slots)
        if phase in out:
            out[phase] = GraphCache(out[phase], name=phase, capture_after=1)
    return out


# ---- loading ------------------------------------------------------------------------------------------------

def load(path, model, *, device=None) -> CompiledModel:
    """Rebuild a saved compiled model on ``model`` (the same model: checked), without capturing or searching."""
    path = Path(path)
    meta = _read_meta(path)
    if not isinstance(model, torch.nn.Module):
        raise TkccError(f"tkcc.load: model must be a torch.nn.Module, got {type(model).__module__}."
                        f"{type(model).__qualname__}")
    if device is not None:
        model = model.to(device)
    _check_versions(path, meta)
    program = _program_for(model, meta, path)
    _check_device(path, meta, program)
    artifact = None
    if meta["serves"] == "artifact":
        from tkcc.codegen.artifact import Artifact

        art_dir = path / "artifact"
        if not art_dir.is_dir():
            raise ArtifactError(f"{path}: {SAVE_FILE} says it serves an artifact, but {art_dir} is missing "
                                "(a truncated copy?)")
        artifact = Artifact.open(art_dir)  # every file checked against the manifest
        if artifact.hash != meta.get("artifact_hash"):
            raise ArtifactError(f"{art_dir}: artifact hash {artifact.hash} is not the {meta.get('artifact_hash')} "
                                f"{SAVE_FILE} recorded (the artifact was replaced)")
        forwards = artifact.load(program)
    elif meta["serves"] == "eager":
        forwards = {p: program.eager for p in program.meta["phases"]}
    else:
        raise ArtifactError(f"{path / SAVE_FILE}: serves {meta['serves']!r}, which this tkcc cannot load")
    rep = meta.get("report") or {}
    report = CompileReport(model=str(rep.get("model") or type(model).__name__), plan=meta.get("plan") or [],
                           plan_hash=str(rep.get("plan_hash", "")), mode=str(rep.get("mode", "")),
                           logs=rep.get("passes") or [], golden=rep.get("golden"), speed=rep.get("speed"),
                           artifact=str(artifact.path) if artifact is not None else None,
                           timings=rep.get("timings_s") or {}, program=rep.get("program") or {},
                           checks=rep.get("checks") or {}, loop=rep.get("loop"))
    return CompiledModel(program, forwards, report, artifact, serves=meta["serves"], settings=meta["settings"],
                         output_type=output_type_of(program))


def _read_meta(path: Path) -> dict:
    f = path / SAVE_FILE
    if not path.is_dir():
        raise ArtifactError(f"tkcc.load: {path} is not a directory (save with compiled.save(path))")
    if not f.is_file():
        raise ArtifactError(f"tkcc.load: {path} has no {SAVE_FILE}: not a saved tkcc model (or a truncated copy)")
    try:
        meta = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{f}: not valid JSON ({e}); the file is truncated or was edited") from None
    missing = [k for k in ("format", "serves", "settings", "fingerprint", "device", "versions") if k not in meta]
    if missing:
        raise ArtifactError(f"{f}: missing fields {missing}")
    if meta["format"] != SAVE_FORMAT:
        raise ArtifactError(f"{f}: format {meta['format']} is not {SAVE_FORMAT}; save it again with this tkcc")
    return meta


def _check_versions(path: Path, meta: dict) -> None:
    have, want = versions(), meta["versions"]
    diff = [f"{k} {want.get(k)} (this process has {have.get(k)})" for k in ("tkcc", "torch", "triton", "transformers")
            if want.get(k) != have.get(k)]
    if diff:
        raise ArtifactError(f"{path}: saved with other library versions: {'; '.join(diff)}. Generated kernels and "
                            "captured graphs depend on them: compile again here, or load where they match")


def _program_for(model, meta: dict, path: Path):
    """The Program the artifact binds to: packed weights, KV cache, eager step; no graphs are exported."""
    settings = meta["settings"]
    from tkcc.frontend.hf import is_hf_causal_lm, prepare_hf

    if settings.get("kind") != "causal_lm":
        raise ArtifactError(f"{path}: saved for a {settings.get('kind')!r} model; tkcc.load takes causal LMs")
    if not is_hf_causal_lm(model):
        raise ArtifactError(f"{path}: saved for a {meta.get('model_class')}, got a {type(model).__name__}, "
                            "which is not a Hugging Face causal LM")
    if type(model).__name__ != meta.get("model_class"):
        raise ArtifactError(f"{path}: saved for a {meta.get('model_class')}, got a {type(model).__name__}")
    if settings.get("slots"):
        from tkcc.frontend.slots import prepare_slots

        program = prepare_slots(model, int(settings["slots"]), max_cache_len=settings["max_cache_len"],
                                exact=settings.get("exact", True))
    else:
        program = prepare_hf(model, max_cache_len=settings["max_cache_len"], batch=settings["batch"],
                             exact=settings.get("exact", True))
    if program.fingerprint != meta["fingerprint"]:
        raise ArtifactError(f"{path}: saved for another model (fingerprint {meta['fingerprint']}; this "
                            f"{type(model).__name__} with {program.meta['num_params']} parameters, "
                            f"{program.meta['dtype']} on {program.meta['device']}, is {program.fingerprint}): "
                            "its config, parameter shapes, dtype or device differ")
    return program


def _check_device(path: Path, meta: dict, program) -> None:
    dev = str(program.meta.get("device"))
    have = device_name(dev)
    if torch.device(dev).type != torch.device(meta["device"]).type or have != meta.get("device_name", have):
        raise ArtifactError(f"{path}: compiled for {meta['device']} ({meta.get('device_name')}); this model is on "
                            f"{dev} ({have}). Its kernels were tuned and measured there: compile again here")


def output_type_of(program):
    """The class the model's own forward returns (an HF ModelOutput), from one one-token call; None if not HF."""
    if program.meta.get("kind") != "causal_lm":
        return None
    model = program.model
    with torch.no_grad():
        ids = torch.zeros((1, 1), dtype=torch.long, device=program.meta.get("device", "cpu"))
        out = model(input_ids=ids, use_cache=False)
    return type(out) if hasattr(out, "logits") else None

