"""Moved to ``tkcc.backend`` (the API layer: the backend runs the build pipeline); kept for old imports."""
from tkcc.backend import TkccBackend, decisions, make_backend, register, tkcc_backend  # noqa: F401
