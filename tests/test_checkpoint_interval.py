"""The checkpoint-interval models against the numbers their papers publish, and against a simulation."""
import math

import numpy as np
import pytest

from course_utils import checkpoint_interval as ci

MIN, HOUR = 60.0, 3600.0


@pytest.mark.parametrize("mtbf_s, published_min", [(24 * HOUR, 117), (6 * HOUR, 57), (15 * MIN, 9.1)])
def test_daly_reproduces_his_figures_3_to_5(mtbf_s, published_min):
    # Daly (2006), Figures 3, 4 and 5: delta = 5 min, R = 10 min, T_s = 500 h; "the new model predicts
    # tau_opt = 117 min / 57 min / 9.1 min". The paper rounds to two or three figures.
    got = ci.daly_interval(5 * MIN, mtbf_s) / MIN
    assert got == pytest.approx(published_min, abs=0.5 if published_min > 10 else 0.05)


@pytest.mark.parametrize("mtbf_s", [24 * HOUR, 6 * HOUR, 15 * MIN, 3 * HOUR])
def test_daly_formula_is_the_minimum_of_his_complete_model(mtbf_s):
    # The perturbation series approximates the minimiser of T_w(tau); the restart time only scales T_w by
    # exp(R/M), so it cannot move the optimum. Within 0.3% at delta/M up to 1/3.
    numeric = ci.optimal_interval_numeric(5 * MIN, mtbf_s, restart_s=10 * MIN)
    assert ci.daly_interval(5 * MIN, mtbf_s) == pytest.approx(numeric, rel=3e-3)
    # ... and Young's first-order formula is further off, always on the long side for these costs.
    assert ci.young_interval(5 * MIN, mtbf_s) > numeric


def test_young_is_the_first_order_term():
    # Young (1974): sqrt(2 delta M). As delta/M -> 0, Daly's corrections vanish and the two agree.
    assert ci.young_interval(5 * MIN, 24 * HOUR) == pytest.approx(120 * MIN)
    assert ci.daly_interval(1.0, 1e9) / ci.young_interval(1.0, 1e9) == pytest.approx(1.0, abs=1e-4)


def test_daly_caps_the_interval_at_the_mtbf_when_a_checkpoint_costs_more_than_two_mtbfs():
    assert ci.daly_interval(3 * HOUR, 1 * HOUR) == 1 * HOUR


@pytest.mark.parametrize("tau_min, mtbf_s", [(57, 6 * HOUR), (9.1, 15 * MIN), (30, 15 * MIN)])
def test_complete_model_agrees_with_a_monte_carlo_of_poisson_failures(tau_min, mtbf_s):
    # The closed form counts failures during compute, checkpoint writes and restarts; the simulator plays
    # them out one by one. 400 runs of 100 segments: agree within 4 standard errors of the simulated mean.
    tau = tau_min * MIN
    solve = 100 * tau
    sim = ci.simulate_wall_time(tau, 5 * MIN, mtbf_s, 10 * MIN, solve, runs=400, seed=1)
    model = float(ci.expected_wall_time(tau, 5 * MIN, mtbf_s, 10 * MIN, solve))
    assert abs(sim.mean() - model) < 4 * sim.std() / math.sqrt(len(sim)), (sim.mean(), model)


def test_without_failures_the_only_waste_is_the_checkpoint_write():
    # A machine that never fails loses delta / (tau + delta): the limit M -> infinity of the model.
    tau, delta = 3600.0, 60.0
    assert float(ci.waste_fraction(tau, delta, 1e15)) == pytest.approx(delta / (tau + delta), rel=1e-6)


def test_waste_curve_has_its_minimum_at_daly_and_rises_on_both_sides():
    delta, mtbf = 2 * MIN, 3 * HOUR
    best = ci.daly_interval(delta, mtbf)
    def waste(tau):
        return float(ci.waste_fraction(tau, delta, mtbf, 10 * MIN))

    assert waste(best) < waste(best / 3) and waste(best) < waste(best * 3)


def test_llama3_interruptions_give_a_job_mtbf_of_about_three_hours():
    # Dubey et al. 2024 (Llama 3), section 3.3.4: 419 unexpected interruptions in 54 days -> one every 3.1 h.
    assert ci.llama3_job_mtbf() / HOUR == pytest.approx(3.09, abs=0.01)
    # ... which, spread over 16,384 GPUs, is one failure per GPU every ~5.8 years.
    gpu_mtbf = ci.llama3_job_mtbf() * ci.LLAMA3_GPUS
    assert ci.job_mtbf(gpu_mtbf, ci.LLAMA3_GPUS) == pytest.approx(ci.llama3_job_mtbf())
    assert gpu_mtbf / (365 * 24 * HOUR) == pytest.approx(5.8, abs=0.1)


@pytest.mark.parametrize("bad", [dict(checkpoint_s=0, mtbf_s=1), dict(checkpoint_s=1, mtbf_s=-1)])
def test_nonsense_inputs_are_refused_in_one_sentence(bad):
    with pytest.raises(ValueError, match="seconds"):
        ci.young_interval(**bad)


def test_sensitivity_figure_draws():
    fig = ci.sensitivity_figure(2 * MIN, 3 * HOUR, 10 * MIN, simulated={3600.0: np.array([1.1, 1.2])})
    assert len(fig.axes) == 2
