"""Scheduling: where each program runs and, by its named policy, whether it may run now."""

from .policies import POLICIES, DefaultPolicy, Policy, TrPolicy, policy_named
from .scheduler import Scheduler, StepLease, serve_resume_monitor

__all__ = [
    "POLICIES",
    "DefaultPolicy",
    "Policy",
    "Scheduler",
    "StepLease",
    "TrPolicy",
    "policy_named",
    "serve_resume_monitor",
]
