"""Where things are, for the notebook side (``workers/`` never imports this: it finds its own files).

``ROOT`` is the repository; ``DATA`` its committed measurements and references (``data/``); ``FIGURES`` is where
``plots.savefig`` writes: the folder the environment variable ``COURSE_FIGURES_DIR`` names, read once, when this
module is imported, else the git-ignored ``build/figures``. A learner's runs in ``make lab`` therefore never rewrite
a tracked file; only ``make notebooks`` (``course_utils.notebooks execute`` in place) names the committed
``notebooks/figures`` (``COMMITTED_FIGURES``), because it regenerates the chapters on purpose.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
COMMITTED_FIGURES = ROOT / "notebooks" / "figures"
FIGURES = Path(os.environ.get("COURSE_FIGURES_DIR") or ROOT / "build" / "figures")
