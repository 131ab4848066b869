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
