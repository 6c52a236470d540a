"""Fixtures for the engine tests: one engine process per test module, talked to over its Unix socket.

Per module, not per session: a live engine is never free (its worker's watchdog reads each kept trial's
memory ten times a second, about a tenth of a core), and under ``--dist loadfile`` the modules that share
an engine land on either worker, so a session engine idled there until the last test of the run.
"""
from __future__ import annotations

import pytest

from engine_helpers import (BLOCKS_ARGS, BLOCKS_MODEL, HERE, LLM_ARGS, RunningEngine, launch_engine,  # noqa: F401
                            ready_engine, start_engine, stop_engine)


@pytest.fixture(scope="module")
def blocks_engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("engine"), BLOCKS_MODEL, *BLOCKS_ARGS)
    yield eng
    stop_engine(eng)


@pytest.fixture(scope="module")
def llm_engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("llm-engine"), "olmoe-tiny", *LLM_ARGS)
    yield eng
    stop_engine(eng)
