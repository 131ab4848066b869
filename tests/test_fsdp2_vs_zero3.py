"""ZeRO-3 by hand against PyTorch's FSDP2 (``fully_shard`` on gloo), issue 16: the same model, data and AdamW.

Both are held to the single-process reference with chapter 11's ``ADAM_TOL`` = 2e-4 (``test_zero1.py``), and to
each other with the same bound: they differ only in how the gradient's mean is rounded (the hand version
pre-scales by 1/n and sums; FSDP2 sums, then divides). Measured over seeds 0-2 at world 2 and 4 and on the
uneven model, under three CPU kernel sets: FSDP2 vs the reference and vs the hand version at most 3.8e-5 (native
AVX-512), 2.4e-5 (AVX2), 2.1e-5 (plain kernels); at world 2 the two agreed bit for bit here (a division by 2 is
exact), which is shown, not asserted.

The messages are compared exactly: same units, same order, same sizes, except for what each does differently on
purpose (``workers/ch11_fsdp2.py``): FSDP2 keeps its root whole from forward to backward, and pads every
parameter's first dimension rather than each unit's flat buffer.
"""
import pytest

import course_utils as cu
from tests.test_zero1 import ADAM_TOL
from tests.test_zero3 import UNEVEN
from tests.numeric import worst

WORKER = "workers.ch11_fsdp2"
pytestmark = pytest.mark.ranks


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_and_the_hand_written_stage_3_agree_and_send_the_same_messages(world):
    res = cu.run(WORKER, world, timeout=240)
    for r in res.ranks:
        assert worst(r["hand_error"]) <= ADAM_TOL and worst(r["fsdp2_error"]) <= ADAM_TOL
        assert worst(r["between"]) <= ADAM_TOL
        assert r["hand_loss"] == pytest.approx(r["fsdp2_loss"], rel=1e-5)
        # one step's collectives, (kind, bytes in, bytes out), in order: the hand version's are FSDP2's plus the
        # root's second all-gather (the first call's again, before backward), nothing else
        root = r["hand_calls"][0]
        units = len(r["units"])
        assert r["hand_calls"][units] == root
        assert r["hand_calls"][:units] + r["hand_calls"][units + 1:] == r["fsdp2_calls"]
        assert [c[0] for c in r["fsdp2_calls"]] == ["all_gather"] * (2 * units - 1) + ["reduce_scatter"] * units
        # kept between steps: the same 1/n of the parameters and of AdamW's moments (every first dimension divides)
        assert r["fsdp2_kept"] == r["hand_kept"]
        assert r["hand_kept"]["params"] * world == 4 * r["n_params"]


def test_on_an_uneven_model_fsdp2_pads_each_parameter_and_still_agrees():
    world = 4
    ranks = cu.run(WORKER, world, timeout=240, **UNEVEN).ranks
    for r in ranks:
        assert worst(r["hand_error"]) <= ADAM_TOL and worst(r["fsdp2_error"]) <= ADAM_TOL
        assert worst(r["between"]) <= ADAM_TOL
        assert r["fsdp2_kept"]["optimizer"] == 2 * r["fsdp2_kept"]["params"]
        # FSDP2 pads every parameter's first dimension to a multiple of n for its messages: larger than the hand
        # version's, which pads each unit once
        gathered = [c for c in r["fsdp2_calls"] if c[0] == "all_gather"]
        assert all(out == world * inp for _, inp, out in gathered)
        hand = [c for c in r["hand_calls"] if c[0] == "all_gather"]
        assert gathered[0][1] > hand[0][1] and gathered[1][1] > hand[1][1]  # the root, then the first block
    n_params = ranks[0]["n_params"]
    # what each keeps: the hand version the same padded 1/n on every rank; FSDP2 torch.chunk's rows, unpadded (the
    # last rank short), so over the ranks exactly the model, and the largest shard more than the hand version's
    assert len({r["hand_kept"]["params"] for r in ranks}) == 1 and ranks[0]["hand_kept"]["params"] * world > 4 * n_params
    assert sum(r["fsdp2_kept"]["params"] for r in ranks) == 4 * n_params
    assert max(r["fsdp2_kept"]["params"] for r in ranks) > ranks[0]["hand_kept"]["params"]
