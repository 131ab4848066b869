"""Chapter 04's vocabulary section, notebook side (``course_utils/tp_vocab.py``): the formula, the tables the chapter
prints, its figures, and the explorer's refusals.

Start here when changing the section's printouts or figures. The bytes are exact (integers: ``b s V / tp`` times the
element's bytes, measured on the ranks as ``numel * element_size``), so they are compared with ``==``; the verdicts
come from ``workers/parallel/vocab_harness.verdict`` (tested with the worker in ``tests/test_vocab_parallel.py``) and
are only read here.
"""
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from course_utils import tp_vocab
from course_utils.model_shapes import MODEL_SHAPES

WORKER = "workers.ch04_vocab_parallel"


def test_the_logits_bytes_formula_for_llama_3_8b():
    # one sequence of 8,192 tokens, V = 128,256 (the released tokenizer), bf16: 2 bytes each
    assert MODEL_SHAPES["llama-3-8b"].vocab == 128_256
    assert tp_vocab.logits_bytes(1, 8192, 128_256, 1, 2) == 8192 * 128_256 * 2 == 2_101_346_304
    assert tp_vocab.logits_bytes(1, 8192, 128_256, 8, 2) == 2_101_346_304 // 8
    # gathered: the same on every rank, whatever tp
    assert tp_vocab.logits_bytes(1, 8192, 128_256, 8, 2, loss_parallel=False) == 2_101_346_304


def test_the_logits_are_the_widest_activation_of_llama_3_8b():
    table = tp_vocab.largest_activations()
    widths = {row[0]: int(row[1].replace(",", "")) for row in table.rows}
    assert widths == {"hidden state [b, s, h]": 4096, "MLP inside [b, s, ffn]": 14336, "logits [b, s, V]": 128_256}
    assert table.rows[-1][2] == "2,101,346,304" and table.rows[-1][3] == "31.3"


def test_scale_names():
    assert [tp_vocab.scale_name(s) for s in tp_vocab.SCALES] == ["~1", "~1e3"]


def _fake(tp: int, fault: str = "", scale: float = 1.0, losses=None, ok=True, mistake="", agree=True):
    shape = tp_vocab.SHAPE
    dense = shape["batch"] * shape["seq"] * shape["vocab"] * tp_vocab.ELEMENT
    return tp_vocab.VocabRun(tp=tp, **shape, logit_scale=scale, fault=fault,
                             logits_shape=[shape["seq"], shape["batch"], shape["vocab"] // tp],
                             logits_bytes=[dense // tp] * tp, dense_logits_bytes=dense,
                             losses=losses or [3.9] * tp, dense_loss=3.9,
                             verdict={"ok": ok, "mistake": mistake, "why": "", "errors": {}, "ranks_agree": agree,
                                      "grad_row_sum": 0.0},
                             reductions=[] if tp == 1 else [{"what": w, "collective": "all_reduce", "pass": "forward",
                                                             "shape": [8, 4], "bytes": 256}
                                                            for w in ("logits_max", "predicted_logits",
                                                                      "sum_exp_logits")])


def _small_text(fig) -> list[str]:
    """Visible text under 8 points: at the figure's dpi (110) and JupyterLab's width, below about 8 pixels."""
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text)
            if t.get_visible() and t.get_text().strip() and t.get_fontsize() < 8]


def test_the_figures_draw_with_nothing_smaller_than_8_points():
    runs = [_fake(t) for t in (1, 2, 4)]
    drills = {}
    for scale in tp_vocab.SCALES:
        drills["", scale] = _fake(4, "", scale)
        drills["max_not_reduced", scale] = _fake(4, "max_not_reduced", scale, [4.0] * 4, False, "max_not_reduced")
        drills["sum_exp_not_reduced", scale] = _fake(4, "sum_exp_not_reduced", scale, [2.4, 2.5, 2.6, float("-inf")],
                                                     False, "sum_exp_not_reduced", agree=False)
        drills["max_not_subtracted", scale] = _fake(4, "max_not_subtracted", scale, [float("inf")] * 4, False,
                                                    "max_not_subtracted")
    for fig in (tp_vocab.bytes_figure(runs), tp_vocab.drills_figure(drills),
                tp_vocab.live_figure(drills["max_not_subtracted", 1e3]), tp_vocab.live_figure(_fake(1))):
        assert not _small_text(fig)
        plt.close(fig)


@pytest.mark.ranks
def test_a_run_is_read_and_printed_exactly():
    runs = [tp_vocab.run(WORKER, t) for t in (1, 2, 4)]
    b, s, v = tp_vocab.SHAPE["batch"], tp_vocab.SHAPE["seq"], tp_vocab.SHAPE["vocab"]
    for r in runs:
        assert r.verdict["ok"] and r.finite
        assert r.logits_bytes == [b * s * v * tp_vocab.ELEMENT // r.tp] * r.tp
        assert r.dense_logits_bytes == b * s * v * tp_vocab.ELEMENT
        assert tp_vocab.equality_line(r).endswith("on every rank: True")
        assert abs(r.losses[0] - r.dense_loss) <= 1e-12 * abs(r.dense_loss)
    table = str(tp_vocab.bytes_table(runs))
    assert "4   [8, 4, 8]         2,048           8,192     1/4    3 x 256 B" in table
    assert [row[0] for row in tp_vocab.reductions_table(runs[-1]).rows] == ["logits_max", "predicted_logits",
                                                                            "sum_exp_logits"]


@pytest.mark.ranks
def test_a_drill_is_named_in_the_verdict_table():
    drills = {(f, 1e3): tp_vocab.run(WORKER, 4, fault=f, logit_scale=1e3) for f in ("", "max_not_subtracted")}
    rows = tp_vocab.drill_verdicts(drills).rows
    assert rows[0] == ["(none)", "~1e3", "passes: equal to the dense ends", "yes", "yes"]
    assert rows[1] == ["max_not_subtracted", "~1e3", "caught, named max_not_subtracted", "no", "yes"]


@pytest.mark.ranks
def test_the_explorer_runs_and_refuses_naming_only_its_controls():
    live = tp_vocab.live(WORKER)
    assert live.wait(120)
    assert live.history[-1][1].__class__.__name__ == "RunResult" and live.out.outputs
    refusals = {}
    for settings in ({"vocab": 30, "tp": 4}, {"vocab": 32, "tp": 3}):
        for name, value in settings.items():
            live.controls[name].value = value
        assert live.wait(60)
        refusals[tuple(settings.items())] = live.status.value
        assert "course-refusal" in live.status.value and live.out.outputs == ()
        named = set(re.findall(r"\b(\w+)=", re.sub(r"<[^>]+>", "", live.status.value)))
        assert named <= set(live.controls), (named, live.status.value)  # only what the learner moves
    assert "tp=4 does not divide vocab=30" in refusals[("vocab", 30), ("tp", 4)]
    assert "tp=3 does not divide the 4 ranks" in refusals[("vocab", 32), ("tp", 3)]
    live.controls["tp"].value = 2
    assert live.wait(60)
    assert live.history[-1][1].__class__.__name__ == "RunResult"
