"""Programs: one agent task, tracked by ``program_id`` across its LLM calls."""

from .registry import ProgramRegistry
from .state import Program, ProgramStatus, StepUsage, Transition

__all__ = ["Program", "ProgramRegistry", "ProgramStatus", "StepUsage", "Transition"]
