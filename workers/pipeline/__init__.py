"""Pipeline parallelism on real point-to-point messages (Picotron/Megatron style, one idea per file).

* ``model.py``: the model (an MLP stack), its partition table into p contiguous stages, the data;
* ``schedules.py``: GPipe, 1F1B (PipeDream-Flush) and interleaved 1F1B as explicit per-rank action lists, a
  validator and an ideal-time simulator (with an optional per-message latency);
* ``p2p.py``: ``send_forward`` / ``recv_forward`` / ``send_backward`` / ``recv_backward`` between neighbours;
* ``zero_bubble.py``: ZB-H1, ZB-H2, ZB-V and DualPipeV as tables of F, B (input gradient) and W (weight gradient);
* ``split_backward.py``: the stage's backward by hand, split into B and W, with what W needs stashed between them;
* ``validity.py``: messages with local hand-offs (the V placement), the validity checker (dependencies and the wire
  order's deadlocks), the ideal-time replay with W and the papers' bubble measure;
* ``executor.py``: runs one rank's action list, timing every action, counting stashed activations and
  the bytes autograd saved for backward (``run_split_schedule``: the zero-bubble tables, after checking them);
* ``reference.py``: the same model unsplit in one process, the ground truth for every gradient.
"""
