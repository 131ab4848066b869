"""Kept for one release: ``python -m workers.bench_attention`` still runs the benchmark, which now lives in
``workers/attention/bench.py`` (``python -m workers.attention.bench``); its names are re-exported here."""
import sys

from workers.attention.bench import *  # noqa: F401,F403
from workers.attention.bench import main

if __name__ == "__main__":
    sys.exit(main())
