"""Traffic: trace files -> Trace -> Workload; drift; serving metrics. Imports no other tkcc package."""
from tkcc.traffic.buckets import workload_from_trace
from tkcc.traffic.drift import DriftReport, DriftWindow, compare_windows, detect_drift, parse_window, windowed
from tkcc.traffic.follow import RollingWorkload, TraceFollower
from tkcc.traffic.loaders import FORMATS, bundled_trace, detect_format, iter_trace, load_trace
from tkcc.traffic.metrics import (OBJECTIVES, BucketTimingModel, FunctionTimingModel, higher_is_better, objective,
                                  serving_metrics)
from tkcc.traffic.routing import Routing
from tkcc.traffic.stats import nearest_rank, trace_stats
from tkcc.traffic.tkcc_format import TraceRecorder, write_trace
from tkcc.traffic.trace import Trace
from tkcc.traffic.workload import Bucket, Workload

__all__ = [
    "Trace", "Workload", "Bucket", "Routing", "load_trace", "iter_trace", "detect_format", "bundled_trace", "FORMATS",
    "workload_from_trace", "serving_metrics", "objective", "higher_is_better", "OBJECTIVES", "BucketTimingModel",
    "FunctionTimingModel", "detect_drift", "compare_windows", "windowed", "parse_window", "DriftReport",
    "DriftWindow", "RollingWorkload", "TraceFollower", "TraceRecorder", "write_trace", "trace_stats", "nearest_rank",
]
