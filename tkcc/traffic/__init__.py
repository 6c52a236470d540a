"""Traffic: trace files -> Trace -> Workload; drift; serving metrics. Imports no other tkcc package."""
from tkcc.traffic.trace import Trace

__all__ = ["Trace"]
