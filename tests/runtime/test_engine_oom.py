"""The engine's answer to running out of device memory: free its own CUDA graphs and run the operation once more.

On an H200 the engine's graphs (one private pool each, 16 GiB a prefill chunk for olmoe-16l) filled the device
after the first ship, and every later candidate crashed out of memory. The decision is tested here on a
stand-in for the engine (no GPU needed): the retry happens once, only after something was freed, and only on
one rank; a second failure is raised as it is.
"""
import pytest
import torch

from tkcc.runtime.engine import EngineCore, _freeing_graphs_on_oom


class _Core:
    def __init__(self, fails: int, graphs: int = 5, device: str = "cuda", tp: int = 1):
        self.device, self.tp = torch.device(device), tp
        self.fails, self.graphs, self.calls, self.freed = fails, graphs, 0, 0

    def free_graphs(self) -> int:
        n, self.graphs = self.graphs, 0
        self.freed += 1
        return n

    @_freeing_graphs_on_oom
    def op_validate(self, candidate: str) -> dict:
        self.calls += 1
        if self.calls <= self.fails:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        return {"candidate": candidate, "ok": True}


def test_out_of_memory_frees_the_graphs_and_runs_once_more():
    core = _Core(fails=1)
    out = core.op_validate("c1")
    assert out["ok"] and core.calls == 2 and core.freed == 1 and core.graphs == 0
    assert "Tried to allocate 16.00 GiB" in out["graphs_freed"]


def test_a_second_out_of_memory_is_the_candidates():
    core = _Core(fails=2)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        core.op_validate("c1")
    assert core.calls == 2 and core.freed == 1


@pytest.mark.parametrize("kw", [{"graphs": 0}, {"device": "cpu"}, {"tp": 2}])
def test_no_retry_without_graphs_off_cuda_or_on_a_rank_of_a_group(kw):
    core = _Core(fails=1, **kw)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        core.op_validate("c1")
    assert core.calls == 1


def test_the_operations_that_capture_graphs_retry():
    for name in ("op_validate", "op_swap", "op_measure"):
        assert getattr(getattr(EngineCore, name), "frees_graphs_on_oom", False), name
