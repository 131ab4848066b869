"""Rank-side checkers for the graded exercises: one module per chapter, each a worker."""
