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
   tolerances plus identical greedy tokens in tolerance mode; where the
   reference is not bitwise reproducible (``tkcc.runtime.determinism``), a
   bound on the error relative to the output's scale, derived from the
   reference's measured self-disagreement, plus greedy tokens identical where
   the reference agrees with itself);
4. the two candidate runs must agree with each other.

The first failure ends validation with a reason naming the bucket, the
output and the error. In tolerance mode an input where the reference itself
jumps under a one-rounding-step perturbation of its cache is not judged and a
fresh one is drawn (``tkcc.runtime.stability``).
"""
from __future__ import annotations

import time

import torch
import torch.utils._pytree as pytree

# (atol, rtol) per dtype for tolerance mode; a model/plan may declare its own.
from tkcc.passes.lint import TOLERANCES  # noqa: E402,F401 - re-exported: one table for passes, golden, engine
from tkcc.runtime import elementwise
from tkcc.runtime.exact_reference import alternatives, closer_to_exact, decisions_of, describe
from tkcc.runtime.stability import MAX_DRAWS, unstable_error
from tkcc.runtime.workloads import input_bucket


WEIGHTS_CHANGED = "the candidate modified the model's weights"


class ValidationFailure(Exception):
    """A check failed: ``str(e)`` is the reason recorded for the candidate. ``mismatch``: for an exact-mode
    difference, its size ({"abs": max abs error, "norm": the same over the reference's scale})."""

    def __init__(self, msg: str, mismatch: dict | None = None):
        super().__init__(msg)
        self.mismatch = mismatch


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


def weights_checksum(model: torch.nn.Module) -> list[tuple]:
    """Per parameter: (name, storage address, three exact integer sums of its bits). Compare two with
    ``changed_weight``.

    The sums see any single changed value, and the position-weighted one also sees rows swapped (experts
    permuted). The address sees a parameter re-pointed at new storage with the same values: graphs captured
    before still read the old storage, which the allocator hands out again. The sums stay on the device and
    come back in one transfer, so the check costs one read of the weights, not a sync per tensor."""
    names, sums = [], []
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            size = flat.element_size()
            wide = torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8
            rows = flat.view(wide).reshape(p.shape[0] if p.dim() > 1 else 1, -1).sum(1, dtype=torch.int64)
            at = torch.arange(1, rows.numel() + 1, device=rows.device, dtype=torch.int64)
            sums += [flat.view(torch.uint8).sum(dtype=torch.int64), rows.sum(), (rows * at).sum()]
            names.append((name, p.data_ptr()))
    vals = torch.stack(sums).tolist() if sums else []
    return [(n, ptr, *vals[3 * i: 3 * i + 3]) for i, (n, ptr) in enumerate(names)]


def changed_weight(before: list[tuple], after: list[tuple]) -> str | None:
    """None when ``after`` equals ``before`` (both from weights_checksum), else which parameter changed, and how."""
    if [b[0] for b in before] != [a[0] for a in after]:
        return "the set of parameters changed"
    for b, a in zip(before, after):
        if b[1] != a[1]:
            return (f"{b[0]} was re-pointed at other storage (graphs captured before it still read the old "
                    "storage, which is freed)")
        if b[2:] != a[2:]:
            return f"{b[0]} has other values" + (" (rows reordered)" if b[2:4] == a[2:4] else "")
    return None


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
            what: str, scaled=None) -> float:
    """Raise ValidationFailure on the first mismatch; return the largest absolute error seen.

    ``scaled`` (a ``tkcc.runtime.determinism.ScaledTolerance``), in tolerance mode: float outputs are held to
    ``max|out - ref| / scale(ref) <= scaled.bound`` instead of ``allclose(atol, rtol)``."""
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
            n = elementwise.nonfinite_where_finite(r, o)
            if n:
                raise ValidationFailure(f"{name}: {n} NaN/Inf value(s) where the reference is finite")
            if o.numel() and elementwise.all_zero(o) and not elementwise.all_zero(r):
                raise ValidationFailure(f"{name}: all zeros (the reference is not)")
        diff = None  # the max abs error, where a branch below has it already (one pass less over gigabytes)
        if exact:
            if not torch.equal(r, o) and not _equal_nan(r, o):
                diff, _, norm = scaled_error(r, o) if o.is_floating_point() else (_max_abs(r, o), 1.0, float("inf"))
                raise ValidationFailure(f"{name}: not bit-exact (max abs error {diff:.3g}) in exact mode",
                                        {"abs": diff, "norm": norm})
            diff = 0.0  # equal, NaN for NaN: no finite difference
        else:
            if o.is_floating_point() and scaled is not None:
                diff, scale, norm = scaled_error(r, o)
                if norm > scaled.bound:
                    raise ValidationFailure(f"{name}: error {norm:.3g} of the output's scale (max abs error "
                                            f"{diff:.3g}, scale {scale:.3g}) exceeds the tolerance {scaled.bound:.3g}"
                                            f" = {scaled.describe()}", {"abs": diff, "norm": norm})
            elif o.is_floating_point():
                if not elementwise.allclose(o, r, atol, rtol):
                    diff = _max_abs(r, o)
                    raise ValidationFailure(f"{name}: max abs error {diff:.3g} exceeds atol={atol:g}, rtol={rtol:g}")
            elif not torch.equal(r, o):
                raise ValidationFailure(f"{name}: integer output differs")
        worst = max(worst, diff if diff is not None else _max_abs(r, o))
    return worst


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_floating_point() and elementwise.equal_nan(a, b)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return elementwise.max_abs_diff(a, b)


def scaled_error(r: torch.Tensor, o: torch.Tensor) -> tuple[float, float, float]:
    """(max abs error, the reference's scale, error / scale): scale is the largest finite |r| (1 if all zero)."""
    if r.numel() == 0:
        return 0.0, 1.0, 0.0
    diff = _max_abs(r, o)
    scale = elementwise.max_finite_abs(r)
    scale = scale if scale > 0 else 1.0
    return diff, scale, diff / scale


def logits_of(outs: list[torch.Tensor]) -> torch.Tensor | None:
    """The last position's scores of the first float output of rank >= 2 (logits), if any: [..., vocab]."""
    for t in outs:
        if t.is_floating_point() and t.dim() >= 2:
            return t[..., -1, :] if t.dim() >= 3 else t
    return None


def greedy_mismatch(ref: list[torch.Tensor], out: list[torch.Tensor], scaled) -> str:
    """'' if the greedy choice agrees wherever the reference's choice is clear; else where it does not.

    A row whose reference top-2 gap is within twice the allowed error could flip in the reference itself
    (it is not reproducible to better than that): it is skipped, not judged."""
    r, o = logits_of(ref), logits_of(out)
    if r is None or o is None or r.shape[-1] < 2:
        return ""
    r2, o2 = r.reshape(-1, r.shape[-1]).double(), o.reshape(-1, o.shape[-1]).double()
    top = r2.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    _, scale, _ = scaled_error(r, o)
    clear = gap > 2 * scaled.allowed_abs(scale)
    bad = clear & (r2.argmax(-1) != o2.argmax(-1))
    if bool(bad.any()):
        i = int(bad.nonzero()[0][0])
        return (f"greedy token differs at row {i}: {int(o2[i].argmax())} vs reference {int(r2[i].argmax())} "
                f"(reference top-2 gap {float(gap[i]):.3g}, beyond the allowed error)")
    return ""


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


def _reference_run(ref_fn, inputs: tuple, guard: "StateGuard", exact: bool, device: torch.device, what: str):
    """(outputs, state left, reproducible) of the reference on one draw of inputs: step 2 of the module
    docstring, with, on a GPU in exact mode, a second poisoned run to see whether it reproduces its bits."""
    with torch.no_grad():
        ref = [t.clone() for t in tensors_of(ref_fn(*clone_all(inputs)))]
    _sync(device)
    ref_state = guard.current()
    for i, r in enumerate(ref):
        if r.is_floating_point() and not elementwise.all_finite(r):
            raise ValidationFailure(f"{what}: the reference output {i} itself has NaN/Inf; "
                                    "cannot validate on these inputs")
    reproducible = None
    if exact and device.type == "cuda":
        # Exactness is only asked where the reference itself reproduces its bits under the same poisoned
        # allocations: on a GPU, library kernels (cuBLAS, sdpa) can pick another algorithm for other pointer
        # alignments (seen on an H200: the captured olmoe-16l decode step differs from itself by 0.035 in bf16
        # at some contexts).
        poison_bytes = sum(r.numel() * r.element_size() for r in ref)
        again = run_candidate(ref_fn, inputs, guard, [], device, poison_bytes, f"{what} reference rerun")
        reproducible = all(torch.equal(x, y) for x, y in zip(ref, again))
        guard.restore()
    return ref, ref_state, reproducible


def _judge(ref_fn, cand_fn, inputs: tuple, guard: "StateGuard", exact: bool, atol: float, rtol: float,
           scaled, device: torch.device, what: str, cached=None, exact_fn=None) -> tuple[dict, tuple]:
    """Steps 2-4 of the module docstring on one draw of inputs: (the bucket's record, the reference's
    (outputs, state, reproducible)), or ValidationFailure (carrying the reference's outputs as ``.ref`` for
    the stability check). ``cached``: the reference's result on these inputs, from the bank
    (``tkcc.runtime.refbank``): it is not run again. ``exact_fn``: the reference computing in fp32
    (``tkcc.runtime.exact_reference``), asked where the candidate exceeds the scaled bound."""
    if cached is not None:
        ref, ref_state, reproducible = cached.outputs, cached.state_after(guard.saved), cached.reproducible
    else:
        ref, ref_state, reproducible = _reference_run(ref_fn, inputs, guard, exact, device, what)
    poison_bytes = sum(r.numel() * r.element_size() for r in ref)
    exact_b, note = exact, ""
    if exact and device.type == "cuda" and reproducible is False:
        exact_b, note = False, "reference not bitwise reproducible here: checked in tolerance mode"
    seconds = []  # what the fp32 reference said, where it was asked

    def held(r, o, label, of_state=False):
        """compare(), with the fp32 reference's second opinion where a candidate exceeds the scaled bound."""
        try:
            return compare(r, o, exact_b, atol, rtol, label, scaled)
        except ValidationFailure as e:
            if exact_fn is None or scaled is None or exact_b or not e.mismatch:
                raise
            said = exact_opinion(exact_fn, inputs, guard, r, o, scaled.bound, of_state, memo)
            if said is None:
                raise
            ok, found = said
            if not ok:
                raise ValidationFailure(f"{e}; {found}", e.mismatch) from None
            seconds.append(f"{label}: {found}")
            return max((_max_abs(a, b) for a, b in zip(r, o)), default=0.0)

    memo: dict = {}
    try:
        runs, prev = [], []
        err = 0.0
        for k in range(2):
            outs = run_candidate(cand_fn, inputs, guard, prev, device, poison_bytes, f"{what} run {k + 1}")
            err = max(err, held(ref, outs, f"{what} run {k + 1}"))
            held(ref_state, guard.current(), f"{what} run {k + 1} cache state", of_state=True)
            if scaled is not None:
                why = greedy_mismatch(ref, outs, scaled)
                if why:
                    e = ValidationFailure(f"{what} run {k + 1}: {why}")
                    e.greedy = True
                    raise e
            elif not exact_b:
                g_ref, g_out = greedy_tokens(ref), greedy_tokens(outs)
                if g_ref is not None and not torch.equal(g_ref, g_out):
                    raise ValidationFailure(f"{what} run {k + 1}: greedy tokens differ "
                                            f"({g_out.flatten().tolist()[:8]} vs reference "
                                            f"{g_ref.flatten().tolist()[:8]})")
            runs.append([o.clone() for o in outs])
            prev = outs
        compare(runs[0], runs[1], exact_b, atol, rtol, f"{what}: run 2 vs run 1", scaled)
    except ValidationFailure as e:
        e.ref = ref
        e.reference = (ref, ref_state, reproducible)
        raise
    if seconds:
        note = "; ".join(([note] if note else []) + seconds)
    rec = {"max_abs_err": err, "outputs": len(ref), "mode": "exact" if exact_b else "tolerance",
           **({"note": note} if note else {}), **({"reference": "kept"} if cached is not None else {})}
    return rec, (ref, ref_state, reproducible)


def exact_run(exact_fn, inputs: tuple, guard: "StateGuard", memo: dict, flip: frozenset = frozenset()):
    """(outputs, cache state, near ties) of the fp32 reference on ``inputs`` from the state before the draw, with
    the top-k choices in ``flip`` taken the other way, once per draw and ``flip``; the cache the candidate left is
    put back. None when the fp32 reference cannot run here (no second opinion)."""
    if flip not in memo:
        decisions = decisions_of(exact_fn)
        left = guard.current()
        guard.restore()
        try:
            if decisions is not None:
                decisions.near, decisions.flip = [], flip
            with torch.no_grad():
                outs = [t.detach().clone() for t in tensors_of(exact_fn(*clone_all(inputs)))]
            memo[flip] = (outs, guard.current(), list(decisions.near) if decisions is not None else [])
        except Exception:  # noqa: BLE001 - e.g. out of memory: the bound against the low-precision reference stands
            memo[flip] = None
        finally:
            if decisions is not None:
                decisions.flip = frozenset()
        with torch.no_grad():
            for b, v in zip(guard.buffers, left):
                b.copy_(v)
    return memo[flip]


def exact_opinion(exact_fn, inputs: tuple, guard: "StateGuard", ref: list, got: list, bound: float,
                  of_state: bool = False, memo: dict | None = None) -> tuple[bool, str] | None:
    """The fp32 reference's word on outputs (or, ``of_state``, the cache) past the scaled bound of the
    low-precision reference (``tkcc.runtime.exact_reference``): (passes, what was found), or None where it cannot
    run. Where the candidate is not as close to the fp32 result, it may be within the bound of the fp32 result
    with one of its near-tied top-k choices (or all of them) taken the other way. ``memo``: fp32 runs shared by
    the checks of one draw."""
    memo = {} if memo is None else memo
    base = exact_run(exact_fn, inputs, guard, memo)
    if base is None:
        return None
    ok, found = closer_to_exact(ref, got, base[1] if of_state else base[0], bound)
    if ok:
        return True, found
    tried = alternatives(base[2])
    for flip in tried:
        alt = exact_run(exact_fn, inputs, guard, memo, flip)
        if alt is None:
            break
        if closer_to_exact(ref, got, alt[1] if of_state else alt[0], bound, strict=True)[0]:
            return True, f"{found}; within {bound:.3g} of it with the near tie at {describe(flip, base[2])} " \
                         "decided the other way"
    return False, found + (f"; and past {bound:.3g} of it in each of {len(tried)} runs with its near-tied top-k "
                           "choices (one, a pair, or all) decided the other way" if tried else "")


HELD_COPIES = 4  # of a bucket's outputs, beside its reference's, while a candidate runs: see _judge


def _held_beside_candidate(reference: tuple) -> int:
    """Bytes validation holds while a candidate runs at a bucket, besides the reference's own outputs: the
    candidate's outputs of its first run (kept, then poisoned as ``prev``) and their clone, the second run's
    and their clone (``_judge``). The engine's device-memory cap leaves this room (``DeviceBudget.reference``):
    at a served long prompt the logits alone are gigabytes, and they are validation's, not the candidate's."""
    outs = reference[0]
    return HELD_COPIES * sum(t.numel() * t.element_size() for t in outs)


def _draw_inputs(program, b, seed: int) -> tuple:
    """One draw of a bucket's inputs from ``seed``, on a zeroed state (the random context a decode bucket
    fills in is then all the cache holds, the same whenever the seed is drawn again)."""
    state = getattr(program, "state", None)
    if state is not None:
        with torch.no_grad():
            for buf in state.buffers():
                buf.zero_()
    return program.inputs(b.phase, input_bucket(b), torch.Generator().manual_seed(seed))


def _bank_entry(seed: int, guard: "StateGuard", reference: tuple):
    from tkcc.runtime.refbank import Entry, state_diff

    ref, ref_state, reproducible = reference
    return Entry(seed, ref, state_diff(guard.saved, ref_state), reproducible)


def validate(program, reference: dict, candidate: dict, buckets: list, exact: bool, atol: float, rtol: float,
             seed: int, weights: tuple | None = None, policy=None, bank=None, tier: str = "",
             candidate_id: str = "", room=None, exact_reference: dict | None = None) -> dict:
    """Check ``candidate`` ({phase: callable}) against ``reference`` on ``buckets``; see the module docstring.

    ``weights``: (whole model, its checksum at start): the candidate must leave every weight untouched.
    ``policy`` (a ``tkcc.runtime.determinism.TierPolicy`` in tolerance mode): the scale-aware bound derived
    from the reference's measured self-disagreement replaces atol/rtol, and greedy tokens are checked where
    the reference agrees with itself (its golden-prompt sequences) instead of on one fresh prompt.
    ``bank`` (a ``tkcc.runtime.refbank.ReferenceBank``, with the ``tier`` and ``candidate_id``): the
    reference's results on earlier draws, reused on draws this candidate has not seen.
    ``room`` (the engine's ``DeviceBudget.reference``): runs each first reference run, so that the device-memory
    cap leaves the room the model itself needs at the workload's shapes.
    ``exact_reference`` ({phase: callable}, tolerance mode): the reference computing in fp32, the second opinion
    where a candidate exceeds the bound (``tkcc.runtime.exact_reference``)."""
    scaled = policy.tolerance if policy is not None and not exact else None
    device = torch.device(program.meta.get("device", "cpu"))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    shapes, greedy = [], None
    try:
        # every bucket's first draw and the reference's result on it, before any candidate code runs here: so no
        # candidate (in-process) can move a reference result that the bank would keep for others
        firsts = {}
        for b in buckets:
            if b.phase not in candidate:
                raise ValidationFailure(f"bucket {b.key()}: the candidate has no forward for phase {b.phase!r}")
            draw = int(torch.randint(0, 2**62, (1,), generator=gen))
            entry = bank.take(tier, b.key(), candidate_id, draw) if bank is not None else None
            if entry is None:
                inputs = _draw_inputs(program, b, draw)
                guard = StateGuard(program.state)
                try:
                    def ref_run(b=b, inputs=inputs, guard=guard):
                        return _reference_run(reference[b.phase], inputs, guard, exact, device, f"bucket {b.key()}")
                    out = ref_run() if room is None else room(ref_run, reset=guard.restore, what=f"bucket {b.key()}",
                                                              holds=_held_beside_candidate)
                    entry = _bank_entry(draw, guard, out)
                finally:
                    guard.restore()
                if bank is not None:
                    bank.add(tier, b.key(), candidate_id, entry)
            firsts[b.key()] = entry
        for b in buckets:
            what = f"bucket {b.key()}"
            unstable = []
            for _draw in range(MAX_DRAWS):
                entry = firsts[b.key()] if not _draw else None
                inputs = _draw_inputs(program, b, entry.seed if entry is not None
                                      else int(torch.randint(0, 2**62, (1,), generator=gen)))
                guard = StateGuard(program.state)
                try:
                    shape, _ = _judge(reference[b.phase], candidate[b.phase], inputs, guard, exact, atol, rtol,
                                      scaled, device, what, cached=entry,
                                      exact_fn=(exact_reference or {}).get(b.phase))
                    if entry is not None and bank is not None and entry.uses > 1:
                        shape["reference"] = "kept from an earlier draw"
                    else:
                        shape.pop("reference", None)
                    break
                except ValidationFailure as e:
                    # in tolerance mode a bound exceeded where the reference itself jumps says nothing of the
                    # candidate (tkcc.runtime.stability): draw other inputs
                    ref = getattr(e, "ref", None)
                    if scaled is None or ref is None or not (e.mismatch or getattr(e, "greedy", False)):
                        raise
                    jump = unstable_error(reference[b.phase], inputs, guard, ref, scaled,
                                          int(torch.randint(0, 2**31, (1,), generator=gen)),
                                          ref_state=(getattr(e, "reference", None) or (None, None))[1])
                    if jump is None:
                        raise
                    unstable.append(round(jump, 4))
                finally:
                    guard.restore()
            else:
                shapes.append({"bucket": b.key(), "max_abs_err": None, "outputs": None, "mode": "not judged",
                               "note": f"at each of {MAX_DRAWS} inputs the candidate exceeded the bound where the "
                                       f"reference itself moved by {unstable} of its scale under a one-rounding-step "
                                       "perturbation of its cache"})
                continue
            if unstable:
                shape["note"] = (shape.get("note", "") + "; " if shape.get("note") else "") + (
                    f"{len(unstable)} input(s) redrawn: there the reference itself moved by {unstable} of its scale "
                    "under a one-rounding-step perturbation of its cache")
            shapes.append({"bucket": b.key(), **shape})
        if shapes and all(sh["mode"] == "not judged" for sh in shapes):
            raise ValidationFailure("no bucket could be judged: at every input drawn the candidate exceeded the "
                                    "bound where the reference itself jumps under a one-rounding-step "
                                    "perturbation of its cache")
        if scaled is not None and getattr(policy, "greedy", None) is not None:
            from tkcc.runtime.golden import greedy_agreement

            greedy = greedy_agreement(program, {**reference, **candidate}, policy.greedy)
            if not greedy["ok"]:
                raise ValidationFailure(greedy["reason"])
        elif scaled is not None or not exact or any(sh["mode"] == "tolerance" for sh in shapes):
            greedy = check_greedy(program, reference, candidate, gen, scaled.bound if scaled is not None else rtol)
    except ValidationFailure as e:
        reason, mismatch = str(e), e.mismatch
    else:
        reason, mismatch = None, None
    changed = changed_weight(weights[1], weights_checksum(weights[0])) if weights is not None else None
    if changed:
        reason = f"{WEIGHTS_CHANGED}: {changed}" + (f" (and {reason})" if reason else "")
    mode = "exact" if exact and all(sh["mode"] == "exact" for sh in shapes) else "tolerance"
    out = {"ok": reason is None, "reason": reason, "mismatch": mismatch, "mode": mode, "atol": atol,
           "rtol": rtol, "seed": seed, "shapes": shapes, "greedy": greedy, "seconds": time.perf_counter() - t0}
    if scaled is not None:
        out["tolerance"] = scaled.to_json()
    return out


GREEDY_PROMPT, GREEDY_TOKENS = 8, 8


def check_greedy(program, reference: dict, candidate: dict, gen, bound: float) -> dict | None:
    """Tolerance mode: fed the reference's greedy tokens, the candidate must choose the same next token
    wherever the reference's choice is clear, i.e. its top-2 logit gap is wider than twice the allowed error
    (``bound`` x the logits' scale). Elsewhere an allowed rounding difference may flip the choice (in bf16 a
    random-weight model's logits are often that flat), and one flip would derail a free-running comparison."""
    if not {"prefill", "decode"} <= set(program.phases) or program.state is None:
        return None
    from tkcc.runtime.golden import chosen_logits, decisive, run_sequence

    cap = int(program.meta.get("max_cache_len", 0) or 0)
    n = min(GREEDY_TOKENS, max(1, cap - GREEDY_PROMPT))
    vocab = int(program.meta.get("vocab_size", 2))
    batch = int(program.meta.get("batch", 1) or 1)
    dev = torch.device(program.meta.get("device", "cpu"))
    prompt = torch.randint(0, vocab, (batch, GREEDY_PROMPT), generator=gen).to(dev)
    guard = StateGuard(program.state)
    try:
        with torch.no_grad():
            pre, dec, want = run_sequence(program, reference, prompt, n - 1)
            _, _, got = run_sequence(program, candidate, prompt, n - 1, force=want)
    finally:
        guard.restore()
    judged, gap, scale = decisive(chosen_logits(pre, dec).double(), bound)  # each [B, n]
    bad = judged & (got != want)
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValidationFailure(f"greedy token {j} differs where the reference's choice is clear: {int(got[b, j])} "
                                f"vs reference {int(want[b, j])} (top-2 gap {float(gap[b, j]):.4g} > 2 x {bound:.3g} "
                                f"x scale {float(scale[b, j]):.4g}); reference tokens {want[b].tolist()}, candidate "
                                f"{got[b].tolist()}")
    return {"tokens": n, "prompt": GREEDY_PROMPT, "judged": int(judged.sum()), "bound": bound}


def long_context_bucket(program, buckets: list):
    """A batch-1 decode bucket at the last position the Program's cache holds, when the workload's decode
    buckets reach less than half of it; else None. An artifact serves every position of its cache, and the
    layouts a long context takes (split-KV grids, attention spans) are otherwise validated nowhere: the engine
    validated olmoe-16l's fused step at contexts up to 128 only. (At 8k its first step was 0.27 off the bf16
    captured graph on an H200, the lowered step 0.665; on four of its layers both were then as close to the
    fp32 graph as the bf16 graph itself, 0.017 against 0.016, tests/decode/test_long_context_gpu.py: the 16
    layers' distance is the model's sensitivity to rounding, not a wrong kernel.) Weight 0: judged, never
    measured."""
    from tkcc.traffic.workload import Bucket

    if "decode" not in program.graphs or getattr(program, "state", None) is None:
        return None
    cap = int(program.meta.get("max_cache_len") or 0)
    reach = [b.context for b in buckets if b.phase == "decode" and b.batch == 1]
    if cap < 2 or not reach or 2 * max(reach) >= cap:
        return None
    return Bucket("decode", 1, cap - 1, 1, 0.0)


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
