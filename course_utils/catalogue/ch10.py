"""Chapter 10's graded exercises, checked in the notebook (pure Python, against the course's own models).

- ``ring_allreduce_time``: the alpha-beta time of a ring all-reduce, 2(n-1) alpha + 2(n-1)/n S/B
  (``course_utils.ledger.collective_time``);
- ``fix_nccl_env``: turn a debugging NCCL/PyTorch environment into one fit for production, judged by
  ``course_utils.nccl_env.validate_env``.
"""
from __future__ import annotations

import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register
from course_utils.nccl_env import BAD_ENV

# -- 1. the ring all-reduce time -----------------------------------------------------------------------------

RING_CASES = [  # (n, size_bytes, alpha seconds, bandwidth bytes/s)
    (8, 1 << 30, 5e-6, 50e9),
    (256, 1 << 20, 5e-6, 50e9),  # 32 nodes of 8: latency dominates
    (2, 4096, 1e-5, 1e9),
    (8192, 64 << 20, 2e-6, 400e9),  # 1024 nodes of 8
    (1, 1 << 20, 5e-6, 50e9),  # one rank communicates nothing
]


def check_ring_allreduce_time(answer) -> tuple[str, str]:
    from course_utils.ledger import collective_time

    for n, size, alpha, bw in RING_CASES:
        got = answer(n, size, alpha, bw)
        want = collective_time("all_reduce", size, n, bw, alpha)
        case = f"n={n}, size={size}, alpha={alpha:g}, bandwidth={bw:g}"
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return FAIL, f"return a number of seconds, got {got!r} for {case}"
        if not math.isfinite(got):
            return FAIL, (f"for {case} you returned {got}, not a finite number of seconds"
                          + (": one rank has nobody to talk to, so the time is 0" if n == 1 else ""))
        if abs(got - want) <= 1e-9 * max(want, 1e-12):
            continue
        if n == 1:
            return FAIL, f"for {case} you returned {got:g}: one rank has nobody to talk to, so the time is 0"
        lat, bwt = 2 * (n - 1) * alpha, 2 * (n - 1) / n * size / bw
        if abs(got - ((n - 1) * alpha + bwt)) <= 1e-9 * want:
            hint = "the latency term counts n-1 steps; a ring all-reduce is a reduce-scatter then an all-gather, 2(n-1) steps"
        elif abs(got - (lat + (n - 1) / n * size / bw)) <= 1e-9 * want:
            hint = "the bandwidth term is missing its factor 2: each byte crosses 2(n-1)/n links' worth, not (n-1)/n"
        elif abs(got - (lat + 2 * size / bw)) <= 1e-9 * want:
            hint = "the bandwidth term is 2(n-1)/n x S/B, not 2 S/B: each rank sends 2(n-1) chunks of S/n"
        elif abs(got - (lat + 2 * (n - 1) * size / bw)) <= 1e-9 * want:
            hint = "each of the 2(n-1) steps moves a chunk of S/n, not the whole S"
        elif abs(got - bwt) <= 1e-9 * want:
            hint = "the latency term 2(n-1) x alpha is missing"
        elif abs(got - (lat + (2 * (n - 1) // n) * size / bw)) <= 1e-9 * want or abs(got - lat) <= 1e-9 * want:
            hint = (f"integer division: 2(n-1)//n is {2 * (n - 1) // n} (and (n-1)//n is 0) where 2(n-1)/n is "
                    f"{2 * (n - 1) / n:g}; use / for the bandwidth factor")
        else:
            hint = f"expected 2(n-1) alpha + 2(n-1)/n S/B = {want:.6g} s"
        return FAIL, f"for {case} you returned {got:.6g} s: {hint}"
    return PASS, "correct: 2(n-1) alpha + 2(n-1)/n x S/B, the ledger's collective_time"


# -- 2. fix a debugging environment ----------------------------------------------------------------------------

MUST_KEEP = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")  # the system configuration: without it NCCL picks the wrong ports
FR_SIZES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch 2.13's name, and the deprecated one


def check_fix_nccl_env(answer) -> tuple[str, str]:
    from course_utils.nccl_env import FR_DEFAULT_ENTRIES, read_int, validate_env

    given = dict(BAD_ENV)
    got = answer(given)
    if given != BAD_ENV:
        changed = sorted(set(given) ^ set(BAD_ENV) | {k for k in given if k in BAD_ENV and given[k] != BAD_ENV[k]})
        return FAIL, (f"your function changed the environment it was given ({', '.join(changed[:3])}...): return a "
                      "corrected copy (fixed = dict(env), then edit fixed); the caller may still need the original, "
                      "to diff it or to launch the debugging run again")
    if not isinstance(got, dict):
        return FAIL, f"return the corrected environment as a dict of name -> value, got {type(got).__name__}"
    not_str = [(k, v) for k, v in got.items() if not isinstance(k, str) or not isinstance(v, str)]
    if not_str:
        k, v = not_str[0]
        return FAIL, (f"{k}={v!r} is of type {type(v).__name__}, not str: an environment holds strings only "
                      f"(os.environ refuses anything else, and NCCL and PyTorch read their settings as text): "
                      f"write {str(v)!r}")
    for name in MUST_KEEP:
        if got.get(name) != BAD_ENV[name]:
            return FAIL, (f"keep {name}={BAD_ENV[name]}: it is system configuration (which ports to use), "
                          "not a debugging setting")
    if "NCCL_ASYNC_ERROR_HANDLING" in got and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in got:
        return FAIL, "NCCL_ASYNC_ERROR_HANDLING is PyTorch's deprecated name: rename it to TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in got:
        return FAIL, ("NCCL_ASYNC_ERROR_HANDLING's intent (tear down on errors) is lost: rename it to "
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING rather than deleting it")
    if "NCCL_IB_QPS_PER_CONNECTION" not in got and "NCCL_IB_QPS_PER_CONECTION" not in got:
        return FAIL, ("the misspelt NCCL_IB_QPS_PER_CONECTION was meant as NCCL_IB_QPS_PER_CONNECTION=4 (measured "
                      "earlier, say): fix the spelling rather than dropping it")
    if str(got.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "")).strip() != "1":
        return FAIL, ("keep TORCH_NCCL_DUMP_ON_TIMEOUT=1: the dump is what you read after the next hang; make it work "
                      "by fixing what turns the flight recorder off")
    sizes = {name: read_int(name, str(got[name]))[0] for name in FR_SIZES if name in got}
    off = [name for name, n in sizes.items() if n is not None and n <= 0]
    if off:
        return FAIL, (f"{off[0]}={got[off[0]]} turns off the flight recorder that TORCH_NCCL_DUMP_ON_TIMEOUT=1 dumps: "
                      f"delete it (torch 2.13 keeps {FR_DEFAULT_ENTRIES} entries by default) or set TORCH_FR_BUFFER_SIZE "
                      "to a positive number")
    findings = validate_env(got)
    if findings:
        return FAIL, f"{len(findings)} problem(s) left; the first: {findings[0]}"
    return PASS, ("correct: debug settings removed, the typo and the deprecated names fixed, the flight recorder back on "
                  "for the dump")


A_FORMULA = "a formula of four numbers: no tensors, no ranks, nothing sent"
AN_ENVIRONMENT = "a dict of names to strings: no tensors, no ranks, nothing sent"

register(Exercise("ring_allreduce_time", "10", "ring_allreduce_time",
                  "The alpha-beta time of a ring all-reduce", local=check_ring_allreduce_time, tries={
                      "non-finite": "a NaN or infinite time is named as not finite",
                      "order": NOT_APPLICABLE + A_FORMULA,
                      "sizes": "n = 2, where 2(n-1)/n is a whole number, and n = 8, 256, 8192, where it is not: "
                               "floor division shows only there",
                      "ragged": "a world of one rank (n = 1): no peer, no step, the time is 0",
                      "layouts": NOT_APPLICABLE + A_FORMULA + "; its cases vary n, S, alpha and B",
                      "traffic": NOT_APPLICABLE + A_FORMULA,
                      "mutation": NOT_APPLICABLE + "the inputs are Python numbers, which cannot change in place",
                      "output": NOT_APPLICABLE + "a Python number of seconds: no device, dtype or length",
                      "memory": NOT_APPLICABLE + A_FORMULA,
                      "bits": NOT_APPLICABLE + "compared to a relative 1e-9: the same formula in another order "
                              "differs in its last bits"}))
register(Exercise("fix_nccl_env", "10", "fix_nccl_env",
                  "Turn a debugging NCCL environment into a production one", local=check_fix_nccl_env, tries={
                      "non-finite": NOT_APPLICABLE + "the answer returns strings, not numbers; a number in it is "
                                    "refused as the wrong type (output)",
                      "order": NOT_APPLICABLE + AN_ENVIRONMENT,
                      "sizes": NOT_APPLICABLE + AN_ENVIRONMENT,
                      "ragged": NOT_APPLICABLE + AN_ENVIRONMENT,
                      "layouts": NOT_APPLICABLE + "one debugging environment, the chapter's; " + AN_ENVIRONMENT,
                      "traffic": NOT_APPLICABLE + AN_ENVIRONMENT,
                      "mutation": "the environment given is compared with a copy after the call",
                      "output": "every value returned must be a str, as os.environ and NCCL read them",
                      "memory": NOT_APPLICABLE + AN_ENVIRONMENT,
                      "bits": NOT_APPLICABLE + AN_ENVIRONMENT}))
