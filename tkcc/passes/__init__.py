"""Passes: Pass, the registry, PassPlan, PassManager and pass logs; one module per pass family."""
from tkcc.passes.base import Pass, RewriteInfo, all_passes, get_pass, register
from tkcc.passes.plan import PassPlan, PassStep

__all__ = ["Pass", "PassPlan", "PassStep", "RewriteInfo", "all_passes", "get_pass", "register"]
