"""Chapter 17, restart and roll back, and the goodput ledger: the notebook side of ``workers/ch17_restart.py``.

``restart_run`` trains chapter 08's run on two ranks with a DCP checkpoint every few steps, optionally with a rank
killed (SIGKILL) or hung in a collective mid-step, torchrun restarting every rank once; ``same_run`` holds it to the
uninterrupted run bit for bit. ``measured_costs`` reads what one step, one checkpoint and one recovery cost on this
machine, ``predicted`` turns them into the run's ledger (``course_utils.goodput.predict_run``) to set beside the
measured one, and the figures draw a run (its loss with the fault, the rollback and the checkpoints marked) and the
same ledger at the scale of a cluster (``goodput.restart_ledger`` / ``quorum_ledger``). A ``slow`` run has a
straggler instead (a rank that stalls after its forward for a few steps; nothing fails, nothing restarts): the
ledger's ``waiting`` share is what the other rank spent waiting for it, and ``straggler`` names it from the ranks'
arrival times alone.
"""
from __future__ import annotations

import statistics

import course_utils as cu
from course_utils import goodput as gp
from course_utils.checkpoint_interval import HOUR, daly_interval, job_mtbf
from course_utils.jobs import KEEP_ALIVE_MISSES, KEEP_ALIVE_S, LAST_CALL_S
from course_utils.scratch import scratch_dir
from course_utils.tables import Table

WORKER = "workers.ch17_restart"
WORLD = 2
STEPS, EVERY = 12, 4  # the worker's defaults: checkpoints after steps 4, 8 and 12
COLLECTIVE_TIMEOUT_S = 3.0  # a hung collective is given up after this (gloo's timeout, set for the run)
# torn: a rank killed inside the checkpoint save; slow: a straggler (workers/resilience/faults.py)
FAULTS = ("none", "kill", "hang", "torn", "slow")
SLOW_S, SLOW_STEPS = 0.3, 3  # the worker's defaults: the straggler's stall per step, and in how many steps
# the ledger's shares in drawing order, with the journal's names for the measured seconds
MEASURED = {"productive": "productive_s", "waiting": "waiting_s", "checkpoint": "checkpoint_s", "lost": "lost_s",
            "recovery": ("detect_s", "restart_s", "reload_s")}
FAULT_NAMES = {"kill": "kill", "hang": "hang", "torn": "torn save", "slow": "straggler", "node": "lost node"}
RESTARTS = {"none": 0, "slow": 0}  # a straggler is not a crash: nothing restarts; every other fault restarts once
COLORS = {"productive": "#2da44e", "checkpoint": "#0969da", "lost": "#cf222e", "recovery": "#bf8700",
          "degraded": "#8250df", "heal": "#57606a", "waiting": "#fb8f44"}


def restart_run(fault: str = "none", fault_step: int = 7, fault_rank: int = 1, ckpt_every: int = EVERY,
                steps: int = STEPS, name: str | None = None, timeout: float = 120.0, world_size: int = WORLD, **train):
    """One job of ``workers/ch17_restart.py`` on two new ranks, its checkpoints and journal in a scratch folder of
    its own. With a fault, torchrun may restart it once (not for a straggler, which fails nothing); a hang is ended
    by the collective timeout."""
    folder = scratch_dir(name or f"ch17-{fault}-{fault_step}-{ckpt_every}")
    restarts = RESTARTS.get(fault, 1)
    return _run_announced(world_size=world_size, warm=False, timeout=timeout, steps=steps, ckpt_every=ckpt_every,
                          ckpt_dir=str(folder), fault=fault, fault_step=fault_step, fault_rank=fault_rank,
                          max_restarts=restarts, collective_timeout=COLLECTIVE_TIMEOUT_S, **train)


def _run_announced(**params):
    """``cu.run`` of the worker, whose cold start announces the whole wait: the start, and after a fault the
    restart too (``announce``)."""
    from course_utils import progress

    job = cu.launch(WORKER, **params)
    if job.cold:
        progress.say(f"{WORKER}: {announce(params, job)}")
    return job.wait()


NODES, NODE_RANKS = 2, 2  # the lost-node job: two simulated nodes (torchrun agents) of two ranks each
# how long the survivors of a lost node wait for it in the rendezvous: its missed heartbeats, then the last call
ELASTIC_WAIT_S = KEEP_ALIVE_S * KEEP_ALIVE_MISSES + LAST_CALL_S


def lost_node_run(fault_step: int = 7, fault_rank: int = 2, ckpt_every: int = EVERY, steps: int = STEPS,
                  name: str = "ch17-lost-node", timeout: float = 180.0, **train):
    """The same run on two nodes of two ranks (two torchrun agents in a c10d rendezvous, ``--nnodes=1:2``); in step
    ``fault_step`` the node of ``fault_rank`` is lost (its agent and both its ranks SIGKILLed). The other node's agent
    restarts its ranks in a world of two, which reload the last checkpoint (written by four) and finish the run."""
    if isinstance(fault_rank, bool) or not isinstance(fault_rank, int) or not NODE_RANKS <= fault_rank < NODES * NODE_RANKS:
        raise ValueError(f"fault_rank={fault_rank!r}: lose a rank of node 1 ({NODE_RANKS} to "
                         f"{NODES * NODE_RANKS - 1}); node 0's agent hosts the job's rendezvous")
    folder = scratch_dir(name)
    return _run_announced(world_size=NODES * NODE_RANKS, nnodes=NODES, min_nodes=1, max_restarts=1, warm=False,
                          timeout=timeout, steps=steps, ckpt_every=ckpt_every, ckpt_dir=str(folder), fault="node",
                          fault_step=fault_step, fault_rank=fault_rank, collective_timeout=COLLECTIVE_TIMEOUT_S,
                          **train)


def resumed_by_hand(res, name: str = "ch17-by-hand", timeout: float = 120.0, **train):
    """The reference for a job that went on in a smaller world: a new job of that many ranks, launched by hand on a
    copy of the checkpoint the restart loaded (and nothing else), trained to the same last step."""
    import shutil

    from workers.resilience.state import step_dir

    record = res[0]
    step = record["resumed_from"][-1]
    folder = scratch_dir(name)
    shutil.copytree(step_dir(record["ckpt_dir"], step), step_dir(str(folder), step))
    return cu.run(WORKER, world_size=res.world_size, warm=False, timeout=timeout, steps=record["steps"][-1],
                  ckpt_every=record["ckpt_every"], ckpt_dir=str(folder), fresh=False, **train)


def same_continuation(res, reference) -> dict:
    """Whether ``res`` (restarted in a smaller world) goes on as ``reference`` (resumed there by hand) bit for bit:
    the steps after the checkpoint, their losses, and every rank's final weights."""
    import torch

    record, ref = res[0], reference[0]
    after = [i for i, s in enumerate(record["steps"]) if s > record["resumed_from"][-1]]
    steps = [record["steps"][i] for i in after] == ref["steps"]
    losses = steps and torch.equal(record["losses"][after], ref["losses"])
    weights = res.world_size == reference.world_size and all(
        torch.equal(a["weights"], b["weights"]) for a, b in zip(res.ranks, reference.ranks))
    return {"steps": steps, "losses": bool(losses), "weights": weights, "bitwise": bool(steps and losses and weights)}


def same_rows(res, reference) -> bool:
    """Whether every step of ``res`` read exactly the samples the same step of ``reference`` read (in any world)."""
    return res[0]["steps"] == reference[0]["steps"] and res[0]["rows"] == reference[0]["rows"]


def same_run(res, reference) -> dict:
    """Whether ``res`` is ``reference`` bit for bit: the steps, every loss, every rank's final weights."""
    import torch

    steps = res[0]["steps"] == reference[0]["steps"]
    losses = steps and torch.equal(res[0]["losses"], reference[0]["losses"])
    weights = all(torch.equal(a["weights"], b["weights"]) for a, b in zip(res.ranks, reference.ranks))
    return {"steps": steps, "losses": bool(losses), "weights": weights, "bitwise": bool(steps and losses and weights)}


def measured_seconds(record: dict) -> dict[str, float]:
    """The journal's wall-time split of a run (rank 0's record) in the ledger's shares, seconds."""
    out = {}
    for share, keys in MEASURED.items():
        keys = keys if isinstance(keys, tuple) else (keys,)
        out[share] = sum(record[k] for k in keys)
    return out


def measured_costs(run, every: int = EVERY, restart_s: float | None = None, detect_s: float = 0.0) -> gp.Costs:
    """What a step and a checkpoint cost in ``run`` (its median step, its mean save) and what a restart costs:
    ``restart_s`` if given, else the launcher's own estimate of starting these ranks and the worker
    (``launcher.expected_cold_s``, from this machine's recent cold starts: measured before, not on this run)."""
    from course_utils.launcher import expected_cold_s

    record = run[0]
    # every save the journal timed: the final trajectory's, and those of steps a fault made the job redo
    saves = max(1, sum(s % every == 0 for s in record["steps"] + record["lost_steps"]))
    if restart_s is None:
        restart_s, _ = expected_cold_s(WORKER, WORLD)
    return gp.Costs(step_s=statistics.median(record["step_s"]), checkpoint_s=record["checkpoint_s"] / saves,
                    detect_s=detect_s, restart_s=restart_s, reload_s=record["checkpoint_s"] / saves)


def predicted(costs: gp.Costs, record: dict, steps: int = STEPS, every: int = EVERY) -> dict[str, float]:
    """The model's seconds per share for this run: the same steps, checkpoints, faults and stalls, priced with
    ``costs``; a straggler's stalls are priced at the seconds it was told to sleep (``goodput.predict_run``)."""
    fail_at = [f["step"] - 1 for f in record["faults"]]  # the journal's steps count from 1, the model's from 0
    stalls = {e["step"] - 1: e["seconds"] for e in record.get("stalls", [])}
    out = gp.predict_run(costs, steps=steps, every=every, fail_at=fail_at, stalls=stalls)
    return {share: out[share] for share in MEASURED}


def ledger_table(record: dict, model: dict[str, float] | None = None) -> Table:
    """Seconds per share, measured (the journal) and, if given, predicted; each with its share of the wall time."""
    seen = measured_seconds(record)
    wall = sum(seen.values())
    rows = []
    for share in MEASURED:
        row = {"share": share, "measured s": round(seen[share], 3), "of wall": f"{seen[share] / wall:.0%}"}
        if model is not None:
            row["predicted s"] = round(model[share], 3)
        rows.append(row)
    total = {"share": "wall time", "measured s": round(wall, 3), "of wall": "100%"}
    if model is not None:
        total["predicted s"] = round(sum(model.values()), 3)
    return Table.of(rows + [total])


def structure_table(record: dict) -> Table:
    """What happened, in steps (the same on every machine): attempts, faults, where it resumed, what it redid."""
    faults = [f"{f['kind']} rank {f['rank']} {'saving after' if f['kind'] == 'torn' else 'in'} step {f['step']}"
              for f in record["faults"]]
    for rank in sorted({e["rank"] for e in record.get("stalls", [])}):
        stalled = sorted({e["step"] for e in record["stalls"] if e["rank"] == rank})
        faults.append(f"slow rank {rank} in step{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))}")
    faults = ", ".join(faults) or "none"
    return Table.of([{"attempts": record["attempts"], "faults": faults,
                      "resumed from checkpoint of step": ", ".join(map(str, record["resumed_from"])) or "-",
                      "steps done twice": ", ".join(map(str, record["lost_steps"])) or "-"}])


def straggler(record: dict) -> dict:
    """The straggler as the journal shows it, from the ranks' arrival times alone: the steps whose arrivals at the
    gradient all_reduce spread over ``journal.STRAGGLER_S`` (``last_to_arrive``), the rank that arrived last in
    them (``rank``: the one most often last; None when no step was slow)."""
    from collections import Counter

    slow = [(s, r, w) for s, r, w in zip(record["steps"], record["last_to_arrive"], record["wait_by_step"])
            if r is not None]
    counts = Counter(r for _, r, _ in slow)
    return {"rank": counts.most_common(1)[0][0] if counts else None, "steps": [s for s, _, _ in slow]}


def last_in(record: dict, steps: list[int]) -> int | None:
    """The rank the journal names last to arrive in every one of ``steps`` (None if they name none, or several)."""
    named = {record["last_to_arrive"][record["steps"].index(s)] for s in steps}
    return named.pop() if len(named) == 1 else None


def straggler_table(record: dict) -> Table:
    """Per step: which rank arrived last at the gradient all_reduce, and how long the first had waited there
    (milliseconds, this machine)."""
    return Table.of([{"step": s, "waited ms": round(1e3 * w, 1), "last to arrive": "-" if r is None else f"rank {r}"}
                     for s, r, w in zip(record["steps"], record["last_to_arrive"], record["wait_by_step"])])


# -- figures ------------------------------------------------------------------------------------------------

def run_figure(res, model: dict[str, float] | None = None, every: int = EVERY, title: str = ""):
    """Left: the loss of every step as the notebook saw it stream in, coloured by attempt, with the checkpoints,
    the fault and the rollback marked. Right: the wall time split, measured (and predicted)."""
    import matplotlib.pyplot as plt

    record = res[0]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 3.6), gridspec_kw={"width_ratios": [1.7, 1]})
    streamed = [m for m in res.metrics[0] if "loss" in m]
    attempts = sorted({m["attempt"] for m in streamed})
    for a in attempts:
        mine = [m for m in streamed if m["attempt"] == a]
        ax.plot([m["step"] for m in mine], [m["loss"] for m in mine], "o-", ms=4, lw=1.2,
                color=f"C{a}", label=f"attempt {a}" + (" (restarted)" if a else ""), zorder=3 - a)
    lost = set(record["lost_steps"])
    for m in streamed:
        if m["attempt"] == 0 and m["step"] in lost:
            ax.plot(m["step"], m["loss"], "x", color=COLORS["lost"], ms=9, mew=2, zorder=4)
    for s in range(every, max(record["steps"], default=0) + 1, every):
        ax.axvline(s + 0.5, color=COLORS["checkpoint"], lw=0.8, ls=":")
    for f in record["faults"]:
        ax.axvline(f["step"], color=COLORS["lost"], lw=1.5)
        ax.annotate(f"{f['kind']}: rank {f['rank']}", (f["step"], 1.0), xycoords=("data", "axes fraction"),
                    xytext=(4, -12), textcoords="offset points", color=COLORS["lost"], fontsize=8.5)
    stalled = sorted({(e["step"], e["rank"]) for e in record.get("stalls", [])})
    for i, (step, rank) in enumerate(stalled):
        ax.axvspan(step - 0.4, step + 0.4, color=COLORS["waiting"], alpha=0.2, lw=0)
        if i == 0:
            ax.annotate(f"slow: rank {rank}", (step - 0.4, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -12),
                        textcoords="offset points", color=COLORS["waiting"], fontsize=8.5)
    for back in record["resumed_from"]:
        ax.annotate("", xy=(back + 0.5, 0.08), xycoords=("data", "axes fraction"),
                    xytext=(record["faults"][0]["step"] if record["faults"] else back, 0.08),
                    arrowprops={"arrowstyle": "->", "color": COLORS["lost"]})
        ax.text(back + 0.6, 0.11, "rolled back to the checkpoint", transform=ax.get_xaxis_transform(), fontsize=8,
                color=COLORS["lost"])
    ax.set_xlabel("step (dotted: a checkpoint written after that step; x: done, then lost)")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title or "the run as it streamed in", fontsize=10)

    seen = measured_seconds(record)
    bars = {"measured": seen} | ({"predicted": model} if model is not None else {})
    for i, (label, split) in enumerate(bars.items()):
        left = 0.0
        for share in MEASURED:
            bx.barh(i, split[share], left=left, color=COLORS[share], label=share if i == 0 else None)
            left += split[share]
        bx.text(left, i, f" {left:.1f} s", va="center", fontsize=8.5)
    bx.set_yticks(range(len(bars)), list(bars))
    bx.invert_yaxis()
    bx.set_xlabel("wall seconds (CPU, this machine)")
    bx.set_xlim(0, max(sum(v.values()) for v in bars.values()) * 1.3)
    bx.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(MEASURED), frameon=False,
              handlelength=1.2, columnspacing=0.8)
    bx.set_title("where the wall time went", fontsize=10)
    fig.tight_layout()
    return fig


def cluster_ledgers(n_gpus: int = 16_384, checkpoint_s: float = 20.0, recovery_s: float = 180.0,
                    heal_s: float = 30.0, step_s: float = 6.0, groups: int = 8, interval_s: float | None = None,
                    gpu_mtbf_s: float = gp.LLAMA3_GPU_MTBF_S) -> dict[str, dict[str, float]]:
    """Both recoveries' shares at one cluster size (Llama 3's failure rate by default), at ``interval_s`` (Daly's
    optimum for restarts when None; the quorum checkpoints at the same interval)."""
    mtbf = job_mtbf(gpu_mtbf_s, n_gpus)
    interval = interval_s or daly_interval(checkpoint_s, mtbf)
    costs = gp.Costs(step_s=step_s, checkpoint_s=checkpoint_s, restart_s=recovery_s, heal_s=heal_s,
                     reconfigure_s=min(step_s, 5.0))
    return {"restart": gp.restart_ledger(costs, interval, mtbf),
            "quorum": gp.quorum_ledger(costs, interval, mtbf, groups)}


def cluster_figure(n_gpus: int = 16_384, checkpoint_s: float = 20.0, recovery_s: float = 180.0,
                   heal_s: float = 30.0, groups: int = 8, interval_min: float | None = None):
    """Left: goodput against the checkpoint interval for both recoveries, Daly's optimum marked. Right: the shares
    at the chosen interval (Daly's when None). Modelled, with Llama 3's failure rate."""
    import matplotlib.pyplot as plt
    import numpy as np

    mtbf = job_mtbf(gp.LLAMA3_GPU_MTBF_S, n_gpus)
    best = daly_interval(checkpoint_s, mtbf)
    chosen = interval_min * 60 if interval_min else best
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 3.6), gridspec_kw={"width_ratios": [1.3, 1]})
    grid = np.geomspace(max(best / 30, 10.0), best * 30, 120)
    for kind, color in (("restart", "C0"), ("quorum", "C1")):
        good = [cluster_ledgers(n_gpus, checkpoint_s, recovery_s, heal_s, groups=groups,
                                interval_s=t)[kind]["productive"] for t in grid]
        ax.plot(grid / 60, good, color=color, label=kind)
    ax.axvline(best / 60, color="black", ls="--", lw=1)
    ax.text(best / 60, 0.02, f" Daly: {best / 60:.0f} min", transform=ax.get_xaxis_transform(), fontsize=8)
    ax.axvline(chosen / 60, color="grey", lw=3, alpha=0.3)
    ax.axhline(0.9, color=COLORS["productive"], lw=0.8, ls=":")
    ax.text(grid[0] / 60, 0.905, "Llama 3: over 90%", fontsize=8, color=COLORS["productive"])
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("minutes of training between checkpoints")
    ax.set_ylabel("goodput (productive share)")
    ax.legend(fontsize=8, loc="lower center")
    ax.set_title(f"{n_gpus:,} GPUs, a failure every {mtbf / HOUR * 60:.0f} min (modelled)", fontsize=10)
    ledgers = cluster_ledgers(n_gpus, checkpoint_s, recovery_s, heal_s, groups=groups, interval_s=chosen)
    for i, (kind, shares) in enumerate(ledgers.items()):
        left = 0.0
        for share in gp.SHARES:
            bx.barh(i, shares[share], left=left, color=COLORS[share], label=share if i == 0 else None)
            left += shares[share]
        bx.text(0.01, i, f"{shares['productive']:.1%}", va="center", fontsize=9, color="white")
    bx.set_yticks(range(len(ledgers)), list(ledgers))
    bx.invert_yaxis()
    bx.set_xlim(0, 1)
    bx.set_xlabel("share of wall time")
    bx.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=6, frameon=False)
    bx.set_title(f"at {chosen / 60:.0f} min between checkpoints", fontsize=10)
    fig.tight_layout()
    return fig


# -- widgets ------------------------------------------------------------------------------------------------

def restart_widget(fault: str = "kill", fault_step: int = 7, ckpt_every: int = EVERY):
    """Fault, its step and the checkpoint interval -> a restart job on two new ranks (a job torchrun may restart
    always starts ranks of its own: a cold start each time, announced) -> the run's figure with the model's ledger."""
    import ipywidgets as W

    from course_utils.widgets import LiveRun, slider

    controls = {"fault": W.Dropdown(options=list(FAULTS), value=fault, description="fault"),
                "fault_step": slider("fault in step", fault_step, 1, STEPS),
                "ckpt_every": slider("checkpoint every", ckpt_every, 1, STEPS)}
    fixed = {"world_size": WORLD, "steps": STEPS, "fault_rank": 1, "collective_timeout": COLLECTIVE_TIMEOUT_S}
    folder = str(scratch_dir("ch17-widget"))  # emptied once here; each job's first attempt empties it again

    def derive(settings: dict) -> dict:
        return {"ckpt_dir": folder, "max_restarts": RESTARTS.get(settings["fault"], 1)}

    def draw(res, params):
        costs = measured_costs(res, params["ckpt_every"],
                               detect_s=COLLECTIVE_TIMEOUT_S if params["fault"] == "hang" else 0.0)
        model = predicted(costs, res[0], STEPS, params["ckpt_every"])
        return run_figure(res, model, every=params["ckpt_every"],
                          title=f"fault: {params['fault']}" + (f" from step {params['fault_step']}"
                                                               if params["fault"] == "slow" else
                                                               f" in step {params['fault_step']}"
                                                               if params["fault"] != "none" else "")
                          + f", a checkpoint every {params['ckpt_every']} steps")

    return LiveRun(WORKER, controls, draw, params=fixed, derive=derive, timeout=120, announce=announce,
                   progress_total=lambda p: STEPS + (0 if p["fault"] in RESTARTS else p["fault_step"]))


def announce(params: dict, job) -> str:
    """The wait of a restart run, in words: the cold start the launcher expects (its record of this worker's cold
    starts, never of restarted runs), and after a fault the collective timeout (a hang) and torchrun starting the
    ranks again, priced as another cold start (a restart keeps torchrun's agent, so it is usually a little less)."""
    if params.get("fault", "none") in RESTARTS or not job.expected_s:  # no restart: the cold start is the wait
        return job.start_note
    start = job.expected_s
    wait = {"hang": COLLECTIVE_TIMEOUT_S, "node": ELASTIC_WAIT_S}.get(params["fault"], 0.0)
    total = 2 * start + wait
    timeout = {"hang": f", the {wait:g} s collective timeout",
               "node": f", {wait:g} s for the lost node to come back"}.get(params["fault"], "")
    return (f"about {total:.0f} s in all: starting {params['world_size']} ranks and running the job (a cold start, "
            f"{start:.0f} s){timeout}, and torchrun starting them again after the {FAULT_NAMES[params['fault']]} (another "
            f"{start:.0f} s or so); longer while the machine is busy")


def cluster_widget():
    """Cluster size, checkpoint stall, recovery time, replica groups and interval -> both ledgers (pure model: it
    redraws at once)."""
    import base64

    import ipywidgets as W

    from course_utils.widgets import controls_row, figure_png

    style = {"description_width": "initial"}
    controls = {
        "n_gpus": W.SelectionSlider(options=[1024, 2048, 4096, 8192, 16_384, 32_768, 65_536, 131_072], value=16_384,
                                    description="GPUs", continuous_update=False, style=style),
        "checkpoint_s": W.FloatLogSlider(value=20.0, base=10, min=0, max=3, step=0.1, description="checkpoint stall s",
                                         continuous_update=False, style=style),
        "recovery_s": W.FloatLogSlider(value=180.0, base=10, min=1, max=4, step=0.1, description="recovery s",
                                       continuous_update=False, style=style),
        "groups": W.SelectionSlider(options=[2, 4, 8, 16, 32, 64, 128], value=8, description="replica groups",
                                    continuous_update=False, style=style),
        "interval_min": W.Dropdown(options=[("Daly's optimum", None), ("5 min", 5.0), ("15 min", 15.0),
                                            ("1 hour", 60.0), ("3 hours", 180.0), ("12 hours", 720.0)], value=None,
                                   description="between checkpoints", style=style),
    }
    out = W.Output()

    def update(_change=None):
        values = {k: c.value for k, c in controls.items()}
        fig = cluster_figure(**values)
        png = base64.b64encode(figure_png(fig)).decode("ascii")
        out.outputs = ({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": png, "text/plain": "<figure>"}},)

    for c in controls.values():
        c.observe(update, names="value")
    update()
    return W.VBox([controls_row(controls.values()), out])


__all__ = ["COLLECTIVE_TIMEOUT_S", "ELASTIC_WAIT_S", "EVERY", "FAULTS", "NODES", "NODE_RANKS", "SLOW_S",
           "SLOW_STEPS", "STEPS", "WORKER", "announce", "cluster_figure", "cluster_ledgers", "cluster_widget",
           "last_in", "ledger_table", "lost_node_run", "measured_costs", "measured_seconds", "predicted",
           "restart_run", "restart_widget", "resumed_by_hand", "run_figure", "same_continuation", "same_rows",
           "same_run", "straggler", "straggler_table", "structure_table"]
