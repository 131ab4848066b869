"""Where things are, for the notebook side (``workers/`` never imports this: it finds its own files).

``ROOT`` is the repository; ``DATA`` its committed measurements and references (``data/``); ``FIGURES`` is where
``plots.savefig`` writes: the committed ``notebooks/figures`` (``COMMITTED_FIGURES``), unless the environment
variable ``COURSE_FIGURES_DIR`` names another folder (runs that do not write the notebook back: CI's
``execute --out``, nbval), read once, when this module is imported.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
COMMITTED_FIGURES = ROOT / "notebooks" / "figures"
FIGURES = Path(os.environ.get("COURSE_FIGURES_DIR") or COMMITTED_FIGURES)
