"""How often to checkpoint: Young's and Daly's optimum intervals, Daly's wall-time model, and a simulator.

A job that fails at random (a Poisson process with mean time between failures ``M``) and takes ``delta``
seconds to write a checkpoint loses, per failure, the work since the last checkpoint plus the restart
time ``R``; checkpointing more often loses less work but spends more time writing. Two classic answers:

- Young (1974), "A first order approximation to the optimum checkpoint interval", CACM 17(9):
  ``tau = sqrt(2 * delta * M)``.
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
  Generation Computer Systems 22(3), 303-312: the complete model of the expected wall time
  ``T_w(tau) = M * exp(R / M) * (exp((tau + delta) / M) - 1) * T_s / tau`` for ``T_s`` seconds of work, and
  its perturbation solution ``tau = sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta``
  for ``delta < 2M`` (``tau = M`` beyond). His Figures 3-5 give 117, 57 and 9.1 minutes for M = 24 h, 6 h
  and 15 min with delta = 5 min, R = 10 min (``tests/test_checkpoint_interval.py`` reproduces them).

``tau`` is compute time between checkpoints, not counting the write. Units are seconds throughout. For a
job on N GPUs whose failures are independent, the job's MTBF is the per-GPU MTBF divided by N
(``job_mtbf``): that is why a 16k-GPU run must checkpoint every hour or so.
"""
from __future__ import annotations

import math

import numpy as np

HOUR = 3600.0
DAY = 24 * HOUR

# Llama 3 405B pre-training (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4 and Table 5):
# 419 unexpected interruptions in a 54-day snapshot, on up to 16,384 H100 GPUs.
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_SNAPSHOT_DAYS = 54
LLAMA3_GPUS = 16384


def job_mtbf(gpu_mtbf_s: float, n_gpus: int) -> float:
    """MTBF of a job that stops when any of ``n_gpus`` independent GPUs fails: the rates add up."""
    if n_gpus < 1:
        raise ValueError(f"n_gpus={n_gpus}: a job runs on at least one GPU")
    return gpu_mtbf_s / n_gpus


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints, sqrt(2 delta M)."""
    _check(checkpoint_s, mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (his perturbation solution, 2006); M itself when delta >= 2M."""
    _check(checkpoint_s, mtbf_s)
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    xi = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(xi) / 3.0 + xi / 9.0) - checkpoint_s


def expected_wall_time(interval_s, checkpoint_s: float, mtbf_s: float, restart_s: float, solve_s: float):
    """Daly's complete model: expected wall time to finish ``solve_s`` of work (numpy-friendly in interval_s).

    Each of the ``T_s / tau`` segments lasts ``tau + delta`` if nothing fails; a failure anywhere in it (the
    write included) loses the segment and costs a restart, which can itself be interrupted.
    """
    tau = np.asarray(interval_s, dtype=float)
    return mtbf_s * math.exp(restart_s / mtbf_s) * np.expm1((tau + checkpoint_s) / mtbf_s) * solve_s / tau


def waste_fraction(interval_s, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0):
    """Fraction of the machine's time not spent on useful work, 1 - T_s / T_w (independent of T_s)."""
    return 1.0 - 1.0 / (expected_wall_time(interval_s, checkpoint_s, mtbf_s, restart_s, 1.0))


def optimal_interval_numeric(checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The interval that minimises Daly's complete model, by golden-section search (a check on the formulas)."""
    _check(checkpoint_s, mtbf_s)
    lo, hi = 1e-6 * mtbf_s, 10.0 * mtbf_s
    g = (math.sqrt(5.0) - 1.0) / 2.0
    f = lambda t: float(expected_wall_time(t, checkpoint_s, mtbf_s, restart_s, 1.0))  # noqa: E731
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    for _ in range(200):
        if f(a) < f(b):
            hi, b = b, a
            a = hi - g * (hi - lo)
        else:
            lo, a = a, b
            b = lo + g * (hi - lo)
    return (lo + hi) / 2.0


def simulate_wall_time(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float, solve_s: float,
                       *, runs: int = 200, seed: int = 0) -> np.ndarray:
    """Monte-Carlo wall times of ``runs`` jobs with exponential failures (what Daly compares his model with).

    A segment is ``min(tau, work left)`` of compute plus one checkpoint write; a failure during it sends the
    job back to the last checkpoint after a restart of ``restart_s``, during which failures can strike too.
    """
    rng = np.random.default_rng(seed)
    out = np.empty(runs)
    for r in range(runs):
        clock, done = 0.0, 0.0
        while done < solve_s - 1e-9:
            work = min(interval_s, solve_s - done)
            segment = work + checkpoint_s
            while True:
                failure = rng.exponential(mtbf_s)
                if failure >= segment:
                    clock += segment
                    done += work
                    break
                clock += failure
                while True:  # restart until one restart completes without a failure
                    failure = rng.exponential(mtbf_s)
                    if failure >= restart_s:
                        clock += restart_s
                        break
                    clock += failure
        out[r] = clock
    return out


def llama3_job_mtbf() -> float:
    """The job MTBF implied by Llama 3's published interruption count (seconds)."""
    return LLAMA3_SNAPSHOT_DAYS * DAY / LLAMA3_UNEXPECTED_INTERRUPTIONS


def _check(checkpoint_s: float, mtbf_s: float) -> None:
    if checkpoint_s <= 0:
        raise ValueError(f"checkpoint_s={checkpoint_s}: a checkpoint takes some time to write; give seconds > 0")
    if mtbf_s <= 0:
        raise ValueError(f"mtbf_s={mtbf_s}: the mean time between failures must be positive seconds")


# -- figures ------------------------------------------------------------------------------------------------

def sensitivity_figure(checkpoint_s: float, mtbf_s: float, restart_s: float, *, simulated: dict | None = None):
    """Waste vs interval for the given costs (with Young and Daly marked), and the price of a wrong MTBF guess.

    ``simulated``: optional {interval_s: array of simulated wall times / solve time} drawn as points.
    """
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    taus = np.geomspace(0.05, 20, 300) * young_interval(checkpoint_s, mtbf_s)
    for scale, style in ((0.5, ":"), (1.0, "-"), (2.0, "--")):
        d = checkpoint_s * scale
        ax.plot(taus / 60, 100 * waste_fraction(taus, d, mtbf_s, restart_s), style, color="C0",
                label=f"checkpoint {d / 60:.1f} min")
        ax.plot(daly_interval(d, mtbf_s) / 60, 100 * waste_fraction(daly_interval(d, mtbf_s), d, mtbf_s, restart_s),
                "o", color="C1")
    ax.plot([], [], "o", color="C1", label="Daly optimum")
    ax.axvline(young_interval(checkpoint_s, mtbf_s) / 60, color="0.5", lw=0.8, label="Young, sqrt(2 C M)")
    if simulated:
        for tau, walls in simulated.items():
            waste = 100 * (1 - 1 / np.asarray(walls))
            ax.errorbar(tau / 60, waste.mean(), yerr=waste.std() / math.sqrt(len(waste)), fmt="s", color="k",
                        ms=4, label="simulated" if tau == next(iter(simulated)) else None)
    ax.set_xscale("log")
    ax.set_xlabel("compute time between checkpoints (minutes)")
    ax.set_ylabel("time lost to checkpoints and failures (%)")
    ax.set_title(f"MTBF {mtbf_s / HOUR:.1f} h, restart {restart_s / 60:.0f} min")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    guesses = np.geomspace(0.1, 10, 200)
    best = waste_fraction(daly_interval(checkpoint_s, mtbf_s), checkpoint_s, mtbf_s, restart_s)
    chosen = [waste_fraction(daly_interval(checkpoint_s, g * mtbf_s), checkpoint_s, mtbf_s, restart_s) for g in guesses]
    bx.plot(guesses, 100 * (np.array(chosen) - best), color="C2")
    bx.set_xscale("log")
    bx.set_xlabel("MTBF you assumed / true MTBF")
    bx.set_ylabel("extra time lost vs the optimum (percentage points)")
    bx.set_title("a 2x error in the MTBF costs little")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    return fig
