"""tkcc's version, in a module that imports nothing: every layer may record it (an artifact's manifest, a saved
model's settings) without importing the API (``tkcc/__init__``)."""

__version__ = "0.1.0"
