"""Hot swaps on a GPU, while requests stream: the H200 benchmark's failure, as a test.

There a swap captured its forward's CUDA graph beside the thread serving the old one: a request failed
("operation not permitted when stream is capturing") and the new forward, its capture spoilt, decoded
eagerly at about 8x the step. Now the build, its captures and its warm-up run on the scheduler thread.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Events:
    def __init__(self):
        self.events, self.second = [], threading.Event()

    def __call__(self, ev):
        from tkcc.serve.scheduler import Token

        self.events.append(ev)
        if sum(isinstance(e, Token) for e in self.events) == 2:
            self.second.set()


@gpu
@pytest.mark.gpu
def test_swaps_beside_streaming_requests_fail_none_and_each_forward_replays_its_decode_graph():
    from tkcc.compiler import default_plan
    from tkcc.frontend.models import build_model
    from tkcc.commands.http_forwards import ForwardBuilder
    from tkcc.serve.scheduler import Done, Failed, Job, Token
    from tkcc.serve.server import Server
    from tkcc.serve.stops import TextStop

    builder = ForwardBuilder(build_model("llama-tiny", dtype=torch.bfloat16, device="cuda"), max_cache_len=256)
    compiled, _tag = builder.first()
    server = Server(compiled, model_name="llama-tiny", builder=builder).start()
    specs = [{"baseline": True}, {"plan": default_plan().to_json()}, {"baseline": True}]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 160, (8 * len(specs),), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    try:
        assert server.warm_up()["replayed"]
        # exact-mode plans give the same tokens; computed before any swap, on the forward serving first
        want = server.scheduler.call(lambda: [compiled.generate(torch.tensor([p]), 24)[0].tolist()
                                              for p in prompts]).result(600)
        seen, records = [], []
        for w, spec in enumerate(specs):
            wave = [_Events() for _ in range(8)]
            jobs = [Job(p, TextStop(server.tokenizer, 24), ev, 600.0) for p, ev in zip(prompts[8 * w:], wave)]
            server.scheduler.submit(jobs)
            assert wave[0].second.wait(600)  # requests in flight and queued: now ship beside them
            records.append(server.swapper.ship(spec))
            deadline = time.monotonic() + 600
            while not all(ev.events and isinstance(ev.events[-1], (Done, Failed)) for ev in wave):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            seen += [(j, ev) for j, ev in zip(jobs, wave)]
    finally:
        server.close()
    for k, (job, ev) in enumerate(seen):
        assert not any(isinstance(e, Failed) for e in ev.events), [e for e in ev.events if isinstance(e, Failed)]
        assert [e.id for e in ev.events if isinstance(e, Token)] == want[k], f"request {k} on {job.forward}"
    assert len({job.forward for job, _ in seen}) >= 2  # the waves were served by more than one forward
    for r in records:
        assert r["decode_graph"]["replayed"] and not r["decode_graph"]["refused"], r
