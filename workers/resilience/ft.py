"""torchft on the course's ranks: one Manager per replica group, and what the chapter measures around it.

torchft (PyPI ``torchft``, Meta's fault-tolerance library) keeps a job training while whole replica groups die and
return. Each replica group runs a ``Manager``; before every step the Managers ask a *lighthouse* (one small server for
the whole job) who is alive, and the answer, the *quorum*, is the set of replicas whose gradients that step averages.
A replica that is behind (a replacement at step 0 while the others are at step t) *heals*: it fetches the weights and
optimizer state of a live peer over HTTP before it trains, so nothing is reloaded from disk and no step is redone.

torchft is an optional import: this module imports it only inside the functions that need it, and
``torchft_missing()`` is the one sentence a learner without it gets (the worker's ``check_params`` returns it, so
the launcher refuses before any rank starts).

- ``make_manager``: a Manager on the job's own TCP store, a gloo process group across replicas, synchronous quorum;
- ``AllreduceMeter``: counts the bytes each replica hands to the Manager's allreduce (DDP's buckets, DiLoCo's
  pseudo-gradients), the traffic the chapter compares;
- ``Rendezvous``: files in the run's folder that say which replica processes are up, so the notebook's experiment can
  pin the step a replacement rejoins at (torchft itself lets it join whenever it is ready).
"""
from __future__ import annotations

import importlib.util
import os
import time
from datetime import timedelta

TORCHFT_VERSION = "0.2.0"  # what pyproject.toml pins: the Manager and DiLoCo signatures below are this release's


def torchft_missing() -> str | None:
    """One sentence for a learner without torchft (None when it is installed)."""
    if importlib.util.find_spec("torchft") is not None:
        return None
    return (f"this part of chapter 17 needs torchft, which is not installed in this Python: run `make setup` "
            f"(or `pip install torchft=={TORCHFT_VERSION}`) and restart the kernel")


def make_manager(*, replica: int, lighthouse: str, min_replicas: int, state_dict, load_state_dict,
                 timeout_s: float, quorum_timeout_s: float):
    """The Manager of a replica group of one rank (this process).

    - the job's own TCP store (torchrun's, ``MASTER_ADDR:MASTER_PORT``) holds the Manager's address and the keys of
      the cross-replica process group: no port of ours;
    - ``use_async_quorum=False``: the quorum is settled before the forward, so a replica that heals does so before
      its step and takes part in it (with an asynchronous quorum it would sit that step out), and DiLoCo requires it;
    - ``init_sync=False``: every replica builds the same weights from the same seed, so step 0 needs no transfer
      (a replacement behind the others still heals: that is decided by steps, not by ``init_sync``);
    - ``min_replica_size``: a step commits only when at least that many replicas took part;
    - every wait is bounded: ``timeout_s`` for a collective, ``should_commit`` and the heal's transfer,
      ``quorum_timeout_s`` for the lighthouse to answer; past them torchft raises, and the rank's traceback ends
      the job.
    """
    from torchft import Manager, ProcessGroupGloo

    timeout = timedelta(seconds=timeout_s)
    return Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=min_replicas,
                   load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica_{replica}",
                   lighthouse_addr=lighthouse, store_addr=os.environ["MASTER_ADDR"],
                   store_port=int(os.environ["MASTER_PORT"]), rank=0, world_size=1, use_async_quorum=False,
                   init_sync=False, timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
                   connect_timeout=timeout)


class AllreduceMeter:
    """Bytes handed to ``manager.allreduce`` by this replica: the payload of every cross-replica reduction.

    Both torchft's DDP (one call per gradient bucket, every step) and DiLoCo (one call per parameter's
    pseudo-gradient, every ``sync_every`` steps) reduce through the Manager, so one meter counts both the same way.
    It is the payload, not the wire: a ring all-reduce over n replicas sends 2(n-1)/n times it per rank, the same
    factor for both."""

    def __init__(self, manager):
        self.bytes, self.calls = 0, 0
        original = manager.allreduce

        def counted(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return original(tensor, *args, **kwargs)

        manager.allreduce = counted  # an attribute of this Manager only: the class and other Managers are untouched


def tensor_bytes(tree) -> int:
    """Bytes of every tensor in a nested state dict: what a heal moved over HTTP."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


class Rendezvous:
    """``<run_dir>/up/<replica>.<incarnation>``: a file per replica process whose Manager is up and heartbeating;
    ``at<step>.<replica>``: a survivor about to ask for step ``step``'s quorum, which its dead peer's replacement joins
    (``mark``)."""

    def __init__(self, run_dir: str, wait_s: float):
        self.folder = os.path.join(run_dir, "up")
        os.makedirs(self.folder, exist_ok=True)
        self.wait_s = wait_s

    def announce(self, replica: int, incarnation: int) -> None:
        self.mark(f"{replica}.{incarnation}")

    def mark(self, name: str) -> None:
        with open(os.path.join(self.folder, name), "w") as f:
            f.write(str(time.time()))

    def wait_for(self, names: list[str], why: str) -> float:
        """Wait until every named file is there (a replica process that announced itself, or a mark); returns the
        seconds waited."""
        t0 = time.monotonic()
        while True:
            missing = [n for n in names if not os.path.exists(os.path.join(self.folder, n))]
            if not missing:
                return time.monotonic() - t0
            if time.monotonic() - t0 > self.wait_s:
                raise TimeoutError(f"{why}: replica process(es) {', '.join(missing)} (replica.incarnation) did not "
                                   f"start within {self.wait_s:.0f} s")
            time.sleep(0.02)
