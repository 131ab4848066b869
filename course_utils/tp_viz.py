"""Which rank holds which block of each weight: the tensor-parallel sharding view (chapters 04-06).

Pure drawing, no ranks: ``layout(...)`` computes the plan of one transformer layer (Megatron's split:
QKV by heads, output projection and fc2 by input rows, fc1 by output columns, LayerNorms and the
row-parallel biases replicated); ``sharding_figure(...)`` draws it; ``sharding_widget()`` lets a learner
move hidden size, FFN size, heads, KV heads and TP. A combination tensor parallelism cannot split is
explained in one sentence (``problem``), never with a traceback.

Weights are drawn in ``torch.nn.Linear`` layout, ``[out_features, in_features]``: a column-parallel
layer is cut along its rows (output features), a row-parallel one along its columns (input features).
"""
from __future__ import annotations

from dataclasses import dataclass

from course_utils.ledger import tp_comm_bytes_per_layer
from workers.parallel.attention import head_problem

BYTES = {"bf16": 2, "fp32": 4}


def problem(hidden: int, ffn: int, heads: int, kv_heads: int, tp: int, seq: int = 0) -> str | None:
    """One sentence saying why this layer cannot be split over ``tp`` ranks this way, or None. The heads and KV
    heads follow the course's one rule (``workers/layout/rules.py: heads_problem``, through ``head_problem``)."""
    from workers.runtime import at_least, divides, refusal

    sizes = refusal(*(at_least(name, value) for name, value in
                      (("hidden", hidden), ("ffn", ffn), ("heads", heads), ("kv_heads", kv_heads), ("tp", tp))))
    if sizes:
        return sizes
    if hidden % heads:
        return f"hidden={hidden} is not divisible by heads={heads}: the head size hidden/heads must be whole"
    return refusal(head_problem(heads, kv_heads, tp),
                   divides("tp", tp, "ffn", ffn),  # each rank holds ffn/tp columns of fc1 and rows of fc2
                   divides("tp", tp, "seq", seq) if seq else None)  # sequence parallelism: seq/tp positions each


@dataclass(frozen=True)
class Block:
    """One rectangle of a weight: rows [r0, r1) x columns [c0, c1), held by ``ranks`` (several: replicated)."""

    r0: int
    r1: int
    c0: int
    c1: int
    ranks: tuple[int, ...]
    label: str = ""


def layout(hidden: int, ffn: int, heads: int, kv_heads: int, tp: int, *, activation: str = "gelu") -> dict:
    """Blocks of every weight of one layer, per-rank heads, and parameter counts. Raises ValueError on a bad shape."""
    bad = problem(hidden, ffn, heads, kv_heads, tp)
    if bad:
        raise ValueError(bad)
    d = hidden // heads
    q_per = heads // tp
    replicated_kv = tp > kv_heads
    kv_owner = {}  # kv head -> ranks holding it
    for r in range(tp):
        held = ([r // (tp // kv_heads)] if replicated_kv
                else list(range(r * kv_heads // tp, (r + 1) * kv_heads // tp)))
        for k in held:
            kv_owner.setdefault(k, []).append(r)
    qkv = [Block(h * d, (h + 1) * d, 0, hidden, (h // q_per,), f"q{h}") for h in range(heads)]
    for part, offset in (("k", heads * d), ("v", (heads + kv_heads) * d)):
        qkv += [Block(offset + k * d, offset + (k + 1) * d, 0, hidden, tuple(kv_owner[k]), f"{part}{k}")
                for k in range(kv_heads)]
    f = ffn // tp
    width1 = 2 * ffn if activation == "swiglu" else ffn
    fc1 = [Block(r * f, (r + 1) * f, 0, hidden, (r,), "gate" if activation == "swiglu" else "") for r in range(tp)]
    if activation == "swiglu":
        fc1 += [Block(ffn + r * f, ffn + (r + 1) * f, 0, hidden, (r,), "up") for r in range(tp)]
    weights = {
        "attention.qkv  (column, by heads)": ((heads + 2 * kv_heads) * d, hidden, qkv),
        "attention.proj  (row)": (hidden, heads * d,
                                  [Block(0, hidden, r * q_per * d, (r + 1) * q_per * d, (r,)) for r in range(tp)]),
        "mlp.fc1  (column)": (width1, hidden, fc1),
        "mlp.fc2  (row)": (hidden, ffn, [Block(0, hidden, r * f, (r + 1) * f, (r,)) for r in range(tp)]),
    }
    per_rank = []
    for r in range(tp):
        params = 0
        for rows, cols, blocks in weights.values():
            params += sum((b.r1 - b.r0) * (b.c1 - b.c0) for b in blocks if r in b.ranks)
        # biases: column-parallel biases are split like their rows; row biases and LayerNorms replicated
        params += q_per * d + 2 * len([k for k, owners in kv_owner.items() if r in owners]) * d
        params += (2 if activation == "swiglu" else 1) * f
        replicated = 2 * hidden + 4 * hidden  # proj and fc2 biases, two LayerNorms (weight and bias)
        per_rank.append({"rank": r, "query_heads": list(range(r * q_per, (r + 1) * q_per)),
                         "kv_head_ids": sorted(k for k, owners in kv_owner.items() if r in owners),
                         "sharded_params": params, "replicated_params": replicated,
                         "params": params + replicated})
    dense = sum(rows * cols for rows, cols, _ in weights.values()) + (heads + 2 * kv_heads) * d + width1 \
        + 2 * hidden + 4 * hidden
    return {"weights": weights, "per_rank": per_rank, "dense_params": dense, "replicated_kv": replicated_kv,
            "head_dim": d}


def comm_per_step(hidden: int, tp: int, *, seq: int, batch: int, bytes_per_element: float = 2,
                  sequence_parallel: bool = False) -> dict:
    """Collectives and bytes one rank sends per layer and micro-batch (Megatron: 2 + 2 all-reduces)."""
    c = tp_comm_bytes_per_layer(batch, seq, hidden, tp, bytes_per_element=bytes_per_element)
    if sequence_parallel:
        ops = "2 all-gathers + 2 reduce-scatters forward, the same backward"
    else:
        ops = f"{c.all_reduces_forward} all-reduces forward + {c.all_reduces_backward} backward"
    return {"collectives": ops, "message_bytes": c.message_bytes, "wire_bytes": c.total_wire_bytes if tp > 1 else 0.0}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def rank_colours(tp: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if tp <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(tp)]


def sharding_figure(hidden: int = 64, ffn: int = 256, heads: int = 8, kv_heads: int = 4, tp: int = 4, *,
                    activation: str = "gelu", seq: int = 2048, batch: int = 1, dtype: str = "bf16"):
    """Every weight of one layer coloured by the rank that holds each block, with bytes and communication."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    plan = layout(hidden, ffn, heads, kv_heads, tp, activation=activation)
    colours = rank_colours(tp)
    fig, axes = plt.subplots(1, 4, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1, 1, 1.6]})
    for ax, (title, (rows, cols, blocks)) in zip(axes, plan["weights"].items()):
        for b in blocks:
            stripes = len(b.ranks)
            for i, r in enumerate(b.ranks):  # a replicated block: one stripe per copy
                w = (b.c1 - b.c0) / stripes
                ax.add_patch(Rectangle((b.c0 + i * w, b.r0), w, b.r1 - b.r0, facecolor=colours[r],
                                       edgecolor="white", linewidth=0.4))
        if title.startswith("attention.qkv"):
            d = plan["head_dim"]
            for name, start, end in (("Q", 0, heads * d), ("K", heads * d, (heads + kv_heads) * d),
                                     ("V", (heads + kv_heads) * d, rows)):
                ax.text(-0.04 * cols, (start + end) / 2, name, ha="right", va="center", fontsize=10)
                ax.axhline(start, color="black", linewidth=0.8)
        if activation == "swiglu" and title.startswith("mlp.fc1"):
            ax.axhline(ffn, color="black", linewidth=0.8)
            ax.text(-0.04 * cols, ffn / 2, "gate", ha="right", va="center", fontsize=9, rotation=90)
            ax.text(-0.04 * cols, 1.5 * ffn, "up", ha="right", va="center", fontsize=9, rotation=90)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal")
        ax.set_title(f"{title}\n[{rows}, {cols}]", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
    per = plan["per_rank"][0]
    nbytes = BYTES[dtype]
    comm = comm_per_step(hidden, tp, seq=seq, batch=batch, bytes_per_element=nbytes)
    kv_note = " (KV heads replicated: striped blocks)" if plan["replicated_kv"] else ""
    fig.suptitle(f"hidden {hidden}, ffn {ffn}, {heads} heads, {kv_heads} KV heads, TP {tp}{kv_note}\n"
                 f"per rank: {per['params']:,} parameters = {_fmt_bytes(per['params'] * nbytes)} {dtype} "
                 f"(dense layer {_fmt_bytes(plan['dense_params'] * nbytes)}); per layer and step (s={seq}, b={batch}): "
                 f"{comm['collectives']}, {_fmt_bytes(comm['wire_bytes'])} sent per rank", fontsize=9)
    fig.legend(handles=[Patch(color=colours[r], label=f"rank {r}") for r in range(tp)], loc="lower center",
               ncol=min(tp, 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 0.93))
    return fig


def kv_copy_grad_sync(hidden: int, heads: int, kv_heads: int, tp: int, *, bytes_per_element: float = 2,
                      bias: bool = False) -> dict:
    """The gradient all-reduce that replicated KV heads add, per layer and step, on one rank (chapter 05).

    When TP exceeds the KV heads, each KV head's K and V rows live on ``copies = tp / kv_heads`` ranks;
    each copy sees only its own query heads' share of their gradient, so the rows enter through ``f`` over
    the group of copies and the backward all-reduces their gradient: ``2 d h`` weight elements (and, with
    ``bias``, a second all-reduce of ``2 d`` bias elements). ``wire_bytes`` uses the ring's 2(c-1)/c, like
    every other count in the course. Zero when the KV heads are split.
    """
    bad = problem(hidden, 4 * hidden, heads, kv_heads, tp)
    if bad:
        raise ValueError(bad)
    copies = tp // kv_heads if tp > kv_heads else 1
    if copies == 1:
        return {"copies": 1, "all_reduces": 0, "message_bytes": [], "wire_bytes": 0.0}
    d = hidden // heads
    messages = [2 * d * hidden * bytes_per_element] + ([2 * d * bytes_per_element] if bias else [])
    return {"copies": copies, "all_reduces": len(messages), "message_bytes": messages,
            "wire_bytes": sum(2 * (copies - 1) / copies * m for m in messages)}


def head_table(hidden: int, heads: int, kv_heads: int, tps=(1, 2, 4, 8), *, seq: int = 2048, batch: int = 1,
               dtype: str = "bf16", bias: bool = False) -> list[dict]:
    """Chapter 05's table: per TP, heads and KV heads per rank, attention parameter bytes, all-reduce bytes.

    Two kinds of all-reduce: the activation's (``g`` forward, ``f`` backward, b*s*h each, whatever the
    heads) and, when the KV heads are replicated, the backward sum of the KV copies' weight gradients.
    """
    nbytes = BYTES[dtype]
    rows = []
    for tp in tps:
        bad = problem(hidden, 4 * hidden, heads, kv_heads, tp)
        if bad:
            rows.append({"TP": tp, "problem": bad})
            continue
        plan = layout(hidden, 4 * hidden, heads, kv_heads, tp)
        (qkv_rows, _, qkv_blocks), (_, proj_cols, proj_blocks) = list(plan["weights"].values())[:2]
        attn = sum((b.r1 - b.r0) * (b.c1 - b.c0) for b in qkv_blocks + proj_blocks if 0 in b.ranks)
        comm = tp_comm_bytes_per_layer(batch, seq, hidden, tp, bytes_per_element=nbytes)
        kv = kv_copy_grad_sync(hidden, heads, kv_heads, tp, bytes_per_element=nbytes, bias=bias)
        rows.append({"TP": tp, "query heads/rank": heads // tp,
                     "KV heads/rank": len(plan["per_rank"][0]["kv_head_ids"]),
                     "KV": "replicated x%d" % (tp // kv_heads) if plan["replicated_kv"] else "split",
                     "attention weights/rank": _fmt_bytes(attn * nbytes),
                     "all-reduce fwd+bwd (attention)": f"2 x {_fmt_bytes(comm.wire_bytes_per_all_reduce)}"
                     if tp > 1 else "none",
                     "KV-copy grad all-reduce (bwd)": f"{kv['all_reduces']} x {_fmt_bytes(kv['wire_bytes'])} over "
                     f"{kv['copies']} copies" if kv["all_reduces"] else "none"})
    return rows


class ShardingWidget:
    """Sliders for the shape and TP; the figure redraws, or one sentence says why the split is impossible.

    Pure drawing (no ranks). A refusal is shown at once; a figure is drawn on a background thread while the
    status line says what it is drawing, and only the newest settings are drawn (moving a slider several times
    while a figure renders draws the last position once, never a queue of stale ones). The output is replaced in
    one step, which also works without a kernel, so the tests can see exactly what a learner sees.
    """

    def __init__(self, hidden: int = 64, ffn: int = 256, heads: int = 8, kv_heads: int = 4, tp: int = 4):
        import threading

        import ipywidgets as W

        from course_utils.widgets import controls_row

        def islider(desc, value, lo, hi, step=1):
            return W.IntSlider(value=value, min=lo, max=hi, step=step, description=desc, continuous_update=False,
                               style={"description_width": "initial"})

        self.controls = {"hidden": islider("hidden", hidden, 16, 512, 16), "ffn": islider("ffn", ffn, 16, 2048, 16),
                         "heads": islider("heads", heads, 1, 32),
                         "kv_heads": islider("KV heads", kv_heads, 1, 32), "tp": islider("TP", tp, 1, 16),
                         "activation": W.Dropdown(options=["gelu", "swiglu"], value="gelu", description="MLP")}
        self.out = W.Output()
        self.status = W.HTML()
        self.message = ""
        self.drawn: list[dict] = []  # the settings of every figure drawn, oldest first
        self._lock = threading.Lock()
        self._wanted = 0  # bumped by every change; a drawing of an older generation is thrown away
        self._drawing = False
        self.idle = threading.Event()
        self.idle.set()
        for c in self.controls.values():
            c.observe(lambda _change: self.redraw(), names="value")
        self.box = W.VBox([controls_row(self.controls.values()), self.status, self.out])
        self._show(self.settings(), self._render(self.settings()))

    def settings(self) -> dict:
        return {k: c.value for k, c in self.controls.items()}

    def _render(self, kw: dict) -> tuple[str, bytes | None]:
        from course_utils.widgets import figure_png

        bad = problem(kw["hidden"], kw["ffn"], kw["heads"], kw["kv_heads"], kw["tp"])
        if bad:
            return bad, None
        try:
            return "", figure_png(sharding_figure(**kw))
        except Exception as exc:  # noqa: BLE001 - a drawing problem is a sentence, never a traceback
            return f"cannot draw this combination: {exc}", None

    def _show(self, kw: dict, rendered: tuple[str, bytes | None]) -> None:
        import base64

        self.message, png = rendered
        if png is None:
            self.out.outputs = ({"output_type": "stream", "name": "stdout", "text": self.message + "\n"},)
            return
        self.drawn.append(kw)
        self.out.outputs = ({"output_type": "display_data", "metadata": {},
                             "data": {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": "<figure>"}},)

    def redraw(self) -> None:
        """Show a refusal now, or start drawing the newest settings (unless a drawing is already under way, which
        then draws them next)."""
        import threading

        kw = self.settings()
        bad = problem(kw["hidden"], kw["ffn"], kw["heads"], kw["kv_heads"], kw["tp"])
        with self._lock:
            self._wanted += 1
            if bad:
                self.status.value = ""
                self._show(kw, (bad, None))
                return
            self.status.value = (f"<i>drawing hidden {kw['hidden']}, ffn {kw['ffn']}, {kw['heads']} heads, "
                                 f"{kw['kv_heads']} KV heads, TP {kw['tp']}, {kw['activation']}...</i>")
            if self._drawing:
                return
            self._drawing = True
            self.idle.clear()
        threading.Thread(target=self._draw_newest, daemon=True).start()

    def _draw_newest(self) -> None:
        while True:
            with self._lock:
                generation, kw = self._wanted, self.settings()
            rendered = self._render(kw)
            with self._lock:
                if generation == self._wanted:  # nothing moved while it rendered: this is the current view
                    self._show(kw, rendered)
                    self.status.value = ""
                    self._drawing = False
                    self.idle.set()
                    return

    def wait(self, timeout: float = 60) -> bool:
        """Block until the newest settings are on screen (tests, headless runs)."""
        return self.idle.wait(timeout)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.box)


def sharding_widget(**kw) -> ShardingWidget:
    return ShardingWidget(**kw)
