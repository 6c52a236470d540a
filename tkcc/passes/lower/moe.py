"""MoE blocks: router (softmax/sigmoid, top-k, renormalisation), routed experts, shared experts."""
from __future__ import annotations

REWRITES: list = []
