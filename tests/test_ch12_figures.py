"""Chapter 12's figures draw what they are given: one panel per model / quantity, the right bars and curves."""
import matplotlib.pyplot as plt
import pytest

from course_utils import ch12
from course_utils.posttrain_ledger import ledger_table


def test_moving_average_is_a_trailing_mean():
    assert ch12.moving_average([1, 3, 5, 7], window=2) == [1.0, 2.0, 4.0, 6.0]


def test_ledger_bars_stack_to_the_ledger_totals():
    rows = ledger_table(("7B",), r=8)
    fig = ch12.draw_ledger(rows)
    ax = fig.axes[0]
    # one stacked bar per method: the top of the last segment of each bar is that method's total
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    assert [tops[i] for i in range(3)] == pytest.approx([r["total"] for r in rows], rel=1e-9)
    plt.close(fig)


def test_training_curves_have_their_panels():
    sft = [{"step": i, "loss": 2.0 - i / 10, "answer_loss": 2.5 - i / 10} for i in range(5)]
    dpo = [{"step": i, "loss": 0.69, "chosen_reward": 0.0, "rejected_reward": -i / 10, "margin": i / 10}
           for i in range(5)]
    grpo = [{"step": i, "reward": i / 10, "kl": 0.01 * (i + 1)} for i in range(5)]
    for fig, n_axes in ((ch12.draw_sft_masking(sft, sft), 2), (ch12.draw_dpo(dpo, 0.1), 3),
                        (ch12.draw_grpo({"a": grpo, "b": grpo}), 2)):
        assert len(fig.axes) == n_axes
        assert all(ax.lines for ax in fig.axes)
        plt.close(fig)


def test_full_vs_lora_bars_stack_to_the_measured_bytes():
    def result(frozen, trained, loss0):
        state = {"frozen_weight_bytes": frozen, "trained_weight_bytes": trained, "grad_bytes": trained,
                 "optimizer_bytes": 2 * trained + 4}
        return {"history": [{"step": i, "answer_loss": loss0 - i / 10} for i in range(5)], "state_bytes": state}

    runs = {"full": result(0, 1000, 2.5), "LoRA": result(1000, 100, 2.5)}
    fig = ch12.draw_full_vs_lora(runs)
    loss_ax, bytes_ax = fig.axes
    assert len(loss_ax.lines) == 2
    tops = {}
    for patch in bytes_ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    # in kB: full 0 + 1000 + 1000 + 2004 bytes, LoRA 1000 + 100 + 100 + 204 bytes
    assert [tops[0], tops[1]] == pytest.approx([4.004, 1.404])
    plt.close(fig)
