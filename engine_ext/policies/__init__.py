"""Scheduling and memory policies shared by all engines and the simulator
(plain Python, no torch): interception handling (InferCept), ranking (LAMPS
and baselines), the predictors they learn with, and the cost model."""

from .capacity import NO_CAPACITY, CapacityPolicy
from .costmodel import BUILTIN_PROFILES, Profile, ProfileError, roofline, unit_profile
from .interception import (INTERCEPTION_NAMES, BatchState, Discard, Fixed, Handling, InterceptedContext,
                           InterceptionPolicy, MinWaste, Preserve, Swap, make_interception)
from .hints import SegmentPrediction, SegmentPredictor
from .objectives import ObjectiveRanking
from .predictors import OutputLengths, ToolDurations
from .spec import PolicySpec
from .ranking import FCFS, LAMPS, RANKING_NAMES, SJF, RankingPolicy, RankState, SchedInfo, SJFTotal, make_ranking

__all__ = ["CapacityPolicy", "NO_CAPACITY", "BUILTIN_PROFILES", "Profile", "ProfileError", "roofline", "unit_profile", "INTERCEPTION_NAMES",
           "BatchState", "Discard", "Fixed", "Handling", "InterceptedContext", "InterceptionPolicy", "MinWaste", "ObjectiveRanking", "PolicySpec",
           "Preserve", "Swap", "make_interception", "OutputLengths", "ToolDurations", "FCFS", "LAMPS",
           "RANKING_NAMES", "SJF", "RankingPolicy", "RankState", "SchedInfo", "SJFTotal", "make_ranking",
           "SegmentPrediction", "SegmentPredictor"]
