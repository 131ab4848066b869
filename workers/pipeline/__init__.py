"""Pipeline parallelism on real point-to-point messages (Picotron/Megatron style, one idea per file).

* ``model.py``: the model (an MLP stack), its partition table into p contiguous stages, the data;
* ``schedules.py``: GPipe and 1F1B (PipeDream-Flush) as explicit per-rank action lists, a validator and an
  ideal-time simulator;
* ``p2p.py``: ``send_forward`` / ``recv_forward`` / ``send_backward`` / ``recv_backward`` between neighbours;
* ``executor.py``: runs one rank's action list, timing every action and counting stashed activations;
* ``reference.py``: the same model unsplit in one process, the ground truth for every gradient.
"""
