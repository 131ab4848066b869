"""The autograd collectives of ``workers/parallel/mappings.py`` against the single-process reference.

The reference (``workers/parallel/reference.py``) simulates all ranks in one process: forward with explicit
concatenation and sums, gradients from plain autograd through them. Inputs are small integers in float64,
so every sum is exact in any order and a correct mapping must match the reference *bit for bit*: outputs
and input gradients, on every rank, at world 1, 2 and 4 on real gloo ranks, in float64 and in float32. Then
the same comparison is shown to fail when a mapping's backward is wrong (one broken implementation for each
of the eight mappings, at world 2), so a passing comparison means something.
"""
import pytest
import torch

import course_utils as cu
from course_utils.ch03 import mapping_rows
from workers.parallel.reference import (LAYOUTS, MAPPING_NAMES, REPLICATED, compare, example, reference,
                                        uneven_splits)

WORKER = "workers.ch03_mappings"


def records(res, name, ranks=None):
    ranks = range(res.world_size) if ranks is None else ranks
    return [res[r]["records"][name] for r in ranks]


# -- the reference itself (no ranks): hand-checkable cases ---------------------------------------------

def test_reference_f_sums_the_gradients_and_g_passes_them_through():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    g0, g1 = torch.tensor([[1.0, 0.0]]), torch.tensor([[10.0, 20.0]])
    outs, grads = reference("copy_to_tensor_model_parallel_region", [x, x], [g0, g1])
    # f: the output is the input on each rank; the replicated input's gradient is the sum of both ranks'
    assert all(torch.equal(o, x) for o in outs)
    assert all(torch.equal(g, torch.tensor([[11.0, 20.0]], dtype=torch.float64)) for g in grads)
    p0, p1 = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    g = torch.tensor([[5.0, 6.0]])
    outs, grads = reference("reduce_from_tensor_model_parallel_region", [p0, p1], [g, g])
    # g: the sum on every rank; the replicated output's gradient is counted once, so each addend gets it unchanged
    assert all(torch.equal(o, torch.tensor([[4.0, 6.0]], dtype=torch.float64)) for o in outs)
    assert all(torch.equal(d, g.double()) for d in grads)


def test_reference_split_and_gather_by_hand():
    x = torch.arange(8.0).reshape(2, 4)
    outs, grads = reference("scatter_to_tensor_model_parallel_region", [x, x], [torch.ones(2, 2), 2 * torch.ones(2, 2)])
    assert torch.equal(outs[1], x[:, 2:].double())  # rank 1 keeps the second half of the last dim
    want = torch.cat([torch.ones(2, 2), 2 * torch.ones(2, 2)], dim=-1).double()  # all-gather of the slice grads
    assert torch.equal(grads[0], want) and torch.equal(grads[1], want)
    a, b = torch.zeros(3, 2), torch.ones(3, 2)
    g = torch.arange(12.0).reshape(3, 4)
    outs, grads = reference("gather_from_tensor_model_parallel_region", [a, b], [g, g])
    assert torch.equal(outs[0], torch.cat([a, b], -1).double())
    assert torch.equal(grads[1], g[:, 2:].double())  # the replicated output's gradient, rank 1's slice


def test_reference_refuses_a_replicated_input_that_differs_between_ranks():
    with pytest.raises(ValueError, match="replicated"):
        reference("copy_to_tensor_model_parallel_region", [torch.zeros(2), torch.ones(2)], [torch.zeros(2)] * 2)


def test_examples_have_the_layouts_the_mappings_expect():
    for name in MAPPING_NAMES:
        inputs, grads = example(name, 4)
        in_layout, _ = LAYOUTS[name]
        if in_layout == REPLICATED:
            assert all(torch.equal(t, inputs[0]) for t in inputs), name
        else:
            assert not torch.equal(inputs[0], inputs[1]), name  # distinct per rank, so mix-ups show
        assert all(float(t.abs().max()) <= 4 and torch.equal(t, t.round()) for t in inputs + grads), name


# -- every mapping on real ranks, bit for bit ----------------------------------------------------------

@pytest.mark.ranks
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_mapping_matches_the_reference_exactly(world_size):
    res = cu.run(WORKER, world_size=world_size, timeout=60)
    for name in MAPPING_NAMES:
        c = compare(name, records(res, name), **records(res, name)[0]["options"])
        # integer-valued float64: any correct summation order gives the same bits
        assert c["exact"], (world_size, name, c)
    assert res[0]["warnings"] == [], res[0]["warnings"]  # no deprecated collective on this torch


@pytest.mark.ranks
def test_mappings_stay_inside_their_process_group():
    # world 4 as two tensor-parallel groups [0,1] and [2,3] with different data: any leak across groups
    # (a collective on the world instead of the group) changes the sums and the gathered tensors.
    res = cu.run(WORKER, world_size=4, tp=2, timeout=60)
    rows = mapping_rows(res)
    assert {r["group"] for r in rows} == {"[0,1]", "[2,3]"}
    assert all(r["exact"] for r in rows), [r for r in rows if not r["exact"]]
    assert not torch.equal(res[0]["records"]["copy_to_tensor_model_parallel_region"]["input"],
                           res[2]["records"]["copy_to_tensor_model_parallel_region"]["input"])
    assert {e["group_size"] for e in res[0]["communication"]} == {2}  # the ledger knows who took part


@pytest.mark.ranks
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_float32_is_exact_on_integer_data_too(world_size):
    res = cu.run(WORKER, world_size=world_size, dtype="float32", timeout=60)
    assert res[0]["records"]["all_to_all"]["output"].dtype == torch.float32
    rows = mapping_rows(res)
    assert len(rows) == len(MAPPING_NAMES) and all(r["exact"] for r in rows), [r for r in rows if not r["exact"]]


@pytest.mark.ranks
def test_all_to_all_with_uneven_splits():
    res = cu.run(WORKER, world_size=4, mapping="all_to_all", uneven=True, timeout=60)
    recs = records(res, "all_to_all")
    splits = uneven_splits(4)
    # rank r receives splits[s][r] rows from each rank s
    assert [rec["output"].shape[0] for rec in recs] == [sum(splits[s][r] for s in range(4)) for r in range(4)]
    assert compare("all_to_all", recs, input_split_sizes=splits)["exact"]


@pytest.mark.ranks
def test_gather_from_sequence_with_a_replicated_output_splits_in_backward():
    res = cu.run(WORKER, world_size=2, mapping="gather_from_sequence_parallel_region",
                 tensor_parallel_output_grad=False, timeout=60)
    recs = records(res, "gather_from_sequence_parallel_region")
    assert compare("gather_from_sequence_parallel_region", recs, tensor_parallel_output_grad=False)["exact"]
    # the backward only kept the rank's slice: no reduce_scatter ran
    assert [e["collective"] for e in res[0]["communication"]] == ["all_gather"]


@pytest.mark.ranks
def test_each_mapping_runs_the_collectives_of_megatrons_table():
    res = cu.run(WORKER, world_size=2, timeout=60)
    seen = {}
    for e in res[0]["communication"]:
        seen.setdefault(e["mapping"], []).append((e["pass"], e["collective"]))
    assert seen == {
        "copy_to_tensor_model_parallel_region": [("backward", "all_reduce")],
        "reduce_from_tensor_model_parallel_region": [("forward", "all_reduce")],
        "scatter_to_tensor_model_parallel_region": [("backward", "all_gather")],
        "gather_from_tensor_model_parallel_region": [("forward", "all_gather")],
        "scatter_to_sequence_parallel_region": [("backward", "all_gather")],
        "gather_from_sequence_parallel_region": [("forward", "all_gather"), ("backward", "reduce_scatter")],
        "reduce_scatter_to_sequence_parallel_region": [("forward", "reduce_scatter"), ("backward", "all_gather")],
        "all_to_all": [("forward", "all_to_all"), ("backward", "all_to_all")],
    }


# -- a wrong backward must be caught by the same comparison -------------------------------------------
# Each broken implementation has the right forward and a plausible wrong backward; it travels to the
# ranks as source, so it imports what it needs inside.

def f_identity_backward(x, group=None):
    import torch

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad  # should all-reduce

    return F.apply(x)


def g_all_reduce_backward(x, group=None):
    import torch
    import torch.distributed as dist

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=group)  # should be the identity
            return grad

    return G.apply(x)


def scatter_identity_backward(x, group=None):
    import torch
    import torch.distributed as dist

    class S(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            n, r = dist.get_world_size(group), dist.get_rank(group)
            return x.chunk(n, dim=-1)[r].contiguous()

        @staticmethod
        def backward(ctx, grad):  # should all-gather every rank's slice; puts its own in place only
            n, r = dist.get_world_size(group), dist.get_rank(group)
            parts = [torch.zeros_like(grad) for _ in range(n)]
            parts[r] = grad
            return torch.cat(parts, dim=-1)

    return S.apply(x)


def gather_tensor_sums_backward(x, group=None):
    """All-gather along the last dim forward; backward all-reduces before keeping the slice (n times too large)."""
    import torch
    import torch.distributed as dist

    from workers.parallel import mappings

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return mappings.gather_from_tensor_model_parallel_region(x.detach(), group=group)

        @staticmethod
        def backward(ctx, grad):  # the replicated output's gradient is already whole: it should only split
            n, r = dist.get_world_size(group), dist.get_rank(group)
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad.chunk(n, dim=-1)[r].contiguous()

    return G.apply(x)


def scatter_sequence_identity_backward(x, group=None):
    import torch
    import torch.distributed as dist

    class S(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            n, r = dist.get_world_size(group), dist.get_rank(group)
            return x.chunk(n, dim=0)[r].contiguous()

        @staticmethod
        def backward(ctx, grad):  # should all-gather every rank's rows; puts its own in place only
            n, r = dist.get_world_size(group), dist.get_rank(group)
            parts = [torch.zeros_like(grad) for _ in range(n)]
            parts[r] = grad
            return torch.cat(parts, dim=0)

    return S.apply(x)


def gather_sequence_split_backward(x, tensor_parallel_output_grad=True, group=None):
    """All-gather forward; backward only splits, where the default must reduce-scatter."""
    from workers.parallel import mappings

    return mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)


def reduce_scatter_wrong_chunk_backward(x, group=None):
    import torch
    import torch.distributed as dist

    from workers.parallel import mappings

    class RS(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return mappings.reduce_scatter_to_sequence_parallel_region(x.detach(), group=group)

        @staticmethod
        def backward(ctx, grad):  # all-gathers, but puts the blocks in reverse rank order
            n = dist.get_world_size(group)
            parts = [torch.empty_like(grad) for _ in range(n)]
            dist.all_gather(parts, grad.contiguous(), group=group)
            return torch.cat(parts[::-1], dim=0)

    return RS.apply(x)


def all_to_all_identity_backward(x, output_split_sizes=None, input_split_sizes=None, group=None):
    import torch

    from workers.parallel import mappings

    class A(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return mappings.all_to_all(x.detach(), group=group)

        @staticmethod
        def backward(ctx, grad):
            return grad  # should send every block back where it came from

    return A.apply(x)


BROKEN = [  # one per mapping, in the order of MAPPING_NAMES
    ("copy_to_tensor_model_parallel_region", f_identity_backward),
    ("reduce_from_tensor_model_parallel_region", g_all_reduce_backward),
    ("scatter_to_tensor_model_parallel_region", scatter_identity_backward),
    ("gather_from_tensor_model_parallel_region", gather_tensor_sums_backward),
    ("scatter_to_sequence_parallel_region", scatter_sequence_identity_backward),
    ("gather_from_sequence_parallel_region", gather_sequence_split_backward),
    ("reduce_scatter_to_sequence_parallel_region", reduce_scatter_wrong_chunk_backward),
    ("all_to_all", all_to_all_identity_backward),
]


def test_every_mapping_has_a_broken_variant():
    assert [name for name, _ in BROKEN] == list(MAPPING_NAMES)


@pytest.mark.ranks
@pytest.mark.parametrize("name,broken", BROKEN, ids=[b.__name__ for _, b in BROKEN])
def test_a_wrong_backward_is_caught(name, broken):
    res = cu.run(WORKER, world_size=2, mapping=name, implementation=broken, timeout=60)
    recs = records(res, name)
    c = compare(name, recs, **recs[0]["options"])
    assert c["output_error"] == 0.0, c  # the forward is right ...
    assert c["grad_error"] > 0 and not c["exact"], c  # ... and the comparison sees the backward is not
    if name in ("reduce_from_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region"):
        # a replicated output's gradient summed again: the scaling trap, n times too large, n = 2
        assert c["grad_ratio"] == pytest.approx(2.0)


@pytest.mark.ranks
def test_bad_sizes_are_refused_in_one_sentence():
    with pytest.raises(cu.InvalidParameter, match="tp=3 does not divide the 4 ranks: choose 1, 2 or 4"):
        cu.run(WORKER, world_size=4, tp=3, timeout=60)
    with pytest.raises(cu.InvalidParameter, match="mapping='copy_to' is not one of 'all', "):
        cu.run(WORKER, world_size=2, mapping="copy_to", timeout=60)


def split_an_odd_width(x, group=None):
    from workers.parallel import mappings

    return mappings.scatter_to_tensor_model_parallel_region(x[..., :-1], group=group)


@pytest.mark.ranks
def test_a_width_that_does_not_divide_gets_a_clear_error():
    with pytest.raises(cu.WorkerFailed) as info:
        cu.run(WORKER, world_size=2, mapping="scatter_to_tensor_model_parallel_region",
               implementation=split_an_odd_width, timeout=60)
    assert "not divisible by the group's 2 ranks" in str(info.value)
