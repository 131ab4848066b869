"""Chapter 08, notebook side, checkpointing half: compare resumed runs with the straight one, read the scans, draw.

Everything here reads ``RunResult``s of ``workers/ch08_resume.py``, ``ch08_dcp.py`` and ``ch08_atomic.py``; no
function recomputes what the ranks computed. Names start with ``ckpt_`` (the precision half and the checkpoint
interval live in their own modules).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from course_utils.plots import CPU_NOTE, log2_axis

FLOOR = 1e-10  # where "exactly 0" is drawn on a log axis


# -- bitwise resume ---------------------------------------------------------------------------------------

def ckpt_first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first row (step) where ``a`` and ``b`` differ in any bit, or None if they are equal."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    differs = (a != b).reshape(a.shape[0], -1).any(dim=1) if a.dim() > 1 else (a != b)
    idx = torch.nonzero(differs)
    return int(idx[0]) if len(idx) else None


def ckpt_stitch(saved, resumed, rank: int = 0) -> dict:
    """The interrupted run as one curve: steps 1..k from the ``save`` run, k+1..N from the ``resume`` run."""
    a, b = saved[rank], resumed[rank]
    return {"steps": a["steps"] + b["steps"], "losses": torch.cat([a["losses"], b["losses"]]),
            "lrs": torch.cat([a["lrs"], b["lrs"]]), "weights": torch.cat([a["weights"], b["weights"]]),
            "scales": a["scales"] + b["scales"], "skipped": a["skipped"] + b["skipped"]}


def ckpt_compare(straight, saved, resumed) -> dict:
    """Per rank: are losses and weights bit-identical to the straight run; from which step do they differ."""
    out = {"ranks": []}
    for rank in range(len(straight.ranks)):
        s, j = straight[rank], ckpt_stitch(saved, resumed, rank)
        if j["steps"] != s["steps"]:
            raise ValueError(f"the runs cover other steps: {j['steps']} vs {s['steps']}")
        first = ckpt_first_difference(j["losses"], s["losses"])
        first_w = ckpt_first_difference(j["weights"], s["weights"])
        out["ranks"].append({
            "losses_equal": torch.equal(j["losses"], s["losses"]),
            "weights_equal": torch.equal(j["weights"], s["weights"]),
            "first_loss_diff_step": None if first is None else s["steps"][first],
            "first_weight_diff_step": None if first_w is None else s["steps"][first_w],
            "max_loss_diff": (j["losses"] - s["losses"]).abs().max().item(),
        })
    out["bitwise"] = all(r["losses_equal"] and r["weights_equal"] for r in out["ranks"])
    out["new_process"] = saved[0]["pid"] != resumed[0]["pid"]
    return out


MARKERS = ["o", "s", "^", "D", "v", "P"]


def _resumed_tail(saved, resumed, save_at: int, rank: int) -> tuple[dict, list[int]]:
    j = ckpt_stitch(saved, resumed, rank)
    return j, [i for i, step in enumerate(j["steps"]) if step > save_at]


def _draw_loss_diff(ax_d, s: dict, runs: dict, save_at: int, rank: int) -> None:
    """|loss - straight| per resumed step, on a log axis whose floor is drawn as "0 (bit-identical)"."""
    for k, (label, (saved, resumed)) in enumerate(runs.items()):
        j, tail = _resumed_tail(saved, resumed, save_at, rank)
        steps = [j["steps"][i] for i in tail]
        diff = (j["losses"] - s["losses"]).abs().clamp_min(FLOOR)[tail].numpy()
        ax_d.plot(np.array(steps) + 0.06 * (k - (len(runs) - 1) / 2), diff, marker=MARKERS[k % len(MARKERS)],
                  ms=5, lw=1, label=label)
    ax_d.set_yscale("log")
    ax_d.set_ylim(FLOOR / 3, 1)
    ax_d.set_yticks([FLOOR, 1e-8, 1e-6, 1e-4, 1e-2, 1], ["0 (bit-identical)", "1e-8", "1e-6", "1e-4", "1e-2", "1"])
    ax_d.set_ylabel("|loss - straight loss|")
    ax_d.set_title("How far each resumed run is from the straight one")


def _mark_save(axes, save_at: int) -> None:
    for a in axes:
        a.axvline(save_at + 0.5, color="grey", ls="--", lw=1)
        a.set_xlabel("step")


def ckpt_draw_resume(straight, runs: dict, save_at: int, rank: int = 0):
    """Left: the loss of the straight run and of each resumed run. Right: |loss - straight| per step (log)."""
    s = straight[rank]
    fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax.plot(s["steps"], s["losses"].numpy(), "k-", lw=2.5, alpha=0.35, label="straight (no interruption)")
    for k, (label, (saved, resumed)) in enumerate(runs.items()):
        j, tail = _resumed_tail(saved, resumed, save_at, rank)
        ax.plot([j["steps"][i] for i in tail], j["losses"][tail].numpy(), marker=MARKERS[k % len(MARKERS)], ms=4,
                lw=1, label=label)
    _mark_save((ax, ax_d), save_at)
    ax.text(save_at + 0.6, ax.get_ylim()[1], " save | new process", va="top", fontsize=8, color="grey")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("Resumed runs against the straight run")
    _draw_loss_diff(ax_d, s, runs, save_at, rank)
    fig.tight_layout()
    # under the panels (the right one uses the same colours and markers): inside, it covered the losses
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.18), ncol=3, frameon=False)
    return fig


# -- the loss scaler (precision="fp16") ---------------------------------------------------------------------

def ckpt_scale_table(straight, runs: dict, save_at: int, rank: int = 0) -> str:
    """Per step: the loss scale each run's backward used, whether the step was skipped (an inf), and whether
    each resumed run's weights after the step are bit-identical to the straight run's."""
    s = straight[rank]
    cols = {label: ckpt_stitch(saved, resumed, rank) for label, (saved, resumed) in runs.items()}
    width = max(30, *(len(label) for label in cols))
    lines = [f"step | {'straight':<16} | " + " | ".join(f"{label:<{width}}" for label in cols)]

    def cell(scale: float, skipped: bool) -> str:
        return f"{scale:>7.0f}" + (" skipped" if skipped else "        ")

    for i, step in enumerate(s["steps"]):
        row = f"{step:>4} | {cell(s['scales'][i], s['skipped'][i]):<16} | "
        if step <= save_at:
            lines.append(row.rstrip(" |"))
            if step == save_at:
                st = next(iter(runs.values()))[0][rank].get("scaler_state") or {}
                lines.append(f"---- save after step {save_at}: the scaler holds scale "
                             f"{st.get('scale', float('nan')):.0f}, {st.get('_growth_tracker', '?')} good step(s) "
                             "towards the next growth ----")
            continue
        parts = []
        for j in cols.values():
            same = torch.equal(j["weights"][i], s["weights"][i])
            parts.append(f"{cell(j['scales'][i], j['skipped'][i])} -> {'same' if same else 'OTHER'} weights"
                         .ljust(width))
        lines.append(row + " | ".join(parts))
    return "\n".join(line.rstrip() for line in lines)


def ckpt_draw_scaler(straight, runs: dict, save_at: int, rank: int = 0):
    """Left: the loss scale per step (skipped steps crossed). Right: |loss - straight| per step (log)."""
    s = straight[rank]
    fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax.plot(s["steps"], s["scales"], "k-", lw=2.5, alpha=0.35, drawstyle="steps-mid", label="straight")
    skips = [step for step, k in zip(s["steps"], s["skipped"]) if k]
    ax.plot(skips, [s["scales"][s["steps"].index(t)] for t in skips], "kx", ms=9, mew=2,
            label="skipped (inf in a gradient)")
    for k, (label, (saved, resumed)) in enumerate(runs.items()):
        j, tail = _resumed_tail(saved, resumed, save_at, rank)
        steps = [j["steps"][i] for i in tail]
        line, = ax.plot(np.array(steps) + 0.08 * (k + 1), [j["scales"][i] for i in tail],
                        marker=MARKERS[k % len(MARKERS)], ms=4, lw=1, drawstyle="steps-mid", label=f"resumed, {label}")
        sk = [i for i in tail if j["skipped"][i]]
        ax.plot(np.array([j["steps"][i] for i in sk]) + 0.08 * (k + 1), [j["scales"][i] for i in sk], "x",
                color=line.get_color(), ms=9, mew=2)
    _mark_save((ax, ax_d), save_at)
    log2_axis(ax, label="loss scale (log2)", axis="y")
    ax.set_title("GradScaler's scale: saved, or started again")
    ax.legend(fontsize=7)
    _draw_loss_diff(ax_d, s, runs, save_at, rank)
    fig.tight_layout()
    return fig


# -- DCP --------------------------------------------------------------------------------------------------

def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def ckpt_dcp_compare(saved, loaded, rank: int = 0) -> dict:
    """Every tensor loaded at the new world size against the full tensor gathered before the save: torch.equal."""
    want, got = _flatten(saved[0]["full"]), _flatten(loaded[rank]["full"])
    same = {k: (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got.get(k) == v) for k, v in want.items()
            if k in got}
    keys_match = set(want) == set(got)
    return {"keys_match": keys_match, "equal": same, "all_equal": keys_match and all(same.values()),
            "missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want))}


def ckpt_shard_table(saved, loaded) -> str:
    """Which rows of each parameter each rank held (the save), and the chunks the checkpoint records (the load)."""
    world = len(saved.ranks)
    lines = [f"{'parameter':>10} | {'global shape':>12} | " + " | ".join(f"rank {r} holds" for r in range(world))
             + " | chunks in the checkpoint (offsets, sizes)"]
    chunks = loaded[0]["chunks"]
    for name, info in saved[0]["shards"].items():
        held = [str(tuple(saved[r]["shards"][name]["local_shape"])) for r in range(len(saved.ranks))]
        parts = ", ".join(f"{tuple(c['offsets'])}+{tuple(c['sizes'])}" for c in chunks.get(name, []))
        lines.append(f"{name:>10} | {str(tuple(info['global_shape'])):>12} | " + " | ".join(f"{h:>12}" for h in held)
                     + f" | {parts}")
    return "\n".join(lines)


def ckpt_async_times(res) -> dict:
    """Per repeat, the slowest rank's time for each kind of save (a save is done when its last rank is)."""
    world = len(res.ranks)
    return {k: np.max([res[r]["timings_s"][k] for r in range(world)], axis=0) for k in res[0]["timings_s"]}


def ckpt_draw_async(res):
    """Per repeat, the slowest rank: blocking save, the time async_save blocks, and its time until durable."""
    world = len(res.ranks)
    t = ckpt_async_times(res)
    n = len(t["blocking"])
    x = np.arange(n)
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.bar(x - 0.27, t["blocking"], 0.27, label="dcp.save: training blocked", color="#cf6b4a")
    ax.bar(x, t["async_call"], 0.27, label="dcp.async_save: training blocked", color="#3b75af")
    ax.bar(x + 0.27, t["async_durable"], 0.27, label="dcp.async_save: until durable", color="#9cc2e5")
    mb = sum(res[r]["local_model_bytes"] for r in range(world)) / 2**20
    ax.set_xticks(x, [f"save {i + 1}" + (" (first: sets up staging)" if i == 0 else "") for i in range(n)], fontsize=8)
    ax.set_ylabel("seconds (slowest rank)")
    ax.set_title(f"Blocking vs async DCP save, {mb:.0f} MiB of weights + AdamW state x2, world {world}")
    tallest = max(max(t[k]) for k in ("blocking", "async_call", "async_durable"))
    ax.set_ylim(0, 1.5 * tallest)  # the top third holds the legend, above every bar
    ax.legend(fontsize=8, loc="upper left")
    fig.text(0.01, -0.02, f"slowest of the {world} ranks per save; {CPU_NOTE}", fontsize=7)
    return fig


# -- atomic writes ----------------------------------------------------------------------------------------

def ckpt_crash(timeout: float = 90, **params) -> str:
    """Run one ``ch08_atomic`` save that is meant to die midway, on ranks of its own (``warm=False``: the dead
    process takes nothing else with it); return the launcher's one-line account of the death."""
    from course_utils.launcher import run
    from course_utils.results import WorkerFailed

    try:
        run("workers.ch08_atomic", world_size=1, part="save", warm=False, timeout=timeout, **params)
    except WorkerFailed as exc:
        return exc.summary.splitlines()[0].split(" (killed")[0] + " (killed, crashed or exited)"
    raise RuntimeError(f"the save finished: kill_at_bytes={params.get('kill_at_bytes')} is beyond its size?")


def ckpt_scan_table(scan: dict) -> str:
    """What is on disk after a crash: each entry, each file (bytes, loads?, step), and the two loaders' picks."""
    lines = []
    for e in scan["entries"]:
        verdict = "complete, manifest matches" if e["valid"] else f"ignored, {e['reason']}"
        lines.append(f"{e['name']}/   (atomic loader: {verdict})")
        for name, f in e.get("files", {}).items():
            # the error's first sentence, whole (torch's zip reader goes on with advice about miniz)
            what = f"loads, step {f['step']}" if f["loads"] else f"does not load ({f['error'].split('. ')[0]})"
            lines.append(f"    {name:<14} {f['bytes']:>9} bytes  {what}")
        for name, size in e.get("others", {}).items():
            lines.append(f"    {name:<14} {size:>9} bytes")
    for who in ("naive_pick", "atomic_pick"):
        pick = scan[who]
        label = "naive loader (newest directory)" if who == "naive_pick" else "atomic loader (newest complete)"
        if pick is None:
            lines.append(f"{label}: nothing to resume from")
            continue
        verdict = ("resumes at step " + str(pick["steps"][0]) if pick["consistent"] else
                   f"MIXED STEPS {pick['steps']}: every file loads, the state is torn" if pick["all_load"] else
                   "fails to load (a file is missing or truncated)")
        lines.append(f"{label}: picks {pick['name']}/ -> {verdict}")
    return "\n".join(lines)
