"""Chapter 01 on real ranks: the minimal script, rank/local_rank on two nodes, every collective against a
single-process reference, async timing, the bandwidth sweep, and the DETAIL injected fault.

Every collective is compared with ``workers.collectives.reference.reference`` (float64, built from the same
inputs without communication). The inputs are small integers, so SUM/MIN/MAX/AVG must match exactly;
PRODUCT is compared with rtol 1e-6 (float32 products of two-digit numbers are exact up to world 4 here,
the tolerance is for larger worlds).
"""
import os
import textwrap
import time

import psutil
import pytest
import torch

import course_utils as cu
from course_utils import ch01, scratch
from course_utils.ledger import bus_bandwidth_factor
from workers.collectives.reference import BITWISE, COLLECTIVES, OPS, REDUCING, ROOTED, reference

pytestmark = pytest.mark.ranks
RUN = dict(timeout=30)  # same pool key as the exercise checks: the warm ranks are shared


# -- the minimal script under plain torchrun ------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2])
def test_minimal_script_sums_to_n_n_plus_1_over_2_on_every_rank(n, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where torchrun would leave a torchelastic_* folder
    # this process's runs only: a notebook running chapter 01 meanwhile (CI's browser test) has folders of its own
    mine = f"script-{os.getpid()}-*"
    before = set(scratch.TORCHELASTIC_LOGS.glob(mine)) if scratch.TORCHELASTIC_LOGS.exists() else set()
    run = ch01.run_script("workers/ch01_minimal.py", n, timeout=120)
    assert run.ok, str(run) + "\n" + "\n".join(run.agent)
    # the rank logs torchrun needs for --tee lived in the course's scratch area and left with the run
    assert not list(tmp_path.glob("torchelastic_*"))
    assert (set(scratch.TORCHELASTIC_LOGS.glob(mine)) if scratch.TORCHELASTIC_LOGS.exists() else set()) <= before
    assert sorted(run.by_rank) == list(range(n))
    for rank in range(n):
        # rank r contributed r + 1; all_reduce SUM leaves 1 + ... + n on every rank
        assert f"rank {rank}/{n}" in run.lines(rank)[0]
        assert f"all_reduce -> {n * (n + 1) // 2}," in run.lines(rank)[0]


@pytest.mark.once  # process handling and messages: the same on every CPU
def test_run_script_kills_the_whole_group_on_timeout(tmp_path):
    # Rank 1 never joins the all_reduce; the default gloo timeout is 30 minutes, so only our timeout ends it.
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import os, time
        print("pid", os.getpid(), flush=True)  # first, before the slow import: both ranks are up long before the limit
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            time.sleep(600)
        dist.all_reduce(torch.ones(1))
    """))
    start = time.time()
    run = ch01.run_script(script, 2, timeout=25)
    assert run.timed_out and not run.ok
    assert time.time() - start < 60
    pids = [int(line.split()[1]) for r in (0, 1) for line in run.lines(r) if line.startswith("pid")]
    assert len(pids) == 2, str(run)  # both ranks had started before the timeout...
    time.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive  # ...and neither survived it
    assert "timed out" in str(run)


def test_run_script_rejects_bad_input():
    with pytest.raises(ValueError, match="whole number"):
        ch01.run_script("workers/ch01_minimal.py", 0)
    with pytest.raises(FileNotFoundError, match="no script"):
        ch01.run_script("workers/no_such_script.py", 1)


# -- rank, local_rank, world_size on two agents ----------------------------------------------------------

@pytest.mark.once  # process handling and messages: the same on every CPU
def test_two_nodes_two_processes_each():
    res = cu.run("workers.ch01_env", world_size=4, nnodes=2, warm=False, gpus_per_node=2, **RUN)
    assert [d["rank"] for d in res.ranks] == [0, 1, 2, 3]
    assert [d["local_rank"] for d in res.ranks] == [0, 1, 0, 1]  # restarts at 0 on each node
    assert [d["node_rank"] for d in res.ranks] == [0, 0, 1, 1]
    assert {d["world_size"] for d in res.ranks} == {4}
    assert [d["env"]["GROUP_RANK"] for d in res.ranks] == ["0", "0", "1", "1"]
    assert {d["env"]["LOCAL_WORLD_SIZE"] for d in res.ranks} == {"2"}
    assert len({d["env"]["MASTER_PORT"] for d in res.ranks}) == 1  # both agents met at one rendezvous
    # the all_gather of (rank, node, local_rank) agrees on every rank
    table = [[0, 0, 0], [1, 0, 1], [2, 1, 0], [3, 1, 1]]
    assert all(d["everyone"].tolist() == table for d in res.ranks)
    # cuda:{rank} does not exist on a 2-GPU node for ranks 2 and 3; cuda:{local_rank} always does
    assert [d["device_by_rank_exists"] for d in res.ranks] == [True, True, False, False]
    assert [d["device_by_local_rank"] for d in res.ranks] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert "no such GPU" in ch01.device_table(res)


# -- every collective -----------------------------------------------------------------------------------

def test_reference_by_hand_at_world_2():
    # The reference itself, checked against values worked out by hand (inputs: rank 0 [10, 11], rank 1 [20, 21]).
    assert reference("all_reduce", 2)[1].tolist() == [30, 32]
    assert reference("all_to_all", 2)[1].tolist() == [11, 21]
    assert reference("reduce_scatter", 2, "max")[0].tolist() == [20]
    assert reference("all_gather", 2)[0].tolist() == [10, 20]  # all_gather inputs are one chunk: [10], [20]
    assert reference("scatter", 2, root=1)[0].tolist() == [20]
    on_root = reference("reduce", 2, "product", root=1)
    assert on_root[0] is None and on_root[1].tolist() == [200, 231]  # 10*20, 11*21 on the root only
    assert reference("all_reduce", 2, "avg")[0].tolist() == [15, 16]
    # bitwise, by hand: 10 = 0b01010, 20 = 0b10100; 11 = 0b01011, 21 = 0b10101
    assert reference("all_reduce", 2, "band")[0].tolist() == [0, 1]
    assert reference("all_reduce", 2, "bor")[0].tolist() == [30, 31]
    assert reference("all_reduce", 2, "bxor")[0].tolist() == [30, 30]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_collective_matches_single_process_reference(collective, n):
    # every operator on the reducing collectives: arithmetic on float32, bitwise on int64 (refused on floats)
    ops = [(op, "int64" if op in BITWISE else "float32") for op in OPS] if collective in REDUCING else [("sum", "float32")]
    root = n - 1 if collective in ROOTED else 0  # a root other than 0 catches src/dst mix-ups
    for op, dtype in ops:
        res = cu.run("workers.ch01_collectives", world_size=n, collective=collective, op=op, root=root, dtype=dtype,
                     **RUN)
        if collective == "barrier":
            break  # nothing to compare: its promise is checked below
        ok, err = ch01.compare_with_reference(res, collective, op=op, root=root)
        assert ok, (collective, op, n, err, [d.get("after") for d in res.ranks])
        if res[root].get("defined", True):
            assert res[root]["after"].dtype == {"int64": torch.int64, "float32": torch.float32}[dtype]
    if collective in ("reduce", "gather"):
        # only the root's result is defined
        assert res.gather("defined") == [r == root for r in range(n)]
    if collective == "barrier":
        late, waited = res.gather("before"), res.gather("after")
        # rank r arrives r*100 ms late and nobody leaves before the last one: late + waited is about equal
        ends = [float(a[0] + b[0]) for a, b in zip(late, waited)]
        assert max(ends) - min(ends) < 40, ends
        assert float(waited[0][0]) > float(waited[-1][0])
        ok, margin = ch01.barrier_check(res)
        assert ok and abs(margin) < ch01.BARRIER_TOL_MS, (late, waited, margin)
        with pytest.raises(ValueError, match="no data"):  # never "equal" for a comparison not made
            ch01.compare_with_reference(res, "barrier")


def test_barrier_check_catches_a_rank_that_left_early():
    # barrier_check must not be a tautology: a "barrier" that waited for nobody lets every rank leave as
    # soon as it arrives (waited = 0), so all but the last leave one delay (100 ms) or more too early.
    res = cu.run("workers.ch01_collectives", world_size=2, collective="barrier", **RUN)
    assert ch01.barrier_check(res)[0]
    res.ranks[0]["after"] = torch.zeros(1)
    ok, margin = ch01.barrier_check(res)
    assert not ok and margin < -ch01.BARRIER_TOL_MS


def test_comparison_catches_a_wrong_result():
    # compare_with_reference must not be a tautology: corrupt one element of one rank and it must say so.
    res = cu.run("workers.ch01_collectives", world_size=2, collective="all_reduce", **RUN)
    assert ch01.compare_with_reference(res, "all_reduce")[0]
    res.ranks[1]["after"] = res.ranks[1]["after"].clone()
    res.ranks[1]["after"][0] += 1
    ok, err = ch01.compare_with_reference(res, "all_reduce")
    assert not ok and err > 1e-3


@pytest.mark.parametrize("op", BITWISE)
def test_bitwise_op_on_floats_is_reported_not_crashed(op):
    res = cu.run("workers.ch01_collectives", world_size=2, collective="all_reduce", op=op, **RUN)
    assert f"Cannot use ReduceOp.{op.upper()}" in res[0]["unsupported"]
    # the group is still usable afterwards (the refusal happened before any byte was sent)
    again = cu.run("workers.ch01_collectives", world_size=2, collective="all_reduce", **RUN)
    assert again.launch == "warm" and ch01.compare_with_reference(again, "all_reduce")[0]


@pytest.mark.parametrize("params, fragment", [
    ({"collective": "allreduce"}, "is not one of"),
    ({"op": "mean"}, "op='mean' is not one of"),
    ({"root": 2}, "use 0 to 1"),
    ({"chunk": 0}, "chunk=0 must be at least 1"),
    ({"dtype": "float16"}, "dtype='float16' is not one of 'float32' or 'int64'"),
    ({"op": "avg", "dtype": "int64"}, "would have to round"),
])
def test_collectives_bad_parameters_are_refused_in_one_sentence(params, fragment):
    with pytest.raises(cu.InvalidParameter) as info:
        cu.launch("workers.ch01_collectives", world_size=2, **params)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_collectives_figure_draws_every_collective():
    import matplotlib

    matplotlib.use("Agg")
    runs = {c: cu.run("workers.ch01_collectives", world_size=2, collective=c, **RUN) for c in COLLECTIVES}
    fig = ch01.collectives_figure(runs)
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {"30", "32"} <= texts  # all_reduce's sums are drawn
    assert "dist.all_to_all(out_chunks, chunks)" in texts
    assert len(fig.axes) == 2 * len(COLLECTIVES)


# -- async and timing -----------------------------------------------------------------------------------

def test_async_launch_returns_before_the_transfer_is_done():
    res = cu.run("workers.ch01_async", world_size=2, size_mb=4.0, iters=3, **RUN)
    # Exact, not timed: rank 0's call returned while rank 1 had not yet joined, so the sum could not exist. (Which
    # of async_launch and async_wait is longer depends on the load: a CI run with both cores busy once measured a
    # 3.4 ms launch and a 0.05 ms wait, the worker thread having finished the transfer before the caller resumed.)
    assert res[0]["pending_at_launch"] is True
    assert res[1]["pending_at_launch"] is None
    for d in res.ranks:
        assert set(d["ms"]) >= {"async_launch", "async_wait", "blocking_host", "overlapped"}
        assert "cuda_event" not in d["ms"]  # only measured on a GPU
        assert d["bytes"] == 4 * 2**20
    assert "async_launch" in ch01.async_table(res)


# -- bandwidth --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter"])
def test_bandwidth_rows_follow_nccl_tests_definitions(collective):
    sizes = [4096, 1 << 20]
    res = cu.run("workers.ch01_bandwidth", world_size=4, collective=collective, sizes=sizes, iters=2, warmup=1, **RUN)
    rows = ch01.bandwidth_rows(res)
    assert [r["bytes"] for r in rows] == sizes  # both sizes are multiples of 4 bytes x 4 ranks
    for r in rows:
        assert r["seconds"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_bandwidth_factor(collective, 4))
    # every rank reports the same (MAX-reduced) times
    assert len({tuple(d["seconds"]) for d in res.ranks}) == 1


def test_bandwidth_rejects_bad_sizes():
    with pytest.raises(cu.InvalidParameter, match="whole numbers of bytes"):
        cu.launch("workers.ch01_bandwidth", world_size=2, sizes=[0])


# -- debugging: TORCH_DISTRIBUTED_DEBUG=DETAIL names the mismatch ---------------------------------------

@pytest.mark.once  # process handling and messages: the same on every CPU
def test_detail_mode_names_mismatched_shapes():
    with pytest.raises(cu.WorkerFailed) as info:
        cu.run("workers.rank_faults", world_size=2, mode="shape_mismatch", bad_rank=1, collective_timeout=5.0,
               timeout=40, warm=False, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    msg = str(info.value)
    assert "Detected mismatch between collectives" in msg
    assert "TensorShape=[4]" in msg and "TensorShape=[5]" in msg
