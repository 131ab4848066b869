"""Chapter 01's graded exercises: two collectives built from smaller ones (on real ranks), and busbw."""
import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

CHECKER = "workers.exercises.ch01"


_FACTORS = "2(n-1)/n for all_reduce; (n-1)/n for all_gather, reduce_scatter and all_to_all; 1 for broadcast and reduce"


def _busbw_diagnosis(collective: str, n: int, got: float, algbw: float) -> str:
    """Name the factor the answer used, when it is one of the known ones."""
    from course_utils.ledger import bus_bandwidth_factor

    want_f = bus_bandwidth_factor(collective, n)
    used = got / algbw
    head = f"{collective} at n={n}: got {got / 1e9:.4g} GB/s, expected {algbw * want_f / 1e9:.4g} GB/s: "
    readings = []  # every known mistake that gives this number (at n = 2, algbw and all_reduce's factor agree)
    if abs(used - 1) < 1e-9:
        readings.append("the algorithm bandwidth (bytes / seconds) itself, with no factor")
    for other in ("all_reduce", "all_gather"):
        f = bus_bandwidth_factor(other, n)
        if other != collective and abs(used - f) < 1e-9:
            readings.append(f"{other}'s factor ({f:.4g})")
    if readings:
        return head + (f"that is {' or '.join(readings)}, but {collective}'s factor at n={n} is {want_f:.4g}: busbw = "
                       f"algbw x a factor that depends on the collective ({_FACTORS})")
    return head + f"algbw x {used:.4g} is no collective's factor; busbw = algbw x factor, with {_FACTORS}"


def check_bus_bandwidth(answer) -> tuple[str, str]:
    """Compare ``answer(collective, nbytes, seconds, world_size)`` with nccl-tests' definition."""
    from course_utils.ledger import bus_bandwidth_factor

    nbytes, seconds = 64 * 2**20, 0.004  # 64 MiB in 4 ms: algbw = 16.8 GB/s
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"):
        for n in (2, 4, 8):
            want = nbytes / seconds * bus_bandwidth_factor(collective, n)
            got = answer(collective, nbytes, seconds, n)
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                return FAIL, f"bus_bandwidth should return a number of bytes/s, not {type(got).__name__}"
            if not math.isfinite(got):
                return FAIL, (f"bus_bandwidth returned {got} for {collective} at n={n}: a bandwidth is a finite "
                              "number of bytes/s (algbw = bytes / seconds, times the collective's factor)")
            if not abs(got - want) <= 1e-9 * want:
                return FAIL, _busbw_diagnosis(collective, n, got, nbytes / seconds)
    return PASS, "matches nccl-tests' busbw for all six collectives at n = 2, 4, 8"


NO_MEMORY = NOT_APPLICABLE + "the answer keeps nothing: its buffers live only while it runs"
NO_ORDER = NOT_APPLICABLE + "no autograd: a collective on tensors that need no gradient"

register(Exercise("ring_all_reduce", "01", "ring_all_reduce",
                  "Ring all-reduce from send/recv: reduce-scatter, then all-gather",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "the sum on every rank: NaN or inf anywhere is named",
                      "order": NO_ORDER,
                      "sizes": NOT_APPLICABLE + "the exercise's tensor is 1-D with a length that is a multiple of the "
                                                "world size, as it states",
                      "ragged": NOT_APPLICABLE + "every rank's tensor has the same length (a multiple of n): n equal chunks",
                      "layouts": NOT_APPLICABLE + "one ring over the ranks in rank order on one 1-D tensor: the "
                                                  "exercise has a single layout",
                      "traffic": "counts the bytes each rank sends with send/isend (2(n-1) chunks of S/n) and forbids "
                                 "the ready-made collectives",
                      "mutation": NOT_APPLICABLE + "summing in place into x is allowed: the answer may return x itself",
                      "output": NOT_APPLICABLE + "the sum may be left in x, so the result is x's own tensor: float32 "
                                                 "on the device x came on",
                      "memory": NO_MEMORY,
                      "bits": NOT_APPLICABLE + "the inputs are small integers as float32: every order of addition "
                                               "gives the exact sum, compared exactly",
                  }))
register(Exercise("all_gather_from_broadcast", "01", "all_gather_from_broadcast",
                  "all_gather built from one broadcast per rank",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "the gathered tensor on every rank: NaN or inf anywhere is named",
                      "order": NO_ORDER,
                      "sizes": NOT_APPLICABLE + "all_gather takes one tensor of the same shape from every rank: "
                                                "nothing is divided",
                      "ragged": NOT_APPLICABLE + "every rank sends a tensor of the same shape, as all_gather requires",
                      "layouts": NOT_APPLICABLE + "row k is rank k's tensor whatever its shape: one layout, tried in "
                                                  "three dtypes (the output class)",
                      "traffic": "forbids every ready-made collective but broadcast, and counts the broadcasts: one "
                                 "per rank",
                      "mutation": "x is the same after the call on every rank",
                      "output": "float32, bfloat16 and int64 inputs: the result keeps x's dtype and device",
                      "memory": NO_MEMORY,
                      "bits": NOT_APPLICABLE + "values are copied, never computed: a wrong row differs by whole "
                                               "integers, compared exactly",
                  }))
register(Exercise("bus_bandwidth", "01", "bus_bandwidth",
                  "nccl-tests' bus bandwidth from a measured time", local=check_bus_bandwidth, tries={
                      "non-finite": "a NaN or inf bandwidth for any collective fails, and is named",
                      "order": NOT_APPLICABLE + "a formula of numbers: no tensors, no gradients",
                      "sizes": NOT_APPLICABLE + "a formula valid for any n: n = 2, 4, 8 are the layouts class",
                      "ragged": NOT_APPLICABLE + "a formula of numbers: nothing is partitioned",
                      "layouts": "six collectives at n = 2, 4, 8: a factor right for one collective, or at n = 2 "
                                 "only, fails",
                      "traffic": NOT_APPLICABLE + "a formula: nothing is communicated",
                      "mutation": NOT_APPLICABLE + "its arguments are numbers and strings, which cannot be changed",
                      "output": "the result is a number (int or float), not a string or a tensor",
                      "memory": NOT_APPLICABLE + "a formula: nothing is allocated",
                      "bits": NOT_APPLICABLE + "a float formula compared to a relative 1e-9: the order of the "
                                               "multiplications may change the last bits",
                  }))
