"""Candidates that game the harness: each is refused, or measured at its true speed.

The engine's defence, in short (docs/engine.md): each candidate runs in a process of its own, which the
reference, the clock and every comparison are out of reach of; every timed call gets fresh input values; a
sample of the timed calls of every measured bucket (two at random and the last) has its outputs and cache
writes compared with the reference on those inputs; and a candidate is named by every file it can import.
One engine serves the whole suite (see conftest.py).
"""
from __future__ import annotations

import pytest

from conftest import NOISE

pytestmark = [pytest.mark.serial, pytest.mark.timeout(300)]

CHEATS = {
    # the three
    "address_cache": dict(body="""
        key = (phase, ids.data_ptr(), pos.data_ptr())   # the engine rotates the same input tensors
        if key not in STATE:                               # remember the outputs and the cache they leave
            STATE[key] = (f(ids, pos), [b.clone() for b in cache])
        out, kv = STATE[key]
        for b, s in zip(cache, kv):
            b.copy_(s)
        return out.clone()                                 # a fresh copy: poisoning its last output misses it
    """),
    "address_cache_in_timing": dict(body="""
        key = (phase, ids.data_ptr(), pos.data_ptr())
        seen = STATE[key] = STATE.get(key, 0) + 1            # the timing loop's rotation shows an address again and
        if seen < 3 or (key, "out") not in STATE:            # again; validation hardly does
            STATE[(key, "out")] = (f(ids, pos), [b.clone() for b in cache])
        out, kv = STATE[(key, "out")]
        for b, s in zip(cache, kv):
            b.copy_(s)
        return out.clone()
    """),
    "first_shape_only": dict(body="""
        shape = (tuple(ids.shape), int(pos[0]))
        STATE.setdefault(phase, shape)
        out = f(ids, pos)
        return out if shape == STATE[phase] else out * 0.5 + 1.0   # "hard-coded" for the shape it saw first
    """),
    "patch_timer": dict(setup="""
        import tkcc.runtime.timing as timing
        _t = [0]
        def _fake():
            _t[0] += 10                                     # every call "takes" 10 ns
            return _t[0]
        timing._perf_counter_ns = _fake
        time.perf_counter_ns = _fake
        time.perf_counter = lambda: _fake() / 1e9
    """, body="return f(ids, pos)"),
    # our own
    "content_cache": dict(body="""
        key = (phase, ids.numpy().tobytes(), pos.numpy().tobytes(), b"".join(b.numpy().tobytes() for b in cache))
        if key not in STATE:                               # keyed by everything the step reads
            STATE[key] = (f(ids, pos), [b.clone() for b in cache])
        out, kv = STATE[key]
        for b, s in zip(cache, kv):
            b.copy_(s)
        return out.clone()
    """),
    "constant_output": dict(body="""
        if phase not in STATE:
            STATE[phase] = f(ids, pos)
        return STATE[phase]
    """),
    "validated_shapes_only": dict(body="""
        seen = STATE.setdefault(phase, [])                  # honest at the first two shapes it is shown
        shape = (tuple(ids.shape), int(pos[0]))
        if shape not in seen and len(seen) < 2:
            seen.append(shape)
        out = f(ids, pos)
        return out if shape in seen else out.roll(1, dims=-1)
    """),
    "honest_first_calls": dict(body="""
        n = STATE[phase] = STATE.get(phase, 0) + 1          # the validation's calls come first
        if n <= 12 or (phase + "_out") not in STATE:
            STATE[phase + "_out"] = f(ids, pos)
        return STATE[phase + "_out"] if n > 12 and STATE[phase + "_out"].shape[1] == ids.shape[1] else f(ids, pos)
    """),
    "forgets_cache_writes": dict(body="""
        n = STATE[phase] = STATE.get(phase, 0) + 1
        if n <= 12:
            return f(ids, pos)
        saved = [b.clone() for b in cache]
        out = f(ids, pos)
        for b, s in zip(cache, saved):                       # as if the step never wrote its K/V
            b.copy_(s)
        return out
    """),
    "fills_output_later": dict(body="""
        out = f(ids, pos)
        late = torch.zeros_like(out)
        threading.Thread(target=lambda: (time.sleep(0.002), late.copy_(out)), daemon=True).start()
        return late                                          # returned at once, right only 2 ms later
    """),
    "rewrites_its_inputs": dict(body="""
        ids.fill_(7)                                         # answer for token 7, whatever was asked
        key = (phase, tuple(ids.shape), pos.numpy().tobytes())
        if key not in STATE:
            STATE[key] = f(ids, pos)
        return STATE[key]
    """),
    "cadence_detector": dict(body="""
        now = time.monotonic()
        fast = now - STATE.get("t", 0.0) < 0.003             # back-to-back calls: the timing loop
        STATE["t"] = now
        if fast and phase in STATE:
            return STATE[phase].clone() if STATE[phase].shape[1] == ids.shape[1] else f(ids, pos)
        STATE[phase] = f(ids, pos)
        return STATE[phase].clone()
    """),
    "one_call_behind": dict(body="""
        prev = STATE.get(phase)
        STATE[phase] = f(ids, pos)
        return prev if prev is not None and prev.shape == STATE[phase].shape else STATE[phase]
    """),
    "patches_the_checks": dict(setup="""
        import tkcc.runtime.validation as validation
        validation.compare = lambda *a, **k: 0.0             # in its own process: the checks run elsewhere
        validation.ValidationFailure = Exception
    """, body="return f(ids, pos) + 0.25"),
    "patches_the_dispatcher": dict(setup="""
        LIB = torch.library.Library("aten", "IMPL")
        LIB.impl("linear", lambda x, w, b=None: torch.zeros(*x.shape[:-1], w.shape[0]), "CPU")
    """, body="return f(ids, pos)"),
}


# what a refusal must say, for the cheats whose outputs are wrong somewhere ("": any validation failure)
MUST_REFUSE = {"address_cache": "", "address_cache_in_timing": "timed call", "first_shape_only": "",
               "constant_output": "",
               "validated_shapes_only": "timed call", "honest_first_calls": "timed call",
               "forgets_cache_writes": "cache state", "fills_output_later": "", "rewrites_its_inputs": "input",
               "cadence_detector": "", "one_call_behind": "", "patches_the_checks": "not bit-exact",
               "patches_the_dispatcher": ""}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_a_cheat_is_refused_or_measured_at_its_true_speed(adversary, name):
    res = adversary.run({"source": adversary.source(name, **CHEATS[name])})
    rec = res["tiers"]["fast"]
    if name in MUST_REFUSE:
        assert not res["ok"], (name, rec.get("measurement", {}).get("objective"), adversary.honest_objective)
        assert rec["failure"] == "invalid" and MUST_REFUSE[name] in rec["reason"], rec
        assert "measurement" not in rec or rec["measurement"] is None
        return
    assert res["ok"], rec  # right outputs: it is measured, by the worker's clock
    m = rec["measurement"]
    assert m["objective"] <= NOISE * adversary.honest_objective, (name, m["objective"], adversary.honest_objective)
    assert all(b["checked"] >= 2 for b in m["buckets"]) and m["checks"]["fresh_inputs"], m["buckets"]


def test_the_timer_patch_reaches_nothing(adversary):
    """Measured by the worker's clock: the patch in the candidate's process changes nothing, and the next
    candidate is measured as before."""
    before = adversary.honest()
    res = adversary.run({"source": adversary.source("patch_timer_2", **CHEATS["patch_timer"])})
    assert res["ok"], res
    obj = res["tiers"]["fast"]["measurement"]["objective"]
    after = adversary.honest()
    # a patched clock reaching the measurement inflates the objective by orders of magnitude (1294 against an
    # honest 131 in the issue); the honest runs beside it bound what this machine's load can do to it
    honest = max(before, after, adversary.honest_objective)
    assert obj <= honest * NOISE, (obj, before, after)
    assert after <= max(before, adversary.honest_objective) * NOISE, (before, after)  # the next one as before


def test_a_candidate_is_every_file_it_can_import(adversary):
    """The same candidate.py beside another helper is another candidate, and runs its own helper."""
    body = "return helper.forward(f, ids, pos)"
    paths = []
    for folder, helper in (("ident_a", "def forward(f, ids, pos):\n    return f(ids, pos)\n"),
                           ("ident_b", "def forward(f, ids, pos):\n    return f(ids, pos) + 1\n")):
        path = adversary.source("ident", body, setup="import helper", folder=folder)
        with open(path.replace("candidate.py", "helper.py"), "w") as f:
            f.write(helper)
        paths.append(path)
    with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
        assert a.read() == b.read()  # byte-identical candidate.py
    good, bad = adversary.run({"source": paths[0]}), adversary.run({"source": paths[1]})
    assert good["candidate"] != bad["candidate"]
    assert good["ok"], good
    assert not bad["ok"] and "not bit-exact" in bad["reason"], bad
    again = adversary.run({"source": paths[0]})  # and the first is still itself
    assert again["ok"] and again["candidate"] == good["candidate"]
