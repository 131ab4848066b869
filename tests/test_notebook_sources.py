"""The notebook build tool: percent sources -> .ipynb, keeping what a source edit did not touch."""
import nbformat

from course_utils import notebooks


def _stored(path):
    nb = nbformat.v4.new_notebook()
    md = nbformat.v4.new_markdown_cell("# Title\n\nOld sentence.")
    code = nbformat.v4.new_code_cell("x = 1\nx", execution_count=3,
                                     outputs=[nbformat.v4.new_output("execute_result", {"text/plain": "1"},
                                                                     execution_count=3)])
    code.metadata["papermill"] = {"duration": 0.5}
    changed = nbformat.v4.new_code_cell("y = 2", execution_count=4,
                                        outputs=[nbformat.v4.new_output("stream", text="stale\n")])
    nb.cells = [md, code, changed]
    nb.metadata["papermill"] = {"duration": 12.0}
    nbformat.write(nb, path)
    return nb


def test_sync_keeps_outputs_ids_and_metadata_of_unchanged_cells(tmp_path):
    stored = _stored(tmp_path / "01_x.ipynb")
    src = tmp_path / "01_x.py"
    src.write_text("# %% [markdown]\n# # Title\n#\n# New sentence.\n\n# %% tags=[\"raises-exception\"]\n"
                   "x = 1\nx\n\n# %%\ny = 3\n")
    nb = notebooks.build(src)
    notebooks._carry_outputs(nb, tmp_path / "01_x.ipynb")
    md, code, changed = nb.cells
    assert "New sentence." in md.source and md.id != stored.cells[0].id  # an edited cell is new
    assert code.id == stored.cells[1].id and code.execution_count == 3  # an unchanged cell is kept whole ...
    assert code.outputs == stored.cells[1].outputs and code.metadata["papermill"] == {"duration": 0.5}
    assert code.metadata["tags"] == ["raises-exception"]  # ... except its tags, which the source decides
    assert changed.outputs == [] and changed.execution_count is None  # a changed cell's old output is dropped
    assert nb.metadata["papermill"] == {"duration": 12.0}


def test_every_shipped_notebook_matches_its_source():
    stale = [src.name for src in notebooks.sources() if not notebooks.in_sync(src)]
    assert not stale, f"rebuild with `python -m course_utils.notebooks sync`: {stale}"


def test_parallel_execution_runs_the_longest_first_two_at_a_time_and_counts_failures(tmp_path, monkeypatch, capsys):
    """``execute --jobs 2`` (make test): each chapter in a process of its own, never more than two at once, the
    longest by its committed run first; every child's report is printed and a child that fails is counted. The
    children here are stand-ins that sleep and log (a real chapter takes minutes; make test runs the real ones)."""
    import subprocess
    import sys

    durations = {"00_a": 5.0, "01_b": 40.0, "02_c": 20.0, "03_d": 1.0}
    for name, seconds in durations.items():
        nb = nbformat.v4.new_notebook()
        nb.metadata["papermill"] = {"duration": seconds}
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    monkeypatch.setattr(notebooks, "NB_DIR", tmp_path)
    log = tmp_path / "log.txt"
    real_popen = subprocess.Popen
    launched = []

    def stand_in(cmd, **kw):
        name = cmd[-1]
        launched.append(name)
        script = (f"import time; open({str(log)!r}, 'a').write('start {name} %f\\n' % time.time()); "
                  f"time.sleep(0.6); open({str(log)!r}, 'a').write('end {name} %f\\n' % time.time()); "
                  f"print('{name}: done'); raise SystemExit({1 if name == '02_c' else 0})")
        return real_popen([sys.executable, "-c", script], **kw)

    monkeypatch.setattr(notebooks.subprocess, "Popen", stand_in)
    failed = notebooks.execute_in_parallel(list(durations), tmp_path / "out", 60, jobs=2)
    assert failed == 1
    events = [line.split() for line in log.read_text().splitlines()]
    assert launched == ["01_b", "02_c", "00_a", "03_d"]
    running, most = 0, 0
    for kind, _, _ in sorted(events, key=lambda e: float(e[2])):
        running += 1 if kind == "start" else -1
        most = max(most, running)
    assert most == 2  # two lanes, never three
    out = capsys.readouterr().out
    assert all(f"{name}: done" in out for name in durations)
    assert "02_c: its execution exited with 1" in out
