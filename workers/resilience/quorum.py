"""One replica group's training loop under torchft: quorum and heal (DDP) or DiLoCo, written down as it happens.

Each replica group is a job of its own (one rank here), so one dying takes nobody else with it. The loop of ``ddp``:

    manager.start_quorum()     # the lighthouse says who is in this step; a replica behind heals from a live peer
    loss = forward_loss(...)   # this replica's batch of the step (replicas.replica_batch)
    loss.backward()
    average_gradients(...)     # one allreduce over the quorum: SUM / num_participants()
    if manager.should_commit(): optimizer.step()   # every replica of the quorum commits, or none does

A replica that dies in the middle of a step (``fault="kill"``, SIGKILL after its forward, ``workers/resilience/
faults.py``) breaks that step's allreduce: the survivors' ``should_commit`` says no, nobody steps, and the step is
tried again once the lighthouse has a quorum without the dead replica: the step is not lost, it is done on fewer
batches. A replacement (``incarnation`` 1 of the same replica) starts at step 0, and its first quorum heals it to the
survivors' step: weights, AdamW's moments and torchft's step arrive over HTTP from a peer.

``DiLoCo`` (Douillard et al. 2023, torchft's ``local_sgd.DiLoCo``): every replica takes ``sync_every`` AdamW steps on
its own batches, then the replicas average their *pseudo-gradients* (weights at the last sync minus weights now) and
an outer Nesterov SGD applies the average: one allreduce of the weights' size every ``sync_every`` steps instead of
one of the gradients' size every step.

Every event goes to the run's journal (``workers/resilience/journal.py``: one file per replica, the replica's
incarnation as its attempt) before the next one happens, so a replica killed mid-run leaves its committed steps on
record. ``forward_loss`` is called through ``replicas`` on purpose: the faults replace it there.
"""
from __future__ import annotations

import os
import time

import torch

from workers.faults import injected
from workers.resilience import faults, replicas
from workers.resilience.ft import AllreduceMeter, Rendezvous, make_manager, tensor_bytes
from workers.resilience.journal import Journal
from workers.resilience.replicas import (ReplicaConfig, eval_loss, flat_weights, make_data, make_inner_optimizer,
                                         make_replica_model, replica_batch, set_lr)

MODES = ("ddp", "diloco")


def run(ctx, cfg: ReplicaConfig, *, mode: str, replica: int, incarnation: int, lighthouse: str, min_replicas: int,
        run_dir: str, run_id: str, fault: str, fault_replica: int, fault_step: int, rejoin_step: int,
        sync_every: int, outer_lr: float, timeout_s: float, quorum_timeout_s: float, wait_s: float) -> dict:
    journal = Journal(run_dir, replica, incarnation, run_id)
    journal.write("start", mode=mode)
    data = make_data(cfg)
    model = make_replica_model(cfg)
    optimizer = make_inner_optimizer(model, cfg)
    heal = {}

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(sd):  # called by torchft on the replica that heals, with a live peer's state_dict()
        t0 = time.time()
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        heal.update(load_s=time.time() - t0, bytes=tensor_bytes(sd))

    rendezvous = Rendezvous(run_dir, wait_s)
    waited_s = 0.0
    if mode == "ddp" and incarnation > 0 and rejoin_step:
        # The experiment pins the rejoin to rejoin_step: the replacement starts its Manager (and so heartbeats and asks
        # for quorums) only once every survivor is about to ask for that step's. Started earlier, it could join the
        # quorum of any step before it (a loaded machine slows the survivors' retry of the broken step more than the
        # replacement's start), and a heartbeating replica that does not ask would hold up the survivors' quorums.
        waited_s = rendezvous.wait_for([f"at{rejoin_step}.{r}" for r in range(cfg.replicas) if r != replica],
                                       f"the replacement waits for the survivors' step {rejoin_step}")
    manager = make_manager(replica=replica, lighthouse=lighthouse, min_replicas=min_replicas, state_dict=state_dict,
                           load_state_dict=load_state_dict, timeout_s=timeout_s, quorum_timeout_s=quorum_timeout_s)
    try:
        meter = AllreduceMeter(manager)
        rendezvous.announce(replica, incarnation)
        if incarnation == 0:
            # The first quorum waits for every replica of the plan (the lighthouse takes whoever has joined once
            # min_replicas have, and a replica whose torchrun started late would otherwise heal into step 2).
            rendezvous.wait_for([f"{r}.0" for r in range(cfg.replicas)], "the run's first quorum")
            time.sleep(0.3)  # three heartbeats: the lighthouse counts everyone alive before anyone asks for a quorum
        # the ports this replica process holds: the job's TCP store (torchrun's) and its Manager's server (torchft's,
        # a port the OS picked), on record so the notebook can check that none outlives the run
        ports = {"store_port": int(os.environ["MASTER_PORT"]),
                 "manager_port": int(manager._manager.address().rsplit(":", 1)[1].strip("/"))}
        journal.write("up", waited_s=waited_s, **ports)
        if mode == "ddp":
            records, heals = _ddp(ctx, cfg, manager, model, optimizer, data, journal, heal, rendezvous,
                                  replica=replica, incarnation=incarnation, fault=fault, fault_replica=fault_replica,
                                  fault_step=fault_step, rejoin_step=rejoin_step, quorum_timeout_s=quorum_timeout_s)
        else:
            records, heals = _diloco(ctx, cfg, manager, model, optimizer, data, journal, replica=replica,
                                     sync_every=sync_every, outer_lr=outer_lr)
        return {"replica": replica, "incarnation": incarnation, "records": records, "heals": heals,
                "weights": flat_weights(model), "eval_loss": eval_loss(model, data),
                "allreduce_bytes": meter.bytes, "allreduce_calls": meter.calls,
                "parameters": sum(p.numel() for p in model.parameters()), **ports}
    finally:
        journal.write("end")
        journal.close()
        manager.shutdown(wait=False)


def start_quorum(manager, step: int, quorum_timeout_s: float) -> None:
    """``manager.start_quorum()`` (synchronous here), with a sentence when the lighthouse never answers: torchft's own
    is its RPC library's ("status: Cancelled, message: \"Timeout expired\"")."""
    try:
        manager.start_quorum()
    except TimeoutError as exc:
        raise TimeoutError(f"step {step}: the lighthouse formed no quorum within {quorum_timeout_s:g} s: fewer "
                           "replicas asked for one than its min_replicas, or a replica is stuck before the step") from exc


def average_gradients(manager, model) -> None:
    """DDP across replica groups, written out: every gradient in one flat buffer (DDP's bucket), one allreduce
    through the Manager (a SUM over the quorum, then a division by ``num_participants()``), copied back.

    torchft's own ``DistributedDataParallel`` does the same in a comm hook, but in torchft 0.2.0 that hook fails on
    exactly the event this chapter is about: when a peer dies in the middle of the allreduce, ``_ManagedWork.wait()``
    catches the error and reports it, and the hook then stops at ``assert fut._fut`` (``torchft/ddp.py``), an
    ``AssertionError`` that ends the survivor too. Called directly, the Manager keeps its promise: the failed
    allreduce is noted, ``should_commit()`` answers False on every replica, and the step is tried again."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])  # [P]: the bucket
    manager.allreduce(flat).wait()  # in place: sum over the quorum / participants (garbage if it failed: not used)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _ddp(ctx, cfg, manager, model, optimizer, data, journal, heal, rendezvous, *, replica, incarnation, fault,
         fault_replica, fault_step, rejoin_step, quorum_timeout_s):
    records, heals = [], []
    aim = dict(rank=replica, attempt=incarnation, at_step=fault_step, at_rank=fault_replica, journal=journal,
               hang_s=0.0)
    with injected(fault, lambda: faults.patches(replicas, **aim)):
        while manager.current_step() < cfg.steps:
            before = manager.current_step()
            rejoin = (rejoin_step and incarnation == 0 and replica != fault_replica and before + 1 == rejoin_step
                      and not any(r["step"] == rejoin_step for r in records))
            if rejoin:
                rendezvous.mark(f"at{rejoin_step}.{replica}")  # the replacement starts its Manager now
            held_s = rendezvous.wait_for([f"{fault_replica}.1"], f"step {rejoin_step} waits for the replacement") \
                if rejoin else 0.0
            t0 = time.time()
            start_quorum(manager, before + 1, quorum_timeout_s)  # settled, and healed if we were behind
            while rejoin and manager.num_participants() < cfg.replicas:
                # The experiment pins the rejoin to rejoin_step: a quorum that formed before the replacement asked
                # is dropped unused (no step was taken in it) and asked again. A real job would not wait: the
                # replacement would join whichever step came after it asked.
                if time.time() - t0 > rendezvous.wait_s:
                    raise TimeoutError(f"the replacement of replica {fault_replica} was up but never joined a quorum "
                                       f"within {rendezvous.wait_s:.0f} s")
                time.sleep(0.05)
                start_quorum(manager, before + 1, quorum_timeout_s)
            t1 = time.time()
            if rejoin:
                journal.write("held", step=rejoin_step, held_s=held_s, quorum_s=t1 - t0)
            step = manager.current_step() + 1  # the step this attempt trains (a heal moved current_step)
            if manager.current_step() != before:
                event = {"from_step": before, "to_step": manager.current_step(), "quorum_s": t1 - t0, **heal}
                heals.append(event)
                journal.write("heal", **event)
            participants = manager.num_participants()
            set_lr(optimizer, cfg, step)
            optimizer.zero_grad(set_to_none=True)
            loss = replicas.forward_loss(model, replica_batch(data, cfg, step, replica), step)
            loss.backward()
            average_gradients(manager, model)  # over the quorum; a dead peer makes it fail, and torchft notes that
            committed = manager.should_commit()  # every replica of the quorum agrees, or nobody steps
            if committed:
                optimizer.step()
            t2 = time.time()
            record = {"step": step, "loss": loss.item(), "committed": committed, "participants": participants,
                      "participating": manager.is_participating(), "quorum_s": t1 - t0, "step_s": t2 - t1,
                      "held_s": held_s, "t0": t0, "t1": t2}
            journal.write("step", **record)
            records.append(record)
            if committed:
                ctx.metric(step=step, loss=record["loss"], participants=participants, replica=replica)
    return records, heals


def _diloco(ctx, cfg, manager, model, optimizer, data, journal, *, replica, sync_every, outer_lr):
    from torchft.local_sgd import DiLoCo

    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=0.9, nesterov=True)  # DiLoCo's outer step
    records = []
    # backup_device: the weights at the last sync stay on the CPU (where this model is); pin_memory needs a GPU
    with DiLoCo(manager, [model], optimizer, outer, sync_every=sync_every, backup_device=torch.device("cpu"),
                pin_memory=False):
        for step in range(1, cfg.steps + 1):
            t0 = time.time()
            set_lr(optimizer, cfg, step)
            optimizer.zero_grad(set_to_none=True)
            loss = replicas.forward_loss(model, replica_batch(data, cfg, step, replica), step)
            loss.backward()  # local: no communication
            optimizer.step()  # DiLoCo's hook: every sync_every-th step, allreduce the pseudo-gradient, outer step
            record = {"step": step, "loss": loss.item(), "syncs": manager.current_step(),
                      "participants": manager.num_participants(), "t0": t0, "t1": time.time()}
            journal.write("step", **record)
            records.append(record)
            ctx.metric(step=step, loss=record["loss"], syncs=record["syncs"], replica=replica)
    return records, []
