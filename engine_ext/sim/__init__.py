"""Agent traces, metrics and a discrete-event simulator that runs the
engines' own scheduling policies against a cost model (no torch)."""

from .metrics import RequestRecord, percentile, summarize
from .simulator import IterationStat, SimResult, SimulationError, simulate
from .traces import (GENERATORS, Segment, Trace, TraceError, TraceRequest, generate, generate_infercept,
                     generate_toolbench, load_trace, save_trace, scale_trace, with_poisson_arrivals)

__all__ = ["RequestRecord", "percentile", "summarize", "IterationStat", "SimResult", "SimulationError", "simulate",
           "GENERATORS", "Segment", "Trace", "TraceError", "TraceRequest", "generate", "generate_infercept",
           "generate_toolbench", "load_trace", "save_trace", "scale_trace", "with_poisson_arrivals"]
