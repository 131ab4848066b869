"""gloo on CUDA tensors (one GPU, several ranks) has no all_gather, reduce_scatter or all_to_all: the runtime
sends those through host copies (``workers.runtime.host_staged``). CPU CI forces that path on gloo ranks
and checks the results are still exact: the tensor-parallel mappings bit for bit against the reference, and
ZeRO-1 (reduce_scatter + all_gather) bit for bit against the same run without host copies."""
import pytest

import course_utils as cu
from workers.parallel.reference import MAPPING_NAMES, compare

HELPER = "tests.rank_helpers.host_staged"  # which collectives stage is tested in tests/test_ch01_helpers.py


@pytest.mark.ranks
def test_mappings_through_host_copies_match_the_reference_exactly():
    res = cu.run(HELPER, world_size=2, target="workers.ch03_mappings", timeout=60)
    assert set(res[0]["staged"]) == {"all_gather", "reduce_scatter", "all_to_all"}
    for name in MAPPING_NAMES:
        recs = [res[r]["records"][name] for r in range(2)]
        assert compare(name, recs, **recs[0]["options"])["exact"], name


@pytest.mark.ranks
def test_zero1_through_host_copies_gives_the_same_bits_as_without():
    direct = cu.run("workers.ch11_zero1", world_size=2, optimizer="adamw", timeout=120)
    staged = cu.run(HELPER, world_size=2, target="workers.ch11_zero1", optimizer="adamw", timeout=120)
    assert set(staged[0]["staged"]) == {"all_gather", "reduce_scatter"}
    assert staged[0]["staged_calls"] >= 2 * 3  # both collectives, every step
    for rank in range(2):  # the same distance from the unsharded optimizer, to the last bit
        assert staged[rank]["max_abs_error"] == direct[rank]["max_abs_error"]
        assert staged[rank]["equal_to_rank0"]
