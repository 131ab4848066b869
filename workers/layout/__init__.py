"""The layout of a run: the rank grid (``grid.py``), the degrees and their one rule set (``rules.py``), and the
one holder of the process groups (``mesh.py``). Plain data at import (no torch), so the notebook side's planner
shares the rules with the ranks."""
from workers.layout.grid import DIMS, RankGrid
from workers.layout.mesh import Mesh
from workers.layout.rules import Layout, problem

__all__ = ["DIMS", "RankGrid", "Layout", "problem", "Mesh"]
