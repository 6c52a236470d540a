"""Parallelism layout: legal layouts, the cost model, machine measurements, multi-process execution.

    from tkcc.parallel import launch, RankGroup, rank_layouts, machine_profile, dims_for_model

The sharding itself is the ``sharding`` pass (``tkcc/passes/sharding/``: the graph
rewrite, the placements and the layout check); this package builds on it. See docs/parallel.md.
"""
from tkcc.parallel.cost import Prediction, predict, predict_workload, rank_layouts
from tkcc.parallel.group import RankGroup
from tkcc.parallel.launch import RankError, launch
from tkcc.parallel.layout import (DEGREES, STRATEGIES, LayoutError, ModelDims, check_layout, dims_for_model,
                                  dims_from_config, legal_layouts)
from tkcc.parallel.machine import MachineProfile, machine_profile

__all__ = ["launch", "RankGroup", "RankError", "LayoutError", "ModelDims", "Prediction", "MachineProfile",
           "predict", "predict_workload", "rank_layouts", "machine_profile", "check_layout", "legal_layouts",
           "dims_for_model", "dims_from_config", "DEGREES", "STRATEGIES"]
