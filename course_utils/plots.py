"""Figures: one style for the course, saved next to the notebooks so headless runs regenerate them."""
from __future__ import annotations

from pathlib import Path

import matplotlib

FIGURES = Path(__file__).resolve().parent.parent / "notebooks" / "figures"
CPU_NOTE = "measured on this machine's CPU (gloo): not GPU numbers"
CPU_NOTE_LOCAL = "measured on this machine's CPU, one process: not GPU numbers"


def savefig(fig, name: str):
    """Save ``fig`` as notebooks/figures/<name>.png and return it (so it also shows inline)."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURES / f"{name}.png", dpi=110, bbox_inches="tight")
    return fig


def style() -> None:
    matplotlib.rcParams.update({"figure.figsize": (7.5, 3.6), "axes.grid": True, "grid.alpha": 0.3,
                                "axes.spines.top": False, "axes.spines.right": False, "font.size": 10})
