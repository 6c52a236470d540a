"""Runtime: the persistent Engine, its RPC server and client, graph capture, tiers, timing, golden checks."""


def __getattr__(name):
    # Lazy: `import tkcc.runtime` must not pull in torch for a client that only talks RPC.
    if name == "EngineClient":
        from tkcc.runtime.client import EngineClient

        return EngineClient
    if name in ("Measurement", "BucketTiming"):
        from tkcc.runtime import measurement

        return getattr(measurement, name)
    raise AttributeError(f"module 'tkcc.runtime' has no attribute {name!r}")


__all__ = ["EngineClient", "Measurement", "BucketTiming"]
