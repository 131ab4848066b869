"""The tool that measures how far chaotic numbers move across CPUs (course_utils/cpu_spread.py): its criteria,
its report, and the CPU variants it emulates. The experiments themselves are measurements, run by hand
(``python -m course_utils.cpu_spread NAME``); the tests that rely on them quote their ranges."""
import math

import pytest

from course_utils import cpu_spread as cs


def test_a_criterion_holds_and_measures_its_worst_margin():
    below = cs.Criterion("<", 2.0, "a test")
    assert below.holds(1.5) and not below.holds(2.0) and not below.holds(float("nan"))
    assert below.margin([1.0, 1.5]) == pytest.approx(0.25)  # the worst value, 1.5, is 25% of the bound below it
    above = cs.Criterion(">", 100.0, "a test")
    assert above.margin([320.0, 4000.0]) == pytest.approx(2.2) and above.margin([50.0]) < 0
    exact = cs.Criterion("==", 0, "a count")
    assert exact.holds(0) and not exact.holds(1) and exact.margin([0, 1]) == -1.0


def test_the_report_gives_first_seed_per_variant_range_and_verdict():
    cs.CRITERIA["_fake"] = {"loss": cs.Criterion("<", 2.0, "a test")}
    try:
        rows = [{"experiment": "_fake", "seed": s, "variant": v, "values": {"loss": x, "free": 1.0}}
                for (v, s, x) in [("native", 0, 1.0), ("native", 1, 1.5), ("avx2", 0, 1.2), ("avx2", 1, 2.5)]]
        text = cs.report("_fake", rows)
    finally:
        del cs.CRITERIA["_fake"]
    loss = next(line for line in text.splitlines() if line.startswith("| loss"))
    cells = [c.strip() for c in loss.strip("|").split("|")]
    assert cells == ["loss", "< 2", "1", "1.2", "1", "2.5", "-25%", "NO"]  # 2.5 breaks it: the report says so
    assert "4 runs, variants native, avx2, seeds [0, 1]" in text


def test_seeds_parse_as_ranges_and_lists():
    assert cs._parse_seeds("0-3") == [0, 1, 2, 3] and cs._parse_seeds("0,2,5-6") == [0, 2, 5, 6]


def test_ci_checks_avx2_on_an_avx512_machine_and_the_plain_kernels_elsewhere():
    assert cs.second_variant("AVX512") == "avx2"
    assert cs.second_variant("AVX2") == "default" and cs.second_variant("DEFAULT") == "default"
    assert cs.second_variant("SVE256") == "default"  # an ARM machine


@pytest.mark.once  # it starts every variant itself
def test_each_variant_runs_the_kernels_it_claims():
    # ATen ignores a capability the CPU lacks, so a variant is offered only where it is what it says
    names = cs.available_variants()
    assert names[0] == "native" and {"default", "mkl-compatible", "2-threads"} <= set(names)
    assert cs.capability(cs.VARIANTS["default"]) == "DEFAULT"
    if "avx2" in names:
        assert cs.capability(cs.VARIANTS["avx2"]) == "AVX2"


def test_every_criterion_names_where_it_is_relied_on():
    for name, criteria in cs.CRITERIA.items():
        assert name in cs.EXPERIMENTS
        for quantity, c in criteria.items():
            assert c.where and c.op in ("<", "<=", ">", ">=", "==") and not math.isnan(c.bound), (name, quantity)
