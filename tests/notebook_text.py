"""What a learner reads in a chapter, checked as text: no raw widget repr in a stored output, no words meant for the
course's builders. Used by ``tests/test_notebook_text.py`` (every stored notebook, no kernel) and by the browser test
(the page a learner opens, before and after Run All).
"""
from __future__ import annotations

import re

# A widget's repr, what JupyterLab shows for a stored widget output whose model does not exist yet (ipywidgets'
# text/plain: "VBox(children=(HBox(children=(Dropdown(description='model', ...").
WIDGET_REPR = re.compile(r"^\s*(VBox|HBox|Box|GridBox|Tab|Accordion|Output|interactive|IntSlider|FloatSlider|"
                         r"FloatLogSlider|SelectionSlider|Dropdown|ToggleButtons|Checkbox|Button|HTML|Image)"
                         r"\((children|value|description|layout|options|outputs)=", re.M)

# Words for the people who build the course (its work tracking, its CI), not for a learner. Each pattern with what it
# catches; an exact phrase in ALLOWED is a learner-facing use of the same word.
BUILDER_WORDS = (
    (re.compile(r"\b(the|this|that|an|our) issue\b", re.I), "an issue of the course's tracker"),
    (re.compile(r"\bissues?\s+#?\d+\b", re.I), "an issue number"),
    (re.compile(r"\bacceptance\b", re.I), "acceptance criteria"),
    (re.compile(r"(?<!\[)\bTODO\b(?!\])"), "a TODO (an exercise's [TODO] verdict is the learner's)"),
    (re.compile(r"\bFIXME\b|\bXXX\b"), "a FIXME"),
    (re.compile(r"\btickets?\b", re.I), "a ticket"),
    (re.compile(r"\bCI\b"), "the course's CI"),
    (re.compile(r"\bnbval\b", re.I), "the course's output comparison"),
    (re.compile(r"\b(subagents?|helper sessions?|work[- ]tracking)\b", re.I), "how the course is built"),
)
ALLOWED = (
    "the test to put in CI for your own training code",  # chapter 08: the learner's own CI
    "once the issue it worked around is fixed",  # chapter 10: a bug in NCCL, not the course's tracker
)
# "NVIDIA/nccl issue 946", "PyTorch issue #58005", "flash-attention issue #1244": a public project's issue, cited as a
# source (its repository, or its capitalised or hyphenated name, before the word); "the issue", "issue 29" alone
# stay the tracker's
CITATION = re.compile(r"(?:[\w.-]+/[\w.-]+|\b[A-Za-z][\w.]*-[\w.-]+|\b[A-Z][\w.-]*)\s+issues?\s+#?\d+")


def cell_texts(nb: dict) -> list[tuple[int, str, str]]:
    """(cell index, where, text) for every cell's source and every output's text a learner can see."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        out.append((i, f"{cell['cell_type']} source", _join(cell.get("source", ""))))
        for o in cell.get("outputs", []):
            if "text" in o:
                out.append((i, "output", _join(o["text"])))
            for mime in ("text/plain", "text/html", "text/markdown"):
                if mime in o.get("data", {}):
                    out.append((i, f"output {mime}", _join(o["data"][mime])))
    return out


def _join(text) -> str:
    return "".join(text) if isinstance(text, list) else str(text)


def builder_words(text: str) -> list[str]:
    """The builder words in ``text`` (with some context), once each, leaving out the allowed phrases."""
    text = " ".join(text.split())  # as a page shows it: line breaks are spaces
    for phrase in ALLOWED:
        text = text.replace(phrase, " ")
    text = CITATION.sub(" ", text)
    found = []
    for pattern, what in BUILDER_WORDS:
        for m in pattern.finditer(text):
            context = " ".join(text[max(0, m.start() - 50):m.end() + 30].split())
            found.append(f"{m.group()!r} ({what}): ...{context}...")
    return found


def raw_widget_reprs(nb: dict) -> list[str]:
    """Stored outputs whose text a learner sees before the cell runs is a widget's repr."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        for o in cell.get("outputs", []):
            plain = _join(o.get("data", {}).get("text/plain", ""))
            if WIDGET_REPR.search(plain):
                found.append(f"cell {i}: {plain[:80]!r}")
    return found


def notebook_problems(nb: dict) -> list[str]:
    """Every raw widget repr and builder word in a notebook, one line each."""
    problems = [f"raw widget repr in a stored output, {r}" for r in raw_widget_reprs(nb)]
    for i, where, text in cell_texts(nb):
        problems += [f"cell {i} ({where}): {w}" for w in builder_words(text)]
    return problems
