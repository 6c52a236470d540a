"""Shared fixtures for the server tests: one compiled olmoe-tiny (an MoE, so routing is recorded) per session."""
from __future__ import annotations

import pytest

MAX_CACHE_LEN = 1024


@pytest.fixture(scope="session")
def builder():
    from tkcc.frontend.models import build_model
    from tkcc.commands.http_forwards import ForwardBuilder

    return ForwardBuilder(build_model("olmoe-tiny"), max_cache_len=MAX_CACHE_LEN)


@pytest.fixture(scope="session")
def compiled(builder):
    """The first forward, as `tkcc serve --http` builds it (the default plan, through tkcc.compile)."""
    return builder.first()[0]
