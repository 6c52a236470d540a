"""The fused step's kernel configs are timed once per model: the tier built second (the same shapes) takes the
configs the first timed (``Program.tuned``), and a discovery run (nothing launches, timings are meaningless)
records nothing."""
from types import SimpleNamespace

import torch

from tkcc.passes import decode_graph


class FakeDecoder:
    def __init__(self, configs=None, width=64):
        self.configs = dict(configs or {})
        self.layers = [{"qkv": torch.empty(96, width), "top_k": 2}]
        self.lm_head = torch.empty(100, width)
        self.max_cache_len, self.device, self.dtype, self.spans = 32, torch.device("cpu"), torch.float32, ()
        self.timed = []

    def tune(self):
        self.timed.append("tune")
        self.configs["qkv"] = (4, 512, 4)
        return {}

    def tune_step(self, kinds=None):
        self.timed.append("tune_step")
        self.configs["lm_head"] = (2, 1024, 4)
        return {}

    def reset(self, token, pos):
        pass

    def use_span(self, position):
        pass


def _build(monkeypatch, program, width=64, discovering=False):
    built = []

    def decoder_for(model, max_cache_len, kv, opts, configs=None):
        built.append(configs)
        return FakeDecoder(configs, width)
    monkeypatch.setattr(decode_graph, "decoder_for", decoder_for)
    monkeypatch.setattr("tkcc.kernels.discovery.discovering", lambda: discovering)
    dec = FakeDecoder(width=width)
    info = SimpleNamespace(notes=[])
    cache = [torch.zeros(1, 32, 4)]
    out = decode_graph._tuned(program, dec, {"pdl": True}, cache, cache, False, info)
    return dec, out, built, info


def test_the_second_tier_takes_the_first_tiers_configs(monkeypatch):
    slow = SimpleNamespace(model=None, tuned={})
    fast = SimpleNamespace(model=None, tuned=slow.tuned)  # runtime.programs.build_tiers shares it
    dec, out, built, _ = _build(monkeypatch, fast)
    assert dec.timed == ["tune", "tune_step"] and out is dec and not built
    dec2, out2, built2, info = _build(monkeypatch, slow)
    assert dec2.timed == [] and built2 == [{"qkv": (4, 512, 4), "lm_head": (2, 1024, 4)}]
    assert out2.configs == dec.configs and "other tier" in info.notes[0]


def test_other_shapes_or_a_discovery_run_are_timed_afresh(monkeypatch):
    prog = SimpleNamespace(model=None, tuned={})
    dec, *_ = _build(monkeypatch, prog, discovering=True)
    assert dec.timed == ["tune", "tune_step"] and prog.tuned == {}  # nothing recorded from a discovery run
    _build(monkeypatch, prog)
    dec3, _, built, _ = _build(monkeypatch, prog, width=128)  # another model's shapes: not the same configs
    assert dec3.timed == ["tune", "tune_step"] and not built and len(prog.tuned) == 2


def test_the_tiers_of_an_engine_share_what_was_tuned():
    from tkcc.frontend.capture import capture_model
    from tkcc.runtime.programs import build_tiers

    prog = capture_model("llama-tiny", "float32", "cpu", max_cache_len=16, phases=["decode"])
    tiers = build_tiers(prog, 1)
    assert tiers["fast"] is not tiers["slow"] and tiers["fast"].tuned is tiers["slow"].tuned


class FakeCache:
    num_layers, max_cache_len = 3, 32

    def key(self, i):
        return torch.zeros(1, 1, 32, 4)

    value = key


def test_a_tier_of_a_few_blocks_is_tuned_on_the_whole_model(monkeypatch):
    """The fast tier's own timing (two blocks) picked configs 20% slower on the whole model: a build on it
    times the whole model's decoder (into the shared memo) and takes its configs, timing nothing itself."""
    whole = SimpleNamespace(model="whole-model", tuned={}, state=FakeCache())
    fast = SimpleNamespace(model="fast-model", tuned=whole.tuned, whole=whole)
    dec, out, built, info = _build(monkeypatch, fast)
    assert dec.timed == [], "the tier's own decoder must not be timed"
    assert built[0] is None and built[1] == {"qkv": (4, 512, 4), "lm_head": (2, 1024, 4)}  # whole's, then the tier's
    assert out.configs == built[1] and len(whole.tuned) == 1
    assert any("whole model (3 layers)" in n for n in info.notes)
    dec2, out2, built2, _ = _build(monkeypatch, whole)  # the slow tier then times nothing either
    assert dec2.timed == [] and built2 == [built[1]]


def test_a_discovery_block_on_a_gpu_engine_records_nothing(monkeypatch):
    """A GPU engine lists a candidate's kernels in a ``deferring`` block without a stand-in driver: launches are
    off there too, so what its tuner picks is of nothing, and must not become the configs the real build takes
    (the memo once recorded them, and olmoe-16l's shipped step ran 35% slow)."""
    from tkcc.kernels.discovery import deferring, discovering

    monkeypatch.setattr(decode_graph, "decoder_for", lambda *a, **k: FakeDecoder(a[4] if len(a) > 4 else None))
    prog = SimpleNamespace(model=None, tuned={})
    cache = [torch.zeros(1, 32, 4)]
    assert not discovering()
    with deferring(lambda job: None):  # no target: the machine's own driver, as on the H200
        assert discovering()
        decode_graph._tuned(prog, FakeDecoder(), {"pdl": True}, cache, cache, False, SimpleNamespace(notes=[]))
    assert not discovering() and prog.tuned == {}
