"""Runtime: the persistent Engine, its RPC server and client, graph capture, tiers, timing, golden checks."""
