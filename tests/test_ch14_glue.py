"""Chapter 14's Ulysses glue (``course_utils/ch14_ulysses.py``): the check that prints the chapter's verdicts, the
bytes the figure and the crossover sentence are drawn from, what the widget can refuse, and the figures from real
runs.

Start here: the formulas themselves are ``workers/context_parallel/ulysses.py``'s, held to the ranks' counts by
``tests/test_ch14_ulysses.py``; this file holds the glue to them (a point counted equal only when every rank's count is
the formula's, a crossover said from the numbers) and to the refusals the launcher gives from the worker's ``check_params`` (only what the widget moves is named).
The verdicts are exact: float64 attention within 1e-12 (Ulysses alone measures 0 against the reference, the ring's
merge ~1e-15), integer byte counts.
"""
import re
import threading
import time

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import course_utils as cu  # noqa: E402
from course_utils import ch14_ulysses as uly  # noqa: E402

LIMITS = {"timeout": 60}


def _run(**params):
    return cu.run(uly.WORKER, world_size=4, **{"seq": 32, "heads": 8, **params}, **LIMITS)


# -- no ranks ------------------------------------------------------------------------------------------------

def test_the_formula_is_the_arithmetic_written_out():
    # cp 4, 8 heads of 16, seq 64, float64: one head's rows on one rank H = 16 x 16 x 8 = 2048 bytes
    f = uly.formula(seq=64, heads=8, kv_heads=2, cp=4)
    assert f["ulysses"]["forward"] == f["ulysses"]["backward"] == 3 * (8 + 2 * 4 + 8) * 2048 // 4  # KV copied to 4
    assert f["ring"] == {"forward": 2 * 3 * 2 * 2048, "backward": (2 * 3 + 2 * 4) * 2 * 2048}  # 2 KV heads a chunk


def test_the_crossover_is_said_from_the_numbers():
    rows = uly.crossover_rows(heads=8, cp=4, seq=32, head_dim=16, kv_options=(1, 2, 4, 8))
    assert [r["fewer_forward"] for r in rows] == ["ring", "ring", "Ulysses", "Ulysses"]
    assert [r["fewer_step"] for r in rows] == ["ring", "Ulysses", "Ulysses", "Ulysses"]
    assert uly.crossover_sentence(rows, 8, 4) == (
        "heads 8, cp 4: in forward, the ring sends fewer bytes with kv_heads 1 and 2, Ulysses with kv_heads 4 and 8; "
        "over forward and backward, the ring sends fewer bytes with kv_heads 1, Ulysses with kv_heads 2, 4 and 8")
    # at cp 2 with as many KV heads as heads, the two forward traffics are the same: 2 (cp-1) = 4 (cp-1)/cp chunks
    [mha] = uly.crossover_rows(heads=8, cp=2, seq=32, head_dim=16, kv_options=(8,))
    assert mha["fewer_forward"] == "equal" and mha["ulysses"]["forward"] == mha["ring"]["forward"]


def test_kv_heads_below_the_degree_cost_their_copies():
    two = uly.kv_copy_bytes(seq=32, heads=8, kv_heads=2, cp=4)
    four = uly.kv_copy_bytes(seq=32, heads=8, kv_heads=4, cp=4)
    assert two["kv_sent"] == 4 and two["forward"] == four["forward"]  # 2 KV heads cost what 4 do
    assert two["extra"] == two["kv_bytes"] // 2 and four["extra"] == 0
    assert uly.kv_copy_bytes(seq=32, heads=8, kv_heads=1, cp=4)["extra"] == 3 * two["kv_bytes"] // 4


def test_every_sweep_point_that_4_ranks_run_is_measured_and_no_other():
    settings = uly.measured_settings()
    assert all(s["cp"] <= 4 and s["cp"] % s["ring"] == 0 for s in settings)
    assert all(s["kv_heads"] == s["heads"] for s in settings if s["method"] == "ring")  # the worker's ring is MHA
    swept = {(s["sweep"], s[s["sweep"]]) for s in settings if s["method"] == "ulysses"}
    assert swept == {(k, x) for k, xs in uly.SWEEPS.items() for x in xs if k != "cp" or x <= 4}
    for s in settings:
        assert uly.refusal(4, **uly.run_params(s)) is None, s


class _Fake:
    def __init__(self, ranks):
        self.ranks = ranks

    def __getitem__(self, i):
        return self.ranks[i]


def _fake_run(bytes_of_rank_1=None, nan=False):
    """One copy of cp = 2 that equals the reference, or not (a NaN in rank 0's out)."""
    from workers.context_parallel.inputs import make_inputs
    from workers.context_parallel.reference import full_attention_grads

    cfg = {"batch": 1, "heads": 2, "kv_heads": 2, "seq": 8, "head_dim": 4, "seed": 0, "dtype": "float64",
           "causal": True}
    ref = full_attention_grads(*make_inputs(1, 2, 8, 4, 0, "float64", kv_heads=2), causal=True)
    want = uly.formula(8, 2, 2, 2, 4)["ulysses"]
    ranks = []
    for r in range(2):
        rows = torch.arange(4 * r, 4 * r + 4)
        d = {name: t[:, :, rows].clone() for name, t in zip(("out", "dq", "dk", "dv"), ref)}
        ranks.append({**d, "positions": rows, "copy": 0, "config": cfg, "sent_bytes": dict(want)})
    if nan:
        ranks[0]["out"][0, 0, 0, 0] = float("nan")
    if bytes_of_rank_1 is not None:
        ranks[1]["sent_bytes"] = bytes_of_rank_1
    return _Fake(ranks)


def test_the_check_fails_a_nan_and_a_point_is_equal_only_if_every_rank_counted_the_formula():
    assert uly.check(_fake_run())["within_bound"]
    assert not uly.check(_fake_run(nan=True))["within_bound"]
    setting = {"seq": 8, "heads": 2, "kv_heads": 2, "cp": 2, "head_dim": 4, "method": "ulysses"}
    assert uly.bytes_point(setting, _fake_run())["equal"]
    assert not uly.bytes_point(setting, _fake_run(bytes_of_rank_1={"forward": 0, "backward": 0}))["equal"]


def test_the_widget_refuses_only_with_what_it_moves_and_suggests_only_what_it_reaches():
    moved = set(uly.WIDGET_CHOICES)
    lo, hi = uly.WIDGET_CHOICES["heads"]
    refusals = 0
    for s in uly.widget_settings():
        said = uly.refusal(4, **s)
        if said is None:
            continue
        refusals += 1
        named = set(re.findall(r"\b([a-z_]+)=", said)) | set(re.findall(r"\b(ring|split|head_dim|batch|dtype)\b", said))
        assert named <= moved, (s, said)
        for choice in re.findall(r"choose (?:cp |kv_heads )?([\d, or]+)", said):
            values = [int(v) for v in re.findall(r"\d+", choice)]
            assert all(lo <= v <= hi for v in values), (s, said)  # cp's 1, 2, 4 are within the heads' range too
    assert refusals  # heads 6 at cp 4, kv_heads 3 of 8, ...
    assert uly.refusal(4, heads=6, cp=4, kv_heads=6, seq=64).startswith("cp=4 does not divide heads=6")


def test_the_exercise_simulation_turns_a_missing_call_into_a_verdict_not_a_hang():
    from course_utils.exercises import FAIL, check

    def only_rank_zero_sends(x, cp, all_to_all):
        import torch

        if x.shape[1] % cp:
            raise ValueError("cp does not divide the heads")
        if float(x.flatten()[1]) > 0:  # some ranks skip the collective: real ranks would wait forever
            return torch.cat([x] * cp, dim=0)[:, : x.shape[1] // cp]
        return torch.cat(all_to_all(list(x.chunk(cp, dim=1))), dim=0)

    start = time.perf_counter()
    verdict = check("seq_to_heads", only_rank_zero_sends)
    assert verdict.status == FAIL and time.perf_counter() - start < 15, verdict
    assert threading.active_count() < 20  # the simulated ranks ended


# -- on ranks ------------------------------------------------------------------------------------------------

@pytest.mark.ranks
def test_verdicts_and_figures_from_real_runs():
    res = _run(cp=4, kv_heads=2)
    assert uly.verdict(res) == ("cp = 4, heads 8, kv_heads 2, causal: out, dq, dk, dv equal to float64 full "
                                "attention within 1e-12: True")
    assert uly.verdict(_run(cp=4, ring=2, split="zigzag")).startswith("cp = 4 = 2 Ulysses x ring 2,")
    fig = uly.all_to_all_figure(res)
    assert "2 KV heads sent as 4 copies" in "".join(ax.get_title() for ax in fig.axes)
    fig = uly.widget_figure(res, {"cp": 4, "heads": 8, "kv_heads": 2, "seq": 32})
    assert fig.axes[0].get_title().endswith("within 1e-12: True")
    points = [uly.bytes_point(s, _run(**uly.run_params(s))) for s in uly.measured_settings()
              if s["sweep"] == "kv_heads" or s["method"] == "ring" and s["sweep"] == "cp"]
    assert points and all(p["equal"] for p in points)
    uly.bytes_figure(points)
    with pytest.raises(ValueError, match="ring = 1"):
        uly.all_to_all_figure(_run(cp=4, ring=2))


@pytest.mark.ranks
def test_the_widget_draws_a_run_and_a_refusal_replaces_the_figure():
    live = uly.ulysses_widget(4)
    assert live.wait(120)
    assert isinstance(live.history[-1][1], cu.RunResult)
    assert [o["output_type"] for o in live.out.outputs] == ["display_data"]  # the figure, as a PNG
    live.controls["heads"].value = 6  # cp 4 does not divide 6 heads (kv_heads 2 divides 6)
    assert live.wait(120)
    assert live.out.outputs == () and "cp=4 does not divide heads=6" in live.status.value
    live.controls["cp"].value = 2  # the refusal's own suggestion runs
    assert live.wait(120) and isinstance(live.history[-1][1], cu.RunResult)
    assert uly.check(live.history[-1][1])["within_bound"] and len(live.out.outputs) == 1
