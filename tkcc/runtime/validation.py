"""Validation of a candidate forward against the engine's own reference, before any measurement counts.

The reference is the baseline (captured, un-rewritten) forward of the same
tier, run by the engine on fresh inputs drawn *after* the candidate was
loaded, so a candidate cannot have seen them. For each chosen bucket:

1. draw inputs (this may fill the KV cache with random context), snapshot the
   mutable state (``Program.state``: the KV cache);
2. restore the state, run the reference; keep its outputs and the state it
   leaves behind;
3. twice: restore the state, poison (previous outputs filled with NaN, and a
   NaN-filled block freed so the allocator hands poisoned memory to the next
   ``empty``), run the candidate on a private copy of the inputs; then check
   the inputs are unchanged, no NaN/Inf where the reference is finite, no
   all-zero output where the reference is not, outputs (and the state left
   behind) equal to the reference (``torch.equal`` in exact mode, dtype
   tolerances plus identical greedy tokens in tolerance mode);
4. the two candidate runs must agree with each other.

The first failure ends validation with a reason naming the bucket, the
output and the error.
"""
from __future__ import annotations

import time

import torch
import torch.utils._pytree as pytree

# (atol, rtol) per dtype for tolerance mode; a model/plan may declare its own.
from tkcc.passes.lint import TOLERANCES  # noqa: E402,F401 - re-exported: one table for passes, golden, engine


WEIGHTS_CHANGED = "the candidate modified the model's weights"


class ValidationFailure(Exception):
    """A check failed: ``str(e)`` is the reason recorded for the candidate."""


def tensors_of(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def clone_all(xs):
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in xs)


class StateGuard:
    """Snapshot of a Program's mutable buffers (the KV cache), restorable before each run."""

    def __init__(self, state: torch.nn.Module | None):
        self.buffers = list(state.buffers()) if state is not None else []
        self.saved = [b.detach().clone() for b in self.buffers]

    def restore(self) -> None:
        with torch.no_grad():
            for b, s in zip(self.buffers, self.saved):
                b.copy_(s)

    def current(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self.buffers]


def weights_checksum(model: torch.nn.Module) -> list[int]:
    """Exact integer checksums of every parameter's bits (two sums each; any single change shows).

    Sums stay on the device and come back in one transfer, so the check costs
    one read of the weights (milliseconds on a GPU), not a sync per tensor.
    """
    sums = []
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            size = flat.element_size()
            wide = torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8
            sums.append(flat.view(torch.uint8).sum(dtype=torch.int64))
            sums.append(flat.view(wide).sum(dtype=torch.int64))
    return torch.stack(sums).tolist() if sums else []


def poison(prev: list[torch.Tensor], device: torch.device, nbytes: int) -> None:
    """Fill previous outputs with NaN and hand the allocator a freed NaN-filled block of ``nbytes``."""
    with torch.no_grad():
        for t in prev:
            if t.is_floating_point():
                t.fill_(float("nan"))
            else:
                t.fill_(-1)
        if nbytes > 0:
            blk = torch.empty(nbytes // 4 + 1, dtype=torch.float32, device=device)
            blk.fill_(float("nan"))
            del blk


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(ref: list[torch.Tensor], out: list[torch.Tensor], exact: bool, atol: float, rtol: float,
            what: str) -> float:
    """Raise ValidationFailure on the first mismatch; return the largest absolute error seen."""
    if len(ref) != len(out):
        raise ValidationFailure(f"{what}: {len(out)} output tensors, the reference has {len(ref)}")
    worst = 0.0
    for i, (r, o) in enumerate(zip(ref, out)):
        name = f"{what} output {i}"
        if tuple(r.shape) != tuple(o.shape) or r.dtype != o.dtype:
            raise ValidationFailure(f"{name}: shape/dtype {tuple(o.shape)}/{o.dtype}, reference "
                                    f"{tuple(r.shape)}/{r.dtype}")
        if o.device != r.device:
            raise ValidationFailure(f"{name}: on {o.device}, reference on {r.device}")
        if o.is_floating_point():
            bad = ~torch.isfinite(o) & torch.isfinite(r)
            if bool(bad.any()):
                n = int(bad.sum())
                raise ValidationFailure(f"{name}: {n} NaN/Inf value(s) where the reference is finite")
            if o.numel() and bool((o == 0).all()) and not bool((r == 0).all()):
                raise ValidationFailure(f"{name}: all zeros (the reference is not)")
        if exact:
            if not torch.equal(r, o) and not _equal_nan(r, o):
                diff = _max_abs(r, o)
                raise ValidationFailure(f"{name}: not bit-exact (max abs error {diff:.3g}) in exact mode")
        else:
            if o.is_floating_point():
                if not torch.allclose(o.float(), r.float(), atol=atol, rtol=rtol, equal_nan=True):
                    diff = _max_abs(r, o)
                    raise ValidationFailure(f"{name}: max abs error {diff:.3g} exceeds atol={atol:g}, rtol={rtol:g}")
            elif not torch.equal(r, o):
                raise ValidationFailure(f"{name}: integer output differs")
        worst = max(worst, _max_abs(r, o))
    return worst


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_floating_point() and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    d = d[torch.isfinite(d)]
    return float(d.max()) if d.numel() else 0.0


def greedy_tokens(outs: list[torch.Tensor]) -> torch.Tensor | None:
    """Next-token choice at the last position of the first float output of rank >= 2 (logits), if any."""
    for t in outs:
        if t.is_floating_point() and t.dim() >= 2:
            return t[..., -1, :].argmax(-1) if t.dim() >= 3 else t.argmax(-1)
    return None


def run_candidate(fn, inputs: tuple, guard: StateGuard, prev: list[torch.Tensor], device: torch.device,
                  poison_bytes: int, what: str) -> list[torch.Tensor]:
    """One poisoned, state-restored run on a private copy of ``inputs``; checks the inputs come back unchanged."""
    guard.restore()
    poison(prev, device, poison_bytes)
    mine = clone_all(inputs)
    with torch.no_grad():
        out = fn(*mine)
    _sync(device)
    outs = tensors_of(out)
    for j, (a, b) in enumerate(zip(inputs, mine)):
        if isinstance(a, torch.Tensor) and not (torch.equal(a, b) or _equal_nan(a, b)):
            raise ValidationFailure(f"{what}: input {j} was modified by the forward")
    return outs


def validate(program, reference: dict, candidate: dict, buckets: list, exact: bool, atol: float, rtol: float,
             seed: int, weights: tuple | None = None) -> dict:
    """Check ``candidate`` ({phase: callable}) against ``reference`` on ``buckets``; see the module docstring.

    ``weights``: (whole model, its checksum at start): the candidate must leave every weight untouched."""
    device = torch.device(program.meta.get("device", "cpu"))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    shapes, greedy = [], None
    try:
        for b in buckets:
            what = f"bucket {b.key()}"
            if b.phase not in candidate:
                raise ValidationFailure(f"{what}: the candidate has no forward for phase {b.phase!r}")
            inputs = program.inputs(b.phase, b if b.shapes or b.phase in ("prefill", "decode") else None, gen)
            guard = StateGuard(program.state)
            with torch.no_grad():
                ref = [t.clone() for t in tensors_of(reference[b.phase](*clone_all(inputs)))]
            _sync(device)
            ref_state = guard.current()
            for i, r in enumerate(ref):
                if r.is_floating_point() and not bool(torch.isfinite(r).all()):
                    raise ValidationFailure(f"{what}: the reference output {i} itself has NaN/Inf; "
                                            "cannot validate on these inputs")
            poison_bytes = sum(r.numel() * r.element_size() for r in ref)
            shape_exact, note = exact, ""
            if exact and device.type == "cuda":
                # Exactness is only asked where the reference itself reproduces its bits under the same
                # poisoned allocations: on a GPU, library kernels (cuBLAS, sdpa) can pick another
                # algorithm for other pointer alignments (seen on an H200: the captured olmoe-16l decode
                # step differs from itself by 0.035 in bf16 at some contexts).
                again = run_candidate(reference[b.phase], inputs, guard, [], device, poison_bytes,
                                      f"{what} reference rerun")
                if not all(torch.equal(x, y) for x, y in zip(ref, again)):
                    shape_exact, note = False, "reference not bitwise reproducible here: checked in tolerance mode"
                guard.restore()
            runs, prev = [], []
            err = 0.0
            exact_b = shape_exact
            for k in range(2):
                outs = run_candidate(candidate[b.phase], inputs, guard, prev, device, poison_bytes,
                                     f"{what} run {k + 1}")
                err = max(err, compare(ref, outs, exact_b, atol, rtol, f"{what} run {k + 1}"))
                compare(ref_state, guard.current(), exact_b, atol, rtol, f"{what} run {k + 1} cache state")
                if not exact_b:
                    g_ref, g_out = greedy_tokens(ref), greedy_tokens(outs)
                    if g_ref is not None and not torch.equal(g_ref, g_out):
                        raise ValidationFailure(f"{what} run {k + 1}: greedy tokens differ "
                                                f"({g_out.flatten().tolist()[:8]} vs reference "
                                                f"{g_ref.flatten().tolist()[:8]})")
                runs.append([o.clone() for o in outs])
                prev = outs
            compare(runs[0], runs[1], exact_b, atol, rtol, f"{what}: run 2 vs run 1")
            guard.restore()
            shapes.append({"bucket": b.key(), "max_abs_err": err, "outputs": len(ref),
                           "mode": "exact" if exact_b else "tolerance", **({"note": note} if note else {})})
        if not exact or any(sh["mode"] == "tolerance" for sh in shapes):
            greedy = check_greedy(program, reference, candidate, gen)
    except ValidationFailure as e:
        reason = str(e)
    else:
        reason = None
    if weights is not None and weights_checksum(weights[0]) != weights[1]:
        reason = WEIGHTS_CHANGED + (f" (and {reason})" if reason else "")
    mode = "exact" if exact and all(sh["mode"] == "exact" for sh in shapes) else "tolerance"
    return {"ok": reason is None, "reason": reason, "mode": mode, "atol": atol,
            "rtol": rtol, "seed": seed, "shapes": shapes, "greedy": greedy, "seconds": time.perf_counter() - t0}


GREEDY_PROMPT, GREEDY_TOKENS = 8, 8


def check_greedy(program, reference: dict, candidate: dict, gen) -> dict | None:
    """Tolerance mode: a short greedy generation must pick the same tokens with both forwards."""
    if not {"prefill", "decode"} <= set(program.phases) or program.state is None:
        return None
    try:
        from tkcc.frontend.generate import greedy
    except ImportError:
        return None
    cap = int(program.meta.get("max_cache_len", 0) or 0)
    n = min(GREEDY_TOKENS, max(1, cap - GREEDY_PROMPT))
    vocab = int(program.meta.get("vocab_size", 2))
    batch = int(program.meta.get("batch", 1) or 1)
    prompt = torch.randint(0, vocab, (batch, GREEDY_PROMPT), generator=gen)
    guard = StateGuard(program.state)
    try:
        want = greedy(program, prompt, n, forwards={p: reference[p] for p in ("prefill", "decode")})
        got = greedy(program, prompt, n, forwards={p: candidate[p] for p in ("prefill", "decode")})
    finally:
        guard.restore()
    if not torch.equal(want, got):
        raise ValidationFailure(f"greedy generation of {n} tokens differs: {got[0].tolist()} vs reference "
                                f"{want[0].tolist()}")
    return {"tokens": n, "prompt": GREEDY_PROMPT}


def pick_buckets(workload, max_shapes: int = 4) -> list:
    """Several of the workload's shapes: per phase the heaviest and the longest-context bucket, then the rest."""
    chosen = []
    by_phase: dict[str, list] = {}
    for b in workload.buckets:
        by_phase.setdefault(b.phase, []).append(b)
    for bs in by_phase.values():
        for b in (max(bs, key=lambda x: x.weight), max(bs, key=lambda x: (x.context, x.batch))):
            if b not in chosen:
                chosen.append(b)
    for b in sorted(workload.buckets, key=lambda x: -x.weight):
        if b not in chosen:
            chosen.append(b)
    return chosen[:max(max_shapes, len(by_phase))]
