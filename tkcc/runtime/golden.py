"""Golden outputs: record a model's eager outputs once, check any candidate against them.

A golden record is what the model itself computes (plain PyTorch, eager,
the Program's ``eager`` module over the static KV cache) on deterministic
prompts drawn from seeds: the prefill logits at every prompt position, the
logits of N greedy decode steps and the greedy tokens. It lives under
``golden/<model>/<device>-<dtype>/`` as ``outputs.pt`` plus ``meta.json``
(versions, seeds, a sha256 of the tensors), a few kilobytes per model.

A check replays the same prompts through the candidate (a Program's graphs,
or the ``forwards`` an artifact loaded) and compares. Decode steps are
teacher-forced with the golden tokens, so one early token flip does not
turn every later comparison into noise; whether the candidate's own greedy
choice agrees is reported separately (token agreement). Verdicts:

- ``exact``: every logit bitwise equal (the default: invariant 2);
- ``tolerance``: every logit within rtol/atol (scale-aware, as the engine's
  validation) *and* identical greedy tokens wherever the reference's choice
  is decisive: its top-2 gap wider than twice the allowed error, so that no
  allowed difference could flip it (a flip at a near tie is reported, not
  held; the engine's ``GreedyReference`` holds the same positions).

``bisect`` finds the first pass of a plan that breaks the verdict by
applying prefixes of the plan (binary search; a plan whose prefix k breaks
exactness is assumed to stay broken for every longer prefix).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tkcc.atomic import replace_dir
from tkcc.errors import GoldenError, TkccError
from tkcc.passes.lint import TOLERANCES, compare

DEFAULT_SEEDS = (0, 1)
DEFAULT_PROMPT_LENS = (8, 5)
DEFAULT_STEPS = 6
FORMAT_VERSION = 1
# a CPU record is exact only against the same reduction order, which a GEMM's thread count changes (one thread
# sums otherwise than several): records and checks run with this many, whatever the process was started with
CPU_THREADS = 2


# ---- where golden data lives -----------------------------------------------------------------

def golden_root(root: str | Path | None = None) -> Path:
    """``root``, else ``$TKCC_GOLDEN_DIR``, else the repository's ``golden/``, else ``./golden``."""
    if root is not None:
        return Path(root)
    env = os.environ.get("TKCC_GOLDEN_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2] / "golden"
    return repo if repo.is_dir() else Path.cwd() / "golden"


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _device_name(device) -> str:
    return torch.device(device).type


def golden_path(model_name: str, dtype="float32", device="cpu", root=None) -> Path:
    return golden_root(root) / model_name / f"{_device_name(device)}-{_dtype_name(dtype)}"


def _parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    d = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise GoldenError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16")
    return d


# ---- running a sequence ------------------------------------------------------------------------

def _reset(program) -> None:
    if hasattr(program, "reset_state"):
        program.reset_state()
    elif getattr(program, "state", None) is not None:
        with torch.no_grad():
            for b in program.state.buffers():
                b.zero_()


def _prompts(vocab: int, seeds, lens, batch: int, device) -> list[torch.Tensor]:
    out = []
    for seed, n in zip(seeds, lens):
        g = torch.Generator().manual_seed(int(seed))
        out.append(torch.randint(0, vocab, (batch, int(n)), generator=g).to(device))
    return out


@torch.no_grad()
def run_sequence(program, forwards: dict, prompt: torch.Tensor, steps: int, force: torch.Tensor | None = None):
    """Prefill ``prompt`` then ``steps`` decode steps; returns (prefill logits, decode logits, own greedy tokens).

    ``force`` ([B, steps+1] tokens) teacher-forces the decode inputs; the
    returned tokens are always the candidate's own argmax choices. The loop is
    the one greedy loop (``tkcc.frontend.generate.greedy_steps``).
    """
    from tkcc.frontend.generate import greedy_steps

    pre, dec, toks = [], [], []
    try:
        for i, (tok, last) in enumerate(greedy_steps(program, prompt, steps + 1, forwards, force=force,
                                                     on_prompt=lambda lg: pre.append(lg.detach().clone()))):
            toks.append(tok[:, None])
            if i:
                dec.append(last.detach().clone())
    finally:
        _reset(program)
    return torch.cat(pre, dim=1), torch.stack(dec) if dec else torch.empty(0), torch.cat(toks, dim=1)


def _is_lm(program) -> bool:
    return set(program.graphs) >= {"prefill", "decode"}


def _graph_forwards(program) -> dict:
    return dict(program.graphs)


def _eager_forwards(program) -> dict:
    eager = getattr(program, "eager", None)
    if eager is None:
        raise GoldenError("this Program has no eager reference module (Program.eager); "
                          "capture it with tkcc.frontend.capture")
    return {ph: eager for ph in program.graphs}


# ---- record ------------------------------------------------------------------------------------

def _capture(model_name: str, dtype, device):
    from tkcc.frontend import capture_model

    return capture_model(model_name, dtype=_parse_dtype(dtype), device=device)


@contextlib.contextmanager
def _pinned_threads(device):
    """Run a CPU record or check with ``CPU_THREADS`` intra-op threads (see there); other devices as they are."""
    if torch.device(device).type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        yield CPU_THREADS
    finally:
        torch.set_num_threads(before)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(model_name: str, dtype="float32", device="cpu", steps: int = DEFAULT_STEPS, *, root=None,
           seeds=DEFAULT_SEEDS, prompt_lens=DEFAULT_PROMPT_LENS, program=None, reference: str = "graph") -> Path:
    """Record the outputs of a built-in model; returns the golden directory (written atomically).

    ``reference="graph"`` (default) records the captured, unmodified graphs
    run op by op in eager PyTorch: what every candidate is derived from, so a
    pass or a kernel is judged on its own. ``reference="eager"`` records the
    model's own forward (``Program.eager``). Either way ``meta.json`` says how
    far the captured graph is from the model's own forward
    (``capture_vs_eager``), so a capture that is not bit-exact is visible.
    """
    if reference not in ("graph", "eager"):
        raise GoldenError(f"reference must be 'graph' or 'eager', got {reference!r}")
    if steps < 1:
        raise GoldenError(f"steps={steps}: record at least one decode step")
    if len(seeds) != len(prompt_lens):
        raise GoldenError(f"{len(seeds)} seeds but {len(prompt_lens)} prompt lengths")
    program = program if program is not None else _capture(model_name, dtype, device)
    if not _is_lm(program):
        raise GoldenError(f"{model_name}: golden records are for causal LMs (phases prefill+decode), "
                          f"this Program has {program.phases}")
    vocab = int(program.meta.get("vocab_size") or program.model.config.vocab_size)
    batch = int(program.meta.get("batch", 1))
    with _pinned_threads(program.meta.get("device", device)) as threads:
        data, cve = _record_runs(program, model_name, reference, vocab, seeds, prompt_lens, batch, device, steps)
    dest = golden_path(model_name, dtype, device, root)
    meta = dict(
        model=model_name, dtype=_dtype_name(dtype), device=_device_name(device), steps=steps,
        seeds=list(seeds), prompt_lens=list(prompt_lens), batch=batch, vocab_size=vocab,
        max_cache_len=program.meta.get("max_cache_len"),
        fingerprint=program.fingerprint,
        reference=("captured graphs, unmodified, run op by op" if reference == "graph"
                   else "eager (Program.eager over the static KV cache)"),
        capture_vs_eager=dict(exact=cve.exact, max_abs_err=cve.max_abs_err, max_rel_err=cve.max_rel_err,
                              first_diff=cve.first_diff, token_agreement=cve.token_agreement),
        torch_version=torch.__version__, transformers_version=_version("transformers"),
        format_version=FORMAT_VERSION,
    )
    if threads is not None:
        meta["cpu_threads"] = threads
    if _unchanged(dest, meta, data):
        return dest  # the record already holds exactly these outputs: leave the (tracked) files alone
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o755)
    try:
        torch.save(data, tmp / "outputs.pt")
        meta.update(recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), sha256=_digest(tmp / "outputs.pt"))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _record_runs(program, model_name, reference, vocab, seeds, prompt_lens, batch, device, steps):
    """The recorded outputs, and how far the other reference (eager or the graphs) is from them."""
    forwards = _eager_forwards(program) if reference == "eager" else _graph_forwards(program)
    prompts = _prompts(vocab, seeds, prompt_lens, batch, device)
    data = {"version": FORMAT_VERSION, "prompts": [], "prefill_logits": [], "decode_logits": [], "tokens": []}
    runs = []
    for p in prompts:
        pre, dec, toks = run_sequence(program, forwards, p, steps)
        runs.append((pre.cpu(), dec.cpu(), toks.cpu()))
        data["prompts"].append(p.cpu())
        data["prefill_logits"].append(pre.cpu())
        data["decode_logits"].append(dec.cpu())
        data["tokens"].append(toks.cpu())
    other = _graph_forwards(program) if reference == "eager" else _eager_forwards(program)
    other_runs = [tuple(x.cpu() for x in run_sequence(program, other, p, steps, force=r[2]))
                  for p, r in zip(prompts, runs)]
    return data, _compare_lm(model_name, "exact", None, None, reference, runs, other_runs)


def _unchanged(dest: Path, meta: dict, data: dict) -> bool:
    """Does the record at ``dest`` already hold ``data`` with the same metadata (its time aside)?"""
    try:
        old = json.loads((dest / "meta.json").read_text())
        # capture_vs_eager is a diagnostic of the model's own eager forward (it varies with the thread count),
        # not part of what the record holds
        skip = ("recorded_at", "sha256", "capture_vs_eager")
        if {k: v for k, v in old.items() if k not in skip} != {k: v for k, v in json.loads(json.dumps(meta)).items()
                                                               if k not in skip}:
            return False
        if old.get("sha256") != _digest(dest / "outputs.pt"):
            return False
        prev = torch.load(dest / "outputs.pt", weights_only=True)
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError):
        return False
    if set(prev) != set(data):
        return False
    for k, v in data.items():
        if isinstance(v, list):
            if len(v) != len(prev[k]) or not all(torch.equal(a, b) for a, b in zip(v, prev[k])):
                return False
        elif v != prev[k]:
            return False
    return True


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:
        return None


@dataclass
class Golden:
    path: Path
    meta: dict
    data: dict


def load(model_name: str | None = None, dtype="float32", device="cpu", *, root=None, path=None) -> Golden:
    """Read a golden record, verifying its hash."""
    d = Path(path) if path is not None else golden_path(model_name, dtype, device, root)
    meta_f, out_f = d / "meta.json", d / "outputs.pt"
    if not meta_f.exists() or not out_f.exists():
        raise GoldenError(f"no golden record at {d} (expected meta.json and outputs.pt); "
                          f"record one with: tkcc golden record --model {model_name or '<name>'} "
                          f"--device {_device_name(device)} --dtype {_dtype_name(dtype)}")
    try:
        meta = json.loads(meta_f.read_text())
    except json.JSONDecodeError as e:
        raise GoldenError(f"{meta_f}: not valid JSON: {e}") from e
    if meta.get("sha256") and meta["sha256"] != _digest(out_f):
        raise GoldenError(f"{out_f}: sha256 does not match meta.json (file changed or truncated); record again")
    try:
        data = torch.load(out_f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise GoldenError(f"{out_f}: cannot be read: {e}") from e
    return Golden(d, meta, data)


# ---- check -------------------------------------------------------------------------------------

@dataclass
class GoldenReport:
    """Outcome of comparing a candidate with golden (or eager) outputs."""

    model: str
    mode: str
    ok: bool
    exact: bool
    reference: str  # path of the golden record, or "eager (fresh inputs, seeds ...)"
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    first_diff: str | None = None  # "prompt 0, decode step 3, index (0, 17): 0.1 vs 0.2"
    token_agreement: float = 1.0
    first_token_mismatch: str | None = None
    compared: int = 0  # number of logit tensors compared
    rtol: float | None = None
    atol: float | None = None
    notes: list[str] = field(default_factory=list)
    # when asked and not bit-exact: candidate vs captured graphs, captured graphs vs eager (JSON reports)
    diagnosis: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("max_abs_err", "max_rel_err"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d

    def summary(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        kind = "bit-exact" if self.exact else f"max abs err {self.max_abs_err:.3g}, max rel err {self.max_rel_err:.3g}"
        lines = [f"golden {verdict} ({self.mode} mode) for {self.model}: {kind}; "
                 f"greedy-token agreement {self.token_agreement:.0%} over {self.compared} outputs",
                 f"  reference: {self.reference}"]
        if self.first_diff:
            lines.append(f"  first difference: {self.first_diff}")
        if self.first_token_mismatch:
            lines.append(f"  first token mismatch: {self.first_token_mismatch}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _program_name(program) -> str:
    return str(program.meta.get("name") or getattr(program.model, "tkcc_name", None) or "model")


def _compare_lm(name, mode, rtol, atol, reference_label, ref_runs, got_runs, notes=()) -> GoldenReport:
    exact_req = mode == "exact"
    rep = GoldenReport(model=name, mode=mode, ok=True, exact=True, reference=reference_label, rtol=rtol, atol=atol,
                       notes=list(notes))
    agree = total = ties = held_flips = 0
    for i, ((rpre, rdec, rtok), (gpre, gdec, gtok)) in enumerate(zip(ref_runs, got_runs)):
        parts = [("prefill", rpre, gpre)] + [(f"decode step {s}", rdec[s], gdec[s]) for s in range(rdec.shape[0])]
        for label, r, g in parts:
            rep.compared += 1
            c = compare(r, g.to(r.device), exact=exact_req, rtol=rtol, atol=atol)
            rep.max_abs_err = max(rep.max_abs_err, c.max_abs_err)
            rep.max_rel_err = max(rep.max_rel_err, c.max_rel_err)
            if not c.exact:
                rep.exact = False
                if rep.first_diff is None:
                    where = c.first_diff.split(" ", 1)[1] if c.first_diff and " " in c.first_diff else c.first_diff
                    rep.first_diff = f"prompt {i}, {label}, {where}"
            if not c.ok:
                rep.ok = False
        n = min(rtok.shape[1], gtok.shape[1])
        same = (rtok[:, :n] == gtok[:, :n].to(rtok.device))
        agree += int(same.sum())
        total += same.numel()
        if not exact_req:  # a flip where the reference's own top-2 gap is within the allowed error is no fault
            judged = _decisive_tokens(rpre, rdec, rtol, n).to(same.device)
            flips = ~same & judged
            ties += int((~same & ~judged).sum())
        else:
            flips = ~same
        held_flips += int(flips.sum())
        if rep.first_token_mismatch is None and bool(flips.any()):
            j = int(flips.nonzero()[0][1])
            rep.first_token_mismatch = (f"prompt {i}, token {j}: golden {int(rtok[0, j])}, "
                                        f"candidate {int(gtok[0, j])}")
    rep.token_agreement = agree / total if total else 1.0
    if held_flips:
        rep.ok = False
    if ties:
        rep.notes.append(f"{ties} greedy token(s) differ where the reference's top-2 gap is within 2 x the bound "
                         f"x the logits' scale (a near tie an allowed rounding difference may flip; not held)")
    return rep


def _decisive_tokens(pre: torch.Tensor, dec: torch.Tensor, bound: float | None, n: int) -> torch.Tensor:
    """[B, n] bool: the greedy choices no allowed difference can flip (``decisive``, as the engine's tolerance
    validation holds them); ``bound`` None or 0 holds every choice."""
    logits = chosen_logits(pre, dec).double()
    if not bound:
        return torch.ones(logits.shape[1], n, dtype=torch.bool)
    return decisive(logits, float(bound))[0][:, :n].cpu()


def check(name_or_program, forwards: dict | None = None, mode: str = "exact", rtol: float | None = None,
          atol: float | None = None, *, dtype="float32", device="cpu", root=None, golden: Golden | None = None
          ) -> GoldenReport:
    """Compare a candidate with the recorded golden outputs.

    ``name_or_program``: a built-in model name (captured here; the candidate
    is its graphs) or a Program. ``forwards``: phase -> callable replacing
    the Program's graphs (e.g. ``artifact.load(program)``).
    """
    if mode not in ("exact", "tolerance"):
        raise GoldenError(f"mode must be 'exact' or 'tolerance', got {mode!r}")
    if isinstance(name_or_program, str):
        program = _capture(name_or_program, dtype, device)
        name = name_or_program
    else:
        program = name_or_program
        name = _program_name(program)
        dtype = program.meta.get("dtype", dtype)
        device = program.meta.get("device", device)
    if not _is_lm(program):
        raise GoldenError(f"{name}: golden records are for causal LMs; use check_against_eager for {program.phases}")
    golden = golden if golden is not None else load(name.split("[")[0], dtype, device, root=root)
    if rtol is None and atol is None and mode == "tolerance":
        rtol, atol = TOLERANCES.get(_parse_dtype(dtype), (1e-4, 1e-5))
    forwards = forwards if forwards is not None else _graph_forwards(program)
    d = golden.data
    ref_runs, got_runs = [], []
    dev = torch.device(program.meta.get("device", "cpu"))
    with _pinned_threads(dev) as threads:
        for p, pre, dec, toks in zip(d["prompts"], d["prefill_logits"], d["decode_logits"], d["tokens"]):
            got = run_sequence(program, forwards, p.to(dev), dec.shape[0], force=toks)
            ref_runs.append((pre, dec, toks))
            got_runs.append(tuple(x.cpu() for x in got))
    notes = []
    if golden.meta.get("cpu_threads") not in (None, threads):
        notes.append(f"golden recorded with {golden.meta['cpu_threads']} CPU threads, checked with {threads} "
                     "(the reduction order differs: bits may too)")
    if golden.meta.get("torch_version") and golden.meta["torch_version"] != torch.__version__:
        notes.append(f"golden recorded with torch {golden.meta['torch_version']}, checking with {torch.__version__}")
    if golden.meta.get("max_cache_len") not in (None, program.meta.get("max_cache_len")):
        notes.append(f"golden recorded with max_cache_len={golden.meta['max_cache_len']}, this Program has "
                     f"{program.meta.get('max_cache_len')} (attention shapes differ: bits may too)")
    if golden.meta.get("fingerprint") and golden.meta["fingerprint"] != program.fingerprint:
        notes.append("model fingerprint differs from the recorded one (different weights, settings or truncation)")
    return _compare_lm(name, mode, rtol, atol, str(golden.path), ref_runs, got_runs, notes)


def check_against_eager(program, forwards: dict | None = None, mode: str = "exact", rtol=None, atol=None, *,
                        seeds=(1234, 5678), steps: int = 4, prompt_lens=(7, 3), reference: dict | None = None,
                        reference_label: str | None = None, diagnose: bool = False) -> GoldenReport:
    """Compare a candidate with the Program's own eager module on fresh inputs (no recorded data needed).

    ``reference``: phase -> callable to compare with instead of the eager
    module. ``diagnose``: if the candidate is not bit-exact, also run the
    captured graphs on the same inputs and report candidate-vs-captured and
    captured-vs-eager, which tells a capture difference from a compiler one.
    """
    if mode not in ("exact", "tolerance"):
        raise GoldenError(f"mode must be 'exact' or 'tolerance', got {mode!r}")
    name = _program_name(program)
    forwards = forwards if forwards is not None else _graph_forwards(program)
    eager = reference if reference is not None else _eager_forwards(program)
    dtype = _parse_dtype(program.meta.get("dtype", "float32"))
    if rtol is None and atol is None and mode == "tolerance":
        rtol, atol = TOLERANCES.get(dtype, (1e-4, 1e-5))
    label = f"{reference_label or 'eager'} on fresh inputs (seeds {list(seeds)})"
    if _is_lm(program):
        vocab = int(program.meta.get("vocab_size") or program.model.config.vocab_size)
        dev = torch.device(program.meta.get("device", "cpu"))
        ref_runs, got_runs = [], []
        prompts = _prompts(vocab, seeds, prompt_lens, int(program.meta.get("batch", 1)), dev)
        for p in prompts:
            ref = run_sequence(program, eager, p, steps)
            got = run_sequence(program, forwards, p, steps, force=ref[2])
            ref_runs.append(tuple(x.cpu() for x in ref))
            got_runs.append(tuple(x.cpu() for x in got))
        rep = _compare_lm(name, mode, rtol, atol, label, ref_runs, got_runs)
        if diagnose and not rep.exact:
            cap_runs = [tuple(x.cpu() for x in run_sequence(program, _graph_forwards(program), p, steps, force=r[2]))
                        for p, r in zip(prompts, ref_runs)]
            vs_cap = _compare_lm(name, mode, rtol, atol, "captured graphs", cap_runs, got_runs)
            cap = _compare_lm(name, mode, rtol, atol, label, ref_runs, cap_runs)
            rep.diagnosis = {"compiled_vs_captured": vs_cap.to_json(), "captured_vs_eager": cap.to_json()}

            def say(r):
                return "bit-exact" if r.exact else f"max abs err {r.max_abs_err:.3g}"

            rep.notes.append(f"candidate vs captured graphs: {say(vs_cap)}; captured graphs vs eager: {say(cap)}"
                             + ("  => the difference comes from capture (frontend), not from passes or codegen"
                                if vs_cap.exact and not cap.exact else ""))
        return rep
    # plain modules: every phase on fresh inputs from Program.inputs
    from tkcc.passes.lint import run_graph

    rep = GoldenReport(model=name, mode=mode, ok=True, exact=True, reference=label, rtol=rtol, atol=atol)
    for seed in seeds:
        for ph in program.phases:
            inputs = program.inputs(ph, None, torch.Generator().manual_seed(int(seed)))
            ref = run_graph(eager[ph], inputs, program)
            got = run_graph(forwards[ph], inputs, program)
            c = compare(ref, got, exact=(mode == "exact"), rtol=rtol, atol=atol)
            rep.compared += 1
            rep.max_abs_err = max(rep.max_abs_err, c.max_abs_err)
            rep.max_rel_err = max(rep.max_rel_err, c.max_rel_err)
            if not c.exact:
                rep.exact = False
                rep.first_diff = rep.first_diff or f"seed {seed}, phase {ph}, {c.first_diff}"
            if not c.ok:
                rep.ok = False
    return rep


# ---- greedy agreement with a reference that is not bitwise reproducible -------------------------

@dataclass
class GreedyReference:
    """The reference's greedy sequences on the golden prompts, run several times, and where they are judged.

    Position j of prompt i is judged only if every run of the reference chose the same token there and its
    top-2 logit gap is wider than twice the allowed error (``bound`` x the logits' scale): elsewhere the
    reference could flip by itself, so a candidate that flips is not wrong.
    """

    prompts: list          # [B, P] token tensors (CPU)
    tokens: list           # [B, steps+1] tokens of run 1 (teacher-forcing input for every other run)
    judged: list           # [B, steps+1] bool: positions a candidate is held to
    runs: int
    steps: int
    bound: float
    self_disagreement_abs: float  # largest logit difference between the reference's own runs here

    def summary(self) -> dict:
        total = sum(int(j.numel()) for j in self.judged)
        held = sum(int(j.sum()) for j in self.judged)
        return {"prompts": len(self.prompts), "steps": self.steps, "runs": self.runs, "positions": total,
                "judged": held, "self_disagreement_abs": self.self_disagreement_abs}


def chosen_logits(pre: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
    """[steps+1, B, V]: the logits that chose token j (prefill's last position, then each decode step)."""
    first = pre[:, -1].unsqueeze(0)
    return torch.cat([first, dec], dim=0) if dec.numel() else first


def decisive(logits: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clear, gap, scale), each [B, n], for chosen logits [n, B, V]: a choice is clear where its top-2 gap
    is wider than twice the allowed error (``bound`` x the logits' scale, their largest magnitude), so no
    allowed difference can flip it."""
    top = logits.topk(2, dim=-1).values
    gap = (top[..., 0] - top[..., 1]).transpose(0, 1)
    scale = logits.abs().amax(dim=-1).clamp_min(1e-30).transpose(0, 1)
    return gap > 2 * bound * scale, gap, scale


def reference_greedy(program, reference: dict, bound: float, runs: int = 3, steps: int = DEFAULT_STEPS,
                     seeds=DEFAULT_SEEDS, prompt_lens=DEFAULT_PROMPT_LENS) -> GreedyReference:
    """Run the reference ``runs`` times on the golden prompts (teacher-forced with run 1's tokens)."""
    if runs < 2:
        raise GoldenError(f"runs={runs}: the reference must run at least twice to see where it agrees with itself")
    vocab = int(program.meta.get("vocab_size") or program.model.config.vocab_size)
    dev = torch.device(program.meta.get("device", "cpu"))
    cap = int(program.meta.get("max_cache_len") or 0)
    if cap:
        steps = max(1, min(steps, cap - max(prompt_lens)))
    prompts = _prompts(vocab, seeds, prompt_lens, int(program.meta.get("batch", 1) or 1), dev)
    toks_all, judged_all, worst = [], [], 0.0
    for p in prompts:
        pre, dec, toks = run_sequence(program, reference, p, steps)
        logits = chosen_logits(pre, dec).double()
        same = torch.ones_like(toks, dtype=torch.bool)
        for _ in range(runs - 1):
            pre2, dec2, toks2 = run_sequence(program, reference, p, steps, force=toks)
            same &= toks2 == toks
            other = chosen_logits(pre2, dec2).double()
            worst = max(worst, float((other - logits).abs().max()))
        judged = same & decisive(logits, bound)[0]
        toks_all.append(toks.cpu())
        judged_all.append(judged.cpu())
    _reset(program)
    return GreedyReference([p.cpu() for p in prompts], toks_all, judged_all, runs, steps, bound, worst)


def greedy_agreement(program, candidate: dict, ref: GreedyReference) -> dict:
    """The candidate's greedy choices on the golden prompts, teacher-forced with the reference's tokens, must
    equal the reference's at every judged position. Returns a record with ``ok`` and, if not, ``reason``."""
    dev = torch.device(program.meta.get("device", "cpu"))
    held = agreed = 0
    reason = None
    for i, (p, toks, judged) in enumerate(zip(ref.prompts, ref.tokens, ref.judged)):
        _, _, got = run_sequence(program, candidate, p.to(dev), ref.steps, force=toks)
        got = got.cpu()
        ok = (got == toks) | ~judged
        held += int(judged.sum())
        agreed += int((judged & (got == toks)).sum())
        if reason is None and not bool(ok.all()):
            b, j = (int(x) for x in (~ok).nonzero()[0])
            reason = (f"greedy tokens differ from the reference's on golden prompt {i} at token {j}: "
                      f"{int(got[b, j])} vs {int(toks[b, j])} (a position where the reference agrees with itself "
                      f"over {ref.runs} runs and its top-2 gap is beyond the allowed error)")
    _reset(program)
    return {"ok": reason is None, "reason": reason, "prompts": len(ref.prompts), "tokens": held, "agreed": agreed,
            "skipped": sum(int(j.numel()) for j in ref.judged) - held}


# ---- bisect ------------------------------------------------------------------------------------

@dataclass
class BisectResult:
    """The first plan step whose prefix fails the check (None: the whole plan passes)."""

    step: int | None
    pass_name: str | None
    params: dict | None
    report: GoldenReport | None  # the check of the first failing prefix
    checks: int = 0  # how many prefixes were checked

    def to_json(self) -> dict:
        return {"step": self.step, "pass": self.pass_name, "params": self.params, "checks": self.checks,
                "report": self.report.to_json() if self.report else None}

    def summary(self) -> str:
        if self.step is None:
            return f"bisect: every prefix of the plan passes ({self.checks} checks)"
        return (f"bisect: plan step {self.step + 1} ({self.pass_name} {self.params}) is the first that breaks the check "
                f"({self.checks} checks)\n" + (self.report.summary() if self.report else ""))


def bisect(program, plan, golden=None, mode: str = "exact", rtol=None, atol=None, **check_kwargs) -> BisectResult:
    """First pass of ``plan`` whose application makes ``program`` fail the golden check.

    ``golden``: a :class:`Golden`, a path to a golden directory, ``"eager"``
    (compare with the Program's eager module on fresh inputs), or None (the
    recorded golden for the program's model). Prefixes are applied with the
    PassManager's own numerics check off, so the golden check is the judge.
    """
    from tkcc.passes.manager import PassManager, resolve_plan
    from tkcc.passes.plan import PassPlan
    from tkcc.pipeline import pass_context

    plan = plan if isinstance(plan, PassPlan) else PassPlan.from_json(plan)
    resolve_plan(plan)
    if isinstance(golden, (str, Path)) and str(golden) != "eager":
        golden = load(path=golden)

    def judge(k: int) -> GoldenReport:
        prefix = PassPlan(plan.steps[:k])
        prog, _ = PassManager(check_numerics=False, context=pass_context()).run(program, prefix)
        if golden == "eager":
            return check_against_eager(prog, mode=mode, rtol=rtol, atol=atol, **check_kwargs)
        return check(prog, mode=mode, rtol=rtol, atol=atol, golden=golden, **check_kwargs)

    checks = 1
    full = judge(len(plan))
    if full.ok:
        return BisectResult(None, None, None, None, checks)
    base = judge(0)
    checks += 1
    if not base.ok:
        raise GoldenError(f"the program fails the check before any pass is applied: {base.first_diff}; "
                          "bisect needs a passing starting point")
    lo, hi, bad = 0, len(plan), full  # prefix lo passes, prefix hi fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        rep = judge(mid)
        checks += 1
        if rep.ok:
            lo = mid
        else:
            hi, bad = mid, rep
    step = plan.steps[hi - 1]
    return BisectResult(hi - 1, step.name, dict(step.params), bad, checks)


__all__ = ["record", "check", "check_against_eager", "bisect", "load", "golden_path", "GoldenReport",
           "BisectResult", "run_sequence", "reference_greedy", "greedy_agreement", "GreedyReference", "TkccError"]
