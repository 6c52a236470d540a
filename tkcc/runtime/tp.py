"""The engine core of one rank of ``tkcc serve --tp N``: it serves this rank's shard of the model.

Every rank's worker holds a ``TPEngineCore``; rank 0's worker is the one the
supervisor talks to, the others follow it op by op (``tkcc.parallel.group``),
so a sharded forward's collectives always find their peers.

What each rank holds, per tier:

- the **golden** Program: the unsharded model as captured (the weights and
  the full KV cache ``U``), the reference every candidate is validated
  against;
- the **served** Program: the degree-N sharded baseline (``sharding`` with
  ``strategy`` ``tp`` unless configured), with this rank's KV shard ``S``.
  It is the tier's baseline forward: what ``baseline`` measures and what
  serves until a candidate is swapped in.

Validation (why it is sound across the two caches): a ``StateBridge`` knows
which slice of ``U`` each buffer of ``S`` is. The served Program's inputs
are drawn as the golden Program's (which fills ``U`` with random context for
a decode bucket) and then ``U``'s slice is copied into ``S``; the reference
forward runs the golden graph on ``U`` and copies ``U``'s slice into ``S``
afterwards, so the engine's ordinary validation (``tkcc.runtime.validation``)
compares the candidate's outputs and the cache state it leaves (this rank's
slice) with the unsharded model's, in tolerance mode with identical greedy
tokens. Every rank checks its own outputs; the verdicts are merged with an
all-gather so all ranks agree on what may be swapped in.

Validation stops at the first failure, which may come on one rank only;
``Lockstep`` keeps the ranks' collectives paired anyway: before every
candidate call the ranks agree (a small all-reduce on a side group) that
none has stopped, and a rank that stopped makes the others stop too.

Every sharded candidate's KV buffers are re-pointed at the tier's ``S``
(``rebind_state``), so all candidates of a tier share one cache, as they
share one in the unsharded engine.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from tkcc.errors import EngineError, TkccError
from tkcc.runtime import candidates as cands
from tkcc.runtime.engine import EngineCore
from tkcc.runtime.programs import build_tiers
from tkcc.runtime.validation import ValidationFailure, pick_buckets

BASELINE_STRATEGY = "tp"  # works for every family the sharding pass knows (dense and MoE)


# ----------------------------------------------------------------- plans
def sharding_steps(spec: dict) -> list[tuple[int, int, str]]:
    """(plan step index, degree, strategy) of every ``sharding`` step of a plan candidate."""
    from tkcc.passes.plan import PassPlan

    plan = PassPlan.from_json(spec["plan"])
    return [(i, s.params.get("degree", 1), s.params.get("strategy", "tp"))
            for i, s in enumerate(plan.steps) if s.name == "sharding"]


def _example(tp: int) -> str:
    return json.dumps([{"name": "sharding", "params": {"degree": tp, "strategy": "tp"}}])


def check_layout_of(spec: dict, tp: int) -> None:
    """Refuse a candidate whose layout this engine cannot run, saying which step and why."""
    kind = cands.spec_kind(spec)
    if kind in ("artifact", "artifacts") and tp > 1:
        raise EngineError(f"this engine runs the model over {tp} ranks (--tp {tp}): a prebuilt artifact is a "
                          f"single-rank program; submit the plan instead, e.g. --plan '{_example(tp)}' (every rank "
                          "compiles it)")
    if kind != "plan":
        return
    steps = sharding_steps(spec)
    for i, degree, _strategy in steps:
        if degree != tp:
            hint = (f"start an engine with `tkcc serve --tp {degree}` for it" if isinstance(degree, int)
                    and degree > 1 else f"use degree {tp}")
            raise EngineError(f"plan step {i + 1} ('sharding'): degree={degree!r}, but this engine runs with --tp {tp}: "
                              f"a candidate's sharding degree must equal the engine's; {hint}")
    if tp > 1 and not steps:
        raise EngineError(f"this engine serves the model split over {tp} ranks (--tp {tp}): a plan must contain the "
                          f"sharding step with degree {tp}, e.g. {_example(tp)}")
    if len(steps) > 1:
        raise EngineError(f"plan steps {[s[0] + 1 for s in steps]} are all 'sharding': a plan shards the model once")


def exact_at_degree_1(spec: dict) -> bool:
    """A plan whose only inexact steps are ``sharding`` at degree 1 (the identity) stays bit-exact."""
    if cands.spec_kind(spec) != "plan" or "exact" in spec:
        return False
    from tkcc.passes.base import get_pass
    from tkcc.passes.plan import PassPlan

    plan = PassPlan.from_json(spec["plan"])
    if not any(s.name == "sharding" for s in plan.steps):
        return False
    try:
        return all(s.params.get("degree", 1) == 1 if s.name == "sharding" else bool(get_pass(s.name).exact)
                   for s in plan.steps)
    except TkccError:
        return False  # a user pass not loaded yet: the candidate's own flags decide


# ------------------------------------------------------------ the caches
class StateBridge:
    """This rank's KV shard ``S`` as a slice of the full cache ``U``: ``S[name] = U[name].narrow(d, rank*n, n)``.

    Built right after sharding: ``U`` holds a known pattern then, and every
    shard must equal the slice this bridge names, or the engine refuses to
    start (the bridge would otherwise validate against the wrong heads).
    """

    def __init__(self, full: torch.nn.Module, shard: torch.nn.Module, rank: int, world: int, where: str):
        whole = dict(full.named_buffers())
        self.pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name, s in shard.named_buffers():
            u = whole.get(name)
            if u is None:
                raise EngineError(f"{where}: the sharded cache has a buffer {name!r} the model's cache does not")
            if s is u:
                continue  # replicated, the same tensor
            dims = [d for d in range(u.dim()) if u.shape[d] != s.shape[d]] if u.dim() == s.dim() else None
            if dims == []:
                src = u
            elif dims and len(dims) == 1 and u.shape[dims[0]] == s.shape[dims[0]] * world:
                n = s.shape[dims[0]]
                src = u.narrow(dims[0], rank * n, n)
            else:
                raise EngineError(f"{where}: cache buffer {name!r} of shape {tuple(s.shape)} on rank {rank} is not a "
                                  f"1/{world} slice of the full {tuple(u.shape)}")
            if not torch.equal(src, s):
                raise EngineError(f"{where}: rank {rank}'s shard of cache buffer {name!r} is not the slice the engine "
                                  "expects; cannot validate against the unsharded model")
            self.pairs.append((name, src, s))

    def project(self) -> None:
        """Copy this rank's slice of the full cache into the shard."""
        with torch.no_grad():
            for _, src, dst in self.pairs:
                dst.copy_(src)

    def inputs_maker(self, make):
        """The golden Program's input maker, followed by a projection (decode buckets fill ``U``)."""
        def inputs(bucket=None, generator=None):
            out = make(bucket, generator)
            self.project()
            return out

        return inputs

    def reference(self, forward):
        """The golden forward on ``U``; then ``U``'s slice into ``S``, so the state check sees its writes."""
        def run(*args):
            out = forward(*args)
            self.project()
            return out

        return run


STOPPED = "stopped because another rank's validation ended"


class Lockstep:
    """Pairs the ranks' collectives while a loop that may end early on one rank (validation) runs.

    Every wrapped candidate call first joins a round: an all-reduce (sum) of
    "I have finished". 0 means every rank is still going; otherwise the call
    raises ``ValidationFailure`` (validation's own "stop here"), so this rank
    finishes too. ``finish()`` joins rounds with 1 until every rank has.
    """

    def __init__(self, world: int):
        import datetime

        import torch.distributed as dist

        self.world = world
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))

    def _round(self, finished: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([finished], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return int(t.item())

    def wrap(self, forwards: dict) -> dict:
        def one(fn):
            def run(*args):
                if self._round(0):
                    raise ValidationFailure(STOPPED)
                return fn(*args)

            return run

        return {p: one(f) for p, f in forwards.items()}

    def finish(self) -> None:
        while self._round(1) < self.world:
            pass

    def outcome(self, err: BaseException | None) -> list:
        """Every rank's exception (type, message) or None, by rank."""
        import torch.distributed as dist

        mine = None if err is None else (type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        return every


def _pattern(state: torch.nn.Module) -> None:
    """Distinct small integers (exact in every float dtype) in every cache element."""
    with torch.no_grad():
        for b in state.buffers():
            b.copy_((torch.arange(b.numel(), device=b.device) % 251).reshape(b.shape).to(b.dtype))


def rebind_state(program, target: torch.nn.Module, where: str):
    """``program`` with every graph's KV buffers re-pointed at ``target``'s buffers of the same name."""
    if program.state is None or program.state is target:
        return program
    own = {id(t): name for name, t in program.state.named_buffers()}
    want = dict(target.named_buffers())
    for gm in program.graphs.values():
        for mod in gm.modules():
            for key, t in list(mod._buffers.items()):
                name = own.get(id(t)) if t is not None else None
                if name is None:
                    continue
                new = want.get(name)
                if new is None or new.shape != t.shape or new.dtype != t.dtype or new.device != t.device:
                    raise EngineError(f"{where}: the candidate's cache buffer {name!r} {tuple(t.shape)} does not "
                                      f"match the engine's sharded cache "
                                      f"({None if new is None else tuple(new.shape)}); its layout differs from "
                                      "the served one")
                mod._buffers[key] = new
    return dataclasses.replace(program, state=target)


# ------------------------------------------------------------------ core
class TPEngineCore(EngineCore):
    """``EngineCore`` for rank ``rank`` of ``world``: serves the sharded model, validates against the unsharded."""

    def __init__(self, cfg: dict, rank: int, world: int):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world:
            raise EngineError(f"TPEngineCore(rank={rank}, world={world}) must run inside a process group of "
                              f"{world} ranks (tkcc serve --tp {world} starts one)")
        self.rank, self.tp = rank, world
        self.strategy = cfg.get("tp_strategy") or BASELINE_STRATEGY
        torch.manual_seed(int(cfg.get("seed", 0)))  # a model factory that draws weights draws the same on every rank
        super().__init__(cfg)
        self.env.update(tp=world, tp_strategy=self.strategy, rank=rank, backend=dist.get_backend())

    def _lockstep(self) -> Lockstep:
        if getattr(self, "_steps", None) is None:
            self._steps = Lockstep(self.tp)  # created by every rank at the same point: the first validation
        return self._steps

    def _device_name(self, cfg: dict) -> str:
        return f"cuda:{self.rank}" if str(cfg["device"]).startswith("cuda") else cfg["device"]

    def _serving_tiers(self, program) -> dict:
        from tkcc.passes.sharding import shard_program

        self.golden = build_tiers(program, self.fast_blocks)
        self.bridges, self.layout_notes, served = {}, {}, {}
        for tier, g in self.golden.items():
            where = f"--tp {self.tp}, {tier} tier"
            if g.state is None or not {"prefill", "decode"} <= set(g.phases):
                raise EngineError(f"{where}: tensor parallelism serves causal LMs with a KV cache; model "
                                  f"{self.cfg['model']!r} has phases {g.phases}")
            _pattern(g.state)
            sharded, info = shard_program(g, self.tp, self.strategy)
            self.bridges[tier] = StateBridge(g.state, sharded.state, self.rank, self.tp, where)
            g.reset_state()
            sharded.reset_state()
            self.layout_notes[tier] = list(info.notes)
            served[tier] = dataclasses.replace(
                sharded, make_inputs={p: self.bridges[tier].inputs_maker(f) for p, f in g.make_inputs.items()},
                recapture=None)
        self.references = {t: {p: self.bridges[t].reference(gm) for p, gm in g.graphs.items()}
                           for t, g in self.golden.items()}
        return served

    def _reference(self, tier: str) -> dict:
        return self.references[tier]

    def _run_validation(self, prog, reference: dict, forwards: dict, buckets: list, exact: bool, atol: float,
                        rtol: float, seed: int) -> dict:
        """Validation on every rank, its collectives kept paired; a candidate that raised on any rank raises on all."""
        steps = self._lockstep()
        res, err = None, None
        try:
            res = super()._run_validation(prog, reference, steps.wrap(forwards), buckets, exact, atol, rtol, seed)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks have stopped too
            err = e
        steps.finish()
        raised = steps.outcome(err)
        if err is not None:
            raise err
        if any(raised):
            r = next(i for i, x in enumerate(raised) if x)
            raise RuntimeError(f"the candidate raised on rank {r}: {raised[r][0]}: {raised[r][1]}")
        return res

    def _all_ok(self, ok: bool) -> bool:
        import torch.distributed as dist

        t = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._lockstep().group)
        return int(t.item()) == 0

    def _build(self, cand: cands.Candidate, tier: str) -> None:
        if cand.kind != "plan":
            cands.build_for_tier(cand, tier, self.programs, self.work_dir, self.max_bytes)
            return
        import time

        from tkcc.passes.plan import PassPlan
        from tkcc.pipeline import build

        t0 = time.perf_counter()
        cands.load_pass_modules(cand.spec.get("pass_modules"), self.max_bytes)
        plan = PassPlan.from_json(cand.spec["plan"])
        cand.exact = bool(cand.spec.get("exact", cands.plan_is_exact(plan)))
        # The PassManager's numerics check runs decode on whatever the cache holds; each rank's full cache has
        # only its own slice kept current by the sharded forwards (with batch 1 the shard is a view of it), so
        # start every rank from the same (empty) cache.
        self.golden[tier].reset_state()
        # every rank at once; no per-pass numerics check (elementwise, in prefill): the engine's validation of the
        # whole forward (tolerance mode, greedy agreement) judges the candidate, as on one GPU
        b = build(self.golden[tier], plan, check_numerics=False, log_code=False, codegen=False)
        rewritten, logs = b.program, b.logs
        rewritten = rebind_state(rewritten, self.programs[tier].state, f"candidate {cand.id} on the {tier} tier")
        cand.forwards[tier] = dict(rewritten.graphs)
        cand.compile_s[tier] = time.perf_counter() - t0
        cand.info[tier] = {"kind": "plan", "plan": plan.to_json(), "plan_hash": plan.hash(),
                           "passes": [cands._log_summary(lg) for lg in logs or []],
                           "layout": rewritten.meta.get("layout"),
                           "codegen": "not used: a rank runs its rewritten FX graphs (its weight shards are "
                                      "neither model parameters nor cache buffers, which artifacts bind by name)"}

    def op_startup(self) -> dict:
        """Reproducibility and canaries of the sharded baseline, then the baseline against the unsharded model."""
        out = super().op_startup()
        atol, rtol = self._tolerance(self.candidates["baseline"])
        for tier, prog in self.programs.items():
            res = self._run_validation(prog, self._reference(tier), prog.graphs, pick_buckets(self.default_workload, 4),
                                       False, atol, rtol, 0)
            res = self._agree(res)
            if not res["ok"]:
                raise EngineError(f"--tp {self.tp}: the sharded baseline (strategy {self.strategy!r}) does not match "
                                  f"the unsharded model on the {tier} tier: {res['reason']}")
            res.update(tier=tier, candidate="baseline", note=f"degree-{self.tp} sharded baseline vs the unsharded "
                                                             "model")
            self.validations[("baseline", tier)] = res
        out["baseline_validation"] = {t: self.validations[("baseline", t)]["mode"] for t in self.programs}
        return out

    def _agree(self, res: dict) -> dict:
        """Every rank's verdict, merged on every rank: ok only if all ranks are; the first failing rank's reason."""
        import torch.distributed as dist

        mine = {"rank": self.rank, "ok": bool(res["ok"]), "reason": res.get("reason"),
                "fatal": bool(res.get("fatal")),
                "max_abs_err": max([s["max_abs_err"] for s in res.get("shapes", [])
                                    if s["max_abs_err"] is not None] or [0.0])}
        every = [None] * self.tp
        dist.all_gather_object(every, mine, group=self._lockstep().group)
        res = dict(res)
        res["ranks"] = every
        bad = [v for v in every if not v["ok"]]
        if bad:
            first = next((v for v in bad if v["reason"] != STOPPED), bad[0])  # the rank that stopped the others
            res["ok"] = False
            res["reason"] = f"rank {first['rank']}: {first['reason']}"
        res["fatal"] = any(v["fatal"] for v in every)
        return res

    def op_weights_digest(self) -> str:
        """A digest of the weights' values (names and sums; not their addresses, which differ per rank)."""
        return hashlib.sha256(json.dumps([(w[0], *w[2:]) for w in self.weights]).encode()).hexdigest()

    def op_status(self) -> dict:
        out = super().op_status()
        out["tp"] = {"degree": self.tp, "rank": self.rank, "strategy": self.strategy,
                     "layout": {t: {k: v for k, v in (p.meta.get("layout") or {}).items()}
                                for t, p in self.programs.items()},
                     "notes": self.layout_notes}
        return out

    def memory(self) -> dict:
        out = super().memory()
        g = self.golden["slow"].state
        out["golden_cache_bytes"] = sum(b.numel() * b.element_size() for b in g.buffers())
        layout = self.program.meta.get("layout") or {}
        out["shard_bytes_copied"] = layout.get("shard_bytes_copied")
        return out
