"""Notebook side of the course: launching ranks, collecting results, drawing, grading, cost models.

Names are imported on first use, so ``import course_utils.ledger`` (pure Python) does not pay for torch.
"""
import importlib

_EXPORTS = {
    "run": "course_utils.launcher", "launch": "course_utils.launcher", "Job": "course_utils.launcher",
    "shutdown_pools": "course_utils.launcher", "warm_pools": "course_utils.launcher",
    "RunResult": "course_utils.results", "CourseError": "course_utils.results",
    "InvalidParameter": "course_utils.results", "WorkerFailed": "course_utils.results",
    "JobTimeout": "course_utils.results", "JobCancelled": "course_utils.results",
    "check": "course_utils.exercises", "each": "course_utils.progress",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'course_utils' has no attribute {name!r}")
