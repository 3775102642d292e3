"""Scheduling: where each program runs and (in ``tr`` mode) whether it may run now."""

from .scheduler import Scheduler, StepLease

__all__ = ["Scheduler", "StepLease"]
