"""Scheduling and memory policies shared by all engines (plain Python, no torch)."""

from .interception import AlwaysDiscard, AlwaysPreserve, Handling, InterceptedContext, InterceptionPolicy
from .ranking import FCFS, RankingPolicy

__all__ = ["AlwaysDiscard", "AlwaysPreserve", "Handling", "InterceptedContext", "InterceptionPolicy",
           "FCFS", "RankingPolicy"]
