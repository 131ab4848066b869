"""``make doctor`` (course_utils/doctor.py): it names the README's Hardware row that applies and the world sizes the
labs will use, and says each rank plan once (issue 18)."""
import pytest

from course_utils import doctor
from workers.runtime import Placement


@pytest.mark.parametrize("gpus, row", [(0, "a CPU only"), (1, "one GPU"), (2, "several GPUs"), (8, "several GPUs")])
def test_hardware_row_is_the_readmes(gpus, row):
    from course_utils.paths import ROOT

    assert doctor.hardware_row(gpus) == row
    assert f"| {row} |" in (ROOT / "README.md").read_text()  # the row exists in the README's table


def test_report_names_the_row_and_the_world_sizes_and_never_repeats_the_backend():
    rows = dict(doctor.report())
    assert list(rows)[0] == "hardware row"
    assert rows["hardware row"].startswith("a CPU only") or "GPU" in rows["hardware row"]
    assert "world sizes 1 to" in rows["hardware row"]
    for ws in (1, 2, 4, 8):
        plan = rows[f"world size {ws}"]
        assert plan.count("gloo") + plan.count("NCCL") + plan.count("nccl") <= 2, plan  # said once (plus a reason)


def test_plan_names_the_devices_when_a_gpu_is_involved(monkeypatch):
    import workers.runtime

    fake = lambda rank, world: Placement("gloo", "cuda:0", "2 local ranks but 1 GPU(s): gloo on CUDA tensors")  # noqa: E731
    monkeypatch.setattr(workers.runtime, "select_placement", fake)
    assert doctor.plan_for(2) == "2 local ranks but 1 GPU(s): gloo on CUDA tensors (ranks on cuda:0, cuda:0)"
    cpu = lambda rank, world: Placement("gloo", "cpu", "no GPU: gloo on the CPU")  # noqa: E731
    monkeypatch.setattr(workers.runtime, "select_placement", cpu)
    assert doctor.plan_for(4) == "no GPU: gloo on the CPU"
