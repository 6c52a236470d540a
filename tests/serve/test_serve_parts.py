"""The server's parts, each against a plain reference: detokenisation, stop strings, prefix hashes, the
rolling trace, MoE counts (vs the model's own router modules in eager), timing decisions on a fake clock."""
from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tkcc.errors import TkccError


# ---- tokenizers ------------------------------------------------------------------------------

def test_byte_tokenizer_round_trips_and_streams_whole_characters():
    from tkcc.serve.tokenizer import ByteTokenizer

    tok = ByteTokenizer(256)
    text = "héllo wörld ☃ 日本語 🙂"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    rng = random.Random(0)
    for _ in range(20):  # any bytes, valid UTF-8 or not: the stream emits what a whole decode gives
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        inc = tok.incremental()
        got = "".join(inc.push(t) for t in ids) + inc.flush()
        assert got == bytes(ids).decode("utf-8", errors="replace")
    inc = tok.incremental()
    assert [inc.push(t) for t in "☃".encode()] == ["", "", "☃"]
    assert ByteTokenizer(1000).decode([104, 300, 105]) == "h<|300|>i"
    with pytest.raises(TkccError, match="at least 256"):
        ByteTokenizer(100)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer trained here and saved in the Hugging Face layout."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld ☃ 日本語", "once upon a time there was"] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["</s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="</s>")
    d = tmp_path_factory.mktemp("hf-tokenizer")
    tok.save_pretrained(d)
    return str(d)


def test_hf_tokenizer_loads_from_a_directory_and_streams_like_a_whole_decode(hf_dir):
    from tkcc.serve.stops import TextStop
    from tkcc.serve.tokenizer import chat_ids, load_tokenizer, plain_chat_text

    tok = load_tokenizer(hf_dir, 1000)
    eos = next(iter(tok.eos_token_ids))
    for text in ["the quick brown fox", "héllo wörld ☃ 日本語 and more", "a"]:
        ids = tok.encode(text)
        inc = tok.incremental()
        assert "".join(inc.push(t) for t in ids) + inc.flush() == tok.decode(ids) == text
        stop = TextStop(tok, 100)
        pieces = [stop.push(t) for t in ids + [eos, 5]]
        assert "".join(p for p, _ in pieces[:len(ids) + 1]) == text and pieces[len(ids)][1] == "stop"
    msgs = [{"role": "user", "content": "hi"}]
    assert chat_ids(tok, msgs) == tok.encode(plain_chat_text(msgs))  # no chat template: the plain one
    with pytest.raises(TkccError, match="vocabulary"):
        load_tokenizer(hf_dir, 100)
    with pytest.raises(TkccError, match="does not exist"):
        load_tokenizer(hf_dir + "-missing", 1000)


def _stop_reference(tok, ids, stops, max_tokens):
    """Plain reference: decode the whole prefix after every token and look for a stop string."""
    for n in range(1, min(len(ids), max_tokens) + 1):
        text = tok.decode(ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], n, "stop"
    n = min(len(ids), max_tokens)
    return tok.decode(ids[:n]), n, "length"


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_streamed_match_a_whole_text_search(seed):
    from tkcc.serve.stops import TextStop
    from tkcc.serve.tokenizer import ByteTokenizer

    rng = random.Random(seed)
    tok = ByteTokenizer(256)
    alphabet = "abcé☃"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        ids = tok.encode(text)
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 3))]
        max_tokens = rng.randrange(1, len(ids) + 3)
        want = _stop_reference(tok, ids, stops, max_tokens)
        ts = TextStop(tok, max_tokens, stops)
        out, n, fin = "", 0, None
        for t in ids:
            piece, fin = ts.push(t)
            out, n = out + piece, n + 1
            if fin:
                break
        if fin is None:  # the prompt ran out before max_tokens: the request ended otherwise
            out += ts.end("length")
            fin = "length"
        assert (out, n, fin) == want, (text, stops, max_tokens)
        assert ts.text == out


# ---- the trace ----------------------------------------------------------------------------------

def test_prefix_hashes_are_chained_over_full_blocks():
    from tkcc.serve.recorder import BLOCK, prefix_hashes

    rng = np.random.default_rng(0)
    a = rng.integers(0, 50000, 5 * BLOCK + 3).tolist()
    b = a[:2 * BLOCK] + [a[2 * BLOCK] + 1] + a[2 * BLOCK + 1:]
    ha, hb = prefix_hashes(a), prefix_hashes(b)
    assert len(ha) == 5 and ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))
    assert prefix_hashes(a[:BLOCK - 1]) == [] and prefix_hashes(a[:BLOCK]) == ha[:1]
    assert prefix_hashes(a[BLOCK:2 * BLOCK])[0] != ha[1]  # a block's hash depends on everything before it
    assert all(0 <= h < 2 ** 63 for h in ha)


def test_rolling_trace_rotates_keeps_the_newest_and_loads_back(tmp_path):
    from tkcc.serve.recorder import RollingTrace
    from tkcc.traffic.loaders import load_trace

    moe = {"num_layers": 2, "num_experts": 3, "top_k": 1}
    rec = RollingTrace(tmp_path, model="m", moe=moe, rotate_requests=3, keep=2)
    for i in range(8):
        rec.record(0.5 * i, list(range(20 + i)), i, moe=[[i, 0, 1], [0, i, 1]])
    rec.close()
    files = sorted(tmp_path.glob("serve-*.jsonl"))
    assert [f.name[-10:] for f in files] == ["0002.jsonl", "0003.jsonl"] and rec.path == files[-1]
    parts = [load_trace(f) for f in files]
    assert [len(p) for p in parts] == [3, 2]
    assert parts[0].arrival_s.tolist() == [1.5, 2.0, 2.5] and parts[1].input_tokens.tolist() == [26, 27]
    assert parts[0].start_time == parts[1].start_time and parts[1].moe_counts[1].tolist() == [[7, 0, 1], [0, 7, 1]]


def test_the_server_side_watch_follows_the_trace_across_rotations(tmp_path):
    from tkcc.serve.recorder import RollingTrace
    from tkcc.serve.watching import _ServerTrace

    rec = RollingTrace(tmp_path, model="m", rotate_requests=2, keep=5)
    server = SimpleNamespace(recorder=rec)
    rolling = _ServerTrace(server, "1h")
    seen = 0
    for i in range(7):
        rec.record(float(i), [1, 2, 3], i)
        seen += rolling.update()
    assert seen == 7 and rolling.current().output_tokens.tolist() == list(range(7))


def test_watch_stops_when_its_event_is_set():
    from tkcc.agents.watch import watch

    stop = threading.Event()
    stop.set()
    assert watch(None, None, None, None, name="n", model="m", budget_s=1, stop=stop) == []


# ---- MoE counts ---------------------------------------------------------------------------------

def _hooked_counts(model, ids, num_experts):
    """Reference: the model's own router modules in eager HF, through forward hooks."""
    got = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out, k=k: got.__setitem__(k, out[-1]))
             for k, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return [torch.bincount(got[k].reshape(-1), minlength=num_experts).tolist() for k in sorted(got)]


@pytest.mark.parametrize("name", ["olmoe-tiny", "mixtral-tiny"])
def test_expert_counts_equal_the_models_own_routers(name, compiled, builder):
    from tkcc.frontend import capture_model
    from tkcc.serve.routing import CHUNK, ExpertCounter

    program = compiled.program if name == "olmoe-tiny" else capture_model(name, max_cache_len=512)
    counter = ExpertCounter(program)
    vocab = program.meta["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    for n in (1, 17, CHUNK + 44):
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        got = counter.count(ids)
        assert got == _hooked_counts(program.model, ids, counter.num_experts)
        assert all(sum(row) == counter.top_k * n for row in got)


def test_dense_models_have_no_routers():
    from tkcc.frontend import capture_model
    from tkcc.serve.routing import ExpertCounter, is_moe

    p = capture_model("llama-tiny", max_cache_len=64)
    assert not is_moe(p)
    with pytest.raises(TkccError, match="not an MoE"):
        ExpertCounter(p)


# ---- scheduling decisions on a fake clock --------------------------------------------------------

class FakeClock:
    def __init__(self, step=0.0):
        self.t, self.step = 1000.0, step

    def __call__(self):
        self.t += self.step
        return self.t


def _job(tok, prompt, n, events, timeout_s=10.0):
    from tkcc.serve.scheduler import Job
    from tkcc.serve.stops import TextStop

    return Job(prompt, TextStop(tok, n), events.append, timeout_s)


def test_timeouts_and_retry_after_follow_the_clock(compiled):
    from tkcc.serve.scheduler import Done, Failed, QueueFull, Scheduler, Served, Token
    from tkcc.serve.tokenizer import ByteTokenizer

    tok = ByteTokenizer(256)
    want = compiled.generate(torch.tensor([[3, 4, 5]]), 6)[0].tolist()
    clock = FakeClock()
    sched = Scheduler(Served(compiled, "t"), max_queue=1, clock=clock).start()
    try:
        gate = threading.Event()
        sched.call(gate.wait)
        waited, served, over = [], [], []
        sched.submit([_job(tok, [3, 4, 5], 6, waited, timeout_s=5.0)])
        sched.submit([_job(tok, [3, 4, 5], 6, served, timeout_s=50.0)])
        with pytest.raises(QueueFull) as e:
            sched.submit([_job(tok, [1], 1, over)])
        assert e.value.retry_after_s == 3  # no service time measured yet: 1 s per request ahead (2 waiting + it)
        clock.t += 10.0  # 10 s pass before the scheduler gets to them
        gate.set()
        sched.call(lambda: None).result(30)
        _wait_for(lambda: served and isinstance(served[-1], Done))
        assert isinstance(waited[0], Failed) and waited[0].status == 504 and "waited 10.0 s" in waited[0].message
        assert [e.id for e in served if isinstance(e, Token)] == want and served[-1].finish == "length"
        # service time is what the clock says a request took (0.25 s per clock read); Retry-After follows it
        clock.step = 0.25
        timed = []
        sched.submit([_job(tok, [3, 4, 5], 6, timed, timeout_s=1.0)])
        _wait_for(lambda: timed and isinstance(timed[-1], Done))
        assert timed[-1].finish == "timeout" and 0 < sum(isinstance(e, Token) for e in timed) < 6
        assert sched.retry_after() >= 1
    finally:
        sched.stop()


def _wait_for(cond, timeout_s=30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


# ---- addresses and loading ----------------------------------------------------------------------

def test_addresses_and_the_loopback_rule():
    from tkcc.serve.runner import bind, parse_address

    assert parse_address("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_address(":9000") == ("127.0.0.1", 9000) and parse_address("8001") == ("127.0.0.1", 8001)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("localhost:http", "1.2.3.4:70000", "[::1]80"):
        with pytest.raises(TkccError, match="--http"):
            parse_address(bad)
    with pytest.raises(TkccError, match="--allow-remote"):
        bind("0.0.0.0", 0)
    s = bind("127.0.0.1", 0)
    try:
        assert s.getsockname()[1] > 0
    finally:
        s.close()


def test_models_the_server_refuses_by_name(tmp_path):
    from tkcc.commands.http_forwards import load_model

    with pytest.raises(TkccError, match="built-in models"):
        load_model("no-such-model", torch.float32, "cpu")
    with pytest.raises(TkccError, match="config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")
    with pytest.raises(TkccError, match="Program factory"):
        load_model("models.py:build", torch.float32, "cpu")


def test_a_saved_artifact_is_served_as_compiled(compiled, builder, tmp_path):
    from tkcc.commands.http_forwards import load_artifact

    prompt = torch.tensor([[1, 2, 3]])
    want = compiled.generate(prompt, 8)
    compiled.save(tmp_path / "art")
    loaded = load_artifact(str(tmp_path / "art"), builder.model)
    assert torch.equal(loaded.generate(prompt, 8), want)


def test_a_server_started_from_an_artifact_builds_each_plan_shipped_into_it(compiled, builder, tmp_path):
    """A loaded artifact never captured, so its Program holds no graphs: every plan shipped builds on a captured
    one (the H200 drift run served an artifact, and the second ship, with the artifact's Program free, was built
    on it and failed: 'greedy() needs the phases prefill and decode'; so did every ship after it)."""
    from tkcc.serve.scheduler import Scheduler, Served
    from tkcc.serve.swap import Swapper

    prompt = torch.tensor([[4, 5, 6]])
    want = compiled.generate(prompt, 6)
    compiled.save(tmp_path / "art")
    first, tag = builder.first(artifact=str(tmp_path / "art"))
    assert not first.program.graphs and not builder.can_build_on(first.program)
    assert builder.can_build_on(compiled.program)
    sched = Scheduler(Served(first, tag)).start()
    swapper = Swapper(SimpleNamespace(scheduler=sched), builder)
    try:
        recs = [swapper.ship({"plan": compiled.plan.to_json()}) for _ in range(2)]
        served = sched.current.compiled
    finally:
        sched.stop()
    assert not swapper.failures, swapper.failures
    assert [r["previous"] for r in recs] == [tag] + [r["current"] for r in recs[:-1]]
    assert served.program.graphs and served.program is not compiled.program
    assert torch.equal(served.generate(prompt, 6), want)


def test_the_server_builds_and_searches_in_its_artifacts_mode():
    """A server started from an artifact builds and searches in the mode it was compiled in; --mode exact over a
    tolerance artifact is refused by name."""
    from tkcc.commands.http_cmd import _serving_mode

    def served(mode):
        return SimpleNamespace(report=lambda print_report=False: SimpleNamespace(mode=mode))

    args = lambda mode, artifact="out/model": SimpleNamespace(mode=mode, artifact=artifact)  # noqa: E731
    assert _serving_mode(args(None), served("tolerance")) == "tolerance"
    assert _serving_mode(args(None), served("exact")) == "exact"
    assert _serving_mode(args("tolerance"), served("exact")) == "tolerance"
    assert _serving_mode(args(None, None), served("tolerance")) == "exact"  # no artifact: the default
    with pytest.raises(TkccError, match="--mode exact: --artifact out/model was compiled in tolerance mode"):
        _serving_mode(args("exact"), served("tolerance"))


def test_ids_are_read_one_step_late_in_order():
    """The CUDA path's order, with a recording stand-in for the device copy: step i+1 starts before id i is
    read, every id comes out once and in order, and stopping early closes the steps."""
    from tkcc.serve.scheduler import one_step_late

    log = []

    def steps(n):
        try:
            for i in range(n):
                log.append(f"step {i}")
                yield i
        finally:
            log.append("closed")

    def start_copy(t):
        log.append(f"copy {t}")
        return lambda: (log.append(f"read {t}"), t)[1]

    assert list(one_step_late(steps(3), start_copy)) == [0, 1, 2]
    assert log == ["step 0", "copy 0", "step 1", "copy 1", "read 0", "step 2", "copy 2", "read 1", "closed",
                   "read 2"]
    log.clear()
    s = steps(10)
    for v in one_step_late(s, start_copy):
        if v == 1:
            break
    s.close()
    assert log[-1] == "closed" and "step 3" not in log  # a stop at id 1 spent one step more (step 2), no more
    assert list(one_step_late(steps(0), start_copy)) == []


def test_a_tolerance_plan_is_golden_checked_before_it_serves(tmp_path):
    """`tkcc serve --http --mode tolerance --plan P`: the first forward is checked as every later ship is (the
    pass manager's numerics, then the golden check); a plan past the tolerance is refused at start-up with the
    pass and its numbers, not served unchecked."""
    import torch

    from tkcc.cli import build_parser
    from tkcc.commands.http_cmd import _build_server
    from tkcc.passes import register
    from tkcc.passes.graph_pass import GraphPass

    @register
    class _ScaleLogits(GraphPass):
        """Multiplies the first graph output by 1.5: far past any tolerance, on purpose."""

        name = "test-serve-scale-output"
        exact = False
        params = {}

        def rewrite(self, gm, info, phase):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            first = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
            with gm.graph.inserting_before(out):
                bumped = gm.graph.call_function(torch.ops.aten.mul.Tensor, (first, 1.5))
            out.args = ((bumped, *out.args[0][1:]),) if isinstance(out.args[0], (tuple, list)) else (bumped,)
            info.matched += 1

    def args(*extra):
        return build_parser().parse_args(["serve", "--http", "127.0.0.1:0", "--model", "llama-tiny", "--device",
                                          "cpu", "--no-record", "--max-cache-len", "64", "--admin-token-file",
                                          str(tmp_path / "admin.token"), *extra])

    with pytest.raises(TkccError, match="pass 'test-serve-scale-output' .* changed the outputs .* beyond tolerance"):
        _build_server(args("--mode", "tolerance", "--plan", '[{"name": "test-serve-scale-output"}]'))
