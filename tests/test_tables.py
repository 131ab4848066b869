"""``course_utils.tables.Table``: the one table of the course (nbval compares its text; Lab shows its HTML)."""
from course_utils.tables import Table


def test_dict_rows_align_columns_and_format_floats_to_four_digits():
    out = str(Table.of([{"a": 1, "bb": 2.5}, {"a": 10, "bb": 1 / 3}]))
    assert out.splitlines() == ["a   bb", "--  ------", "1   2.5", "10  0.3333"]


def test_columns_pick_and_order_keys_and_formats_apply_per_column():
    rows = [{"x": 0.5, "name": "long name", "skip": 1}, {"x": 2.0, "name": "b"}]
    out = str(Table.of(rows, ["name", "x", "missing"], formats={"x": "{:.1e}"}))
    assert out.splitlines() == ["name       x        missing", "---------  -------  -------",
                                "long name  5.0e-01", "b          2.0e+00"]


def test_no_trailing_spaces_and_list_rows_without_header():
    out = str(Table.of([["a", "xyz"], ["bbbb", ""]]))
    assert out.splitlines() == ["a     xyz", "bbbb"]


def test_caption_text_and_html():
    t = Table(["k", "v"], [["<b>", "1"]], "caption")
    assert str(t) == repr(t) == "caption\nk    v\n---  -\n<b>  1"
    html = t._repr_html_()
    assert html.startswith("<table><caption style='text-align:left'>caption</caption>") and "&lt;b&gt;" in html
