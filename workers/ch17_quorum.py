"""Quorum and heal, and DiLoCo, with torchft: one replica group per job, coordinated by a lighthouse.

Each replica group is a torchrun job of one rank; the lighthouse (torchft's, one per run) decides before every step
which replicas are in it. From a terminal, a lighthouse and three replicas, replica 2 killed in step 5:

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 3000 --bind [::]:0      # prints its address
    for r in 0 1 2; do torchrun --standalone --nproc-per-node 1 workers/ch17_quorum.py --replica $r \\
        --lighthouse http://HOST:PORT --run-dir /tmp/q --fault kill --fault-step 5 & done
    torchrun --standalone --nproc-per-node 1 workers/ch17_quorum.py --replica 2 --incarnation 1 ...   # the replacement

From a notebook, ``course_utils.ch17_quorum.quorum_run()`` does all of it (a lighthouse on a port the OS picks, one
job per replica, the replacement, the reference) and stops everything afterwards. ``mode="diloco"`` trains the same
replicas with torchft's DiLoCo (``course_utils.ch17_quorum.diloco_vs_ddp``). The loop itself is
``workers/resilience/quorum.py``; the data and the single-process reference are ``workers/resilience/replicas.py``.

``min_replicas``: the fewest replicas a step may commit with. 1 lets a replica that is alone train a history the others
never see (torchft's probe here: the first replica to arrive trained all 30 steps before the second had started,
which then trained 30 of its own from the initial weights: two models). A majority of the planned replicas (2 of 3)
keeps a lone replica waiting, and lets the run go on when a minority dies.
"""
from __future__ import annotations

from workers.resilience import quorum
from workers.resilience.ft import torchft_missing
from workers.resilience.replicas import ReplicaConfig
from workers.runtime import at_least, entrypoint, one_of, refusal

FAULTS = ("none", "kill")


def check_params(world_size, mode, replicas, replica, incarnation, lighthouse, min_replicas, run_dir, steps, batch,
                 n_samples, fault, fault_replica, fault_step, rejoin_step, sync_every, **_):
    def within(name, value, low, high):
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        return None if ok else f"{name}={value!r} must be a whole number from {low} to {high}"

    return torchft_missing() or refusal(
        None if world_size == 1 else f"world_size={world_size}: each replica group is one rank here, so launch one "
        "job of world_size=1 per replica (course_utils.ch17_quorum.quorum_run does)",
        one_of("mode", mode, quorum.MODES), one_of("fault", fault, FAULTS),
        at_least("replicas", replicas), at_least("steps", steps), at_least("batch", batch),
        None if not isinstance(replicas, int) else within("replica", replica, 0, replicas - 1),
        None if not isinstance(replicas, int) else within("min_replicas", min_replicas, 1, replicas),
        within("incarnation", incarnation, 0, 1),
        None if lighthouse else "lighthouse is empty: give the address of a running lighthouse "
        "(course_utils.ch17_quorum.lighthouse() starts one)",
        None if run_dir else "run_dir is empty: give the folder the replicas' journal goes to",
        None if not all(isinstance(v, int) for v in (replicas, batch, n_samples)) or replicas * batch <= n_samples
        else f"batch={batch} x replicas={replicas} rows a step exceed n_samples={n_samples}: lower batch",
        None if mode != "diloco" or fault == "none" else "fault='kill' is for mode='ddp' here: use fault='none'",
        None if mode != "diloco" or (isinstance(sync_every, int) and sync_every >= 1 and isinstance(steps, int)
                                     and steps % sync_every == 0)
        else f"steps={steps} is not a multiple of sync_every={sync_every}: the run must end on a synchronisation",
        None if fault == "none" or not isinstance(replicas, int) else within("fault_replica", fault_replica, 0,
                                                                              replicas - 1),
        None if fault == "none" or not isinstance(steps, int) else within("fault_step", fault_step, 1, steps),
        None if fault == "none" or rejoin_step == 0 or not isinstance(steps, int) or not isinstance(fault_step, int)
        else within("rejoin_step", rejoin_step, fault_step + 1, steps))


def main(ctx, mode: str = "ddp", replicas: int = 3, replica: int = 0, incarnation: int = 0, lighthouse: str = "",
         min_replicas: int = 2, run_dir: str = "build/ch17/quorum", run: str = "quorum", steps: int = 12,
         batch: int = 4, n_samples: int = 64, dropout: float = 0.2, lr: float = 3e-3, warmup_steps: int = 3,
         seed: int = 0, fault: str = "none", fault_replica: int = 2, fault_step: int = 5, rejoin_step: int = 0,
         sync_every: int = 4, outer_lr: float = 0.7, timeout_s: float = 10.0, quorum_timeout_s: float = 30.0,
         wait_s: float = 60.0):
    """Train replica ``replica`` of ``replicas`` for ``steps`` committed steps under torchft.

    ``incarnation`` 1 is the replacement of a replica that died (it heals from a live peer); ``rejoin_step``: the
    survivors hold before that step until the replacement is up (0: they never wait); ``run``: the run's name in
    the journal, the same for every replica process of one run."""
    cfg = ReplicaConfig(replicas=replicas, steps=steps, batch=batch, n_samples=n_samples, dropout=dropout, lr=lr,
                        warmup_steps=warmup_steps, seed=seed)
    return quorum.run(ctx, cfg, mode=mode, replica=replica, incarnation=incarnation, lighthouse=lighthouse,
                      min_replicas=min_replicas, run_dir=run_dir, run_id=run, fault=fault,
                      fault_replica=fault_replica, fault_step=fault_step, rejoin_step=rejoin_step,
                      sync_every=sync_every, outer_lr=outer_lr, timeout_s=timeout_s,
                      quorum_timeout_s=quorum_timeout_s, wait_s=wait_s)


if __name__ == "__main__":
    entrypoint(main)
