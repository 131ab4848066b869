"""Chapter 01's graded exercises: two collectives built from smaller ones (on real ranks), and busbw."""
from course_utils.exercises import FAIL, PASS, Exercise, register

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
            if abs(got - want) > 1e-9 * want:
                return FAIL, _busbw_diagnosis(collective, n, got, nbytes / seconds)
    return PASS, "matches nccl-tests' busbw for all six collectives at n = 2, 4, 8"


register(Exercise("ring_all_reduce", "01", "ring_all_reduce",
                  "Ring all-reduce from send/recv: reduce-scatter, then all-gather",
                  worker=CHECKER, world_sizes=(2, 4)))
register(Exercise("all_gather_from_broadcast", "01", "all_gather_from_broadcast",
                  "all_gather built from one broadcast per rank",
                  worker=CHECKER, world_sizes=(2, 4)))
register(Exercise("bus_bandwidth", "01", "bus_bandwidth",
                  "nccl-tests' bus bandwidth from a measured time", local=check_bus_bandwidth))
