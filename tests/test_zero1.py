"""The hand-written ZeRO-1 optimizer (workers/zero/zero1.py) on real ranks, against the unsharded optimizer.

What must hold, and why:
- the weights equal a single process training the whole batch with the plain torch optimizer, after every step,
  at world 1, 2 and 4 (SGD with momentum to fp32 rounding; AdamW to 5e-5 = 5e-3 x lr, because Adam divides each
  update by its own gradient's size and so amplifies the fp32 reordering of n ranks' sums; and bitwise when the
  unsharded AdamW is fed the very same averaged gradient, which isolates the sharded step);
- every rank ends every step with identical weights (the all-gather re-synchronises them);
- the tied embedding / LM head stays one Parameter, stepped once: the ranks together own exactly n_params elements;
- the optimizer-state bytes each rank holds, summed from the state tensors' nbytes, equal the ledger's K*P/N;
- at the four moments of a step (workers/ch11_memory.py) the model states equal the ledger, and the activations,
  counted from the saved tensors still alive, equal the sum of their terms after the forward, whatever N, and
  zero after backward; a kept graph or a stray reference shows up.
"""
import pytest

import course_utils as cu
from course_utils.ledger import model_state_bytes
from workers.zero.model import MODEL, model_config
from workers.zero.zero1 import flat_partition, params_partition
from tests.numeric import worst

pytestmark = pytest.mark.ranks
# AdamW divides each update by the size of that element's own gradient, so the fp32 reordering of the sums over
# ranks (~1e-7 relative) becomes up to ~1e-3 relative on the smallest gradients. The max over 28k weights is an
# extreme value: measured 3.3e-7 to 7.2e-6 over native, AVX2 and plain kernels x seeds 0-3 (python -m
# course_utils.cpu_spread ch11_zero1, 2026-12-04, the course's GPT with nanoGPT's init; 1.3e-7 to 3.5e-5 with
# PyTorch's default init before), so 2e-4 = 0.02 x lr; a shard stepped wrong or not gathered moves weights by ~lr.
ADAM_TOL = 2e-4
SGD_TOL = 1e-6  # SGD is linear in the gradient: the reordering stays ~1e-7 (measured <= 1.2e-7)
N_PARAMS = MODEL.n_params  # 27,840, divisible by 4: no padding


def _ledger(n_params, world, k):
    return model_state_bytes(n_params, dp=world, zero_stage=1, optimizer_bytes_per_param=k).optimizer


# -- partitions, no ranks needed -------------------------------------------------------------------------

@pytest.mark.parametrize("split", [flat_partition, params_partition])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_partitions_cover_every_element_once_in_equal_regions(split, n):
    numels = [2048, 512, 32, 32, 3072, 96, 1024, 32, 7]
    offsets, shard, ranges = split(numels, n)
    owned = sorted((a, b) for rank in ranges for a, b in rank)
    # disjoint, inside each rank's region [r*S, (r+1)*S), and covering exactly sum(numels) elements
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(owned, owned[1:]))
    for r, rank in enumerate(ranges):
        assert all(r * shard <= a <= b <= (r + 1) * shard for a, b in rank)
    assert sum(b - a for a, b in owned) == sum(numels)
    # every parameter's slice of the flat buffer is owned by one rank
    for off, numel in zip(offsets, numels):
        if split is params_partition:
            assert any(a == off and b == off + numel for a, b in owned)


def test_flat_shards_are_equal_and_whole_tensor_shards_are_balanced_within_the_largest():
    numels = [2048, 512, 32, 32, 3072, 96, 1024, 32, 7]
    _, shard, ranges = flat_partition(numels, 4)
    assert shard == -(-sum(numels) // 4) and [sum(b - a for a, b in r) for r in ranges][:3] == [shard] * 3
    _, shard, ranges = params_partition(numels, 4)
    loads = [sum(b - a for a, b in r) for r in ranges]
    assert worst(loads) <= sum(numels) / 4 + max(numels)  # largest-first greedy (LPT) bound


# -- equivalence and bytes on real ranks -----------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("optimizer, k, tol", [("adamw", 8, ADAM_TOL), ("sgd", 4, SGD_TOL)])
def test_zero1_equals_the_unsharded_optimizer_and_holds_one_nth_of_the_state(world, optimizer, k, tol):
    res = cu.run("workers.ch11_zero1", world, optimizer=optimizer, timeout=180)
    for rank, r in enumerate(res.ranks):
        assert r["max_abs_error"][0] == 0.0, "ranks started from their own seeds: the broadcast must equalise them"
        assert worst(r["max_abs_error"]) <= tol, (rank, r["max_abs_error"])
        assert r["equal_to_rank0"] and r["tied"]
        # measured: sum of nbytes of exp_avg/exp_avg_sq (or momentum_buffer) on this rank == the ledger
        assert r["state_bytes"]["elementwise"] == _ledger(N_PARAMS, world, k) == k * N_PARAMS / world
    assert sum(res.gather("owned_numel")) == N_PARAMS  # the tied weight is stepped once, by one rank


@pytest.mark.parametrize("partition", ["flat", "params"])
def test_same_averaged_gradient_gives_bitwise_the_unsharded_adamw(partition):
    res = cu.run("workers.ch11_zero1", 4, optimizer="adamw", partition=partition, grad_sync="all_reduce",
                 timeout=180)
    for r in res.ranks:
        assert worst(r["same_grad_max_abs_error"]) <= 1e-7  # 0.0 on the CPU: same inputs, elementwise update


def test_whole_tensor_partition_is_exact_but_only_balanced_within_a_tensor():
    res = cu.run("workers.ch11_zero1", 4, optimizer="adamw", partition="params", timeout=180)
    owned = res.gather("owned_numel")
    assert sum(owned) == N_PARAMS and max(owned) > N_PARAMS / 4  # uneven: whole tensors
    for r in res.ranks:
        assert worst(r["max_abs_error"]) <= ADAM_TOL and r["equal_to_rank0"]
        assert r["state_bytes"]["elementwise"] == 8 * r["owned_numel"]


def test_padding_when_the_world_size_does_not_divide_the_parameters():
    cfg = dict(vocab=61, hidden=30, heads=3)
    n = model_config(**cfg).n_params
    assert n % 4 == 2
    res = cu.run("workers.ch11_zero1", 4, optimizer="sgd", timeout=180, **cfg)
    shard = -(-n // 4)
    assert res.gather("owned_numel") == [shard, shard, shard, n - 3 * shard]
    for r in res.ranks:
        assert worst(r["max_abs_error"]) <= SGD_TOL and r["equal_to_rank0"]
        assert r["state_bytes"]["elementwise"] == 4 * r["owned_numel"]  # no state for padding
        assert r["buffer_bytes"]["params"] == 4 * 4 * shard  # the flat buffer is padded to N*S


def test_mixed_precision_master_weights_make_the_papers_k_of_12():
    res = cu.run("workers.ch11_zero1", 2, optimizer="adamw", dtype="bfloat16", master_weights=True, timeout=180)
    for r in res.ranks:
        s = r["state_bytes"]
        # fp32 master shard (4) + exp_avg (4) + exp_avg_sq (4) = K = 12 bytes per parameter, over N = 2
        assert s["elementwise"] + s["master"] == _ledger(N_PARAMS, 2, 12) == 12 * N_PARAMS / 2
        assert r["equal_to_rank0"]
        # bf16 weights near 1 (LayerNorm gains) have an ulp of 2^-7; the mixed-precision reference sums its
        # gradients in another order, which can flip a rounding, and Adam turns a flipped gradient sign into a
        # full lr step the other way: a few ulps (measured 0.012 to 0.023 over CPU kernels x seeds 0-3)
        assert worst(r["max_abs_error"]) <= 0.1


def test_without_sharding_every_rank_holds_the_whole_state():
    # The same machinery with shard=False is DDP: this is what the bytes test above would see if sharding broke.
    res = cu.run("workers.ch11_zero1", 2, optimizer="adamw", shard=False, timeout=180)
    assert res.gather("owned_numel") == [N_PARAMS, N_PARAMS]
    assert all(s["elementwise"] == 8 * N_PARAMS for s in res.gather("state_bytes"))


def test_bad_settings_are_refused_before_launch_in_one_sentence():
    with pytest.raises(cu.InvalidParameter, match="global_batch=6 does not split evenly over world_size=4"):
        cu.run("workers.ch11_zero1", 4, global_batch=6)
    with pytest.raises(cu.InvalidParameter, match="partition='rows' is not one of"):
        cu.run("workers.ch11_zero1", 2, partition="rows")
    with pytest.raises(cu.InvalidParameter, match="needs master_weights=True"):
        cu.run("workers.ch11_zero1", 2, dtype="bfloat16")
    with pytest.raises(cu.InvalidParameter, match=r"global_batch=0 does not split evenly over world_size=2 \(choose a "
                                                  r"positive multiple of 2\): it gives the ranks no rows"):
        cu.run("workers.ch11_zero1", 2, global_batch=0)
    with pytest.raises(cu.InvalidParameter, match="heads=0 does not divide hidden=32"):
        cu.run("workers.ch11_zero1", 2, heads=0)


# -- memory at the four moments, accounted ---------------------------------------------------------------

SMALL = dict(hidden=64, heads=4, layers=2, vocab=256, seq=32, micro_batch=2, steps=2)


@pytest.mark.parametrize("world, zero", [(1, 0), (2, 1), (4, 1)])
def test_accounted_model_states_at_the_four_moments_equal_the_ledger(world, zero):
    from course_utils import ch11

    res = cu.run("workers.ch11_memory", world, zero=zero, timeout=240, **SMALL)
    # what the forward saves, term by term (Korthikanti sec 4.1 without dropout, plus what the paper leaves out):
    # the same at every N, because ZeRO-1 does not touch activations and each saved tensor counts its own bytes
    saved_bytes = sum(t["bytes"] for t in ch11.activation_terms(res[0]["config"]))
    for r in res.ranks:
        assert [(m["step"], m["moment"]) for m in r["moments"]] == [(0, "init")] + [
            (step, moment) for step in (1, 2) for moment in ("forward", "backward", "step")]
        for m in r["moments"]:
            acc = m["accounted"]
            want = ch11.ledger_moment(r["config"], r["n_params"], m["step"], m["moment"])
            assert acc["params"] == want["params"] and acc["grads"] == want["grads"]
            stepped = m["step"] >= 2 or (m["step"], m["moment"]) == (1, "step")
            scalars = 4 if stepped else 0  # Adam's step counter, once Adam has stepped
            assert acc["optimizer"] == want["optimizer"] + scalars, m
            if m["moment"] == "forward":
                assert acc["activations"] == saved_bytes and m["saved_tensors_alive"] > 0, m
            else:  # measured: none of the saved tensors is alive before the forward or after backward
                assert acc["activations"] == 0 and m["saved_tensors_alive"] == 0, m


@pytest.mark.parametrize("leak", ["retain_graph", "stash"])
def test_activations_kept_past_backward_are_seen(leak):
    # The zero after backward is a measurement: keep the graph, or a reference to saved tensors, and it is not zero.
    res = cu.run("workers.ch11_memory", 1, zero=0, leak=leak, timeout=240, **SMALL)
    b, s, h, layers = SMALL["micro_batch"], SMALL["seq"], SMALL["hidden"], SMALL["layers"]
    for m in res[0]["moments"]:
        if m["moment"] in ("backward", "step"):
            forward = next(f for f in res[0]["moments"] if f["step"] == m["step"] and f["moment"] == "forward")
            kept = m["accounted"]["activations"]
            if leak == "retain_graph":  # the whole graph stays while `loss` lives
                assert kept == forward["accounted"]["activations"] and m["saved_tensors_alive"] > 0
            else:  # one [b, s, h] bf16 output per block, saved by the next LayerNorm
                assert kept == layers * b * s * h * 2 and m["saved_tensors_alive"] == layers


def test_saved_activations_count_own_bytes_once_and_only_while_alive():
    import torch

    from workers.zero.memory import SavedActivations

    base = torch.zeros(4, 9)  # [4, 9] fp32: 144 bytes
    saved = SavedActivations(exclude_ptrs=set())
    kept = [base[:, :-1], base.view(36), base.t(), base[:, 1:]]  # a strided view, the same memory twice, ...
    for t in kept:
        saved.pack(t)
    # base[:, :-1] and base[:, 1:]: 32 elements each (not the 36 of their storage); view(36) and .t(): one 144 bytes
    assert saved.alive_bytes() == 144 + 2 * 32 * 4 and saved.alive_count() == 4
    del t
    kept.pop()
    assert saved.alive_bytes() == 144 + 32 * 4 and saved.alive_count() == 3
    kept.clear()
    assert saved.alive_bytes() == 0 and saved.alive_count() == 0


def test_memory_worker_refuses_empty_runs_before_launch_in_one_sentence():
    with pytest.raises(cu.InvalidParameter, match=r"micro_batch=0 must be at least 1: it gives each rank no rows"):
        cu.run("workers.ch11_memory", 1, **{**SMALL, "micro_batch": 0})
    with pytest.raises(cu.InvalidParameter, match=r"layers=0 must be at least 1: it builds a model without transformer layers"):
        cu.run("workers.ch11_memory", 1, **{**SMALL, "layers": 0})
    with pytest.raises(cu.InvalidParameter, match=r"steps=0 must be at least 1: it runs no training step"):
        cu.run("workers.ch11_memory", 1, **{**SMALL, "steps": 0})
    with pytest.raises(cu.InvalidParameter, match=r"leak='forever' is not one of"):
        cu.run("workers.ch11_memory", 1, **{**SMALL, "leak": "forever"})


# -- refused constructions touch nothing -----------------------------------------------------------------

@pytest.mark.parametrize("case, message", [
    ("in_two_groups", "a parameter of group 1 is already in group 0; list each tensor in one parameter group only."),
    ("twice_in_a_group_then_in_another",
     "a parameter of group 1 is already in group 0; list each tensor in one parameter group only."),
    ("later_group_mixes_dtypes", "parameter group 1 mixes dtypes torch.float32, torch.float64; put the parameters "
                                 "of each dtype in a parameter group of their own."),
    ("optimizer_refuses_an_option", "Invalid learning rate: -1.0"),  # torch.optim.SGD's own sentence
])
def test_a_refused_construction_leaves_every_ranks_parameters_untouched(case, message):
    # Every check must come before the first flatten and broadcast: group 0 is valid in every case, so a check
    # made group by group would already have overwritten rank 1's weights with rank 0's (and re-pointed every
    # rank's p.data into a flat buffer) by the time group 1 is refused.
    res = cu.run("tests.rank_helpers.zero1_refusals", 2, case=case, timeout=60)
    for rank, r in enumerate(res.ranks):  # rank 1 first shows a broadcast: its weights became rank 0's
        assert r["values_kept"] == ["a", "b", "c"], f"rank {rank}'s weights changed: only {r['values_kept']} kept"
    for rank, r in enumerate(res.ranks):  # a flatten alone re-points p.data, on rank 0 too
        assert r["memory_kept"] == ["a", "b", "c"], f"rank {rank}'s p.data re-pointed: only {r['memory_kept']} kept"
        assert r["error"] == message, (rank, r["error"])  # the same one sentence on every rank
