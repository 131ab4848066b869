"""Chapter 08, mixed precision: the formats as torch defines them, the demos, the worker on real ranks, the checkers.

The formats are checked two ways: against torch.finfo / the bit patterns, and against the published numbers
(IEEE 754-2008 binary16; OCP OFP8 v1.0 and Micikevicius et al. 2022, Table 1, for E4M3 and E5M2). Loss scaling
is checked against GradScaler's rule written out here, independently of torch and of the exercise's solution.
Floating-point results of casts are exact, so most comparisons are equalities; where a tolerance is stated,
the comment says where it comes from.
"""
import math

import matplotlib.figure
import pytest
import torch

import course_utils as cu
from course_utils import ch08_precision as P
from course_utils.exercises import FAIL, PASS, TODO, check

ranks = pytest.mark.ranks
RUN = {"timeout": 60}
WORKER = "workers.ch08_precision"


# -- the format table ------------------------------------------------------------------------------------

def test_format_table_is_what_torch_finfo_says(one_thread):
    for f in P.format_table():
        fi = torch.finfo(f.dtype)
        assert (f.bits, f.max, f.smallest_normal, f.eps) == (fi.bits, fi.max, fi.smallest_normal, fi.eps)
        # sign + exponent + stored mantissa fill the word, and eps is one unit of the last mantissa bit
        assert 1 + f.exponent_bits + f.mantissa_bits == f.bits
        assert f.eps == 2.0**-f.mantissa_bits
        # The smallest subnormal, decoded from the bit pattern 0...01, is one mantissa unit of the smallest
        # normal's binade: two independent routes to the same number.
        assert f.smallest_subnormal == f.smallest_normal * f.eps
    assert [(f.exponent_bits, f.mantissa_bits) for f in P.format_table()] == [(8, 23), (5, 10), (8, 7), (4, 3), (5, 2)]


def test_published_maxima_and_subnormals_match_torch(one_thread):
    table = {f.name: f for f in P.format_table()}
    assert P.PUBLISHED["fp16"]["max"] == 65504.0 and P.PUBLISHED["fp8_e4m3"]["max"] == 448.0
    assert P.PUBLISHED["fp8_e5m2"]["max"] == 57344.0
    for name, pub in P.PUBLISHED.items():
        assert table[name].max == pub["max"], name
        assert table[name].smallest_subnormal == pub["smallest_subnormal"], name
    # Where the maxima come from. IEEE-like formats (fp16, E5M2) keep the all-ones exponent for inf/NaN: the
    # largest normal is (2 - 2^-m) * 2^bias. E4M3 "fn" uses the all-ones exponent for numbers too, except
    # mantissa 111 (NaN): (2 - 2^-(m-1)) * 2^(bias + 1) = 1.75 * 256 = 448 (OCP OFP8 v1.0, Table 1).
    for name in ("fp16", "fp8_e5m2"):
        f = table[name]
        assert f.max == (2 - 2.0**-f.mantissa_bits) * 2.0 ** (2 ** (f.exponent_bits - 1) - 1)
    e4m3 = table["fp8_e4m3"]
    assert e4m3.max == (2 - 2.0 ** -(e4m3.mantissa_bits - 1)) * 2.0 ** (2 ** (e4m3.exponent_bits - 1))


def test_special_values_counted_from_every_bit_pattern(one_thread):
    table = {f.name: f for f in P.format_table()}
    # E4M3fn: no infinity at all, and only S.1111.111 is NaN (two patterns, one per sign).
    assert not table["fp8_e4m3"].has_inf and table["fp8_e4m3"].nan_encodings == 2
    # E5M2, fp16 and bf16 follow IEEE: all-ones exponent with a non-zero mantissa is NaN, 2 * (2^m - 1) patterns.
    # (fp32's count uses that rule without enumerating 2^32 patterns; fp16 and bf16 check the rule.)
    for name in ("fp8_e5m2", "fp16", "bf16", "fp32"):
        f = table[name]
        assert f.has_inf and f.nan_encodings == 2 * (2**f.mantissa_bits - 1), name
    # E4M3 trades inf for one more binade: 2 x 126 finite non-zero values vs E5M2's 2 x 123.
    def finite_nonzero(fmt):
        values = P.all_values(fmt)
        return int((torch.isfinite(values) & (values != 0)).sum())

    assert (finite_nonzero("fp8_e4m3"), finite_nonzero("fp8_e5m2")) == (252, 246)


# -- overflow, underflow, rounding -----------------------------------------------------------------------

def test_fp16_overflows_to_inf_at_half_an_ulp_above_its_max(one_thread):
    top = P.ulp(65504.0, "fp16")
    assert top == 32.0  # fp16's top binade [2^15, 2^16) has steps of 2^(15-10)
    assert P.round_to(65504.0 + 15.0, "fp16") == 65504.0  # below halfway: rounds down to max
    # Exactly halfway to the would-be next value 65536 is a tie; the even neighbour is 65536, beyond max: inf.
    assert math.isinf(P.round_to(65504.0 + 16.0, "fp16"))
    x = torch.tensor(65504.0, dtype=torch.float16)
    assert torch.isinf(x * 2) and torch.isinf(x + x)  # fp16 arithmetic overflows the same way


def test_fp8_out_of_range_behaviour_is_measured_not_assumed(one_thread):
    # E5M2 has inf, and a cast beyond max + ulp/2 gives it, like fp16.
    (_, at_tie), (_, below) = P.cast_table("fp8_e5m2", [61440.0, 61439.0])
    assert math.isinf(at_tie) and below == 57344.0
    # E4M3fn has no inf pattern: a cast of a too-large value can only saturate to 448 or give NaN (the two
    # conversions OCP OFP8 allows). Whatever torch does, the table reports it and it is one of those.
    values = [464.0, 1000.0, float("inf")]
    for x, y in P.cast_table("fp8_e4m3", values):
        assert y == 448.0 or math.isnan(y), (x, y)
    [(_, nan_out)] = P.cast_table("fp8_e4m3", [float("nan")])
    assert math.isnan(nan_out)
    table = P.overflow_demo()
    tie = [r for r in table.rows if r[0] == "fp16" and "tie" in r[1]]
    assert tie and tie[0][3] == "inf"


def test_gradual_underflow_then_zero(one_thread):
    f = P.format_info("fp16")
    # Every power of two from the smallest normal down to the smallest subnormal survives exactly (subnormals
    # are m * 2^-24 with m = 1 .. 1023); the next halving is a tie between 0 and 2^-24 and goes to even, 0.
    for k in range(f.mantissa_bits + 1):
        assert P.round_to(f.smallest_normal * 2.0**-k, "fp16") == f.smallest_normal * 2.0**-k
    assert P.round_to(f.smallest_subnormal / 2, "fp16") == 0.0
    assert P.round_to(0.75 * f.smallest_subnormal, "fp16") == f.smallest_subnormal
    kinds = [r[3] for r in P.underflow_demo("fp16").rows]
    assert kinds[:f.mantissa_bits + 2] == ["normal"] + ["subnormal"] * f.mantissa_bits + ["zero"]
    # Subnormals keep the absolute spacing 2^-24, so their relative error grows past a normal number's eps/2.
    x, rel = P.subnormal_relative_error("fp16")
    assert rel[x < f.smallest_normal].max() > 10 * f.eps
    assert rel[x >= f.smallest_normal].max() <= f.eps / 2


def test_rounding_and_the_update_that_vanishes(one_thread):
    # bf16 keeps 7 mantissa bits: 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7, and ties go to even (1).
    assert P.round_to(1 + 2.0**-8, "bf16") == 1.0
    assert P.round_to(1 + 3 * 2.0**-8, "bf16") == 1 + 2.0**-6  # the other tie: the even neighbour is above
    assert P.ulp(1.0, "bf16") == 2.0**-7 and P.ulp(1.0, "fp16") == 2.0**-10 and P.ulp(1.0, "fp32") == 2.0**-23
    assert P.ulp(1000.0, "bf16") == 4.0  # [512, 1024): 2^9 * 2^-7
    assert P.ulp(448.0, "fp8_e4m3") == 32.0  # at max the next pattern is NaN: the gap below, 448 - 416
    # An update below half an ulp is lost in bf16 and kept in fp32 (whose ulp at 1 is 2^-23).
    lost = P.vanishing_update(1.0, 2.0**-9, "bf16")
    assert lost["vanished"] and lost["w_plus_dw"] == 1.0 and lost["half_ulp"] == 2.0**-8
    assert not P.vanishing_update(1.0, 2.0**-9, "fp32")["vanished"]
    assert not P.vanishing_update(1.0, 2.0**-8 * (1 + 2.0**-6), "bf16")["vanished"]  # just above half an ulp
    # A thousand updates of 1e-3 each: bf16 never moves; fp32 gets to 2 within its rounding (1000 additions of
    # about 2^-23 relative error each: well inside 1e-4).
    assert P.accumulate(1.0, 1e-3, 1000, "bf16") == 1.0
    assert abs(P.accumulate(1.0, 1e-3, 1000, "fp32") - 2.0) < 1e-4


# -- loss scaling on real ranks ---------------------------------------------------------------------------

def gradscaler_rule(skipped, init_scale, growth_factor, backoff_factor, growth_interval):
    """GradScaler.update as documented (torch.amp.GradScaler): x backoff and count reset on inf; x growth and
    count reset after growth_interval consecutive good steps. Returns (scale before, scale after, count after)."""
    scale, good, before, after, counts = init_scale, 0, [], [], []
    for bad in skipped:
        before.append(scale)
        if bad:
            scale, good = scale * backoff_factor, 0
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * growth_factor, 0
        after.append(scale)
        counts.append(good)
    return before, after, counts


@pytest.fixture(scope="module")
def loss_scaling_runs():
    # The inf goes into the last rank's gradient only: at world 2 rank 0's own gradient is finite.
    return {world: cu.run(WORKER, world_size=world, part="loss_scaling", inf_rank=world - 1, **RUN) for world in (1, 2)}


@ranks
@pytest.mark.parametrize("world", [1, 2])
def test_gradscaler_trajectory_follows_the_rule_and_skipped_steps_leave_weights_alone(loss_scaling_runs, world):
    res = loss_scaling_runs[world]
    for rank, d in enumerate(res.ranks):
        args = d["scaler_args"]
        steps = d["steps"]
        assert len(d["scale"]) == steps and d["weights"].shape[0] == steps + 1
        # "skipped" is measured by the worker (non-finite .grad after unscale_), not read from the scaler;
        # the scaler's scale and growth counter must then follow the rule exactly (powers of two: no rounding).
        before, after, counts = gradscaler_rule(d["skipped"], args["init_scale"], args["growth_factor"],
                                                args["backoff_factor"], args["growth_interval"])
        assert d["scale"] == before and d["scale_after"] == after and d["growth_tracker"] == counts, rank
        # A skipped step leaves every weight bit-identical; every other step moves them.
        w = d["weights"]
        for k, skipped in enumerate(d["skipped"]):
            assert torch.equal(w[k + 1], w[k]) == skipped, (rank, k)
        # The injected step is skipped on every rank, including the ranks whose own gradient was finite.
        for s in d["inf_steps"]:
            assert d["skipped"][s], (rank, s)
        # The sawtooth: the scale grew at least twice and the fp16 backward overflowed on its own at least
        # once (a skip that was not injected) - the scaler finds the largest scale the gradients allow.
        assert sum(b > a for a, b in zip(before, after)) >= 2
        assert any(k not in d["inf_steps"] for k, sk in enumerate(d["skipped"]) if sk)
        # The exercise's reference rule, replayed on the measured flags, gives the ranks' scales too.
        from solutions.ch08 import update_scale

        assert P.replay_scale(update_scale, d["skipped"], **args) == d["scale"]
        # The metrics stream carries one point per step, with the same scale and skip flags.
        assert [m["scale"] for m in res.metrics[rank]] == d["scale"]
        assert [m["skipped"] for m in res.metrics[rank]] == d["skipped"]


@ranks
def test_an_inf_on_one_rank_is_all_reduced_so_every_rank_skips_the_same_step(loss_scaling_runs):
    r0, r1 = loss_scaling_runs[2].ranks
    s = r0["inf_steps"][0]
    # Rank 1's own gradient held the inf; rank 0's did not (measured in DDP's comm hook, before the all-reduce).
    assert not r1["local_finite"][s] and r0["local_finite"][s]
    # After the all-reduce both hold inf, so both skip; the ranks agree on every step, every scale, every weight.
    assert r0["skipped"][s] and r1["skipped"][s]
    assert r0["skipped"] == r1["skipped"] and r0["scale"] == r1["scale"]
    assert torch.equal(r0["weights"], r1["weights"])
    # Some natural overflows also started on one rank only: the all-reduce made them everyone's too.
    one_sided = [k for k in range(len(r0["skipped"])) if r0["local_finite"][k] != r1["local_finite"][k]]
    assert one_sided and all(r0["skipped"][k] for k in one_sided)


@ranks
def test_nan_and_back_to_back_infs():
    res = cu.run(WORKER, world_size=1, part="loss_scaling", steps=12, inf_steps=[3, 4], inject="nan",
                 growth_interval=100, init_scale=1024.0, **RUN)
    d = res[0]
    # NaN is caught like inf; two bad steps in a row halve twice; growth_interval=100 means no growth here.
    assert [k for k, sk in enumerate(d["skipped"]) if sk] == [3, 4]
    assert d["scale"][:6] == [1024.0] * 4 + [512.0, 256.0] and d["scale"][-1] == 256.0
    assert d["growth_tracker"][4] == 0 and d["growth_tracker"][-1] == 7


@ranks
def test_parameters_a_learner_can_get_wrong_are_refused_before_launch():
    with pytest.raises(cu.InvalidParameter, match="part='loss_sacling' is not one of"):
        cu.run(WORKER, world_size=1, part="loss_sacling", **RUN)
    with pytest.raises(cu.InvalidParameter, match="inf_rank=3"):
        cu.run(WORKER, world_size=2, part="loss_scaling", inf_rank=3, **RUN)
    with pytest.raises(cu.InvalidParameter, match="inf_steps"):
        cu.run(WORKER, world_size=1, part="loss_scaling", steps=5, inf_steps=[7], **RUN)


# -- underflow and master weights ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def underflow_run():
    return cu.run(WORKER, world_size=1, part="underflow", **RUN)[0]


@ranks
def test_small_gradients_flush_to_zero_in_fp16_unless_the_loss_is_scaled(underflow_run):
    d = underflow_run
    un, sc = d["unscaled"], d["scaled"]
    assert all(a["dtype"] == "float16" for a in un["activations"].values())  # autocast really ran the backward in fp16
    # The logits' gradients are (p - onehot) / 2^20 with p ~ 1/512: about 2^-29, far below fp16's 2^-24.
    assert un["activations"]["head"]["flushed"] > 0.9
    assert un["flushed"] > 0.5  # most of all activation-gradient values are lost
    # Scaled by 2^16 they land inside fp16's range: (almost) nothing flushes and nothing overflows.
    # (A few values sit in the fp32 reference's own tail below 2^-40 even after scaling: < 0.1%.)
    assert sc["flushed"] < 1e-3 and all(a["overflowed"] == 0 for a in sc["activations"].values())
    # What that does to the weight gradients, against the fp32 backward: a large error unscaled; with
    # scaling only fp16 rounding remains (eps/2 = 2^-11 ~ 5e-4 per value, less after the fp32 sums).
    assert un["weight_grad_rel_error"] > 0.1
    assert sc["weight_grad_rel_error"] < 2e-3
    # The exponent histogram counts every non-zero reference value once.
    counts = sum(sum(c) for c in d["reference"]["exponents"].values())
    assert counts > 0.99 * d["tokens_per_rank"] * (4 * 64 + 64 + 512)


@pytest.fixture(scope="module")
def master_run():
    return cu.run(WORKER, world_size=1, part="master_weights", **RUN)[0]


@ranks
def test_pure_bf16_stagnates_while_fp32_master_weights_track_fp32(master_run):
    runs = master_run["runs"]
    assert [runs[k]["param_dtype"] for k in ("fp32", "bf16_master_fp32", "pure_bf16")] == ["float32", "float32", "bfloat16"]
    # The claims the notebook prints, each with its reason:
    # - master weights: the same loss as fp32 at every step, within 2% (measured <= 0.5% over CPU kernels and
    #   seeds). The only difference is the bf16 forward and backward (relative rounding 2^-9 per value), which
    #   perturbs the gradient, not its direction;
    # - the fp32 master copy keeps the updates: in any step under 1% of them are lost, the odd gradient element
    #   that is itself near zero (at most 1 of 256 here), which the fp32 run loses just the same;
    # - ... although its bf16 copy, the one the matmuls use, often does not change in a step: the small updates
    #   accumulate in fp32 until they cross a bf16 rounding boundary;
    # - pure bf16: most updates are below half an ulp of their weight by the end, and are lost;
    # - so its loss stalls: over the last third fp32 still halves (at least), pure bf16 barely moves, and it
    #   ends several times above fp32 (5x asked; ~10-12x measured).
    claims = P.master_weights_claims(master_run)
    assert len(claims) == 6 and all(claims.values()), claims
    # a run whose master copy were bf16 would break the first two claims: the claims can fail
    broken = {**runs, "bf16_master_fp32": runs["pure_bf16"]}
    assert not all(P.master_weights_claims({**master_run, "runs": broken}).values())


# -- figures ----------------------------------------------------------------------------------------------

@ranks
def test_every_figure_draws_from_real_results(loss_scaling_runs, underflow_run, master_run, one_thread):
    import matplotlib.pyplot as plt

    figs = [P.draw_format_ranges(), P.draw_fp8_grid(), P.draw_subnormal_error(), P.draw_loss_scaling(loss_scaling_runs[2]),
            P.draw_underflow(underflow_run), P.draw_master_weights(master_run)]
    try:
        assert all(isinstance(f, matplotlib.figure.Figure) and f.axes for f in figs)
        assert len(P.underflow_table(underflow_run).rows) == 2 * 4  # unscaled, scaled: 3 activations + weights
        assert len(P.master_weights_table(master_run).rows) == 3
    finally:
        for f in figs:
            plt.close(f)


def test_replay_scale_with_the_solution_matches_the_rule():
    from solutions.ch08 import update_scale

    skipped = [False] * 5 + [True] + [False] * 4
    assert P.replay_scale(update_scale, skipped, 8.0, growth_interval=2) == gradscaler_rule(skipped, 8.0, 2.0, 0.5, 2)[0]


# -- the exercise checkers ------------------------------------------------------------------------------

def test_round_to_bf16_checker(one_thread):
    from course_utils.catalogue.ch08 import check_round_to_bf16
    from solutions.ch08 import round_to_bf16
    from tests.wrong_answers.ch08 import WRONG

    assert check_round_to_bf16(round_to_bf16)[0] == PASS
    wrong = [(fn, frag) for name, fn, frag in WRONG if name == "round_to_bf16"]
    assert len(wrong) >= 2
    for fn, fragment in wrong:
        status, message = check_round_to_bf16(fn)
        assert status == FAIL and fragment in message, (fn.__name__, message)


def test_update_scale_checker_against_the_real_gradscaler():
    from course_utils.catalogue.ch08 import SCALE_SEQUENCES, _gradscaler_trajectory, check_update_scale
    from solutions.ch08 import update_scale
    from tests.wrong_answers.ch08 import WRONG

    # The ground truth is torch's GradScaler itself; on power-of-two factors it must agree with the rule above.
    init, gf, bf, gi, start, pattern = SCALE_SEQUENCES[0]
    flags = [c == "x" for c in pattern]
    _, after, counts = gradscaler_rule(flags, init, gf, bf, gi)
    assert _gradscaler_trajectory(init, gf, bf, gi, start, flags) == list(zip(after, counts))

    assert check_update_scale(update_scale)[0] == PASS
    wrong = [(fn, frag) for name, fn, frag in WRONG if name == "update_scale"]
    assert len(wrong) >= 2
    for fn, fragment in wrong:
        status, message = check_update_scale(fn)
        assert status == FAIL and fragment in message, (fn.__name__, message)
        assert "the real GradScaler went to" in message and "update " in message  # where, and what torch did


def test_stubs_score_todo_and_never_raise():
    def round_to_bf16(x):
        raise NotImplementedError

    def update_scale(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        raise NotImplementedError

    for name, stub in (("round_to_bf16", round_to_bf16), ("update_scale", update_scale)):
        verdict = check(name, stub)
        assert verdict.status == TODO and verdict.points == 0, verdict
    assert check("update_scale", lambda *a, **k: None).status == FAIL  # a malformed answer is a verdict too
