"""Shared fixtures for traffic tests: bundled traces, the optional shared trace folder."""
from pathlib import Path

import pytest

from tkcc.traffic import bundled_trace, load_trace

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    if not SHARED.is_dir():
        pytest.skip("../shared/traces not present")
    return SHARED


@pytest.fixture(scope="session")
def conv():
    return load_trace(bundled_trace("azure-conv"))


@pytest.fixture(scope="session")
def code():
    return load_trace(bundled_trace("azure-code"))


@pytest.fixture(scope="session")
def client80():
    return load_trace(bundled_trace("servegen-m-large-80"), seed=0)
