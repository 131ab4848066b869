"""Chapter 06's per-segment profile of the Megatron block (``workers/ch06_profile.py``), on CPU ranks."""
import pytest

import course_utils as cu

pytestmark = pytest.mark.ranks


@pytest.mark.parametrize("tp", [1, 2])
def test_shares_add_up_and_communication_is_zero_without_collectives(tp):
    res = cu.run("workers.ch06_profile", world_size=2, tp=tp, hidden=32, heads=4, seqs=[8, 16], batch=2,
                 repeats=3, warmup=1, timeout=120)
    for prof in res[0]["profiles"]:
        share = prof["forward_share"]
        assert sum(share.values()) == pytest.approx(1.0, abs=1e-9), share  # one step's parts of one whole
        assert all(v >= 0 for v in share.values()), share
        if tp == 1:  # a group of one runs no collective: nothing may be booked as communication
            assert share["communication"] == 0 and prof["comm_forward_s"] == prof["comm_backward_s"] == 0
        else:
            assert share["communication"] > 0 and prof["comm_backward_s"] > 0
