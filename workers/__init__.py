"""Rank side of the course: scripts that run under torchrun, on one node or many.

Nothing in this package imports notebook-side code (``course_utils``).
"""
