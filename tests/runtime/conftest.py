"""Fixtures for the engine tests: one engine process per test module, talked to over its Unix socket."""
from __future__ import annotations

import pytest

from engine_helpers import (BLOCKS_ARGS, BLOCKS_MODEL, HERE, LLM_ARGS, RunningEngine, launch_engine,  # noqa: F401
                            ready_engine, start_engine, stop_engine)


@pytest.fixture(scope="session")
def _launched(request, tmp_path_factory):
    """Start every engine the selected tests need at once: their start-ups overlap (each uses one thread)."""
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    launched = {}
    if "llm_engine" in wanted:
        launched["llm"] = launch_engine(tmp_path_factory.mktemp("llm-engine"), "olmoe-tiny", *LLM_ARGS)
    if "blocks_engine" in wanted:
        launched["blocks"] = launch_engine(tmp_path_factory.mktemp("engine"), BLOCKS_MODEL, *BLOCKS_ARGS)
    started = {}
    yield launched, started
    for name, la in launched.items():
        eng = started.get(name)
        if eng is not None:
            stop_engine(eng)
        else:
            la[0].kill()
            la[0].wait(30)


def _engine(launched_started, name: str) -> RunningEngine:
    launched, started = launched_started
    if name not in started:
        started[name] = ready_engine(launched[name])
    return started[name]


@pytest.fixture(scope="session")
def blocks_engine(_launched):
    return _engine(_launched, "blocks")


@pytest.fixture(scope="session")
def llm_engine(_launched):
    return _engine(_launched, "llm")
