"""ECMP hash collisions: F flows hashed uniformly onto L equal-cost uplinks, and why more QPs per connection help.

A switch picks the uplink of a flow by hashing its header (for RoCE, the UDP source port that each queue
pair gets), so two flows can land on the same link while another link idles. The flows on a link share it;
a collective is as slow as its slowest flow. This is "balls into bins": with F balls and L bins, the fullest
bin holds max_load balls, and the slowest flow gets 1 / max_load of a link.

``NCCL_IB_QPS_PER_CONNECTION=q`` splits each connection over q queue pairs, so q times as many flows each
carrying 1/q of the data: the loads average out (law of large numbers) and max_load / mean_load falls towards 1.
The simulation is seeded numpy; ``expected_max_load`` is the exact expectation, and a test holds them together.
"""
from __future__ import annotations

import math

import numpy as np


def _check(flows: int, links: int) -> None:
    for name, v in (("flows", flows), ("links", links)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")


def simulate_link_loads(flows: int, links: int, trials: int = 10_000, seed: int = 0) -> np.ndarray:
    """Flows per link, ``[trials, links]``: each flow's uplink drawn uniformly (an ideal hash), seeded."""
    _check(flows, links)
    rng = np.random.default_rng(seed)
    choice = rng.integers(0, links, size=(trials, flows))  # [trials, flows]
    loads = np.zeros((trials, links), dtype=np.int64)
    np.add.at(loads, (np.arange(trials)[:, None], choice), 1)
    return loads  # [trials, links]


def prob_max_load_at_most(k: int, flows: int, links: int) -> float:
    """P(no link gets more than k of the flows), exactly.

    Place the flows link by link: the first of b remaining links takes c ~ Binomial(r, 1/b) of the r remaining
    flows, and so on; g_b(r) = sum_{c<=k} Binom(r, c; 1/b) g_{b-1}(r - c), g_0(r) = [r == 0].
    """
    _check(flows, links)
    if k * links < flows:
        return 0.0
    if k >= flows:
        return 1.0
    r = np.arange(flows + 1)
    g = (r == 0).astype(float)  # g_0
    for b in range(1, links + 1):
        p = 1.0 / b
        new = np.zeros(flows + 1)
        for c in range(0, k + 1):
            rem = r - c
            ok = rem >= 0
            pmf = np.zeros(flows + 1)
            rr = r[ok]
            log_pmf = (_log_comb(rr, c) + c * math.log(p) + (rr - c) * (math.log1p(-p) if b > 1 else 0.0))
            if b == 1:  # the last link takes every remaining flow
                log_pmf = np.where(rr == c, 0.0, -np.inf)
            pmf[ok] = np.exp(log_pmf)
            new[ok] += pmf[ok] * g[rem[ok]]
        g = new
    return float(min(max(g[flows], 0.0), 1.0))


def _log_comb(n: np.ndarray, k: int) -> np.ndarray:
    log_fact = np.cumsum(np.log(np.maximum(np.arange(int(n.max()) + 1), 1)))  # log(i!) for i = 0..max(n)
    return log_fact[n] - log_fact[k] - log_fact[n - k]


def expected_max_load(flows: int, links: int) -> float:
    """E[flows on the busiest link], exactly: sum over k >= 0 of P(max load > k)."""
    _check(flows, links)
    total, k = 0.0, 0
    while k < flows:
        tail = 1.0 - prob_max_load_at_most(k, flows, links)
        if tail < 1e-13 and k * links >= flows:
            break
        total += tail
        k += 1
    return total


def qp_sweep(pairs: int, links: int, qps_list=(1, 2, 4, 8), trials: int = 4000, seed: int = 0) -> list[dict]:
    """For ``pairs`` GPU-pair connections on ``links`` uplinks, each split over q QPs: the fabric's efficiency.

    A connection's data is split evenly over its q flows, so it finishes when its flow on the busiest link
    does: it gets q x link / max_load. ``efficiency`` = mean load / max load, with mean load = flows / links: the
    share of the uplinks' total bandwidth the collective actually uses, paced by its slowest flow (1 = a perfect
    spread). Neither the mean load nor the slowest connection's share of a link (q / E[max load] =
    ``efficiency x links / pairs``) gets a column: with as many connections as uplinks, the case the notebook
    shows, they would repeat the QP count and the efficiency.
    """
    rows = []
    for q in qps_list:
        flows = pairs * q
        loads = simulate_link_loads(flows, links, trials, seed)
        sim = loads.max(axis=1).mean()
        exact = expected_max_load(flows, links)
        mean_load = flows / links
        rows.append({"QPs per connection": q, "flows": flows, "E[max load] exact": exact, "max load simulated": float(sim),
                     "efficiency": mean_load / exact})
    return rows
