"""Training that survives failures, rank side (chapter 17): restart and roll back, quorum and heal, DiLoCo.

- ``journal``: the run's logbook, one JSON line per event and rank next to the checkpoints, which outlives an
  attempt that was killed; ``ledger`` turns it into the wall-time split (productive, lost, detect, restart, reload,
  checkpoint) and the steps that were redone;
- ``board``: where each rank is (the collective it entered, in the job's store), so a collective that times out
  names the rank that never called it;
- ``state``: the whole training state of chapter 08's run (model, AdamW, schedule, data position, every rank's RNG)
  saved and loaded with DCP, the newest *complete* checkpoint found by its ``.metadata``;
- ``faults``: the kill and the hang, injected through ``workers/faults`` (the trainer never branches on them);
- ``replicas``: quorum and heal's data, keyed by (step, replica) so a replacement draws what the dead replica would
  have, and the single-process ``reference`` a quorum run must equal;
- ``ft``: torchft on the course's ranks (an optional import: ``torchft_missing`` is the learner's one sentence), the
  Manager, the allreduce byte meter, the files that say which replica processes are up;
- ``quorum``: one replica group's loop under torchft, quorum and heal (DDP) or DiLoCo.

Nothing here imports ``course_utils``; ``journal`` and ``state``'s finders need no process group.
"""
