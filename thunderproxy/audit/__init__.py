"""The audit log: record types, the single SQLite writer and the schema migrations."""

from .records import BackendSample, DecisionRecord, StepRecord
from .writer import AuditLog, serve_audit_writer

__all__ = ["AuditLog", "BackendSample", "DecisionRecord", "StepRecord", "serve_audit_writer"]
