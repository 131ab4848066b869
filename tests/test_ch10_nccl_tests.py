"""The nccl-tests parser and formatter (course_utils.nccl_tests): the specification.

Fixtures in tests/data/: one real table (a public gist, NCCL 2.18.5, values unchanged) and two synthetic
ones in the 2.x and older column layouts, labelled as such in their headers.
"""
from pathlib import Path

import pytest

from course_utils import nccl_tests
from course_utils.ledger import bus_bandwidth_factor

DATA = Path(__file__).parent / "data"


def _report(name):
    return nccl_tests.parse((DATA / name).read_text())


def test_real_gist_table_is_read_field_by_field():
    # https://gist.github.com/kwen2501/89c28b6d12045b45ccf7e33816af2713: 4 ranks, one size.
    rep = _report("nccl_tests_2_18_gist.txt")
    assert rep.n_ranks == 4  # four "# Rank N" lines
    [row] = rep.rows
    assert (row.size_bytes, row.count, row.dtype, row.redop, row.root) == (4218900, 1054725, "float", "sum", None)
    assert row.out_of_place == nccl_tests.Measurement(1011.4, 4.17, 6.26, 0)
    assert row.in_place == nccl_tests.Measurement(993.6, 4.25, 6.37, 0)
    assert rep.avg_busbw_GBps == pytest.approx(6.31306) and rep.out_of_bounds == 0


def test_busbw_is_algbw_times_2_n_minus_1_over_n_for_all_reduce():
    # nccl-tests doc/PERFORMANCE.md: busbw = algbw * 2(n-1)/n for AllReduce; the published gist row must obey
    # it within the table's rounding (2 decimals: +-0.005 on each of algbw and busbw).
    row = _report("nccl_tests_2_18_gist.txt").rows[0]
    factor = bus_bandwidth_factor("all_reduce", 4)
    assert factor == 1.5
    for m in (row.out_of_place, row.in_place):
        assert abs(m.busbw_GBps - m.algbw_GBps * factor) <= 0.005 + 0.005 * factor


@pytest.mark.parametrize("name, collective", [("nccl_tests_2_18_gist.txt", "all_reduce"),
                                              ("nccl_tests_all_reduce_8gpu_synthetic.txt", "all_reduce"),
                                              ("nccl_tests_legacy_layout_synthetic.txt", "all_reduce")])
def test_bandwidths_recomputed_from_time_and_size_match_the_table(name, collective):
    # algbw = S / t (GB/s = 1e9 bytes/s, t in us) and busbw = algbw * factor; nccl-tests computes them from the
    # unrounded time, so the tolerance is the time column's rounding (half a unit of its last printed digit,
    # relative) plus the bandwidth columns' own (0.005 GB/s).
    rep = _report(name)
    n = rep.n_ranks
    text = (DATA / name).read_text()
    for row in rep.rows:
        for m in filter(None, (row.out_of_place, row.in_place)):
            t_token = _token_for(text, m.time_us)
            rel = 0.5 * 10 ** -nccl_tests.decimals(t_token) / m.time_us
            algbw = row.size_bytes / (m.time_us * 1e-6) / 1e9
            assert abs(algbw - m.algbw_GBps) <= 0.005 + algbw * rel * 1.01, (row, algbw)
            busbw = algbw * bus_bandwidth_factor(collective, n)
            assert abs(busbw - m.busbw_GBps) <= 0.005 + busbw * rel * 1.01, (row, busbw)


def _token_for(text, value):
    for tok in text.split():
        try:
            if float(tok) == value:
                return tok
        except ValueError:
            pass
    return f"{value}"


def test_synthetic_sweep_8b_to_8g_with_info_lines_mixed_in():
    rep = _report("nccl_tests_all_reduce_8gpu_synthetic.txt")
    assert rep.n_ranks == 8
    sizes = [r.size_bytes for r in rep.rows]
    assert sizes == [8 << i for i in range(31)]  # -b 8 -e 8G -f 2: 31 sizes, NCCL INFO lines skipped
    assert all(r.count == r.size_bytes // 4 for r in rep.rows)  # float: 4 bytes per element
    # the footer is the mean busbw over both halves (to the rounding of the printed values)
    mean = sum(m.busbw_GBps for r in rep.rows for m in (r.out_of_place, r.in_place)) / (2 * len(rep.rows))
    assert rep.avg_busbw_GBps == pytest.approx(mean, abs=0.01)


def test_legacy_layout_without_root_and_with_an_error_column():
    rep = _report("nccl_tests_legacy_layout_synthetic.txt")
    assert rep.n_ranks == 2 and len(rep.rows) == 8  # 1 KiB to 16 MiB, -f 4
    first = rep.rows[0]
    assert first.root is None and first.redop == "sum" and first.out_of_place.wrong == 0.0  # "0e+00"


def test_check_disabled_prints_na_and_all_gather_prints_none():
    text = """#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
     1048576        262144     float    none      -1    20.50   51.15   44.76    N/A    20.10   52.17   45.65    N/A
"""
    row = nccl_tests.parse(text).rows[0]
    assert row.redop is None and row.out_of_place.wrong is None and row.in_place.busbw_GBps == 45.65


def test_a_row_that_does_not_fit_its_header_is_an_error_not_a_guess():
    text = "#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong\n 8 2 float sum -1 20.1 0.00\n"
    with pytest.raises(nccl_tests.NcclTestsParseError, match="fields"):
        nccl_tests.parse(text)
    with pytest.raises(nccl_tests.NcclTestsParseError, match="no result rows"):
        nccl_tests.parse("# nothing here\n")


def test_formatter_round_trips_through_the_parser():
    # The course prints its own gloo numbers in nccl-tests' format; the parser must read them back to the
    # printed precision, with busbw from the ledger's factor (reduce_scatter: (n-1)/n).
    sizes, seconds = [4096, 1 << 20, 16 << 20], [9.1e-5, 2.3e-3, 0.041]
    rows = nccl_tests.rows_from_timings("reduce_scatter", sizes, seconds, n_ranks=4)
    back = nccl_tests.parse(nccl_tests.format_table(rows, comments=("CPU/gloo",))).rows
    assert [r.size_bytes for r in back] == sizes and all(r.in_place is None for r in back)
    for mine, read in zip(rows, back):
        assert read.out_of_place.time_us == pytest.approx(mine.out_of_place.time_us, rel=1e-3)
        assert read.out_of_place.algbw_GBps == pytest.approx(mine.out_of_place.algbw_GBps, abs=0.005)
        assert read.out_of_place.busbw_GBps == pytest.approx(mine.out_of_place.algbw_GBps * 0.75, abs=0.006)


def test_published_8xh200_sweep_busbw_over_algbw_is_the_ledger_factor():
    # data/reference/allreduce_8xH200_published.csv (stas00/ml-engineering): 8 ranks, so busbw/algbw = 1.75.
    from course_utils.reference_data import published_allreduce

    rows, _ = published_allreduce()
    for r in rows:
        assert r["busbw"] / r["algbw"] == pytest.approx(bus_bandwidth_factor("all_reduce", 8), abs=0.02)


def test_tuning_table_is_read_per_collective_and_algorithm():
    # A real NCCL 2.29.7 TUNING printout (see the fixture's header): nine columns, Algorithm/Protocol, per collective.
    table = nccl_tests.parse_tuning_table((DATA / "nccl_2_29_7_tuning_2nodes_1gpu.txt").read_text())
    assert set(table) == {"Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce"}  # not "Max NThreads"
    assert list(table["AllReduce"])[:4] == ["Tree/LL", "Tree/LL128", "Tree/Simple", "Ring/LL"]
    assert table["AllReduce"]["Tree/Simple"] == (36.4, 1.9) and table["Broadcast"]["Ring/Simple"] == (22.4, 2.4)
    assert table["AllGather"]["CollNetDirect/Simple"] == (14.0, 0.0)
    with pytest.raises(nccl_tests.NcclTestsParseError, match="NCCL_DEBUG_SUBSYS=TUNING"):
        nccl_tests.parse_tuning_table("# nothing here\n")
