"""Chapter 17's notebook glue (course_utils/ch17.py): the run's tables and figures, the model beside the measurement,
the cluster-scale ledgers and both widgets. Structure is asserted exactly (steps, attempts, shares that add up);
wall times only where any machine must agree (positive, recovery the largest share of a fault run)."""
import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402

from course_utils import ch17  # noqa: E402
from course_utils import goodput as gp  # noqa: E402
from course_utils.checkpoint_interval import daly_interval, job_mtbf  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    straight = ch17.restart_run("none", name="test-ch17-straight")
    killed = ch17.restart_run("kill", fault_step=6, fault_rank=1, ckpt_every=4, name="test-ch17-killed")
    return straight, killed


@pytest.mark.ranks
def test_tables_and_the_model_beside_the_measurement(runs):
    straight, killed = runs
    assert ch17.same_run(killed, straight) == {"steps": True, "losses": True, "weights": True, "bitwise": True}
    assert "kill rank 1 in step 6" in str(ch17.structure_table(killed[0]))
    assert "5" in str(ch17.structure_table(killed[0])).splitlines()[-1]  # step 5 was done twice
    costs = ch17.measured_costs(straight, restart_s=2.0)
    assert costs.step_s > 0 and costs.checkpoint_s > 0 and costs.restart_s == 2.0
    model = ch17.predicted(costs, killed[0])
    # the model redid exactly the steps the journal says were lost, and wrote the same three checkpoints
    assert model["lost"] == pytest.approx(len(killed[0]["lost_steps"]) * costs.step_s)
    assert model["productive"] == pytest.approx(ch17.STEPS * costs.step_s)
    assert model["checkpoint"] == pytest.approx(3 * costs.checkpoint_s)
    assert model["recovery"] == pytest.approx(costs.recovery_s)  # the restart given, and a reload as long as a save
    seen = ch17.measured_seconds(killed[0])
    assert all(v > 0 for v in seen.values()) and max(seen, key=seen.get) == "recovery"
    text = str(ch17.ledger_table(killed[0], model))
    assert "predicted s" in text and text.splitlines()[-1].startswith("wall time")


@pytest.mark.ranks
def test_the_run_figure_marks_the_fault_the_rollback_and_the_lost_steps(runs):
    _, killed = runs
    fig = ch17.run_figure(killed, ch17.predicted(ch17.measured_costs(runs[0], restart_s=1.0), killed[0]))
    ax, bx = fig.axes[:2]
    texts = {t.get_text() for t in ax.texts}
    assert "kill: rank 1" in texts and "rolled back to the checkpoint" in texts
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["attempt 0", "attempt 1 (restarted)"]
    assert [t.get_text() for t in bx.get_yticklabels()] == ["measured", "predicted"]


@pytest.mark.ranks
def test_a_straggler_is_named_and_its_waiting_set_beside_the_model(runs):
    straight, _ = runs
    slowed = ch17.restart_run("slow", fault_step=5, fault_rank=1, name="test-ch17-slowed")
    assert slowed[0]["attempts"] == 1  # a straggler fails nothing: no restart
    assert ch17.same_run(slowed, straight)["bitwise"]
    assert "slow rank 1 in steps 5, 6, 7" in str(ch17.structure_table(slowed[0]))
    found = ch17.straggler(slowed[0])
    # the slowed steps name rank 1 exactly; another step may, rarely on a loaded machine, be late by chance too
    assert found["rank"] == 1 and {5, 6, 7} <= set(found["steps"]) and ch17.last_in(slowed[0], [5, 6, 7]) == 1
    assert "rank 1" in str(ch17.straggler_table(slowed[0])).splitlines()[-6]  # step 7's row, of 12
    model = ch17.predicted(ch17.measured_costs(straight, restart_s=1.0), slowed[0])
    assert model["waiting"] == pytest.approx(ch17.SLOW_S * ch17.SLOW_STEPS)  # the sleep, less nothing
    assert model["recovery"] == 0.0 and model["lost"] == 0.0
    seen = ch17.measured_seconds(slowed[0])
    assert seen["waiting"] >= 0.5 * ch17.SLOW_S * ch17.SLOW_STEPS and seen["recovery"] == 0.0
    text = str(ch17.ledger_table(slowed[0], model))
    assert any(line.startswith("waiting") for line in text.splitlines())
    fig = ch17.run_figure(slowed, model)
    assert "slow: rank 1" in {t.get_text() for t in fig.axes[0].texts}
    assert "waiting" in [t.get_text() for t in fig.axes[1].get_legend().get_texts()]


def test_cluster_ledgers_and_figure():
    ledgers = ch17.cluster_ledgers()
    assert set(ledgers) == {"restart", "quorum"}
    for shares in ledgers.values():
        assert sum(shares.values()) == pytest.approx(1.0)
    mtbf = job_mtbf(gp.LLAMA3_GPU_MTBF_S, 16_384)
    assert ledgers["restart"] == gp.restart_ledger(gp.Costs(6.0, 20.0, restart_s=180.0, heal_s=30.0, reconfigure_s=5.0),
                                                   daly_interval(20.0, mtbf), mtbf)
    fig = ch17.cluster_figure(interval_min=60)
    assert "at 60 min between checkpoints" == fig.axes[1].get_title()
    assert [line.get_label() for line in fig.axes[0].get_lines()[:2]] == ["restart", "quorum"]


def test_cluster_widget_redraws_on_every_control():
    box = ch17.cluster_widget()
    controls, out = box.children[0].children, box.children[1]
    first = out.outputs[0]["data"]["image/png"]
    controls[0].value = 1024  # the GPUs
    assert out.outputs[0]["data"]["image/png"] != first
    controls[-1].value = 60.0  # an hour between checkpoints
    assert out.outputs[0]["output_type"] == "display_data"


@pytest.mark.ranks
def test_restart_widget_runs_a_fault_and_refuses_a_step_outside_the_run():
    live = ch17.restart_widget(fault="kill", fault_step=3, ckpt_every=2)
    assert "in all" in live.status.value  # new ranks, a kill, a restart: the whole wait announced while it runs
    assert live.wait(180)
    settings, result = live.history[-1]
    assert settings == {"fault": "kill", "fault_step": 3, "ckpt_every": 2}
    assert result[0]["lost_steps"] == [] and result[0]["resumed_from"] == [2]  # step 3 follows step 2's checkpoint
    assert live.out.outputs[0]["output_type"] == "display_data"
    live.controls["fault"].value = "none"
    assert live.wait(180)
    assert live.history[-1][1][0]["attempts"] == 1


def test_a_restart_run_announces_its_whole_wait():
    # the browser's check reads the first "about N s" while the widget is busy: it must be the whole wait
    import re
    from types import SimpleNamespace

    job = SimpleNamespace(expected_s=3.4, start_note="starting 2 ranks (a cold start: about 3 s ...)")  # a Job's
    kill = ch17.announce({"fault": "kill", "world_size": 2}, job)
    hang = ch17.announce({"fault": "hang", "world_size": 2}, job)
    assert re.search(r"about (\d+) s", kill).group(1) == "7" and "after the kill" in kill
    assert re.search(r"about (\d+) s", hang).group(1) == "10" and "3 s collective timeout" in hang
    assert ch17.announce({"fault": "none", "world_size": 2}, job) == job.start_note
    assert ch17.announce({"fault": "slow", "world_size": 2}, job) == job.start_note  # nothing restarts
