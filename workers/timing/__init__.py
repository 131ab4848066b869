"""Timing on a rank, for every chapter that measures a kernel or a step: ``cuda`` holds the one loop of CUDA events
(warm-up, synchronize, one event pair around each call) that the benchmarks and workers share; ``cpu`` the loop of
repeats that times one CPU rank's work, and what the machine's calibration (``workers/calibrate.py``) times with it."""
