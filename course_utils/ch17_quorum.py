"""Chapter 17, quorum and heal, and DiLoCo: the notebook side of ``workers/ch17_quorum.py``.

``quorum_run()`` starts a torchft lighthouse in this process (on a port the OS picks), launches one job per replica
group, lets one replica die in the middle of a step (SIGKILL), launches its replacement once the job has ended, and
returns what happened: who took part in each committed step, the losses, the heal, the timings; and the same run
trained by one process on only the batches that were there (``workers/resilience/replicas.py: reference``), with the
largest difference. ``diloco_vs_ddp()`` trains two replica groups with torchft's DDP and with DiLoCo and returns the
bytes each replica sent and the losses. Both stop every job and the lighthouse before they return, whatever happened.

torchft is imported only here, inside ``lighthouse()``: a learner without it gets one sentence (an
``InvalidParameter``) before anything starts.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field

import torch

from course_utils import progress
from course_utils.launcher import launch
from course_utils.results import InvalidParameter, JobTimeout, WorkerFailed
from course_utils.scratch import scratch_dir
from course_utils.validate import check_params
from workers.resilience.ft import torchft_missing
from workers.resilience.journal import read_events
from workers.resilience.replicas import ReplicaConfig, reference

WORKER = "workers.ch17_quorum"
# The lighthouse's clocks, chosen for a laptop run: a replica silent for 1 s is dead (torchft's default is 5 s); a
# quorum waits up to 3 s for a replica that is alive but has not asked yet (torchft's default is 60 s).
HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS = 1000, 3000
QUIET = {"RUST_LOG": "warn"}  # the ranks' torchft logging: each Manager also logs every quorum at INFO
TRAIN_KEYS = ("batch", "n_samples", "dropout", "lr", "warmup_steps", "timeout_s", "quorum_timeout_s", "wait_s")


@contextlib.contextmanager
def lighthouse(min_replicas: int, *, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
               join_timeout_ms: int = JOIN_TIMEOUT_MS):
    """A torchft lighthouse in this process for the ``with`` block; yields its address (``http://host:port``).

    Port 0: the OS picks a free one, so two runs never collide. It is torchft's Rust server on threads of this
    process: ``shutdown()`` on the way out stops it, and it cannot outlive the kernel."""
    missing = torchft_missing()
    if missing:
        raise InvalidParameter(missing)
    # torchft's Rust side logs every quorum decision at INFO to stderr (a dozen lines a step): only warnings here.
    # Read once, when its logger starts: a kernel that started a lighthouse with another level keeps that one.
    os.environ.setdefault("RUST_LOG", QUIET["RUST_LOG"])
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    try:
        yield server.address()
    finally:
        server.shutdown()


def port_of(address: str) -> int:
    return int(re.search(r":(\d+)/?$", address).group(1))


@dataclass
class QuorumRun:
    """What ``quorum_run`` measured. ``participation[k]``: the replicas whose batches committed step k averaged."""

    cfg: ReplicaConfig
    fault_replica: int
    fault_step: int
    rejoin_step: int
    min_replicas: int
    participation: dict[int, list[int]]
    losses: torch.Tensor  # [steps] float64: the mean of the present replicas' losses, per committed step
    weights: dict[str, torch.Tensor]  # "replica.incarnation" -> [P] float64, for every process alive at the end
    reference_weights: torch.Tensor  # [P] float64
    reference_losses: torch.Tensor  # [steps] float64
    heals: list[dict]
    retried: list[dict]  # attempts that did not commit (the step the dead replica broke), per survivor
    timings: dict
    lighthouse_port: int
    job_ports: list[int] = field(default_factory=list)

    @property
    def quorum_sizes(self) -> list[int]:
        return [len(self.participation[k]) for k in sorted(self.participation)]

    @property
    def weight_error(self) -> float:
        """Largest |w_run - w_reference| over every surviving process (NaN if any weight is not finite)."""
        errors = [(w - self.reference_weights).abs().max().item() for w in self.weights.values()]
        return float("nan") if any(e != e for e in errors) else max(errors)

    @property
    def loss_error(self) -> float:
        return (self.losses - self.reference_losses).abs().max().item()

    @property
    def replicas_identical(self) -> bool:
        """Every process alive at the end, the healed replacement included, holds the same weights, bit for bit."""
        first = next(iter(self.weights.values()))
        return all(torch.equal(w, first) for w in self.weights.values())


def _config(replicas, steps, seed, train) -> ReplicaConfig:
    fields = {k: train[k] for k in ("batch", "n_samples", "dropout", "lr", "warmup_steps") if k in train}
    return ReplicaConfig(replicas=replicas, steps=steps, seed=seed, **fields)


def _check(train: dict, common: dict, replicas: int) -> None:
    unknown = sorted(set(train) - set(TRAIN_KEYS))
    if unknown:
        raise InvalidParameter(f"{', '.join(unknown)}: not a setting of this run; it takes {', '.join(TRAIN_KEYS)}")
    for r in range(replicas):  # every job's parameters refused here, before the lighthouse or any rank starts
        check_params(WORKER, 1, {**common, "replica": r, "lighthouse": "(checked)", "run_dir": "(checked)"})


def _stop(jobs) -> None:
    for job in jobs:
        if not job.done():
            job.cancel()


def quorum_run(replicas: int = 3, steps: int = 12, fault_replica: int = 2, fault_step: int = 5,
               rejoin_step: int = 9, min_replicas: int = 0, seed: int = 0, timeout: float = 180.0,
               **train) -> QuorumRun:
    """Train ``replicas`` replica groups (one job each) for ``steps`` steps; replica ``fault_replica`` dies (SIGKILL)
    after its forward of step ``fault_step``; its replacement is launched as soon as its job has ended, and the
    survivors hold before step ``rejoin_step`` until it is up. ``min_replicas`` 0 means a majority of ``replicas``.
    ``timeout`` bounds each job; ``train``: the rest of the worker's settings (batch, lr, ...)."""
    min_replicas = min_replicas or replicas // 2 + 1
    run_id = f"quorum-{uuid.uuid4().hex[:8]}"
    common = dict(mode="ddp", replicas=replicas, min_replicas=min_replicas, steps=steps, seed=seed, fault="kill",
                  fault_replica=fault_replica, fault_step=fault_step, rejoin_step=rejoin_step, run=run_id, **train)
    _check(train, common, replicas)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidParameter(f"timeout={timeout!r} must be a positive number of seconds")
    cfg = _config(replicas, steps, seed, train)
    run_dir = scratch_dir(run_id)
    jobs, results, t_replacement = [], {}, None
    try:
        with lighthouse(min_replicas) as address:
            common.update(lighthouse=address, run_dir=str(run_dir))
            progress.say(f"lighthouse on port {port_of(address)}; starting {replicas} replica jobs of one rank each")
            jobs = [launch(WORKER, 1, warm=False, timeout=timeout, env=QUIET, replica=r, incarnation=0, **common)
                    for r in range(replicas)]
            try:
                jobs[fault_replica].wait()
                raise RuntimeError(f"replica {fault_replica} finished although it was to die in step {fault_step}")
            except WorkerFailed as exc:
                # the SIGKILL ends its job (torchrun's agent with it); any other failure is the run's failure
                struck = any(e["event"] == "fault" for e in read_events(str(run_dir), run_id))
                if isinstance(exc, JobTimeout) or not struck:
                    raise
            t_replacement = time.time()
            progress.say(f"replica {fault_replica} was killed in step {fault_step}; launching its replacement, which "
                         f"heals from a live peer and rejoins in step {rejoin_step}")
            replacement = launch(WORKER, 1, warm=False, timeout=timeout, env=QUIET, replica=fault_replica,
                                 incarnation=1, **common)
            jobs.append(replacement)
            for i, job in enumerate(jobs):
                if i != fault_replica:
                    try:
                        res = job.wait()
                    except WorkerFailed as exc:
                        if job is not replacement:  # a survivor that gave up on the replacement: say what it did
                            exc.add_note(_replacement_state(replacement, fault_replica))
                        raise
                    results[f"{res[0]['replica']}.{res[0]['incarnation']}"] = res[0]
            address_port = port_of(address)
    except BaseException:
        _stop(jobs)
        raise
    finally:
        _stop(jobs)
        events = read_events(str(run_dir), run_id)
        shutil.rmtree(run_dir, ignore_errors=True)
    return _summarise(cfg, events, results, fault_replica, fault_step, rejoin_step, min_replicas, t_replacement,
                      address_port)


def _replacement_state(job, replica: int) -> str:
    """What the replacement's job had come to when a survivor failed: its own failure (the likelier cause), or its
    state (a replacement still starting after the survivors' wait: a machine too loaded to start it in time)."""
    if job.error is not None:
        return f"replica {replica}'s replacement (incarnation 1) had failed: {str(job.error).splitlines()[0]}"
    return f"replica {replica}'s replacement (incarnation 1) was {job.status} when the survivor gave up on it"


def _summarise(cfg, events, results, fault_replica, fault_step, rejoin_step, min_replicas, t_replacement,
               lighthouse_port) -> QuorumRun:
    steps = [e for e in events if e["event"] == "step"]
    participation: dict[int, list[int]] = {}
    losses: dict[int, list[float]] = {}
    for e in steps:
        if e["committed"] and e["participating"]:
            participation.setdefault(e["step"], []).append(e["rank"])  # the journal's rank is the replica
            losses.setdefault(e["step"], []).append((e["rank"], e["loss"]))
    for k, present in participation.items():
        sizes = {e["participants"] for e in steps if e["step"] == k and e["committed"]}
        if sizes != {len(present)}:
            raise RuntimeError(f"step {k}: torchft counted {sizes} participants but {sorted(present)} committed it")
        participation[k] = sorted(present)
    order = sorted(participation)
    if order != list(range(1, cfg.steps + 1)):
        raise RuntimeError(f"committed steps {order} are not 1 to {cfg.steps}")
    run_losses = torch.tensor([sum(v for _, v in sorted(losses[k])) / len(losses[k]) for k in order],
                              dtype=torch.float64)
    ref_weights, ref_losses = reference(cfg, participation)
    fault_t = min(e["t"] for e in events if e["event"] == "fault")
    survivors = [e for e in steps if e["rank"] != fault_replica]
    shrunk = min((e for e in survivors if e["committed"] and e["step"] == fault_step), key=lambda e: e["t0"])
    heals = [r for key, res in results.items() for r in res["heals"]]
    replacement = results.get(f"{fault_replica}.1", {})
    first_commit = min((r["t1"] for r in replacement.get("records", []) if r["committed"]), default=float("nan"))
    timings = {
        # from the SIGKILL to the survivors' quorum without the dead replica (its broken step's failure, the
        # lighthouse noticing the silence, the new quorum and process group)
        "shrink_s": shrunk["t0"] + shrunk["quorum_s"] - fault_t,
        "heal_s": heals[0]["quorum_s"] if heals else float("nan"),  # the replacement's first quorum, heal included
        "heal_load_s": heals[0].get("load_s", float("nan")) if heals else float("nan"),
        "heal_bytes": heals[0].get("bytes", 0) if heals else 0,
        # from launching the replacement to its first committed step: torchrun, imports, the wait for the survivors to
        # reach the rejoin step (none unless they are slower than its start), Manager, quorum, heal
        "replacement_s": first_commit - t_replacement if t_replacement else float("nan"),
        "held_s": max((r["held_s"] for res in results.values() for r in res["records"]), default=0.0),
        "step_s": sorted(r["step_s"] for res in results.values() for r in res["records"] if r["committed"]),
    }
    retried = [{"replica": e["rank"], "step": e["step"], "participants": e["participants"]}
               for e in survivors if not e["committed"]]
    ports = sorted({e[k] for e in events if e["event"] == "up" for k in ("store_port", "manager_port")})
    return QuorumRun(cfg=cfg, fault_replica=fault_replica, fault_step=fault_step, rejoin_step=rejoin_step,
                     min_replicas=min_replicas, participation=participation, losses=run_losses,
                     weights={k: r["weights"] for k, r in results.items()}, reference_weights=ref_weights,
                     reference_losses=ref_losses, heals=heals, retried=retried, timings=timings,
                     lighthouse_port=lighthouse_port, job_ports=ports)


@dataclass
class DilocoComparison:
    sync_every: int
    steps: int
    parameters: int
    bytes: dict[str, int]  # per replica, handed to the Manager's allreduce over the run
    calls: dict[str, int]
    eval_loss: dict[str, float]  # the final model on the whole dataset, no dropout
    initial_eval_loss: float
    losses: dict[str, torch.Tensor]  # [steps]: the mean over replicas of each step's training loss
    weights: dict[str, list[torch.Tensor]]  # per mode, every replica's final weights
    lighthouse_ports: list[int]
    job_ports: list[int]  # every replica process's TCP store and Manager server ports


def diloco_vs_ddp(sync_every: int = 4, steps: int = 24, replicas: int = 2, seed: int = 0, timeout: float = 120.0,
                  outer_lr: float = 0.7, **train) -> DilocoComparison:
    """The same replicas and batches trained twice: torchft's DDP (an allreduce of the gradients every step) and
    torchft's DiLoCo (an allreduce of the pseudo-gradients every ``sync_every`` steps). Every replica is needed in
    every step here (``min_replicas = replicas``): no faults."""
    from workers.resilience.replicas import eval_loss, make_data, make_replica_model

    cfg = _config(replicas, steps, seed, train)
    out = {"bytes": {}, "calls": {}, "eval_loss": {}, "losses": {}, "weights": {}}
    ports, job_ports = [], []
    plans = {mode: dict(mode=mode, replicas=replicas, min_replicas=replicas, steps=steps, seed=seed,
                        sync_every=sync_every, outer_lr=outer_lr, run=f"{mode}-{uuid.uuid4().hex[:8]}", **train)
             for mode in ("ddp", "diloco")}
    for common in plans.values():  # both runs' parameters refused before the first starts
        _check(train, common, replicas)
    for mode, common in plans.items():
        progress.say(f"{mode}: a lighthouse and {replicas} replica jobs, {steps} steps")
        run_id = common["run"]
        run_dir = scratch_dir(run_id)
        jobs = []
        try:
            with lighthouse(replicas) as address:
                ports.append(port_of(address))
                common.update(lighthouse=address, run_dir=str(run_dir))
                jobs = [launch(WORKER, 1, warm=False, timeout=timeout, env=QUIET, replica=r, **common) for r in range(replicas)]
                ranks = [job.wait()[0] for job in jobs]
        except BaseException:
            _stop(jobs)
            raise
        finally:
            _stop(jobs)
            shutil.rmtree(run_dir, ignore_errors=True)
        out["bytes"][mode] = ranks[0]["allreduce_bytes"]
        out["calls"][mode] = ranks[0]["allreduce_calls"]
        out["eval_loss"][mode] = ranks[0]["eval_loss"]
        out["losses"][mode] = torch.tensor([sum(r["records"][i]["loss"] for r in ranks) / replicas
                                            for i in range(steps)], dtype=torch.float64)
        out["weights"][mode] = [r["weights"] for r in ranks]
        job_ports += [r[k] for r in ranks for k in ("store_port", "manager_port")]
        parameters = ranks[0]["parameters"]
    return DilocoComparison(sync_every=sync_every, steps=steps, parameters=parameters, lighthouse_ports=ports,
                            job_ports=job_ports,
                            initial_eval_loss=eval_loss(make_replica_model(cfg), make_data(cfg)), **out)


def quorum_figure(run: QuorumRun):
    """Left: who took part in each committed step (a row per replica), the kill and the heal marked. Right: the loss
    of the run and of the one-process reference on the same batches, and their largest difference."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 3.4))
    steps = sorted(run.participation)
    for r in range(run.cfg.replicas):
        present = [k for k in steps if r in run.participation[k]]
        ax.scatter(present, [r] * len(present), marker="s", s=70, color=f"C{r}")
        missing = [k for k in steps if r not in run.participation[k]]
        ax.scatter(missing, [r] * len(missing), marker="s", s=70, facecolor="none", edgecolor="#bbbbbb")
    ax.axvline(run.fault_step - 0.5, color="#cf222e", lw=1.5)
    ax.text(run.fault_step - 0.45, run.cfg.replicas - 0.45, f"replica {run.fault_replica} killed",
            color="#cf222e", fontsize=8.5)
    ax.axvline(run.rejoin_step - 0.5, color="#2da44e", lw=1.5)
    ax.text(run.rejoin_step - 0.45, -0.75, "healed, rejoins", color="#2da44e", fontsize=8.5)
    ax.set_yticks(range(run.cfg.replicas), [f"replica {r}" for r in range(run.cfg.replicas)])
    ax.set_ylim(-0.9, run.cfg.replicas - 0.2)
    ax.set_xticks(steps)
    ax.set_xlabel("committed step (filled: its batch was in the average)")
    ax.set_title(f"quorum sizes {run.quorum_sizes}", fontsize=9.5)
    bx.plot(steps, run.losses.tolist(), "o-", ms=4, label="the replicas (mean of those present)")
    bx.plot(steps, run.reference_losses.tolist(), "x", ms=7, color="black",
            label="one process, the present replicas' batches")
    bx.axvspan(run.fault_step - 0.5, run.rejoin_step - 0.5, color="#cf222e", alpha=0.08)
    bx.set_xlabel("step")
    bx.set_ylabel("training loss")
    bx.legend(fontsize=8)
    bx.set_title(f"largest weight difference from one process: {run.weight_error:.1e} (float64)", fontsize=9.5)
    fig.tight_layout()
    return fig
