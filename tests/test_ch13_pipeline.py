"""Chapter 13 on real ranks (gloo, CPU): the pipeline is the unsplit model, its memory is the schedule's,
and its measured bubble is (p-1)/(m+p-1).

Ground truth: ``workers/pipeline/reference.py`` (the same model and global batch in one process), with the
fp32 tolerance of ``workers/pipeline/model.FP32_TOL`` (atol 1e-6, rtol 1e-5). All runs use one world of 4
warm ranks; p = 1 and 2 run as 4 and 2 identical pipelines inside it (each copy is checked).
"""
import pytest

import course_utils as cu
from course_utils import ch13
from course_utils.ledger import pipeline_bubble_fraction
from course_utils.results import InvalidParameter

WORKER, WORLD, LIMITS = "workers.ch13_pipeline", 4, {"timeout": 60}
pytestmark = pytest.mark.ranks


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_pipeline_equals_single_process_over_optimizer_steps(schedule, p):
    steps = 3
    res = cu.run(WORKER, world_size=WORLD, pp=p, schedule=schedule, micro_batches=8, steps=steps, **LIMITS)
    c = ch13.compare_to_reference(res, steps=steps)
    # Loss of each micro-batch / m, summed over m equal micro-batches, is the mean over the global batch; the
    # gradients each stage accumulates are the slices of the whole model's: only the order of additions differs.
    assert c["within_tol"], c
    assert c["parameters"] == 16  # 8 layers x (weight, bias): every parameter was compared, on some stage
    # A stage that forgot to send the input gradient back (or dropped a micro-batch) would be off by far more:
    assert c["grad_max_abs"] < 1e-6 and c["weight_max_abs"] < 1e-6
    # and training moved the weights, so "equal weights" says something
    assert abs(c["reference_losses"][-1] - c["reference_losses"][0]) > 1e-3


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (2, 5)])
def test_peak_stash_measured_by_the_executor(p, m):
    # GPipe stashes every micro-batch before its first backward; 1F1B at most p - stage (its warm-up + 1).
    for schedule, want in (("gpipe", lambda s: m), ("1f1b", lambda s: min(p - s, m))):
        res = cu.run(WORKER, world_size=WORLD, pp=p, schedule=schedule, micro_batches=m, **LIMITS)
        assert [d["peak_stash"] for d in ch13.pipeline_ranks(res)] == [want(s) for s in range(p)], schedule
        rows = ch13.pipeline_ranks(res)
        # p2p volume: one [micro_batch, hidden] fp32 activation per micro-batch forward, one gradient back
        assert rows[0]["sent_bytes"] == {"forward": m * 4 * 16 * 4 if p > 1 else 0, "backward": 0}
        assert rows[-1]["sent_bytes"] == {"forward": 0, "backward": m * 4 * 16 * 4 if p > 1 else 0}


def test_measured_bubble_follows_the_formula_and_shrinks_with_m():
    # Each F is padded to 20 ms and each B to 40 ms (a calibrated wait, so a loaded CPU cannot change the
    # compute time); the real messages add their latency to every action, so the measurement may exceed the
    # formula but never undercut it by more than timer noise, and the ranks' own schedules replayed with one
    # per-message latency (fitted to these runs) must explain what was measured.
    p, runs = 4, {}
    for m in (1, 4, 16):
        runs[m] = cu.run(WORKER, world_size=WORLD, schedule="1f1b", micro_batches=m, forward_ms=20.0, backward_ms=40.0,
                         **LIMITS)
    fit = ch13.fit_message_time(list(runs.values()))
    for (m, res), got, replay in zip(runs.items(), fit["measured"], fit["simulated"]):
        want = pipeline_bubble_fraction(p, m, denominator="total")
        assert got > want - 0.02, (m, got, want)
        assert abs(got - replay) < 0.05, (m, got, replay, fit["message_ms"])
        assert [d["peak_stash"] for d in ch13.pipeline_ranks(res)] == [d["planned_peak_stash"] for d in ch13.pipeline_ranks(res)]
    assert fit["measured"][0] > fit["measured"][1] > fit["measured"][2]  # more micro-batches, smaller bubble


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (2, 4)])
def test_interleaved_equals_single_process(p, v):
    steps = 3
    res = cu.run(WORKER, world_size=WORLD, pp=p, schedule="interleaved", virtual_stages=v, micro_batches=8, steps=steps,
                 **LIMITS)
    c = ch13.compare_to_reference(res, steps=steps)
    assert c["within_tol"], c
    assert c["parameters"] == 16  # every layer, cut into p * v chunks, was compared


def test_interleaved_memory_and_messages_measured():
    # p = 4, m = 8, v = 2 on 8 layers: one layer per chunk. Stash and bytes measured by the executor.
    p, m, v, mb, h = 4, 8, 2, 4, 16
    res = cu.run(WORKER, world_size=WORLD, schedule="interleaved", virtual_stages=v, micro_batches=m, **LIMITS)
    rows = ch13.pipeline_ranks(res)
    assert [d["peak_stash"] for d in rows] == [2 * (p - s - 1) + (v - 1) * p + 1 for s in range(p)] == [11, 9, 7, 5]
    # each chunk-forward saves its input and one tensor per layer ([mb, h] fp32 each; parameters not counted)
    per_chunk = (1 + 8 // (p * v)) * mb * h * 4
    assert [d["peak_saved_bytes"] for d in rows] == [d["peak_stash"] * per_chunk for d in rows]
    # v times as many forward messages; rank 0's chunk 1 also sends gradients back round to rank p-1
    assert rows[1]["messages"] == {"forward": v * m, "backward": v * m}
    assert rows[0]["messages"] == {"forward": v * m, "backward": (v - 1) * m}
    assert rows[-1]["messages"] == {"forward": (v - 1) * m, "backward": v * m}
    # every message lands in a receive posted before the step (P2P.post_receives): what one rank sends round the
    # ring, its neighbour received, and none had to be posted late (a late receive leaves gloo's thread polling)
    for d in ("forward", "backward"):
        assert sum(r["received"][d] for r in rows) == sum(r["messages"][d] for r in rows) > 0, d
    assert [r["posted_ahead"] for r in rows] == [r["received"] for r in rows]
    plain = ch13.pipeline_ranks(cu.run(WORKER, world_size=WORLD, schedule="1f1b", micro_batches=m, **LIMITS))
    per_stage = (1 + 8 // p) * mb * h * 4
    assert [d["peak_saved_bytes"] for d in plain] == [min(p - s, m) * per_stage for s in range(p)]


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2)])
def test_on_gloo_each_direction_of_a_link_travels_on_a_group_of_its_own(schedule, v):
    # gloo's transport thread only tries a pair's lock, and polls while its own rank holds it to send
    # (workers/pipeline/p2p.py): the executor sends up the ranks on one group, down on another, none on the default
    m = 8
    res = cu.run(WORKER, world_size=WORLD, pp=2, schedule=schedule, virtual_stages=v, micro_batches=m, **LIMITS)
    assert len(res.ranks) == WORLD
    for r in res.ranks:  # two pipelines, [0, 1] and [2, 3]: stage 0 is the lower rank of its pipeline
        sent = sum(r["messages"].values())
        # 1F1B: stage 0 sends activations up, stage 1 gradients down; interleaved on p = 2 the other stage is both
        # neighbours, so each rank sends everything one way (activations round the ring and gradients alike)
        assert sent == (m if schedule == "1f1b" else 2 * v * m - m), r["messages"]
        up, down = (sent, 0) if r["stage"] == 0 else (0, sent)
        assert r["sent_on"] == {"up": up, "down": down, "default": 0}, (r["stage"], r["sent_on"])


def test_interleaving_shrinks_the_measured_bubble():
    # calibrated waits per stage (a chunk is padded to 1/v of them); 16 layers so v = 2 splits evenly
    # A stall of one rank only adds idle to every stage (test_zb_h1_measured_bubble_is_below_1f1bs met one in CI):
    # each schedule's bubble is the least of two launches. Here: 1F1B 0.29-0.31, interleaved 0.18-0.20, quiet or
    # beside busy loops or another pipeline's ranks (six launches each).
    timed = {"micro_batches": 8, "layers": 16, "forward_ms": 20.0, "backward_ms": 40.0, **LIMITS}
    plain, inter = (min(ch13.measured_bubble(cu.run(WORKER, world_size=WORLD, schedule=s, virtual_stages=v, **timed))
                        for _ in range(2)) for s, v in (("1f1b", 1), ("interleaved", 2)))
    want = pipeline_bubble_fraction(4, 8, 2, denominator="total")  # 3/19 against 1F1B's 3/11
    assert inter > want - 0.02
    assert inter < plain - 0.04  # at the latency gloo has here: see chunks_crossover


# Refusals come from the course's one rule set (workers/layout/rules.py: problem), with the chapter's own additions
# (equal stages, the hint that an interleaved schedule without virtual stages is 1F1B); each names every offending
# value in one sentence.
@pytest.mark.parametrize("params, fragment", [
    ({"schedule": "interleaved"}, r"needs pp >= 2 and virtual_stages >= 2, not pp=4, virtual_stages=1; "
                                  r"virtual_stages=1 would make it plain 1F1B: choose schedule='1f1b'"),
    ({"schedule": "interleaved", "virtual_stages": 2, "pp": 1}, "needs pp >= 2 and virtual_stages >= 2, not pp=1"),
    ({"schedule": "interleaved", "virtual_stages": 2, "micro_batches": 6},
     r"micro_batches=6 is not a multiple of pp=4 \(the interleaved schedule sends micro-batches round in groups"),
    ({"schedule": "interleaved", "virtual_stages": 4}, "pp x virtual_stages = 16 is more than layers=8"),
    ({"schedule": "interleaved", "virtual_stages": 3, "layers": 16, "micro_batches": 8},
     "pp x virtual_stages = 12 does not divide layers=16 into equal chunks"),
    ({"virtual_stages": 2}, "virtual_stages=2 needs schedule='interleaved'"),
])
def test_invalid_interleaving_is_refused_before_launch(params, fragment):
    with pytest.raises(InvalidParameter, match=fragment) as refused:
        cu.run(WORKER, world_size=WORLD, **params, **LIMITS)
    assert "equal stages" not in str(refused.value)  # the rule set's layers sentence is not said twice


@pytest.mark.parametrize("params, fragment", [
    ({"layers": 6}, "pp=4 does not divide layers=6 into equal stages"),
    ({"pp": 3}, "pp=3 does not divide the 4 ranks: choose 1, 2 or 4"),
    ({"pp": -1}, r"pp=-1 must be at least 0 \(0: the whole world\)"),
    ({"schedule": "zb"}, "schedule='zb' is not one of 'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-h2', 'zb-v' or 'dualpipev'"),
    ({"micro_batches": 0}, "micro_batches=0 must be"),
    ({"layers": 0}, "layers=0 must be at least 1"),
    ({"hidden": 0, "steps": 0}, "hidden=0 must be at least 1; steps=0 must be at least 1"),
])
def test_invalid_input_is_refused_before_launch(params, fragment):
    with pytest.raises(InvalidParameter, match=fragment):
        cu.run(WORKER, world_size=WORLD, **params, **LIMITS)


def test_a_saved_notebooks_old_keywords_still_run_with_a_warning_naming_the_new_ones():
    # A notebook saved before the rename says stages= and chunks=: cu.run translates them into pp= and
    # virtual_stages= (workers/runtime.py: RENAMED) with a FutureWarning, one release, and runs what the new names run.
    with pytest.warns(FutureWarning) as caught:
        old = cu.run(WORKER, world_size=WORLD, stages=2, schedule="interleaved", chunks=2, micro_batches=4, **LIMITS)
    said = " ".join(str(w.message) for w in caught)
    assert "stages= is now called pp=" in said and "chunks= is now called virtual_stages=" in said, said
    new = cu.run(WORKER, world_size=WORLD, pp=2, schedule="interleaved", virtual_stages=2, micro_batches=4, **LIMITS)
    assert [(d["pp"], d["virtual_stages"], d["actions"]) for d in old.ranks] == \
        [(d["pp"], d["virtual_stages"], d["actions"]) for d in new.ranks]
    assert [d["pp"] for d in old.ranks] == [2] * WORLD and ch13.compare_to_reference(old)["within_tol"]
    with pytest.warns(FutureWarning), pytest.raises(InvalidParameter, match="pp=3 does not divide the 4 ranks"):
        cu.run(WORKER, world_size=WORLD, stages=3, **LIMITS)  # an old name is refused in the new one's words


def test_float64_runs_every_schedule_to_one_process_within_rounding():
    # dtype="float64" (added with the zero-bubble schedules) reaches the old schedules too: the same comparison as
    # above to 1e-12 instead of fp32's 1e-6, so a stage that summed its micro-batches in the wrong order would still
    # pass, but one that lost a micro-batch's gradient could not hide in fp32 rounding.
    import torch

    from workers.pipeline.model import PipelineConfig
    from workers.pipeline.reference import reference_step_in

    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        res = cu.run(WORKER, world_size=WORLD, pp=2, schedule=schedule, virtual_stages=v, micro_batches=4, steps=2,
                     dtype="float64", **LIMITS)
        ref = reference_step_in(PipelineConfig(**res[0]["config"]), torch.float64, steps=2)
        for key in ("grads", "weights"):
            got = ch13.merged(res, key)
            assert sorted(got) == sorted(ref[key]) and all(got[n].dtype == torch.float64 for n in got)
            assert all(torch.allclose(got[n], ref[key][n], rtol=0, atol=1e-12) for n in ref[key]), (schedule, key)
