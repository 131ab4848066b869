"""Notebook side of the course: launching ranks, collecting results, drawing, grading, cost models."""
from course_utils.launcher import Job, launch, run, shutdown_pools, warm_pools
from course_utils.results import (CourseError, InvalidParameter, JobCancelled, JobTimeout, RunResult,
                                  WorkerFailed)

__all__ = ["run", "launch", "Job", "shutdown_pools", "warm_pools", "RunResult", "CourseError",
           "InvalidParameter", "WorkerFailed", "JobTimeout", "JobCancelled"]
