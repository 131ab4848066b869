"""The failures chapter 17 recovers from, injected the course's one way (``workers/faults``): each replaces the
trainer's ``forward_loss`` for a run with one that, on the chosen rank and step of the *first* attempt, strikes right
after the forward, in the middle of the step: the other ranks are about to wait in the gradient all_reduce.

- ``kill``: SIGKILL to its own process: no exception, no traceback, no goodbye (the OOM killer, a lost node). The
  other ranks' all_reduce loses its peer; torchrun's agent sees the exit code -9 and restarts every rank.
- ``hang``: the rank stops (``hang_s`` seconds) and never calls the all_reduce; the others wait in it until the
  collective timeout, raise, and that failure is what torchrun restarts on.
- ``node``: the rank's whole node is lost at once: its torchrun agent and every rank the agent started, SIGKILLed
  (a machine that loses power, a network partition). The other nodes' ranks lose their peers in the all_reduce; an
  elastic job (``torchrun --nnodes=min:max``) restarts them in the world that is left, from the last checkpoint.
  Needs an agent of the node's own: the rank must not be on node 0, whose agent hosts the job's rendezvous.
- ``torn``: the rank dies (SIGKILL) in the middle of the checkpoint save after step ``at_step``, once its own shard
  is on disk and before DCP's coordinator writes the ``.metadata`` that makes the folder a checkpoint: the folder
  is left torn, and the restarted job must take the checkpoint before it. Replaces ``state.save`` instead, and
  needs ``at_step`` to be a step that saves.
- ``slow``: a straggler. The rank sleeps ``slow_s`` seconds right after its forward in ``slow_steps`` steps from
  ``at_step`` on, then goes on: the other ranks wait for it in the gradient all_reduce, and nothing fails. It strikes
  on every attempt (a slow node stays slow) and journals each stall (``stall``, with ``t0``, ``t1`` and the step)
  after it; it changes the run's time, never its arithmetic.

Except for ``slow``, only attempt 0 (``TORCHELASTIC_RESTART_COUNT`` 0) is struck, so the restarted job runs clean. The fault is written to
the journal *before* it strikes: the ledger times detection and restart from that moment.
"""
from __future__ import annotations

import os
import signal
import time

FAULTS = ("none", "kill", "hang", "torn", "slow", "node")


def patches(trainer, *, rank: int, attempt: int, at_step: int, at_rank: int, journal, hang_s: float,
            slow_s: float = 0.3, slow_steps: int = 3) -> dict:
    """The table ``workers.faults.injected`` picks from: ``{fault: (module, name, faulty version)}``."""
    original = trainer.forward_loss

    def striking(kind: str, strike, on_record=dict):
        def forward_loss(model, batch, step):
            loss = original(model, batch, step)
            if attempt == 0 and rank == at_rank and step == at_step:
                journal.write("fault", kind=kind, step=step, **on_record())
                strike()
            return loss
        return forward_loss

    save = getattr(getattr(trainer, "state", None), "save", None)  # a trainer that checkpoints (not torchft's replicas)

    def torn_save(root, step, *args):
        if not (attempt == 0 and rank == at_rank and step == at_step):
            return save(root, step, *args)

        def strike():  # this rank's files are written; the coordinator will wait for it, and the metadata never comes
            journal.write("fault", kind="torn", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        return save(root, step, *args, after_write=strike)

    def slow_forward_loss(model, batch, step):
        loss = original(model, batch, step)
        if rank == at_rank and at_step <= step < at_step + slow_steps:  # every attempt: a slow node stays slow
            t0 = time.time()
            time.sleep(slow_s)  # the other ranks are about to wait in the gradient all_reduce
            journal.write("stall", step=step, t0=t0, t1=time.time(), seconds=slow_s)
        return loss

    return {"slow": (trainer, "forward_loss", slow_forward_loss),
            "kill": (trainer, "forward_loss", striking("kill", lambda: os.kill(os.getpid(), signal.SIGKILL))),
            "node": (trainer, "forward_loss", striking("node", lose_node, lambda: {"pids": node_pids()})),
            "hang": (trainer, "forward_loss", striking("hang", lambda: time.sleep(hang_s))),
            **({"torn": (trainer.state, "save", torn_save)} if save is not None else {})}


def node_pids() -> list[int]:
    """This rank's node: its torchrun agent (the parent) and every process the agent started, this rank last."""
    import psutil

    agent = psutil.Process(os.getppid())
    others = [p.pid for p in agent.children(recursive=True) if p.pid != os.getpid()]
    return [*others, agent.pid, os.getpid()]  # on record before the strike: the orphans' pids, to check none is left


def lose_node() -> None:
    """SIGKILL this rank's node: the other ranks its torchrun agent started, the agent, then this rank."""
    for pid in node_pids():
        os.kill(pid, signal.SIGKILL)
