"""Pipeline parallelism on real point-to-point messages (Picotron/Megatron style, one idea per file).

* ``model.py``: the model (an MLP stack), its partition table into p contiguous stages, the data;
* ``schedules.py``: GPipe, 1F1B (PipeDream-Flush) and interleaved 1F1B as explicit per-rank action lists, a
  validator and an ideal-time simulator (with an optional per-message latency);
* ``p2p.py``: ``send_forward`` / ``recv_forward`` / ``send_backward`` / ``recv_backward`` between neighbours;
* ``executor.py``: runs one rank's action list, timing every action, counting stashed activations and
  the bytes autograd saved for backward;
* ``reference.py``: the same model unsplit in one process, the ground truth for every gradient.
"""
