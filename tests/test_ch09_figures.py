"""Chapter 09, notebook side: the figures draw what the ranks measured, the spike labels come from the ranks'
own detector, and the Adam arithmetic the notebook prints is what torch.optim.AdamW does."""
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from course_utils import ch09  # noqa: E402
from workers.gpt.detect import SpikeDetector  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _history(steps=30, loss_scaling=False):
    """Telemetry columns shaped like ``workers/ch09_train.py``'s, with distinct values per series."""
    s = list(range(steps))
    return {"step": s, "loss": [3.5 - 0.05 * i for i in s], "grad_norm": [1.0 + 0.01 * i for i in s],
            "update_ratio": [0.01 / (1 + i) for i in s], "max_attn_logit": [0.1 * (1 + i) for i in s],
            "log_z_mean": [3.4 + 0.02 * i for i in s],
            "loss_scale": [2.0 ** (16 + i // 10) for i in s] if loss_scaling else [1.0] * steps,
            "zero_grad_frac": [0.0] * steps, "woken_elements": [100] + [0] * (steps - 1)}


@pytest.mark.parametrize("loss_scaling, panels", [(False, 5), (True, 6)])
def test_telemetry_figure_draws_one_panel_per_series_of_the_history(loss_scaling, panels):
    tel = _history(loss_scaling=loss_scaling)
    drawn = ch09.telemetry_panels(tel)
    # every series the healthy-run cell promises, and the loss scale only when loss scaling was on
    assert [key for key, _, _ in drawn] == ["loss", "grad_norm", "update_ratio", "max_attn_logit", "log_z_mean",
                                            "loss_scale"][:panels]
    fig = ch09.draw_telemetry(tel, "test", vocab=32)
    assert len(fig.axes) == panels  # the unused cells of the grid are removed, not left empty
    for ax, (key, title, _) in zip(fig.axes, drawn):
        line = ax.get_lines()[0]  # the series itself is the first line; the loss panel adds log V after it
        assert list(line.get_xdata()) == tel["step"] and list(line.get_ydata()) == tel[key], key
        assert ax.get_title() == title
    assert fig.axes[0].get_lines()[1].get_ydata()[0] == pytest.approx(math.log(32))  # the log V reference
    plt.close(fig)


def test_spike_labels_are_what_the_training_loops_detector_flags():
    loss = [3.0, 2.9, 2.8, 2.7, 2.6, 2.5, 2.4, 2.3, 2.2, 2.1, 2.05, 5.0, 2.0, float("nan"), 1.9]
    tel = {"step": list(range(100, 100 + len(loss))), "loss": loss}
    # the detector of workers/gpt/detect.py, fed every loss as in a run without recovery
    det, want = SpikeDetector(10, 1.5), []
    for step, value in zip(tel["step"], loss):
        if det.is_spike(value):
            want.append(step)
        det.accept(value)
    assert ch09.spike_steps(tel) == want == [111, 113]  # the jump to 5.0, and a NaN (never <= anything)
    assert ch09.spike_steps({"step": [0, 1, 2], "loss": [1.0, 9.0, 9.0]}) == []  # no verdict before 10 losses


@pytest.mark.parametrize("first_step", [0, 5, 52])
def test_adams_steps_after_one_gradient_match_torch_adamw(first_step):
    # One weight, gradient 0 at every step but one; torch's AdamW with the training loop's betas and eps.
    # The closed form ignores eps (1e-8), negligible against sqrt(v) of a gradient of 1e-3.
    n = 20
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    moves = []
    for step in range(first_step + n):
        before = w.detach().clone()
        w.grad = torch.tensor([1e-3 if step == first_step else 0.0], dtype=torch.float64)
        opt.step()
        moves.append(abs(float(w.detach() - before)))
    assert moves[:first_step] == [0.0] * first_step  # no history: zero gradients leave the weight where it is
    want = ch09.adam_steps_after_one_gradient(first_step, n)
    assert moves[first_step:] == pytest.approx(want, rel=1e-4)
    if first_step == 0:
        assert want[0] == pytest.approx(1.0)  # Adam's very first step is lr * sign(g)
    if first_step == 52:
        assert want[0] == pytest.approx(0.434, abs=1e-3)  # the notebook's fp16 run: about half of lr


def test_fp16_and_dormant_figures_draw_every_run():
    runs = {"a": _history(), "b": _history(loss_scaling=True)}
    fig = ch09.draw_fp16(runs, vocab=32)
    assert len(fig.axes) == 4 and len(fig.axes[0].get_lines()) == 3  # two runs and log V
    assert list(fig.axes[2].get_lines()[0].get_ydata()) == [100]  # only the steps with first gradients
    plt.close(fig)
    fig = ch09.draw_dormant(runs, wake=10, vocab=32)
    bars = fig.axes[1].patches
    assert len(bars) == 20 and bars[0].get_height() == pytest.approx(ch09.adam_steps_after_one_gradient(10, 1)[0])
    plt.close(fig)
