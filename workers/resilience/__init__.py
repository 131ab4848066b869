"""Training that survives failures, rank side (chapter 17): restart from the last checkpoint and roll back.

- ``journal``: the run's logbook, one JSON line per event and rank next to the checkpoints, which outlives an
  attempt that was killed; ``ledger`` turns it into the wall-time split (productive, lost, detect, restart, reload,
  checkpoint) and the steps that were redone;
- ``board``: where each rank is (the collective it entered, in the job's store), so a collective that times out
  names the rank that never called it;
- ``state``: the whole training state of chapter 08's run (model, AdamW, schedule, data position, every rank's RNG)
  saved and loaded with DCP, the newest *complete* checkpoint found by its ``.metadata``;
- ``faults``: the kill and the hang, injected through ``workers/faults`` (the trainer never branches on them).

Nothing here imports ``course_utils``; ``journal`` and ``state``'s finders need no process group.
"""
